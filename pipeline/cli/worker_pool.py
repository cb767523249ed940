"""Parsl's worker pool on the run's leash, as the sites start it (`ffn-worker-pool`, a script pip
puts in the venv's bin/, found on the PATH `worker_init` sets; site_configs.pools.POOL_LAUNCH_CMD):

    ffn-worker-pool <process_worker_pool.py's arguments>

It runs Parsl's `process_worker_pool.py` with those arguments and watches the run's owner
(`pipeline.core.owner`): when the workflow is gone (on its own host) or another has taken the run
dir, it ends the pool, its workers and what they started. Parsl's pool alone waits for its
interchange's heartbeats, and a pool of MPI tasks does not end even then (its result thread
waits on a queue no one writes to again).
"""

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter
from pipeline.core.owner import watch_owner

POOL_SCRIPT = "process_worker_pool.py"


def pool_script() -> str:
    """Parsl's pool script: beside this interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / POOL_SCRIPT
    return str(beside) if beside.is_file() else shutil.which(POOL_SCRIPT) or POOL_SCRIPT


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.worker_pool",
        description="Parsl's process_worker_pool.py with the arguments given (Parsl's, passed on "
        "as they are), ending with the workflow named in $FFN_RUN_OWNER.",
        usage="%(prog)s [process_worker_pool.py's arguments]",
        allow_abbrev=False,  # a pool argument is never taken for a prefix of one of ours
    )


def main(argv: Sequence[str] | None = None) -> int:
    _, pool_arguments = _parser().parse_known_args(argv)
    watch_owner()  # ends this process and the pool below it when the run's owner is lost
    return subprocess.call([pool_script(), *pool_arguments])


if __name__ == "__main__":
    sys.exit(main())
