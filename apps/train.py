"""Multi-rank Horovod training, started by the site's MPI launcher (site_configs.MPILaunch)."""

import subprocess
import threading
from typing import BinaryIO

from parsl import python_app

from apps.contracts import Train
from site_configs import MPI_LABEL

# What a failed launch's message is read from: the end of its output, kept in memory.
TAIL_BYTES = 64 * 1024


def run_logged(command: str, log: BinaryIO) -> tuple[int, str]:
    """Run the launch line `command`, its output appended to `log` as it comes; returns its exit
    code and the end of its output (`TAIL_BYTES`). The output goes through a pipe, not onto the
    log directly: on a full disk (where the log is, beside the checkpoints) MPICH's mpiexec
    cannot write it, aborts with exit code 255 and every rank's output is lost. Here the log
    takes what it can and the failure's own lines are in the tail whatever it took."""
    # Same process group as the worker: cancelling the worker's block stops the ranks.
    process = subprocess.Popen(
        command,
        shell=True,
        executable="/bin/bash",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    tail = bytearray()

    def copy() -> None:
        logging = True
        while chunk := process.stdout.read1(65536):
            tail.extend(chunk)
            del tail[:-TAIL_BYTES]
            if logging:
                try:
                    log.write(chunk)
                    log.flush()
                except OSError:
                    logging = False  # no room left for the log: the tail still has the end

    reader = threading.Thread(target=copy, name="launch output", daemon=True)
    reader.start()
    returncode = process.wait()
    # A rank orphaned by its launcher (the launcher killed) may hold the pipe open for ever.
    reader.join(timeout=30)
    if not reader.is_alive():
        process.stdout.close()
    return returncode, bytes(tail).decode(errors="replace")


@python_app(executors=[MPI_LABEL])
def train(
    settings: dict,
    command: str,
    log: str,
    io: Train,
    inputs=(),
    outputs=(),
    parsl_resource_specification=None,
):
    """settings: {"train": TrainConfig, "ranks": N, "init_from": path}; `command` is the launch
    line built by the workflow (it resumes from the train dir's latest checkpoint of the same
    lineage); its output is appended to `log`."""
    from apps.train import run_logged
    from pipeline.core.errors import StageFailed
    from pipeline.core.stamps import run_once

    def work() -> None:
        # Unbuffered: a write the disk refuses is dropped, not kept to fail again at close.
        with open(log, "ab", buffering=0) as out:  # the log goes on across runs
            returncode, output = run_logged(command, out)
        if returncode != 0:
            raise StageFailed.from_output("training", returncode, output, log)

    return run_once(settings, io.inputs(), io.outputs(), work)
