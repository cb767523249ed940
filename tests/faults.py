"""Faults the tests inject into real files, as a disk, a crash or a user would."""

import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def zero_bytes(path: str | Path, start: int = 0, count: int = 50) -> None:
    """Overwrite `count` bytes from `start` with zeros, the file's size kept: a rewrite in place
    that a record of sizes alone does not see."""
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(count))


# The child's preamble: `Path.write_bytes` of a file whose name holds `sys.argv[2]` writes half of
# the data, syncs it, names the file in the marker `sys.argv[1]`, then waits to be killed.
_HALF_WRITE = r"""
import os, pathlib, sys, time
marker, written_name = pathlib.Path(sys.argv[1]), sys.argv[2]
sys.argv[1:3] = []


def half_then_wait(path, data):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    marker.write_text(str(path))
    time.sleep(600)


write_bytes = pathlib.Path.write_bytes
pathlib.Path.write_bytes = lambda self, data: (
    half_then_wait(self, data) if written_name in self.name else write_bytes(self, data))
"""


def killed_mid_write(
    code: str, written_name: str, marker: Path, *args: str, cwd: str | Path | None = None
) -> Path:
    """Run `code` in a child process (its own arguments `args`, as `sys.argv[1:]`) and SIGKILL it
    once half of a file whose name holds `written_name` is on disk, as a lost node or an
    out-of-memory kill would stop it; returns that file. The child's writes go through
    `Path.write_bytes`, as the export's do."""
    command = [sys.executable, "-c", _HALF_WRITE + code, str(marker), written_name, *args]
    child = subprocess.Popen(command, cwd=cwd)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the child never began writing (exit {child.poll()})"
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL  # the fault happened
    finally:
        child.kill()
    return Path(marker.read_text())


class SmallDisk:
    """A small file system of its own at `path` that fills up as a real disk does (the kernel's
    ENOSPC): a tmpfs of `size` bytes mounted in a user and mount namespace of its own (`unshare
    -rm`, no root needed where unprivileged user namespaces are allowed), so only the processes
    started through `command` see it. A holder process keeps the namespace while the test runs;
    the test itself reaches the files through that process's root (`seen`). `missing()` says why
    one cannot be mounted here (then a test simulates the fault instead, or is skipped)."""

    FILLER = ".filler"

    def __init__(self, path: str | Path, size: int):
        self.path = Path(path).resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        mount = f'mount -t tmpfs -o size={size} tmpfs "$0" && echo mounted && exec sleep infinity'
        self._holder = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", mount, str(self.path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if self._holder.stdout.readline().strip() != "mounted":
            self.close()
            raise OSError(f"cannot mount a tmpfs at {self.path}: {self._holder.stderr.read()}")

    @staticmethod
    @functools.cache
    def missing() -> str | None:
        """None where a SmallDisk can be made, else why not."""
        if not (shutil.which("unshare") and shutil.which("nsenter")):
            return "unshare/nsenter (util-linux) not installed"
        with tempfile.TemporaryDirectory() as folder:
            try:
                disk = SmallDisk(folder, 2**20)
            except OSError as exc:
                return f"no tmpfs can be mounted in a user namespace here ({str(exc).strip()})"
            try:
                entered = subprocess.run(disk.command(["true"], folder), capture_output=True)
            finally:
                disk.close()
        if entered.returncode != 0:
            return f"nsenter cannot enter a user namespace here: {entered.stderr.decode()}"
        return None

    def command(self, argv: list[str], cwd: str | Path) -> list[str]:
        """`argv` run inside the namespace (where the disk is), in `cwd`."""
        pid = str(self._holder.pid)
        enter = ["nsenter", "-t", pid, "-U", "-m", "--preserve-credentials", f"--wd={cwd}"]
        return [*enter, "--", *argv]

    def seen(self, path: str | Path) -> Path:
        """`path` (on the disk) as this test process reaches it."""
        return Path(f"/proc/{self._holder.pid}/root") / Path(path).resolve().relative_to("/")

    def fill(self, leave: int) -> None:
        """Fill the disk with a file of zeros until the kernel refuses (ENOSPC), then give back
        `leave` bytes: what another job writing to the same file system does."""
        filler = self.seen(self.path / self.FILLER)
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(2**16))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        os.truncate(filler, max(0, filler.stat().st_size - leave))

    def free(self) -> None:
        self.seen(self.path / self.FILLER).unlink(missing_ok=True)

    def close(self) -> None:
        """Unmount the disk (its namespace ends with its holder), with all it holds."""
        self._holder.kill()
        self._holder.wait()
        self._holder.stdout.close()
        self._holder.stderr.close()


def limit_file_size(processes: list, limit: int) -> None:
    """From now on no file that `processes` (psutil.Process) write may grow past `limit` bytes
    (RLIMIT_FSIZE, as `ulimit -f` sets it; Python ignores SIGXFSZ, so the write fails with EFBIG,
    "File too large"): a full disk's failure where none can be mounted."""
    for process in processes:
        hard = process.rlimit(psutil.RLIMIT_FSIZE)[1]
        process.rlimit(psutil.RLIMIT_FSIZE, (limit, hard))
