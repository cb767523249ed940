"""kill -9 of the workflow (or a login node dropping its session) leaves nothing of the run
computing or living for more than 30 s: the run's watchdog (pipeline.run.watchdog) ends the
workflow's processes, its detached local worker blocks and its batch jobs; on a normal end it
exits and kills nothing; and `--resume` afterwards goes on.

Each test injects the real fault: SIGKILL of the process that started the watchdog.
"""

import json
import os
import signal
import subprocess
import sys
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
from workflow_runs import ROOT, TINY, workflow

from pipeline.run import watchdog

FAKE_SCHEDULER = Path(__file__).parents[1] / "fake_scheduler"
LIMIT_S = 30  # the promise: nothing of a killed workflow's run lives on longer

# A stand-in workflow: starts the watchdog, then processes the way Parsl does (children,
# grandchildren, and a block detached the way LocalProvider starts one: a background subshell of
# a shell in a process group of its own, which exits at once; the block starts its pool later),
# and optionally submits a batch job through a Parsl provider to the stand-in PBS. It writes what
# it started to <run>/started.json, then waits (mode "kill") or ends normally (mode "stop").
STAND_IN = r"""
import json, os, subprocess, sys, time
from pathlib import Path
from pipeline.run import watchdog

run_dir, mode, flavour = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spared = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL)  # the caller's own, before the watchdog: not the run's
dog = watchdog.start(run_dir)
child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL)
tree = subprocess.Popen(["bash", "-c", "sleep 301 & sleep 302 & wait"], stdout=subprocess.DEVNULL)
launch = subprocess.run(
    ["/bin/bash", "-c",
     "{ sleep 2; sleep 303 & sleep 304; } >/dev/null 2>&1 & echo $!"],
    capture_output=True, text=True, preexec_fn=os.setpgrp, check=True,
)
block = int(launch.stdout)
watchdog.record_job(run_dir, watchdog.local_block(block))
job = None
if flavour != "local":
    from types import SimpleNamespace
    from parsl.launchers import SimpleLauncher
    from parsl.providers import PBSProProvider, SlurmProvider
    from site_configs import base
    from site_configs.cobalt import CobaltProvider

    provider = {
        "pbspro": lambda: PBSProProvider(launcher=SimpleLauncher(), queue="debug"),
        "cobalt": lambda: CobaltProvider(launcher=SimpleLauncher(), queue="debug-cache-quad"),
        "slurm": lambda: SlurmProvider(launcher=SimpleLauncher(), partition="debug"),
    }[flavour]()
    provider.script_dir = str(run_dir)
    base._record_submissions(run_dir, SimpleNamespace(provider=provider))
    job = provider.submit("sleep 305", 1, "sleeper")
time.sleep(4)  # the block has started its "pool"; the watchdog has looked
Path(run_dir / "started.json").write_text(json.dumps(
    {"watchdog": dog.pid, "spared": spared.pid, "block": block, "job": job}
))
if mode == "stop":
    dog.stop()
    Path(run_dir / "stopped.txt").write_text(f"stopped {dog.process.returncode}")
    sys.exit(0)
time.sleep(600)
"""


def stand_in(tmp_path: Path, mode: str, flavour: str = "local", env: dict | None = None):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    command = [sys.executable, str(script), str(run_dir), mode, flavour]
    environment = (env or os.environ) | {"PYTHONPATH": str(ROOT)}
    # Output to a file: the stand-in's children hold it open after the stand-in is gone.
    output = open(tmp_path / "stand_in.out", "w")  # noqa: SIM115  (closed with the test's tmp)
    context = processes.started(
        command, cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT
    )
    return context, run_dir


def started_record(run_dir: Path, process: subprocess.Popen, timeout: float = 60) -> dict:
    path = run_dir / "started.json"
    took = wait_until(lambda: path.exists() or process.poll() is not None, timeout)
    if not path.exists():
        output = (run_dir.parent / "stand_in.out").read_text()[-2000:]
        pytest.fail(f"the stand-in did not start ({took} s): {output}")
    return json.loads(path.read_text())


def kill_and_wait_for_the_run(process: subprocess.Popen, run: list, run_dir: Path) -> None:
    """kill -9 the workflow; every process of `run` and every one naming the run dir must be
    gone within LIMIT_S (whatever a failed test finds is killed, not left running)."""
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    gone_within(run, run_dir, LIMIT_S)


def kill_and_check(process: subprocess.Popen, run_dir: Path, record: dict) -> list[psutil.Process]:
    """SIGKILL the stand-in workflow; its run's processes must all be gone within LIMIT_S."""
    run = family(process.pid, record["block"])
    spared = psutil.Process(record["spared"])
    run = [p for p in run if p.pid != spared.pid]
    assert len(run) >= 7, describe(run)  # watchdog, sleeps, bash, the block and its pool
    kill_and_wait_for_the_run(process, run, run_dir)
    assert alive(spared), "a process the workflow had before the watchdog is not the run's"
    spared.kill()
    log = (run_dir / "runinfo" / watchdog.LOG_NAME).read_text()
    assert "is gone: stopping the run" in log, log
    return run


def test_kill_9_of_the_workflow_ends_its_children_and_its_detached_blocks(tmp_path):
    context, run_dir = stand_in(tmp_path, "kill")
    with context as process:
        record = started_record(run_dir, process)
        watchdog_process = psutil.Process(record["watchdog"])
        # Findable: the watchdog's command line names the run dir, in a session of its own.
        assert str(run_dir) in " ".join(watchdog_process.cmdline())
        assert os.getsid(watchdog_process.pid) == watchdog_process.pid
        block = psutil.Process(record["block"])
        assert block.ppid() != process.pid  # detached, as LocalProvider's blocks are
        kill_and_check(process, run_dir, record)
        assert not alive(block)


def test_a_normal_end_stops_the_watchdog_and_kills_nothing(tmp_path):
    context, run_dir = stand_in(tmp_path, "stop")
    with context as process:
        record = started_record(run_dir, process)
        run = [p for p in family(process.pid, record["block"]) if p.pid != record["watchdog"]]
        assert process.wait(timeout=30) == 0  # (its children hold its output pipe open)
        # The watchdog exited on "stop", with 0.
        assert (run_dir / "stopped.txt").read_text() == "stopped 0"
        time.sleep(2 * watchdog.PERIOD + 1)
        try:
            # The workflow is gone now, yet nothing of its (here left-over) processes was killed:
            # after a stop the watchdog does not act.
            assert all(alive(p) for p in run if p.pid != process.pid), describe(run)
        finally:
            for p in run:
                if alive(p):
                    p.kill()
    log = (run_dir / "runinfo" / watchdog.LOG_NAME).read_text()
    assert "is gone" not in log


def test_the_watchdog_records_a_block_submitted_just_before_the_kill(tmp_path):
    """A block recorded in jobs.jsonl but not yet seen by the watchdog's look (which it makes
    every PERIOD s) is still ended: the watchdog reads the file again when the workflow is gone."""
    run_dir = tmp_path / "run"
    (run_dir / "runinfo").mkdir(parents=True)
    workflow_stand_in = subprocess.Popen(["sleep", "300"], start_new_session=True)
    block = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        me = psutil.Process(workflow_stand_in.pid)
        run = watchdog.Run(run_dir, me.pid, me.create_time(), since=me.create_time())
        run.record()
        line = {
            "workflow": me.pid,
            "workflow_started": me.create_time(),
            **watchdog.local_block(block.pid),
        }
        with open(watchdog.jobs_path(run_dir), "a") as jobs:
            jobs.write(json.dumps(line) + "\n")
        workflow_stand_in.kill()
        workflow_stand_in.wait()
        assert not run.alive()
        run.end()
        assert block.wait(timeout=10) is not None
    finally:
        for p in (workflow_stand_in, block):
            p.kill()


@pytest.mark.mpi  # the stand-in schedulers run jobs through the venv
@pytest.mark.parametrize(
    "flavour, cancel", [("pbspro", "qdel"), ("cobalt", "qdel"), ("slurm", "scancel")]
)
def test_kill_9_of_the_workflow_cancels_its_batch_jobs(tmp_path, flavour, cancel):
    state = tmp_path / "scheduler"
    tools = FAKE_SCHEDULER / flavour
    env = os.environ | {
        "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SCHED_DIR": str(state),
        "FAKE_SCHED_PYTHON": sys.executable,
        "FAKE_SITE_PATH": f"{tools}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
    }
    context, run_dir = stand_in(tmp_path, "kill", flavour, env=env)
    with context as process:
        record = started_record(run_dir, process)
        assert record["job"]
        (job,) = [json.loads(p.read_text()) for p in (state / "jobs").glob("*.json")]
        job_processes = [p for p in psutil.process_iter() if _sid(p.pid) == job["sid"]]
        assert job_processes, "the batch job should be running"
        try:
            kill_and_check(process, run_dir, record)
            calls = [json.loads(x) for x in (state / "calls.jsonl").read_text().splitlines()]
            assert [c["argv"] for c in calls if c["tool"] == cancel] == [[record["job"]]]
            assert wait_until(lambda: not any(alive(p) for p in job_processes), 10) < 10
        finally:
            kill_all(job_processes)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.mark.mpi
@pytest.mark.slow  # a tiny run killed while training, then resumed: about 2-3 min on 2 cores
def test_kill_9_of_workflow_py_leaves_nothing_running_and_a_resume_goes_on(tmp_path):
    run_dir = tmp_path / "killed"
    command = [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir)]
    with processes.started(command, cwd=ROOT) as process:
        deadline = time.monotonic() + 600
        while process.poll() is None and time.monotonic() < deadline:
            if len(training_ranks(run_dir)) == 2:  # the pools, interchanges, monitoring: all up
                break
            time.sleep(0.2)
        assert len(training_ranks(run_dir)) == 2, "the ranks should be training"
        time.sleep(1)
        run = family(process.pid) + naming(str(run_dir))
        names = " ".join(" ".join(p.cmdline()) for p in run if alive(p))
        for service in ("interchange", "process_worker_pool", "parsl: monitoring", "mpiexec"):
            assert service in names, f"{service} should be running: {describe(run)}"
        kill_and_wait_for_the_run(process, run, run_dir)

    out = workflow("--config", str(TINY), "--run-dir", str(run_dir), "--resume").stdout
    assert "stage      3/3 up to date" in out, out[-3000:]
    assert (run_dir / "evaluation.json").is_file()
    assert naming(str(run_dir)) == []  # a normal end: the resume's watchdog is gone too


# A stand-in workflow running one long task on the local site's cpu pool, as Parsl runs it.
ONE_TASK = r"""
import dataclasses, sys, time
from pathlib import Path
import parsl
from parsl import python_app
from site_configs import base, local

@python_app(executors=[base.CPU_LABEL])
def computing(seconds, began):
    import time
    from pathlib import Path

    Path(began).write_text("began")
    time.sleep(seconds)  # in the worker itself

folder = Path(sys.argv[1])
site = dataclasses.replace(local.SITE, monitoring=False)
parsl.load(base.only_executors(local.make_config(folder / "run", site), {base.CPU_LABEL}))
computing(300, str(folder / "began"))
time.sleep(600)
"""


def test_a_pool_whose_interchange_is_killed_stops_its_workers_after_the_heartbeat_threshold(
    tmp_path,
):
    """Parsl's own guard, for pools the watchdog cannot reach (a batch job whose qdel failed):
    with the sites' heartbeat settings a pool that loses its interchange stops its workers
    within heartbeat_threshold (30 s, not Parsl's 120 s)."""
    from site_configs import base

    script = tmp_path / "one_task.py"
    script.write_text(ONE_TASK)
    output = open(tmp_path / "one_task.out", "w")  # noqa: SIM115
    command = [sys.executable, str(script), str(tmp_path)]
    environment = os.environ | {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    pool: list[psutil.Process] = []
    with processes.started(
        command, cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT
    ) as process:
        try:
            began = tmp_path / "began"
            took = wait_until(lambda: began.exists() or process.poll() is not None, 120)
            assert began.exists(), (tmp_path / "one_task.out").read_text()[-2000:]
            pool = [
                p for p in naming(str(tmp_path)) if "process_worker_pool" in " ".join(p.cmdline())
            ]
            pool += [c for p in pool for c in p.children(recursive=True)]
            assert len(pool) >= 2, describe(pool)  # the pool and its workers
            (interchange,) = [
                p
                for p in psutil.Process(process.pid).children()
                if "interchange" in " ".join(p.cmdline())
            ]
            interchange.kill()
            limit = base.HEARTBEATS["heartbeat_threshold"] + 15
            took = wait_until(lambda: not any(alive(p) for p in pool), limit)
            assert took <= limit, describe([p for p in pool if alive(p)])
        finally:
            kill_all(pool)
