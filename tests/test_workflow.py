"""The whole DAG through Parsl on the local site: what a run leaves, and what the CLI refuses.
How a run resumes after changes and faults: tests/test_resume.py."""

import subprocess
import sys

import pytest
from workflow_runs import ROOT, TINY, workflow


@pytest.mark.mpi
@pytest.mark.slow
class TestLocalRun:
    def test_every_stage_leaves_its_outputs_and_stamps(self, tiny_run):
        for output in (
            "staged/train.h5", "staged/eval.h5", "preprocess/coordinates.npz", "train/train_summary.json",
            "train/curves.png", "selection.json", "inference/segmentation.h5", "evaluation.json",
            "precomputed/export.json", "report.md", "monitoring.db", "config.json",
        ):  # fmt: skip
            assert (tiny_run / output).exists(), output
        for stamped in (
            "staged/eval.h5",
            "train/train_summary.json",
            "inference/segmentation.h5",
            "precomputed",
        ):
            assert (tiny_run / f"{stamped}.stamp.json").is_file(), stamped
        report = (tiny_run / "report.md").read_text()
        assert "| watershed |" in report and "| ffn |" in report and "| train | 1 |" in report

    def test_training_ran_two_horovod_ranks(self, tiny_run):
        assert '"world_size": 2' in (tiny_run / "train" / "train_summary.json").read_text()

    def test_rerun_without_resume_is_refused(self, tiny_run):
        done = subprocess.run(
            [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(tiny_run)],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 2 and "add --resume" in done.stderr


def test_dry_run_on_theta_needs_no_scheduler():
    done = workflow("--site", "theta", "--dry-run")
    assert "CobaltProvider" in done.stdout and "aprun" in done.stdout
    assert "infer" in done.stdout and "placeholder" in done.stdout


def test_stages_left_out_must_have_their_outputs(tmp_path):
    done = subprocess.run(
        [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(tmp_path), "--stages", "train"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--stages leaves out 'stage', but 'train' needs its output" in done.stderr
