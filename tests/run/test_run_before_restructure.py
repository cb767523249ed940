"""A run dir made by the code as it was before pipeline/ was split into stages and the planner
moved out of workflow.py (commit 5bbf517, configs/tiny.toml without the learned watershed) resumes
with nothing re-run but its evaluation, which ERL changed: the stamps key on settings and inputs,
which the restructuring kept.

The fixture (tests/fixtures/README.md) holds the run's outputs and stamps, with their mtimes to
the nanosecond (a POSIX tar); Parsl's logs, the code copy and the checkpoints are left out."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from apps.plan.dag import steps_of
from apps.plan.resolved import resolve_plan
from apps.plan.step import plan_run
from apps.run_setup import load_site_record
from pipeline.data.staging import reads_in_place
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_before_issue55.tar.gz"


@pytest.fixture
def old_run(tmp_path) -> Path:
    # GNU tar, not tarfile: tarfile sets mtimes through floats, off by up to a microsecond.
    subprocess.run(["tar", "-xzf", str(FIXTURE), "-C", str(tmp_path)], check=True)
    return tmp_path / "tiny-run"


def planned(run_dir: Path) -> dict[str, str | None]:
    config = load_run_config(run_dir / "config.json")
    paths = RunPaths(run_dir, reads_in_place(config.data))
    _, spec = load_site_record(paths.site)
    return plan_run(steps_of(resolve_plan(config, paths, spec)))


def test_a_run_made_before_the_restructuring_is_up_to_date(old_run):
    reasons = planned(old_run)
    assert (
        len(reasons) == 27
    )  # stage 3, preprocess, train, select, infer 4, stitch 7, export 8, evaluate 2
    # But what the old run lacks (issue 59): ERL added its skeletons' settings and the
    # segmentations it reads, so the evaluate task runs again for its scores; and the export's
    # skeletons, so their tasks and the export's last task run, its other tasks kept.
    rerun = {name: why for name, why in reasons.items() if why}
    skeletons = ["export[skeleton 0]", "export[skeleton plan]", "export[skeleton merge 0]"]
    assert sorted(rerun) == sorted([*skeletons, "export", "evaluate"])
    assert rerun["export[skeleton 0]"] == "not run yet"
    assert "settings changed: skeletons" in rerun["evaluate"]


def test_its_stamps_still_see_a_changed_output(old_run):
    staged = old_run / "staged" / "eval.h5"
    os.utime(staged, ns=(staged.stat().st_atime_ns, staged.stat().st_mtime_ns + 1))
    reasons = planned(old_run)
    assert "output changed since it was made: staged/eval.h5" in reasons["stage[eval]"]
    assert reasons["infer[0]"] is not None and reasons["export"] is not None


def test_small_objects_left_out_make_its_coordinates_and_selection_stale(old_run):
    # `[partitions] min_object_voxels`, added since, is at 0 in the run above: up to date. Set,
    # it changes the training's coordinates and the selection's held-out FOVs alike.
    config = old_run / "config.json"
    settings = json.loads(config.read_text())
    settings["partitions"]["min_object_voxels"] = 10000
    config.write_text(json.dumps(settings))
    reasons = planned(old_run)
    # (its stamps, older than the setting, name it null)
    assert "settings changed: partitions.min_object_voxels null -> 10000" in reasons["preprocess"]
    assert reasons["train"] == "after preprocess" and reasons["select"] == "after train"
