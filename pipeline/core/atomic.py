"""Write a file or folder so that readers see either nothing (or the previous version) or the
complete result, never a partial one."""

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import DiskFull

# How a full disk or an exhausted quota (common on HPC project spaces) reaches Python: an errno,
# or only a message where a library (HDF5) wraps the system's error in its own.
_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


@contextlib.contextmanager
def naming_full_disk(path: Path) -> Iterator[None]:
    """A full disk while writing `path` raises DiskFull naming the path and its free space."""
    try:
        yield
    except DiskFull:
        raise  # named already, by a write nested in this one
    except OSError as exc:
        code = (
            exc.errno
            if exc.errno in _FULL
            else next((c for c, text in _FULL.items() if text in str(exc)), None)
        )
        if code is None:
            raise
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        raise DiskFull(
            code,
            f"nothing left half-written, {free / 2**20:.0f} MiB free on its file system (free "
            f"space, then --resume): {_FULL[code]}",
            str(path),
        ) from exc


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `final_path`; rename it into place only if the block succeeds.

    The temporary name keeps the extension (plus `suffix`) so libraries that sniff it still work.
    On any exception the temporary file is removed and the final path is left untouched.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}{final.suffix}{suffix}")
    try:
        with naming_full_disk(final):
            yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty folder beside `final_path`; it replaces `final_path` (a previous version is
    moved aside, then deleted) only if the block succeeds. On any exception the temporary folder
    is removed and the final path is left untouched."""
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run that had this pid
    tmp.mkdir()
    try:
        with naming_full_disk(final):
            yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
