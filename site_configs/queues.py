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
    `max_walltime`, and at most `max_jobs` of them queued or running at once. A routing queue
    whose longest walltime depends on the job's size (Polaris' prod) has one entry per size
    range, all under its name."""

    name: str  # as qsub -q / sbatch --partition takes it
    min_nodes: int
    max_nodes: int
    max_walltime: str  # HH:MM:SS
    # Jobs one user (or project: the site's table says which) may have queued or running in the
    # queue at once; the scheduler refuses a submission beyond it. None: no such limit (a limit on
    # running jobs alone is not one: the jobs beyond it wait in the queue).
    max_jobs: int | None = None

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
        jobs = self.max_jobs
        if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
            raise ConfigError(
                f"{where}: max_jobs must be None or a whole number >= 1, got {jobs!r}"
            )

    @property
    def size(self) -> str:
        """Its sizes as "1-2 nodes, <= 01:00:00" (", <= 1 job" where it holds few)."""
        jobs = f", <= {_count(self.max_jobs, 'job')}" if self.max_jobs else ""
        return f"{self.min_nodes}-{self.max_nodes} nodes, <= {self.max_walltime}{jobs}"

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


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _nodes(count: int) -> str:
    return _count(count, "node")


def check_queues(site: SiteSpec) -> None:
    """Each pool's jobs (nodes, walltime) must be ones its queue accepts."""
    limits = site.queue_limits
    if not isinstance(limits, tuple) or not all(isinstance(q, QueueLimit) for q in limits):
        raise ConfigError(f"site {site.name!r}: queue_limits must be a tuple of QueueLimit")
    _check_job(site, "training", site.queue, site.nodes_per_block, site.walltime)
    _check_job(site, "cpu", site.cpu_job_queue, site.cpu_nodes_per_block, site.cpu_job_walltime)
    _check_job_count(site)


def job_limit(limits: Iterable[QueueLimit]) -> int | None:
    """The fewest jobs any of one queue's entries holds at once; None: not limited."""
    counts = [limit.max_jobs for limit in limits if limit.max_jobs is not None]
    return min(counts) if counts else None


def _check_job_count(site: SiteSpec) -> None:
    """The jobs both pools may have at once in one queue (each pool up to its max blocks) are no
    more than the queue holds: qsub would refuse the one beyond, half-way into a run."""
    training, cpu = site.max_blocks, site.cpu_max_blocks
    shared = site.queue == site.cpu_job_queue
    plan = [(site.queue, training + cpu if shared else training)]
    if not shared:
        plan.append((site.cpu_job_queue, cpu))
    for queue, jobs in plan:
        held = job_limit(site.limits_of(queue))
        if held is None or jobs <= held:
            continue
        pools = f"training {training}, cpu {cpu}" if shared else None
        if shared and training <= held:  # the cpu jobs can go elsewhere
            fit = _described(_holding(site, cpu, site.cpu_nodes_per_block, site.cpu_job_walltime))
            advice = f"give --cpu-queue one that holds {cpu} jobs of the cpu pool: {fit}"
        else:
            pool = "training" if queue == site.queue else "cpu"
            nodes = site.nodes_per_block if pool == "training" else site.cpu_nodes_per_block
            walltime = site.walltime if pool == "training" else site.cpu_job_walltime
            fit = _described(_holding(site, jobs if pool == "cpu" else training, nodes, walltime))
            advice = f"give another {'--' if pool == 'training' else '--cpu-'}queue: {fit}"
        raise ConfigError(
            f"site {site.name!r}: queue {queue!r} holds at most {_count(held, 'job')} queued or "
            f"running and the plan may have {jobs} there"
            + (f" ({pools})" if pools else "")
            + f"; {advice}"
        )


def _jobs_going_with(site: SiteSpec, pool: str) -> int:
    """The jobs that go to the queue of `pool`'s jobs, whichever it is: the pool's own, and the
    cpu pool's with the training's when the cpu pool has no queue of its own."""
    if pool != "training":
        return site.cpu_max_blocks
    return site.max_blocks + (site.cpu_max_blocks if site.cpu_queue is None else 0)


def _described(limits: list[QueueLimit]) -> str:
    return describe_queues(limits) or "none"


def _holding(site: SiteSpec, jobs: int, nodes: int, walltime: str) -> list[QueueLimit]:
    """The site's queues that take `jobs` jobs of `nodes` nodes for `walltime` at once."""
    return [
        limit
        for limit in site.queue_limits
        if limit.allows(nodes, walltime) and (limit.max_jobs or jobs) >= jobs
    ]


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
    both = _holding(site, _jobs_going_with(site, pool), nodes, walltime)
    fit = _described(both)
    if pool == "training" and site.cpu_queue is None:
        # Those that hold the training's jobs but not the cpu pool's as well: with the cpu jobs
        # sent elsewhere.
        alone = [q for q in _holding(site, site.max_blocks, nodes, walltime) if q not in both]
        if alone:
            fit += f", or with a --cpu-queue of its own: {describe_queues(alone)}"
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
        f"fit: {fit}; give {advice}"
    )
