"""Write a file so that readers see either nothing or the complete file, never a partial one."""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


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
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
