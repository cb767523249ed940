"""A training that meets a full disk or loses a rank, run as the workflow runs it: the training
app (apps/train.py) starts real Horovod ranks with the venv's mpiexec, appends their output to the
log and turns a failure into one line. That line names the checkpoint that found no room or the
signal that killed a rank; a full disk leaves no half checkpoint and is not retried; the run then
goes on from its last complete checkpoint."""

import contextlib
import json
import os
import random
import re
import shlex
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import processes
import pytest
from faults import SmallDisk, limit_file_size
from test_train import ROOT, train_command

from apps.contracts import Train
from apps.train import train
from pipeline.core.errors import StageFailed
from pipeline.training.trainer import local_ranks

# One thread per rank: 2 ranks on 2 cores. The launch line carries its environment, as the
# workflow's does (site_configs.launch.MPILaunch.command).
ENV = {
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
}
# Checkpoints at steps 4, 8, 12, ...; a log line every 2 steps.
EVERY = ("--log-every-steps", "2", "--checkpoint-every-steps", "4", "--deterministic")


def launch_line(data: dict, train_dir: Path, *flags: str) -> list[str]:
    environment = [f"{name}={value}" for name, value in ENV.items()]
    return ["env", *environment, "mpiexec", "-n", "2", *train_command(data, train_dir, *flags)]


def launch(command: list[str], log: Path, data: dict, train_dir: Path) -> Future:
    """The training app's own function, as a worker runs it (Parsl's wrapper would return the
    error), in a thread: the test injects the fault meanwhile. The future's exception is the
    task's."""
    io = Train(
        train_volume=Path(data["raw"].partition(":")[0]),
        coordinates=Path(data["coordinates"]),
        init_from=(),
        train_summary=train_dir / "train_summary.json",
    )
    run = train.func.__wrapped__
    pool = ThreadPoolExecutor(1)
    future = pool.submit(run, {"train_dir": str(train_dir)}, shlex.join(command), str(log), io=io)
    pool.shutdown(wait=False)
    return future


def wait_for(condition, failure: Future, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert not failure.done(), f"the training ended before {what}: {failure.exception()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def ended(running: Future, train_dir: Path, log: Path, timeout: float) -> BaseException | None:
    """The launch's error once it ends; if it has not ended within `timeout` s, the test fails
    with what a person would look at: every local rank's stacks (SIGUSR1, pipeline.cli.train)
    and the log's end."""
    try:
        return running.exception(timeout=timeout)
    except TimeoutError:
        ranks = local_ranks(train_dir)
        for rank in ranks:
            rank.send_signal(signal.SIGUSR1)
        time.sleep(5)
        states = [f"{r.pid} {r.status()}" for r in ranks if processes.alive(r)]
        pytest.fail(
            f"the launch has not ended after {timeout} s; ranks {states}; log:\n"
            + text_of(log)[-20_000:]
        )


def text_of(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", ["full disk", "full disk, no room for the streams", "file-size limit"]
)
def test_a_checkpoint_that_finds_no_room_fails_in_one_line_and_the_run_goes_on_from_the_last(
    training_data, tmp_path, fault
):
    """The fault, injected while 2 ranks train, once the first checkpoint (ckpt-4) is written:

    - "full disk": the train dir, the log included, is on a 64 MiB tmpfs of its own
      (faults.SmallDisk, mounted in a user namespace); another writer fills it up to the kernel's
      ENOSPC and leaves 200 KB: room for the ranks' streams (about 40 KB each) but not for the
      checkpoint's data file (430 KB), as on a disk that fills up during a run. TensorFlow's
      checkpoint writer gets ENOSPC and raises ResourceExhaustedError. Skipped where no tmpfs can
      be mounted without root (no user namespaces).
    - "full disk, no room for the streams": the same with 30 KB left, less than the ranks'
      streams of the checkpoint, written before it: the ranks fail there, one before the other,
      and none of the streams already written is kept either.
    - "file-size limit": the same fault simulated, for where no disk can be filled: the ranks'
      file-size limit (RLIMIT_FSIZE, set from outside as `prlimit` does) drops to 200 KB, so the
      checkpoint's data file cannot grow past it: the kernel's EFBIG, "File too large", which
      TensorFlow raises as OutOfRangeError. The same write fails at the same place; only the
      errno differs (the log stays writable here)."""
    if fault.startswith("full disk") and (why := SmallDisk.missing()):
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        if fault.startswith("full disk"):
            disk = SmallDisk(tmp_path / "disk", 64 * 2**20)
            stack.callback(disk.close)
            train_dir, seen = disk.path / "train", disk.seen

            def inside(argv: list[str]) -> list[str]:
                return disk.command(argv, ROOT)
        else:
            train_dir, seen = tmp_path / "train", Path

            def inside(argv: list[str]) -> list[str]:
                return argv

        seen(train_dir).mkdir(parents=True)
        checkpoints = seen(train_dir / "checkpoints")
        command = inside(launch_line(training_data, train_dir, "--max-steps", "60", *EVERY))
        running = launch(command, seen(train_dir / "train.log"), training_data, seen(train_dir))
        # A save is complete once the manager's state file names it.
        wait_for(lambda: '"ckpt-4"' in text_of(checkpoints / "checkpoint"), running, "ckpt-4")
        if fault.startswith("full disk"):
            disk.fill(leave=30_000 if "streams" in fault else 200_000)
        else:
            limit_file_size(local_ranks(train_dir), 200_000)

        error = ended(running, train_dir, seen(train_dir / "train.log"), timeout=600)

        assert isinstance(error, StageFailed), error
        message = str(error)
        words = "no space left on device" if fault.startswith("full disk") else "file too large"
        where = re.escape(str(train_dir / "checkpoints"))
        match = re.fullmatch(
            rf"training exited with code 1: error: {words} writing checkpoint {where}/ckpt-(\d+) "
            rf"\(nothing of it kept; .*: .* then --resume goes on from ckpt-(\d+)\) \(log: .*\)",
            message,
        )
        assert match, message
        failed, kept = int(match[1]), int(match[2])
        assert failed == kept + 4 and failed < 60
        assert not error.retryable  # a retry would redo the steps since ckpt-{kept} and fail again
        # Nothing of the failed checkpoint is left: no TensorFlow temporary folder, no files of
        # it, no streams; the state file names the last complete one.
        assert not list(checkpoints.glob("*_temp")) and not list(checkpoints.glob("*.tmp*"))
        assert not list(checkpoints.glob(f"ckpt-{failed}.*"))
        assert not (checkpoints / "streams" / f"ckpt-{failed}").exists()
        assert text_of(checkpoints / "checkpoint").splitlines()[0].endswith(f'"ckpt-{kept}"')

        # Room again (the filler deleted, or a new process without the limit): the run goes on
        # from the last complete checkpoint, through the one that failed.
        if fault.startswith("full disk"):
            disk.free()
        flags = ("--max-steps", str(failed), *EVERY)
        resumed = processes.run(inside(launch_line(training_data, train_dir, *flags)), timeout=600)

        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"resuming from {train_dir}/checkpoints/ckpt-{kept} at step {kept}" in resumed.stdout
        summary = json.loads(seen(train_dir / "train_summary.json").read_text())
        assert summary["step"] == failed and summary["resumed_from_step"] == kept
        assert summary["checkpoint"].endswith(f"ckpt-{failed}")


@pytest.mark.mpi
@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_reported_as_killed(training_data, tmp_path):
    """Asked for their stacks, the ranks print them and go on. Then the fault: one of the 2 ranks, chosen at random, is killed with SIGKILL mid-training, as
    the kernel's out-of-memory killer or a lost node does. MPICH's mpiexec reports the signal, not
    the rank: its box names the PID of whichever rank it reaps first, often one it killed itself
    while cleaning up (tried: killing rank 1 of 3 names rank 0's PID every time)."""
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    command = launch_line(training_data, train_dir, "--max-steps", "1000", *EVERY)
    running = launch(command, train_dir / "train.log", training_data, train_dir)
    wait_for(lambda: "[train] step 2/" in text_of(train_dir / "train.log"), running, "step 2")
    ranks = local_ranks(train_dir)
    assert len(ranks) == 2
    # First a rank that seems stuck is asked where it is, as a person would: SIGUSR1 to the
    # launcher, which passes it on; every rank prints its threads' stacks and trains on.
    launcher = ranks[0].parent().parent()  # mpiexec, over the rank's hydra proxy
    assert launcher.name() == "mpiexec", launcher.cmdline()
    launcher.send_signal(signal.SIGUSR1)
    # faulthandler heads the signalled thread's stack so, once per rank.
    stacks = "Current thread 0x"
    wait_for(lambda: text_of(train_dir / "train.log").count(stacks) == 2, running, "stacks")
    assert "in run_training\n" in text_of(train_dir / "train.log")
    steps = text_of(train_dir / "train.log").count("[train] step ")
    wait_for(
        lambda: text_of(train_dir / "train.log").count("[train] step ") > steps,
        running,
        "a step after",
    )

    random.choice(ranks).kill()
    error = ended(running, train_dir, train_dir / "train.log", timeout=300)

    assert isinstance(error, StageFailed), error
    message = str(error)
    assert message.startswith(
        "a training rank was killed by SIGKILL (out of memory, a lost node, or a kill), "
        "exit code 9: [train] step "
    ), message
    assert "FAQ" not in message and "\n" not in message
    assert error.retryable  # the retry goes on from the last checkpoint


@pytest.mark.mpi
def test_a_launch_whose_log_cannot_be_written_still_reports_its_error(training_data, tmp_path):
    """The fault: the log is on a full disk, as the log beside the checkpoints is when the disk
    fills up: a tmpfs of its own filled up to the kernel's ENOSPC (faults.SmallDisk), else
    /dev/full, where every write fails with ENOSPC alike (the app only writes the log; reading
    /dev/full never ends). mpiexec wrote the ranks' output there itself and, unable to, aborted
    with exit code 255 and no output; the launch (2 ranks that refuse a bad setting) is real."""
    with contextlib.ExitStack() as stack:
        if SmallDisk.missing():
            log = tmp_path / "train.log"
            log.symlink_to("/dev/full")
        else:
            disk = SmallDisk(tmp_path / "disk", 2**20)
            stack.callback(disk.close)
            log = disk.seen(disk.path / "train.log")
            # An earlier run's lines, a whole page of the tmpfs: a line more takes a new one.
            log.write_text("[train] an earlier run\n".rjust(4096, "-"))
            disk.fill(leave=0)
        command = launch_line(training_data, tmp_path / "train", "--lr-policy", "cubic")

        error = launch(command, log, training_data, tmp_path / "train").exception(timeout=300)

    assert isinstance(error, StageFailed), error
    assert str(error).startswith("training exited with code 2: error: lr_policy must be one of")
    assert not error.retryable


# Launchers' own reports of a killed rank, as they print them (the local site's MPICH is tried
# live above). HPE's PALS mpiexec (Polaris) names the rank, then the ranks it ended after it;
# Slurm's srun names the task (the rank) and the signal's description.
PALS = """[train] step 12/30 loss 0.6913
x3004c0s7b0n0.hsn.cm.polaris.alcf.anl.gov: rank 1 died from signal 9
x3004c0s7b0n0.hsn.cm.polaris.alcf.anl.gov: rank 0 died from signal 15
"""
SRUN = """[train] step 12/30 loss 0.6913
srun: error: nid001234: task 3: Killed
srun: error: nid001234: tasks 0-2: Terminated
"""


KILLED = "killed by SIGKILL (out of memory, a lost node, or a kill)"


@pytest.mark.parametrize(
    "output, returncode, status",
    [
        (PALS, 137, f"training rank 1 was {KILLED}, exit code 137"),
        (SRUN, 137, f"training rank 3 was {KILLED}, exit code 137"),
        ("[train] step 12/30 loss 0.6913\n", 143, "training was killed by SIGTERM, exit code 143"),
        ("[train] step 12/30 loss 0.6913\n", 9, "training exited with code 9"),  # its own exit
    ],
)
def test_the_rank_a_launcher_reports_killed_is_named(output, returncode, status):
    message = str(StageFailed.from_output("training", returncode, output, "train.log"))
    assert message == f"{status}: [train] step 12/30 loss 0.6913 (log: train.log)"
