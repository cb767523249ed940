"""The run's watchdog process, started by the workflow (pipeline.run.watchdog.start), not by hand:

    python -m pipeline.cli.watchdog --run-dir RUN --pid P --started T [--spare PIDS] [--since T]

It ends every process of the run and cancels its batch jobs when workflow pid P is gone.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter
from pipeline.run.watchdog import PERIOD, serve


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.watchdog",
        description="End a run's processes and batch jobs when its workflow process is gone.",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="the run's folder")
    parser.add_argument("--pid", required=True, type=int, help="the workflow process")
    parser.add_argument("--started", required=True, type=float, help="its start time")
    parser.add_argument("--spare", default="", help="pids not of the run, comma-separated")
    parser.add_argument("--period", type=float, default=PERIOD, help="seconds between looks")
    parser.add_argument(
        "--since", type=float, help="the run's processes started since (default: now)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spare = {int(pid) for pid in args.spare.split(",") if pid}
    return serve(args.run_dir, args.pid, args.started, spare, args.period, args.since)


if __name__ == "__main__":
    sys.exit(main())
