"""The study's report from its cells' metrics (pipeline.study.study_report)."""

from parsl import python_app

from apps.contracts import ReportStudy
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def report_study(settings: dict, io: ReportStudy, inputs=(), outputs=()):
    """settings: {"study": StudyConfig, "cells": [StudyCell]}; the cells' figures and
    results.json are written beside the report."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.study.study_grid import StudyCell, StudyConfig
    from pipeline.study.study_report import write_study_report

    def work() -> None:
        study = from_dict(StudyConfig, settings["study"])
        cells = [from_dict(StudyCell, cell) for cell in settings["cells"]]
        write_study_report(io.report.parent, study, cells)

    return run_once(settings, io.inputs(), io.outputs(), work)
