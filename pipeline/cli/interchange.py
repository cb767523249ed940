"""Parsl's HTEX interchange on the run's leash, as the sites start it (`ffn-interchange`, a
script pip puts beside the venv's python; site_configs.pools.INTERCHANGE_CMD):

It runs Parsl's `interchange.py` in this process after starting `pipeline.core.owner`'s watch:
when the workflow that started it is gone (kill -9 of the workflow and of its watchdog), the
interchange ends within seconds, and the worker pools it fed stop after their heartbeat
threshold; Parsl's own interchange would go on heartbeating with them for ever.
"""

import argparse
import runpy
from collections.abc import Sequence

from pipeline.cli import HelpFormatter
from pipeline.core.owner import watch_owner


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.interchange",
        description="Parsl's HTEX interchange (its settings pickled on stdin, as Parsl starts "
        "it), ending with the workflow named in $FFN_RUN_OWNER.",
    )


def main(argv: Sequence[str] | None = None) -> None:
    _parser().parse_args(argv)
    watch_owner()
    runpy.run_module("parsl.executors.high_throughput.interchange", run_name="__main__")


if __name__ == "__main__":
    main()
