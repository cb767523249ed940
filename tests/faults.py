"""Faults the tests inject into real files, as a disk, a crash or a user would."""

from pathlib import Path


def zero_bytes(path: str | Path, start: int = 0, count: int = 50) -> None:
    """Overwrite `count` bytes from `start` with zeros, the file's size kept: a rewrite in place
    that a record of sizes alone does not see."""
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(count))
