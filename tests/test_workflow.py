"""The whole DAG through Parsl on the local site: a run, a killed run resumed, a dry run."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import psutil
import pytest

from pipeline.report import task_states

ROOT = Path(__file__).parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def workflow(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "workflow.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def kill_everything_under(run_dir: Path, process: subprocess.Popen) -> int:
    """SIGKILL the workflow and every process it started: Parsl's interchange, monitoring and
    worker pools are in its session (started with start_new_session=True) or name the run dir."""

    def ours(p: psutil.Process) -> bool:
        try:
            return os.getsid(p.pid) == process.pid or str(run_dir) in " ".join(p.cmdline())
        except (psutil.Error, ProcessLookupError):
            return False

    members = [p for p in psutil.process_iter() if p.pid != os.getpid() and ours(p)]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for p in members:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(members, timeout=10)
    return process.returncode


def segmentation(run_dir: Path) -> np.ndarray:
    with h5py.File(run_dir / "inference" / "segmentation.h5", "r") as f:
        return f["segmentation"][...]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    workflow("--site", "local", "--config", TINY, "--run-dir", str(run_dir))
    return run_dir


@pytest.mark.mpi
@pytest.mark.slow
class TestLocalRun:
    def test_every_stage_leaves_its_outputs(self, finished_run):
        for output in (
            "staged/train.h5", "staged/eval.h5", "preprocess/coordinates.npz", "train/train_summary.json",
            "train/curves.png", "selection.json", "inference/segmentation.h5", "evaluation.json",
            "precomputed/export.json", "report.md", "monitoring.db", "config.json",
        ):  # fmt: skip
            assert (finished_run / output).exists(), output
        report = (finished_run / "report.md").read_text()
        assert "| watershed |" in report and "| ffn |" in report and "| train | 1 |" in report

    def test_training_ran_two_horovod_ranks(self, finished_run):
        assert '"world_size": 2' in (finished_run / "train" / "train_summary.json").read_text()

    def test_second_resume_does_no_work_and_says_so(self, finished_run):
        done = workflow(
            "--site", "local", "--config", TINY, "--run-dir", str(finished_run), "--resume"
        )
        assert "nothing to do: every stage was already complete" in done.stdout
        states = task_states(finished_run / "monitoring.db")
        assert states and all(s == "memo_done" for values in states.values() for s in values), (
            states
        )

    def test_rerun_without_resume_is_refused(self, finished_run):
        done = subprocess.run(
            [sys.executable, "workflow.py", "--config", TINY, "--run-dir", str(finished_run)],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 2 and "add --resume" in done.stderr

    def test_killed_during_inference_resumes_without_training_again(self, finished_run, tmp_path):
        run_dir = tmp_path / "killed"
        command = [sys.executable, "workflow.py", "--config", TINY, "--run-dir", str(run_dir)]
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        blocks = run_dir / "inference" / "blocks"
        deadline = time.monotonic() + 600
        while process.poll() is None and time.monotonic() < deadline:
            if blocks.is_dir() and any(blocks.iterdir()):  # training done, inference under way
                break
            time.sleep(0.2)
        assert kill_everything_under(run_dir, process) == -signal.SIGKILL, (
            "the workflow ended first"
        )
        assert (run_dir / "train" / "train_summary.json").exists()
        assert not (run_dir / "inference" / "segmentation.h5").exists()

        done = workflow("--config", TINY, "--run-dir", str(run_dir), "--resume")

        assert "train skipped: done in an earlier run" in done.stdout
        assert task_states(run_dir / "monitoring.db")["train"] == ["memo_done"]
        np.testing.assert_array_equal(segmentation(run_dir), segmentation(finished_run))


def test_dry_run_on_theta_needs_no_scheduler():
    done = workflow("--site", "theta", "--dry-run")
    assert "CobaltProvider" in done.stdout and "aprun" in done.stdout
    assert "infer" in done.stdout and "placeholder" in done.stdout


def test_stages_left_out_must_have_their_outputs(tmp_path):
    done = subprocess.run(
        [sys.executable, "workflow.py", "--config", TINY, "--run-dir", str(tmp_path), "--stages", "train"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--stages leaves out 'stage', but 'train' needs its output" in done.stderr
