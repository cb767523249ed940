"""The study's report from its cells' metrics (pipeline.study.study_report)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def report_study(settings: dict, inputs=(), outputs=()):
    """settings: {"study": StudyConfig, "cells": [StudyCell]}; inputs: each cell's
    train_summary.json; outputs[0]: study/report.md (figures and results.json beside it)."""
    from pathlib import Path

    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.study.study_grid import StudyCell, StudyConfig
    from pipeline.study.study_report import write_study_report

    report = Path(outputs[0].filepath)

    def work() -> None:
        study = from_dict(StudyConfig, settings["study"])
        cells = [from_dict(StudyCell, cell) for cell in settings["cells"]]
        write_study_report(report.parent, study, cells)

    return run_once(settings, [f.filepath for f in inputs], [str(report)], work)
