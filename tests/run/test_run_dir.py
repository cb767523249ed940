"""A run directory belongs to one run on one site: a resume goes on where the run was made, one
workflow at a time holds it, `status` says whether that workflow is alive and what failed, and
`--stages` never passes off what it left out as done."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import processes
import pytest
from parsl import python_app
from workflow_runs import ROOT, TINY, copy_run, workflow

from apps.plan.dag import dag_steps
from apps.plan.resolved import resolve_plan
from apps.run_setup import load_site_record, save_site_record
from pipeline.core.config_io import save_json
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.run.run_lock import RunDirBusy, hold, holder


def recorded_run(run_dir, site: str, **changes) -> None:
    """A run dir as `workflow.py --site <site>` leaves it before its first task: its resolved
    settings and its site record (the site's settings with `changes`)."""
    from dataclasses import replace

    from site_configs import load_site

    run_dir.mkdir(parents=True)
    save_json(run_dir / "config.json", load_run_config(TINY))
    spec = replace(load_site(site).SITE, **changes)
    save_site_record(run_dir / "site.json", site, spec)


class TestResumeOnTheRunsSite:
    def test_resume_without_site_goes_on_on_the_recorded_site(self, tmp_path):
        run_dir = tmp_path / "run"
        recorded_run(run_dir, "polaris", account="abc123", queue="debug")
        done = workflow("--run-dir", str(run_dir), "--resume", "--dry-run")
        assert "site polaris (as the run recorded it)" in done.stdout
        assert "PBSProProvider" in done.stdout and "account: abc123" in done.stdout
        assert "LocalProvider" not in done.stdout

    def test_a_real_resume_does_not_start_tasks_here_nor_rewrite_the_site(self, tmp_path):
        run_dir = tmp_path / "run"
        recorded_run(run_dir, "polaris")  # account still the placeholder: nothing can submit
        before = (run_dir / "site.json").read_text()
        done = workflow("--run-dir", str(run_dir), "--resume", expect=2)
        assert "polaris" in done.stderr
        assert not list(run_dir.glob("runinfo/[0-9][0-9][0-9]")), "Parsl should not have started"
        assert (run_dir / "site.json").read_text() == before

    def test_another_site_on_resume_is_refused_without_move_site(self, tmp_path):
        run_dir = tmp_path / "run"
        recorded_run(run_dir, "polaris")
        done = workflow("--site", "local", "--run-dir", str(run_dir), "--resume", expect=2)
        assert "was made on site polaris" in done.stderr and "--move-site" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        moved = workflow(
            "--site", "local", "--run-dir", str(run_dir), "--resume", "--move-site", "--dry-run"
        )
        assert "site local" in moved.stdout and "LocalProvider" in moved.stdout

    def test_move_site_without_resume_is_refused(self, tmp_path):
        done = workflow("--run-dir", str(tmp_path / "r"), "--move-site", "--dry-run", expect=2)
        assert "--move-site goes with --resume" in done.stderr

    def test_a_users_site_module_is_recorded_by_its_path(self, tmp_path):
        module = tmp_path / "mysite.py"
        module.write_text((ROOT / "site_configs" / "local.py").read_text())
        run_dir = tmp_path / "run"
        recorded_run(run_dir, "local")
        save_site_record(run_dir / "site.json", str(module), load_site_spec(module))
        # From another directory, without --site: the module is found by its recorded path.
        done = processes.run(
            [sys.executable, str(ROOT / "workflow.py"), "--run-dir", str(run_dir), "--resume",
             "--dry-run"], cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "site local (as the run recorded it)" in done.stdout

    def test_an_older_run_that_recorded_only_the_settings_resumes_on_that_site(self, tmp_path):
        from site_configs import load_site

        run_dir = tmp_path / "run"
        recorded_run(run_dir, "theta")
        save_json(run_dir / "site.json", load_site("theta").SITE)  # site.json before the module
        (run_dir / "runinfo" / "site.json.sha256").unlink()  # nor did such a run keep a digest
        done = workflow("--run-dir", str(run_dir), "--resume", "--dry-run")
        assert "site theta (as the run recorded it)" in done.stdout


def load_site_spec(module):
    from site_configs import load_site

    return load_site(str(module)).SITE


class TestOneWorkflowPerRunDir:
    def test_a_second_holder_is_refused_naming_the_first(self, tmp_path):
        holder_process = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; from pathlib import Path; "
             "from pipeline.run.run_lock import hold; h = hold(Path(sys.argv[1])); print('held', flush=True); "
             "time.sleep(600)", str(tmp_path)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert holder_process.stdout.readline().strip() == "held"
            with pytest.raises(RunDirBusy, match=f"pid {holder_process.pid} on"):
                hold(tmp_path)
            alive = holder(tmp_path)
            assert alive.held and alive.pid == holder_process.pid
            assert "a workflow is running" in alive.describe()
            # The fault a dropped login session brings: the holder dies without a word.
            holder_process.send_signal(signal.SIGKILL)
            holder_process.wait(timeout=30)
            assert holder_process.returncode == -signal.SIGKILL
            gone = holder(tmp_path)
            assert not gone.held and "no workflow is running" in gone.describe()
            hold(tmp_path).close()  # the lock went with the process: a resume may go on
        finally:
            holder_process.kill()

    def test_a_record_from_another_host_is_not_taken_for_alive_or_dead(self, tmp_path):
        (tmp_path / "workflow.lock").write_text(
            json.dumps({"pid": 4242, "host": "login-elsewhere", "started": "x", "command": "y"})
        )
        assert "another host" in holder(tmp_path).describe()


@pytest.mark.mpi
@pytest.mark.slow
class TestStatusAndStages:
    @pytest.fixture
    def run_dir(self, tiny_run, tmp_path):
        return copy_run(tiny_run, tmp_path / "run")

    def test_resume_dry_run_previews_the_runs_own_settings(self, run_dir):
        done = workflow("--run-dir", str(run_dir), "--resume", "--dry-run")
        assert "infer      4/4 up to date" in done.stdout and "settings changed" not in done.stdout

    def test_a_resume_while_another_workflow_holds_the_run_dir_is_refused(self, run_dir):
        with hold(run_dir):
            done = workflow("--run-dir", str(run_dir), "--resume", expect=2)
            assert f"pid {os.getpid()}" in done.stderr
            status = workflow("status", "--run-dir", str(run_dir)).stdout
            assert f"a workflow is running: pid {os.getpid()}" in status
        status = workflow("status", "--run-dir", str(run_dir)).stdout
        assert "workflow: no workflow is running" in status

    def test_status_shows_a_begun_blocks_progress(self, run_dir):
        from pipeline.inference.blocks import block_progress_path

        steps = dag_steps(resolve_plan(load_run_config(run_dir / "config.json"), RunPaths(run_dir),
                              load_site_record(run_dir / "site.json")[1]))  # fmt: skip
        block = next(s for s in steps if s.task.name == "infer[2]")
        record = {"block": "block_2", "objects": 5, "fov_evaluations": 1200, "fov_per_s": 3.0,
                  "seed_share": 0.25, "eta_s": 600.0}  # fmt: skip
        block_progress_path(block.task.outputs[0]).write_text(json.dumps(record))
        status = workflow("status", "--run-dir", str(run_dir)).stdout
        assert "infer[2] block_2: 5 objects, 1,200 FOV evaluations" in status

    def test_stages_left_out_and_stale_are_said_so_and_no_report_is_written(self, run_dir):
        (run_dir / "evaluation.json").unlink()  # evaluate is now stale
        report = (run_dir / "report.md").stat().st_mtime_ns
        time.sleep(0.01)
        done = workflow("--run-dir", str(run_dir), "--resume", "--stages", "export")
        assert "evaluate   left out by --stages;" in done.stdout
        assert "report not written: --stages left out evaluate" in done.stdout
        assert (run_dir / "report.md").stat().st_mtime_ns == report


# Workers import the app from this module: this folder on their PYTHONPATH, as in
# tests/site_configs/test_site_configs.py.
WORKER_INIT = f"export PYTHONPATH={Path(__file__).parent}:{Path(__file__).parents[1]}"


@python_app(executors=["cpu"])
def broken(outputs=()):
    raise ValueError("voxel size (0, 8, 8) has a zero")


def test_failed_tasks_are_read_with_their_error_from_monitoring(tmp_path):
    """A real Parsl run with monitoring whose app fails: the reader `status` uses finds the
    app, its output and the error text."""
    from dataclasses import replace

    import parsl
    from parsl.data_provider.files import File

    from pipeline.run.run_report import failed_tasks
    from site_configs import local
    from site_configs.base import child_pids, shutdown

    spare = child_pids()
    dfk = parsl.load(
        local.make_config(tmp_path, replace(local.SITE, worker_init=WORKER_INIT, retries=0))
    )
    try:
        future = broken(outputs=[File(str(tmp_path / "out.npz"))])
        with pytest.raises(ValueError, match="has a zero"):
            future.result(timeout=120)
    finally:
        shutdown(dfk, spare)
    ((app, output, error),) = failed_tasks(tmp_path / "monitoring.db")
    assert app == "broken" and output == str(tmp_path / "out.npz")
    assert "voxel size (0, 8, 8) has a zero" in error


@pytest.mark.parametrize("name", ["with space", "a;touch INJECTED"])
def test_a_run_dir_a_shell_would_split_is_refused_before_anything_starts(tmp_path, name):
    run_dir = tmp_path / name
    done = workflow("--config", str(TINY), "--run-dir", str(run_dir), expect=2, timeout=120)
    assert "Parsl puts it into shell lines unquoted" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not run_dir.exists() and not (ROOT / "INJECTED").exists()


def test_a_refused_placeholder_start_leaves_no_run_dir(tmp_path):
    # Theta: no GPUs, so the venv's CPU TensorFlow is fine; its account is a placeholder.
    run_dir = tmp_path / "run"
    done = workflow("--site", "theta", "--config", str(TINY), "--run-dir", str(run_dir), expect=2)
    assert "still a placeholder" in done.stderr and not run_dir.exists()


def test_a_killed_training_is_reported_as_killed_not_as_an_earlier_runs_error(tmp_path):
    from apps.contracts import Train
    from apps.train import train
    from pipeline.core.errors import StageFailed

    log = tmp_path / "train.log"
    log.write_text("[train] step 20\nerror: training diverged: the loss is NaN at step 20\n")
    # The fault: this launch's process is killed (as the kernel's OOM killer or a lost node does).
    command = "echo '[train] step 10'; kill -9 $$"
    with pytest.raises(StageFailed) as failure:
        # The app's own function, as a worker runs it (Parsl's wrapper would return the error).
        train.func.__wrapped__(
            {"x": 1}, command, str(log),
            io=Train(train_volume=tmp_path / "train.h5", coordinates=tmp_path / "coordinates.npz",
                     init_from=(), train_summary=tmp_path / "summary.json"),
        )  # fmt: skip
    message = str(failure.value)
    assert "was killed by SIGKILL" in message and "[train] step 10" in message
    assert "NaN" not in message and failure.value.retryable
    assert log.read_text().count("[train] step") == 2  # the log still holds both runs


def test_a_full_disk_names_the_file_and_leaves_nothing_half_written(tmp_path):
    from pipeline.core.atomic import atomic_path
    from pipeline.core.errors import DiskFull

    final = tmp_path / "selection.json"
    # The fault: the temporary file the write goes to is /dev/full, where every write fails
    # with the kernel's ENOSPC, as on a full file system.
    (tmp_path / f".selection.tmp-{os.getpid()}.json").symlink_to("/dev/full")
    with pytest.raises(
        DiskFull, match=f"^{final}: nothing left half-written.*No space left on device$"
    ):
        with atomic_path(final) as tmp:
            with open(tmp, "w") as f:
                f.write("{}" * 10_000)
                f.flush()
    assert not final.exists() and list(tmp_path.iterdir()) == []


def test_a_fov_larger_than_the_synthetic_volume_is_refused_by_the_dry_run(tmp_path):
    config = tmp_path / "small.toml"
    config.write_text(
        "[data]\nsynthetic_shape_zyx = [8, 64, 64]\n"
        "[train.model]\nfov_shape_zyx = [9, 17, 17]\ndeltas_zyx = [2, 4, 4]\n"
    )
    done = workflow("--config", str(config), "--dry-run", expect=2)
    assert "smaller than the FOV (9, 17, 17)" in done.stderr


def test_a_runs_objects_are_the_merged_layer_where_pairs_were_merged_else_the_export(tmp_path):
    """What a script reads as a finished run's objects (RunPaths.objects): the export, until the
    second pass has merged pairs into a layer of their own (the export then holds supervoxels)."""
    paths = RunPaths(tmp_path)
    assert paths.objects == paths.precomputed
    paths.merged.mkdir(parents=True)
    assert paths.objects == paths.merged
