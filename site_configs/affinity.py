"""How the cpu pool's workers are placed on a node's CPUs: Parsl's `cpu_affinity` of a
HighThroughputExecutor, either a strategy that splits the CPUs the pool may use ("block",
"block-reverse", "alternating"; "none" leaves the workers unbound) or "list:" and one
"0-7,32-39"-style list of logical CPUs per worker (ALCF's way of giving each worker the cores
nearest its GPU and their second hardware threads). Parsl reads it in each worker
(process_worker_pool.py); here it is read once, when the site is built, so a list that Parsl
would refuse on the compute node is refused before anything is submitted, and the threads each
worker gets are what the dry run says.
"""

from __future__ import annotations

from pipeline.core.errors import ConfigError

STRATEGIES = ("none", "block", "block-reverse", "alternating")
LIST_PREFIX = "list:"


def worker_cpus(affinity: str, workers: int) -> tuple[tuple[int, ...], ...] | None:
    """Each worker's logical CPUs of a "list:..." affinity, in worker order; None for a strategy.
    ConfigError for anything Parsl would refuse or that gives two workers one CPU."""
    if affinity in STRATEGIES:
        return None
    if not isinstance(affinity, str) or not affinity.startswith(LIST_PREFIX):
        raise ConfigError(
            f"cpu_affinity {affinity!r} is neither one of {', '.join(STRATEGIES)} nor a "
            f"'{LIST_PREFIX}0-7,32-39:8-15,40-47...' list of each worker's CPUs"
        )
    parts = affinity.removeprefix(LIST_PREFIX).split(":")
    if len(parts) != workers:
        raise ConfigError(
            f"cpu_affinity lists the CPUs of {len(parts)} worker(s) and a node has {workers} "
            "(cpu_workers_per_node): give one list per worker, or 'block'"
        )
    cpus = tuple(_cpus(part, affinity) for part in parts)
    seen: set[int] = set()
    for mine in cpus:
        if shared := seen.intersection(mine):
            raise ConfigError(f"cpu_affinity {affinity!r} gives CPU {min(shared)} to two workers")
        seen.update(mine)
    return cpus


def _cpus(part: str, affinity: str) -> tuple[int, ...]:
    """ "24-31,56-63" as (24, ..., 31, 56, ..., 63)."""
    cpus: list[int] = []
    for piece in part.split(","):
        first, _, last = piece.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ConfigError(
                f"cpu_affinity {affinity!r}: {piece!r} is not a CPU or a range of CPUs (8-15)"
            )
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def threads_per_worker(affinity: str, workers: int, node_cpus: int) -> int:
    """The OMP_NUM_THREADS Parsl gives each worker: the CPUs of its list (the fewest, should the
    lists differ), else the `node_cpus` the pool may use split among its workers."""
    lists = worker_cpus(affinity, workers)
    if lists is not None:
        return min(len(cpus) for cpus in lists)
    return max(1, node_cpus // workers)
