"""A run's workers import the code the run started with (a copy in the run dir), so a checkout
edited or pulled while a run waits in a queue or goes on does not change what its tasks do."""

import os
import shutil
import subprocess
import sys

import processes
import pytest
from workflow_runs import ROOT, copy_run, workflow

from pipeline.run.code_copy import CODE_DIR, copy_code, copy_name
from pipeline.run.run_report import task_states
from site_configs import local

BROKEN = 'raise ImportError("edited under a running workflow")\n'


def checkout_copy(folder):
    """A user's checkout: this one's code and configs."""
    for name in ("apps", "pipeline", "site_configs", "configs"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "workflow.py", folder)
    return folder


class TestTheCopy:
    def test_holds_every_module_of_the_packages(self, tmp_path):
        code = copy_code(tmp_path / "run")
        assert code.parent == tmp_path / "run" / CODE_DIR
        for name in ("apps/stitch.py", "pipeline/inference/stitching.py", "pipeline/cli/train.py"):
            assert (code / name).read_bytes() == (ROOT / name).read_bytes()
        assert not list(code.rglob("__pycache__"))

    def test_the_same_code_is_copied_once_and_new_code_replaces_it(self, tmp_path):
        checkout = checkout_copy(tmp_path / "checkout")
        first = copy_code(tmp_path / "run", checkout)
        made = first.stat().st_mtime_ns
        assert copy_code(tmp_path / "run", checkout) == first
        assert first.stat().st_mtime_ns == made  # not copied again

        (checkout / "pipeline" / "inference" / "stitching.py").write_text(BROKEN)
        second = copy_code(tmp_path / "run", checkout)
        assert second != first and second.name == copy_name(checkout)
        assert (second / "pipeline" / "inference" / "stitching.py").read_text() == BROKEN
        assert sorted((tmp_path / "run" / CODE_DIR).iterdir()) == [second]  # nothing else kept


def test_a_local_worker_imports_the_runs_copy_not_the_checkout(tmp_path):
    config = local.make_config(tmp_path / "run")
    (code,) = (tmp_path / "run" / CODE_DIR).iterdir()
    for executor in config.executors:
        # A block runs worker_init, then the worker; a training rank is a `python -m`, often in
        # the checkout (the working directory), which Python would put first on its path.
        shown = subprocess.run(
            ["bash", "-c", executor.provider.worker_init
             + "\npython -c 'import pipeline.inference.stitching as m; print(m.__file__)'"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert shown.strip() == str(code / "pipeline" / "inference" / "stitching.py"), (
            executor.label
        )


@pytest.mark.mpi
@pytest.mark.slow
def test_a_checkout_edited_under_a_running_workflow_does_not_reach_its_training(tmp_path):
    checkout = checkout_copy(tmp_path / "checkout")
    run_dir = tmp_path / "run"
    # Workers import the checkout the workflow runs from, as a venv's editable install makes them;
    # the training ranks (`python -m`) import from their working directory, the checkout.
    env = os.environ | {"PYTHONPATH": str(checkout)}
    command = [
        sys.executable, "workflow.py", "--config", "configs/tiny.toml", "--run-dir", str(run_dir),
        "--stages", "stage", "preprocess", "train",
    ]  # fmt: skip
    with processes.started(command, cwd=checkout, env=env) as process:
        seen = []
        for line in process.stdout:  # planned, and the first tasks started: the training not yet
            seen.append(line)
            if line.rstrip().endswith(" started"):
                break
        assert seen and seen[-1].rstrip().endswith(" started"), "".join(seen)[-3000:]
        # A `git pull` while the run goes on: the module the training ranks import now fails.
        (checkout / "pipeline" / "training" / "trainer.py").write_text(BROKEN)
        out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, "".join(seen)[-2000:] + out[-3000:]
    assert task_states(run_dir / "monitoring.db")["train"] == ["exec_done"]
    (code,) = (run_dir / CODE_DIR).iterdir()
    assert (code / "pipeline" / "training" / "trainer.py").read_bytes() == (
        ROOT / "pipeline" / "training" / "trainer.py"
    ).read_bytes()
    broken = subprocess.run(
        [sys.executable, "-c", "import pipeline.training.trainer"],
        cwd=checkout,
        capture_output=True,
    )
    assert broken.returncode != 0 and b"edited under a running workflow" in broken.stderr


def test_status_and_a_resume_say_when_the_checkout_has_changed_since_the_last_run(
    tiny_run, tmp_path
):
    run_dir = copy_run(tiny_run, tmp_path / "run")
    status = workflow("status", "--run-dir", str(run_dir)).stdout
    current = run_dir / CODE_DIR / copy_name()
    assert (
        f"code: the last run's workers imported {current}, the checkout's code as it is" in status
    )

    # As if the last run had had other code: a copy of a checkout with one module edited.
    checkout = checkout_copy(tmp_path / "checkout")
    stitching = checkout / "pipeline" / "inference" / "stitching.py"
    stitching.write_text("# an edit\n" + stitching.read_text())
    earlier = copy_code(run_dir, checkout)
    changed = f"imported {earlier}; the checkout's code has changed since"
    assert changed in workflow("status", "--run-dir", str(run_dir)).stdout
    resumed = workflow("--run-dir", str(run_dir), "--resume").stdout
    assert changed in resumed and "nothing to do: every task is up to date" in resumed
