"""A site's batch queues: `QueueLimit` (the jobs one queue accepts), walltimes (HH:MM:SS), the
queues described in one line (for messages and `--dry-run`), and `check_queues`, the check that
each pool's jobs fit the queue they go to. The queue tables themselves are the sites' (`QUEUES`
in site_configs/polaris.py and theta.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from site_configs.spec import SiteSpec

_WALLTIME = re.compile(r"\d{1,4}:[0-5]\d:[0-5]\d")


def is_walltime(value: object) -> bool:
    """Whether `value` is a walltime, "HH:MM:SS" (up to 9999 hours)."""
    return isinstance(value, str) and bool(_WALLTIME.fullmatch(value))


def walltime_seconds(walltime: str) -> int:
    hours, minutes, seconds = map(int, walltime.split(":"))
    return 3600 * hours + 60 * minutes + seconds


@dataclass(frozen=True)
class QueueLimit:
    """What one batch queue accepts: jobs of `min_nodes` to `max_nodes` nodes for up to
    `max_walltime`. A routing queue whose longest walltime depends on the job's size (Polaris'
    prod) has one entry per size range, all under its name."""

    name: str  # as qsub -q / sbatch --partition takes it
    min_nodes: int
    max_nodes: int
    max_walltime: str  # HH:MM:SS

    def __post_init__(self) -> None:
        where = f"queue limit {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"{where}: name must be a non-empty string")
        for value in (self.min_nodes, self.max_nodes):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: node counts must be whole numbers >= 1, got {value!r}")
        if self.min_nodes > self.max_nodes:
            raise ConfigError(f"{where}: min_nodes {self.min_nodes} > max_nodes {self.max_nodes}")
        if not is_walltime(self.max_walltime):
            raise ConfigError(f"{where}: max_walltime {self.max_walltime!r} is not HH:MM:SS")

    @property
    def size(self) -> str:
        """Its sizes as "1-2 nodes, <= 01:00:00"."""
        return f"{self.min_nodes}-{self.max_nodes} nodes, <= {self.max_walltime}"

    def allows(self, nodes: int, walltime: str) -> bool:
        return self.min_nodes <= nodes <= self.max_nodes and walltime_seconds(
            walltime
        ) <= walltime_seconds(self.max_walltime)


def queue_sizes(limits: Iterable[QueueLimit]) -> str:
    """The sizes of one queue's entries: "10-24 nodes, <= 03:00:00; 25-99 nodes, ..."."""
    return "; ".join(limit.size for limit in limits)


def describe_queues(limits: Iterable[QueueLimit]) -> str:
    """The queues as "debug (1-2 nodes, <= 01:00:00), prod (10-24 nodes, ...; 25-99 nodes, ...)"."""
    limits = tuple(limits)
    names = dict.fromkeys(limit.name for limit in limits)
    return ", ".join(f"{n} ({queue_sizes(q for q in limits if q.name == n)})" for n in names)


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def check_queues(site: SiteSpec) -> None:
    """Each pool's jobs (nodes, walltime) must be ones its queue accepts."""
    limits = site.queue_limits
    if not isinstance(limits, tuple) or not all(isinstance(q, QueueLimit) for q in limits):
        raise ConfigError(f"site {site.name!r}: queue_limits must be a tuple of QueueLimit")
    _check_job(site, "training", site.queue, site.nodes_per_block, site.walltime)
    _check_job(site, "cpu", site.cpu_job_queue, site.cpu_nodes_per_block, site.cpu_job_walltime)


def _check_job(site: SiteSpec, pool: str, queue: str | None, nodes: int, walltime: str) -> None:
    check_fit(site, pool, queue, site.limits_of(queue), nodes, walltime)


def check_fit(
    site: SiteSpec,
    pool: str,
    name: str | None,
    known: list[QueueLimit],
    nodes: int,
    walltime: str,
    kind: str = "queue",
) -> None:
    """A `pool`'s job of `nodes` for `walltime` fits one of `known`, the limits of the queue (or,
    `kind` "QOS", the Slurm QOS) `name`; else one line naming those that fit and what to give."""
    if not known or any(limit.allows(nodes, walltime) for limit in known):
        return
    fit = [limit for limit in site.queue_limits if limit.allows(nodes, walltime)]
    # The workflow's options for this pool's jobs (its size: --train-nodes, training only).
    flag = "--" if pool == "training" else "--cpu-"
    other = "--qos" if kind == "QOS" else f"{flag}queue"
    if any(limit.min_nodes <= nodes <= limit.max_nodes for limit in known):
        advice = f"a shorter {flag}walltime or another {other}"
    elif pool == "training":
        advice = f"another {other}, or --train-nodes that the {kind} takes"
    else:
        advice = f"another {other}"
    raise ConfigError(
        f"site {site.name!r}: a {pool} job of {_nodes(nodes)} for {walltime} does not fit "
        f"{kind} {name!r} ({queue_sizes(known)}); {kind}{'es' if kind == 'QOS' else 's'} that "
        f"fit: {describe_queues(fit) or 'none'}; give {advice}"
    )
