"""A training launch's output: appended to its log as it comes, its end kept for the failure's
message (the Parsl app `apps.train` runs the launch line through it)."""

import subprocess
import threading
from typing import BinaryIO

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
