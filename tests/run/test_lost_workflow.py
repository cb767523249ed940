"""A workflow lost with its watchdog (kill -9 of both, as a `kill -9` of every python process or
the OOM killer does) leaves nothing of its run alive, and no second workflow works on the run dir
while anything of the first does: the workflow starts its watchdog again when it dies, and every
process of the run (interchanges, monitoring, pools, tasks, ranks) carries its workflow in its
environment and stops once that workflow is gone or the run dir has passed to another
(pipeline.core.owner).

Each test injects the real fault: SIGKILL of the watchdog and of the workflow, or a lock record
rewritten by another workflow under a running task.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import processes
import psutil
import pytest
from processes import (
    alive,
    describe,
    family,
    gone_within,
    kill_all,
    naming,
    training_ranks,
    wait_until,
)
from workflow_runs import ROOT, TINY, copy_run, tiny_variant, workflow

from pipeline.core.owner import EXIT_LOST, OWNER_ENV, process_start
from pipeline.run.run_lock import owner_of, run_processes

LIMIT_S = 60  # the promise: nothing of a lost run lives longer


def wait_for_training(process: subprocess.Popen, run_dir: Path) -> list[psutil.Process]:
    took = wait_until(lambda: len(training_ranks(run_dir)) == 2 or process.poll() is not None, 600)
    ranks = training_ranks(run_dir)
    assert len(ranks) == 2, f"the ranks should be training ({took} s): {describe(ranks)}"
    time.sleep(1)  # the pools, interchanges, monitoring: all up
    return ranks


def the_run(process: subprocess.Popen, run_dir: Path) -> list[psutil.Process]:
    run = family(process.pid) + naming(str(run_dir))
    names = " ".join(" ".join(p.cmdline()) for p in run if alive(p))
    for service in ("interchange", "worker-pool", "parsl: monitoring", "mpiexec", "watchdog"):
        assert service in names, f"{service} should be running: {describe(run)}"
    return run


def watchdog_of(run_dir: Path) -> psutil.Process:
    (dog,) = [p for p in naming(f"pipeline.cli.watchdog --run-dir {run_dir}")]
    return dog


@pytest.mark.mpi
@pytest.mark.slow  # a tiny run killed while training: about 1-2 min on 2 cores
def test_kill_9_of_the_watchdog_then_of_the_workflow_leaves_nothing_of_the_run(tmp_path):
    run_dir = tmp_path / "lost"
    command = [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir)]
    output = open(tmp_path / "workflow.out", "w")  # noqa: SIM115  (closed with the test's tmp)
    with processes.started(command, cwd=ROOT, stdout=output) as process:
        wait_for_training(process, run_dir)
        run = the_run(process, run_dir)
        first = watchdog_of(run_dir)
        first.kill()
        again = f"pipeline.cli.watchdog --run-dir {run_dir}"
        took = wait_until(lambda: any(p.pid != first.pid for p in naming(again)), 15)
        assert took < 15, "the workflow should start its watchdog again"
        second = watchdog_of(run_dir)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        gone_within([*run, second], run_dir, LIMIT_S)
    said = (tmp_path / "workflow.out").read_text()
    assert f"watchdog (pid {first.pid}) ended (killed by SIGKILL)" in said, said[-2000:]
    log = (run_dir / "runinfo" / "watchdog.log").read_text()
    assert "(started again)" in log and "is gone: stopping the run" in log, log[-2000:]


@pytest.mark.mpi
@pytest.mark.slow  # a run killed while training and resumed until it trains: about 2 min
def test_a_resume_after_the_workflow_and_its_watchdog_died_together_trains_alone(tmp_path):
    # Long enough that the lost run's ranks would still train when the resume does.
    config = tiny_variant(tmp_path, "long", {"max_steps = 30": "max_steps = 5000"})
    run_dir = tmp_path / "lost"
    command = [sys.executable, "workflow.py", "--config", str(config), "--run-dir", str(run_dir)]
    with processes.started(command, cwd=ROOT) as process:
        old_ranks = wait_for_training(process, run_dir)
        run = the_run(process, run_dir)
        os.kill(watchdog_of(run_dir).pid, signal.SIGKILL)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    killed = time.monotonic()
    try:
        resume = [*command, "--resume"]
        with processes.started(resume, cwd=ROOT) as second:
            took = wait_until(
                lambda: (
                    [p for p in training_ranks(run_dir) if p not in old_ranks]
                    or second.poll() is not None
                ),
                600,
            )
            assert second.poll() is None, second.stdout.read()[-3000:]
            left = describe([p for p in run if alive(p)])
            assert not left, f"the resume trains ({took} s) beside the lost run's {left}"
            second.send_signal(signal.SIGINT)  # a clean end: the test needs no more
            second.communicate(timeout=120)
        gone_within(run, run_dir, max(1.0, LIMIT_S - (time.monotonic() - killed)))
    finally:
        kill_all(run)
    metrics = run_dir / "train" / "metrics.csv"
    rows = metrics.read_text().splitlines() if metrics.is_file() else []
    steps = [row.split(",")[0] for row in rows]
    assert len(steps) == len(set(steps)), "two trainings wrote into one metrics.csv"


# A task as a Parsl worker runs it (stamps.run_once), working for the owner in its environment.
TASK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pipeline.core.stamps import run_once

    output = Path(sys.argv[1])

    def work():
        Path(sys.argv[2]).write_text("began")
        time.sleep(float(sys.argv[3]))
        output.write_text("made")

    print(run_once({"task": 1}, [], [output], work), flush=True)
    """
)


def owned_by_this_test(run_dir: Path) -> tuple[dict, dict[str, str]]:
    """A lock record naming this test process as the run's workflow, and the environment a
    process of that workflow has."""
    (run_dir / "runinfo").mkdir(parents=True)
    record = {"pid": os.getpid(), "created": process_start(os.getpid()), "host": os.uname()[1]}
    (run_dir / "workflow.lock").write_text(json.dumps(record))
    env = os.environ | {OWNER_ENV: owner_of(run_dir, record).to_env(), "PYTHONPATH": str(ROOT)}
    return record, env


def task_working(tmp_path: Path, run_dir: Path, seconds: float) -> tuple[list[str], Path, Path]:
    """The command of a TASK that works `seconds`, its output, and the file it writes when its
    work begins."""
    script = tmp_path / "task.py"
    script.write_text(TASK)
    output, began = run_dir / "made.txt", tmp_path / "began"
    return [sys.executable, str(script), str(output), str(began), str(seconds)], output, began


def test_a_task_stops_once_another_workflow_takes_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    record, env = owned_by_this_test(run_dir)
    command, output, began = task_working(tmp_path, run_dir, seconds=120)
    with processes.started(command, cwd=ROOT, env=env) as task:
        assert wait_until(lambda: began.exists() or task.poll() is not None, 60) < 60
        assert task.poll() is None, task.stdout.read()
        # Another workflow takes the run dir (as `run_lock.hold` writes its record).
        (run_dir / "workflow.lock").write_text(json.dumps(record | {"pid": 1, "created": 0.0}))
        took = wait_until(lambda: task.poll() is not None, 15)
        said = task.stdout.read()
    assert took < 15, "the task should stop within the owner's period"
    assert task.returncode == EXIT_LOST, said
    assert "the run dir passed from workflow pid" in said and "to workflow pid 1" in said, said
    assert not output.exists()


def test_a_task_of_a_workflow_that_lost_the_run_dir_does_not_start(tmp_path):
    """Nor does it drop the stamps of outputs it would have made: they are another's now."""
    run_dir = tmp_path / "run"
    record, env = owned_by_this_test(run_dir)
    command, output, began = task_working(tmp_path, run_dir, seconds=0)
    assert processes.run(command, cwd=ROOT, env=env, timeout=120).stdout.strip() == "ran"
    stamps = sorted(p.name for p in run_dir.iterdir())
    (run_dir / "workflow.lock").write_text(json.dumps(record | {"pid": 1, "created": 0.0}))
    began.unlink()
    output.write_text("changed by the workflow that holds the run now")
    done = processes.run(command, cwd=ROOT, env=env, timeout=120)
    assert done.returncode != 0 and "RunDirTaken" in done.stderr, done.stderr[-2000:]
    assert "does not start: the run dir passed from" in done.stderr
    assert not began.exists(), "the task's work must not begin"
    assert sorted(p.name for p in run_dir.iterdir()) == stamps


def test_status_counts_a_runs_processes_and_a_resume_ends_those_its_lost_workflow_left(
    tiny_run, tmp_path
):
    """A process left by a lost workflow (here a `sleep` with that workflow in its environment,
    as every process of a run has) is counted by `status` and ended by the next `--resume`."""
    run_dir = copy_run(tiny_run, tmp_path / "run")
    record = json.loads((run_dir / "workflow.lock").read_text())  # the workflow that made it
    env = os.environ | {OWNER_ENV: owner_of(run_dir, record).to_env()}
    with processes.started(["sleep", "600"], env=env) as left:
        status = workflow("status", "--run-dir", str(run_dir)).stdout
        assert (
            f"processes: 1 process (1 sleep) of the run alive on this host, left by a workflow "
            f"that is gone (pids {left.pid})"
        ) in status, status
        resumed = workflow("--config", str(TINY), "--run-dir", str(run_dir), "--resume")
        assert "ending 1 process (1 sleep) left running by workflow pid" in resumed.stderr
        assert left.poll() is not None, "the resume should have ended it"
    status = workflow("status", "--run-dir", str(run_dir)).stdout
    assert "processes:" not in status, status
    assert "node-hours charged so far: " in status and " train " in status, status


def test_status_counts_the_processes_of_a_run_by_their_owner(tmp_path):
    run_dir = tmp_path / "run"
    _, env = owned_by_this_test(run_dir)
    with processes.started(["sleep", "60"], env=env) as sleeper:
        assert wait_until(lambda: run_processes(run_dir), 10) < 10
        (found, owner), *more = run_processes(run_dir)
        assert not more and found.pid == sleeper.pid and owner.pid == os.getpid()
