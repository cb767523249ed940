"""Serve an export folder (`python -m pipeline.cli.export`) on localhost, in Neuroglancer:

    python -m pipeline.cli.viewer --precomputed DIR [--port 8000] [--viewer-port 8001]

Prints the URL to open: it holds a random token (as a Jupyter server's does), without which
neither server gives anything away to another user of the machine; keep it to yourself. To view
from another machine, fix both ports and tunnel them (pipeline.export.viewer says how).
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, one_line_errors
from pipeline.export.viewer import DEFAULT_SEGMENT_COUNT, serve_forever


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.viewer",
        description="Serve an export folder (python -m pipeline.cli.export) on localhost and open it "
        "in Neuroglancer; prints the URL to open in a browser (a token in it: keep it to yourself).",
    )
    add = parser.add_argument
    add("--precomputed", required=True, type=Path, help="export folder")
    add("--port", type=int, default=0, help="data server port (default: any free port)")
    add("--viewer-port", type=int, default=0, help="Neuroglancer port (default: any free port)")
    add(
        "--segments",
        type=int,
        nargs="+",
        metavar="ID",
        help=f"segments to show (default: the {DEFAULT_SEGMENT_COUNT} largest)",
    )
    return parser


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    serve_forever(args.precomputed, args.port, args.segments, args.viewer_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
