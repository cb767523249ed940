"""What every command-line entry point shares: expected failures end in one line, not a traceback.

    @one_line_errors
    def main(argv=None) -> int: ...

A pipeline error (bad input, bad setting) exits 2, an operating-system error (disk full, no
permission, file gone) exits 1, Ctrl-C exits 130; each prints `error: ...` on stderr.
"""

import functools
import sys
from collections.abc import Callable, Sequence

from pipeline.errors import FFNError, first_line

Main = Callable[[Sequence[str] | None], int]


def describe_os_error(exc: OSError) -> str:
    """`path: reason` where the error names a file, else the library's first line."""
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return first_line(exc)


def one_line_errors(main: Main) -> Main:
    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except FFNError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"error: {describe_os_error(exc)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130

    return wrapper
