"""Parsl's logging when the run dir's disk fills up (parsl_config.RunDirLogging): the records its
log files cannot take are dropped, with one line on the console, instead of a traceback each
(`--- Logging error ---`: 10,330 lines in one run) from the workflow, its interchange and its
monitoring database.

The test runs this module as a program, a workflow in miniature: the local site's Parsl (two
pools, monitoring on), a task, then the fault, then tasks that each log a few records."""

import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TASKS = 20


def add_one(x: int) -> int:
    return x + 1


def main(run_dir: Path, fault: str) -> int:
    import parsl
    from parsl import python_app

    from site_configs import local
    from site_configs.teardown import child_pids, shutdown

    app = python_app(add_one, executors=["cpu"])
    spare = child_pids()
    dfk = parsl.load(local.make_config(run_dir, replace(local.SITE, retries=0)))
    try:
        assert app(1).result(timeout=120) == 2
        log = next(run_dir.glob("runinfo/*/parsl.log"))
        if fault == "full disk":  # another writer fills the disk up to the kernel's ENOSPC
            with open(run_dir / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(bytes(2**16))
                except OSError:
                    pass
        else:  # this process's files may not grow past their sizes now (EFBIG)
            limit = log.stat().st_size + 100
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        done = [app(i).result(timeout=120) for i in range(TASKS)]
        print(f"tasks done: {len(done)}", flush=True)
        time.sleep(2)  # the interchange's and the monitoring's records of them
    finally:
        shutdown(dfk, spare)
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["full disk", "file-size limit"])
def test_records_parsl_cannot_write_are_dropped_with_one_line(tmp_path, fault):
    """The fault, after the first task:

    - "full disk": the run dir is on a 64 MiB tmpfs of its own (faults.SmallDisk, mounted in a
      user namespace), which the program fills up to the kernel's ENOSPC: every Parsl process's
      log fails, as do the monitoring database's writes. Skipped where no tmpfs can be mounted
      without root (no user namespaces).
    - "file-size limit": the same fault simulated, where no disk can be filled: the program's
      file-size limit (RLIMIT_FSIZE) drops to its log's size, so the log cannot grow: EFBIG,
      "File too large", in the workflow's own process only (its interchange and monitoring
      processes started before, without the limit)."""
    import processes
    from faults import SmallDisk

    if fault == "full disk" and (why := SmallDisk.missing()):
        pytest.skip(why)
    program = [sys.executable, __file__]
    if fault == "full disk":
        disk = SmallDisk(tmp_path / "disk", 64 * 2**20)
        run_dir = disk.path / "run"
        command = disk.command([*program, str(run_dir), fault], ROOT)
        reason = "No space left on device"
    else:
        disk, run_dir = None, tmp_path / "run"
        command = [*program, str(run_dir), fault]
        reason = "File too large"
    try:
        done = processes.run(command, timeout=600, cwd=ROOT)
    finally:
        if disk is not None:
            disk.close()

    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"tasks done: {TASKS}" in done.stdout
    assert "Logging error" not in done.stderr and "Traceback" not in done.stderr, done.stderr[:3000]
    said = [line for line in done.stderr.splitlines() if "Parsl's log" in line]
    assert said == [
        f"[workflow] Parsl's log {run_dir}/runinfo/000/parsl.log cannot be written ({reason}): "
        "Parsl's log records are dropped while it cannot"
    ], done.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's code, as workflow.py run from it imports
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
