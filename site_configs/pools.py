"""The two pools of workers every site has: their executor labels, and what their executors and
workers start with on every site (the interchange command, the heartbeats, `worker_init`: the
site's module loads and the venv; `cpu_worker_init`: that and `CPU_WORKER_ENV`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD

from pipeline.core.owner import OWNER_ENV

if TYPE_CHECKING:
    from site_configs.spec import SiteSpec

# The two executor labels every site provides; apps pick one with `executors=[...]`.
MPI_LABEL = "mpi"  # multi-rank tasks (Horovod training), one batch job per block
CPU_LABEL = "cpu"  # single-process tasks (staging, preprocessing, inference blocks, evaluation)


def _interchange_cmd() -> str:
    """HTEX starts its interchange as `interchange.py` looked up on PATH; ours is
    `ffn-interchange` (pipeline/cli/interchange.py: Parsl's, ending with its workflow), named
    beside the running interpreter (the venv's bin/), so the caller's PATH does not matter. A
    string, not a list: MPIExecutor's type check accepts only a string, and Popen runs it.
    Parsl's own where the project is not installed (its watchdog still ends it)."""
    for name in ("ffn-interchange", "interchange.py"):
        if (beside := Path(sys.executable).parent / name).is_file():
            return str(beside)
    return shutil.which("interchange.py") or "interchange.py"


INTERCHANGE_CMD = _interchange_cmd()


def _pool_launch_cmd() -> str:
    """HTEX's command for a worker pool with `ffn-worker-pool` (pipeline/cli/worker_pool.py:
    Parsl's pool, ended with its workflow) in place of `process_worker_pool.py`, both looked up
    on the PATH `worker_init` sets; Parsl's own where the project is not installed."""
    if not (Path(sys.executable).parent / "ffn-worker-pool").is_file():
        return DEFAULT_LAUNCH_CMD
    return DEFAULT_LAUNCH_CMD.replace("process_worker_pool.py", "ffn-worker-pool", 1)


POOL_LAUNCH_CMD = _pool_launch_cmd()

# Given to every pool's executor. A worker pool whose interchange is gone (its workflow killed:
# the watchdog, pipeline.run.watchdog, ends the interchange at once, and with the watchdog gone
# too the interchange ends itself, pipeline/cli/interchange.py) stops its workers after
# `heartbeat_threshold` seconds without a word from it; Parsl's default, 120 s (heartbeats every
# 30 s), let a pool on a node the watchdog cannot reach compute on for 2 minutes. Heartbeats
# every 10 s, three missed: the interchange likewise gives up on a silent pool after 30 s.
HEARTBEATS = {"heartbeat_period": 10, "heartbeat_threshold": 30}

# What every executor of every site is given.
EXECUTOR_SETTINGS = {
    "interchange_launch_cmd": INTERCHANGE_CMD,  # ours, by path: ends with its workflow
    "launch_cmd": POOL_LAUNCH_CMD,  # ours: a pool that ends with its workflow
    # CurveZMQ between interchange and pools, HTEX's default (MPIExecutor's is off): else anyone
    # who reaches the ports could take tasks, or send results the workflow unpickles.
    "encrypted": True,
    **HEARTBEATS,  # a pool whose interchange is gone stops in 30 s
}


def venv_path(site: SiteSpec) -> Path | None:
    """The virtual environment workers activate: the site's, or the one running this code."""
    if site.venv:
        return Path(site.venv)
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    return None


def worker_init(site: SiteSpec, *extra: str) -> str:
    """Shell lines every batch job runs before Parsl starts a worker pool: the site's module
    loads, then the venv (its bin/ holds process_worker_pool.py, python, and locally mpiexec)."""
    lines = [site.worker_init.strip()] if site.worker_init.strip() else []
    venv = venv_path(site)
    if venv is not None:
        lines.append(f"source {shlex.quote(str(venv))}/bin/activate")
    else:  # a system Python: its bin/ on PATH is the best we can do
        lines.append(f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"')
    if owner := os.environ.get(OWNER_ENV):  # a batch job does not inherit the workflow's env
        lines.append(f"export {OWNER_ENV}={shlex.quote(owner)}")
    lines.extend(extra)
    return "\n".join(lines)


# Set in every cpu worker's environment. glibc gives each thread that meets a busy allocator
# an arena of its own (up to 8 per core); cloud-volume's and igneous's I/O threads made such
# arenas in the workers, and memory freed in pieces across them is more than `malloc_trim` can
# hand back: over 9 meshing tasks in one process the memory held between tasks rose 3-5 MiB
# (0.4 MiB with one arena; after 5 tasks two arenas held what one did), and the last tasks of a
# 1024^3 run began 19 MiB above the 256^3 run's (14 with two arenas). Two: the main thread's,
# one the I/O threads share. The training pool keeps glibc's default: TensorFlow's threads
# allocate in parallel.
CPU_WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}


def cpu_worker_init(site: SiteSpec, *extra: str) -> str:
    """`worker_init` for a pool of the cpu executor: the site's lines, then `CPU_WORKER_ENV`
    (and `extra` lines)."""
    return worker_init(site, *(f"export {k}={v}" for k, v in CPU_WORKER_ENV.items()), *extra)
