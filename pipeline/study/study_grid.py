"""The paper's study as cells of training (Dong et al., SC'19, Fig. 3-6).

A study trains the same model on the same coordinates once per cell of a grid: world size N
(data-parallel ranks), learning rate, optimizer, warm-up on or off, and seed; every cell for the
same number of steps. Which learning rate is best at each N, and how it grows with N (linear,
square root), is the study's answer (`pipeline.study.study_report`).

A cell's learning rate is the rate after scaling, the one its N ranks train at: the cell trains
with `[train] learning_rate` = rate / N and the linear rule, so without warm-up it trains at the
rate from the first step and with warm-up ramps from rate / N (one rank's share, Goyal et al.)
to it over `[train] warmup_steps`.
"""

import math
from dataclasses import dataclass, replace

from pipeline.core.errors import ConfigError
from pipeline.training.train_config import OPTIMIZERS, TrainConfig


@dataclass(frozen=True)
class StudyConfig:
    # World sizes studied (ranks whose gradients are averaged; Dong et al.: 1 to 1,024 KNL
    # nodes, one rank each). () = the run is not a study.
    rank_counts: tuple[int, ...] = ()
    # Rates tried at every rank count (after scaling). () = `rates_per_rank_count` rates
    # log-spaced from the square-root rule's rate / rate_margin to the linear rule's x rate_margin
    # at each N, both rules from `[train] learning_rate` as the one-rank rate.
    learning_rates: tuple[float, ...] = ()
    rates_per_rank_count: int = 4
    rate_margin: float = 2.0
    optimizers: tuple[str, ...] = ("adam",)
    warmup: tuple[bool, ...] = (True,)  # linear warm-up over [train] warmup_steps, or none
    repeats: int = 2  # seeds per cell: [train] seed, seed + 1, ...
    steps: int = 200  # training steps of every cell (the paper's Fig. 4: 10,000)
    # A cell's score is the mean of its logged metrics over the last `score_fraction` of its
    # steps: a training batch's accuracy is noisy, one logged row would rank rates by chance.
    score_fraction: float = 0.2
    f1_threshold: float = 0.8  # Fig. 5: steps and wall time until voxel F1 first reaches it
    # Ranks a cell runs as processes; above, each process stands for several virtual ranks
    # ([train] virtual_ranks). 0 = as many as the site holds (one node locally, any on a batch site).
    max_real_ranks: int = 0

    def __post_init__(self) -> None:
        ints = ("rates_per_rank_count", "repeats", "steps")
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"[study] {name} must be >= 1, got {getattr(self, name)}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.rank_counts):
            raise ConfigError(f"[study] rank_counts must be integers >= 1, got {self.rank_counts}")
        if len(set(self.rank_counts)) != len(self.rank_counts):
            raise ConfigError(f"[study] rank_counts repeats a count: {self.rank_counts}")
        if any(not rate > 0 for rate in self.learning_rates):  # NaN too
            raise ConfigError(f"[study] learning rates must be > 0, got {self.learning_rates}")
        if not self.rate_margin >= 1:
            raise ConfigError(f"[study] rate_margin must be >= 1, got {self.rate_margin}")
        if bad := [o for o in self.optimizers if o not in OPTIMIZERS]:
            raise ConfigError(f"[study] optimizers {bad}: use {', '.join(OPTIMIZERS)}")
        if not self.optimizers or not self.warmup:
            raise ConfigError("[study] optimizers and warmup need at least one value each")
        if not 0 < self.score_fraction <= 1 or not 0 < self.f1_threshold < 1:
            raise ConfigError("[study] score_fraction must be in (0, 1], f1_threshold in (0, 1)")
        if self.max_real_ranks < 0:
            raise ConfigError(f"[study] max_real_ranks must be >= 0, got {self.max_real_ranks}")


@dataclass(frozen=True)
class StudyCell:
    """One training of the study."""

    ranks: int  # world size N
    learning_rate: float  # after scaling: the rate the N ranks train at
    optimizer: str
    warmup: bool
    seed: int
    real_ranks: int  # processes; each stands for ranks / real_ranks virtual ranks

    @property
    def virtual_ranks(self) -> int:
        return self.ranks // self.real_ranks

    @property
    def name(self) -> str:
        """Folder and task name; sorts by N."""
        warmup = "warmup" if self.warmup else "constant"
        return (
            f"n{self.ranks:04d}-lr{self.learning_rate:.3e}-{self.optimizer}-{warmup}-s{self.seed}"
        )

    def train_config(self, base: TrainConfig, steps: int) -> TrainConfig:
        """`base` as this cell trains: its rate (the linear rule from rate / N), optimizer,
        warm-up, seed, steps and virtual ranks."""
        return replace(
            base,
            learning_rate=self.learning_rate / self.ranks,
            lr_policy="linear_warmup" if self.warmup else "linear",
            optimizer=self.optimizer,
            seed=self.seed,
            max_steps=steps,
            virtual_ranks=self.virtual_ranks,
        )


def rates_for(study: StudyConfig, one_rank_rate: float, ranks: int) -> tuple[float, ...]:
    """The learning rates tried at `ranks`: the study's own, else log-spaced over both rules."""
    if study.learning_rates:
        return tuple(study.learning_rates)
    low = one_rank_rate * math.sqrt(ranks) / study.rate_margin
    high = one_rank_rate * ranks * study.rate_margin
    count = study.rates_per_rank_count
    if count == 1:
        return (math.sqrt(low * high),)
    return tuple(low * (high / low) ** (i / (count - 1)) for i in range(count))


def real_ranks_for(ranks: int, capacity: int | None) -> int:
    """Processes for a world of `ranks`: all of them if they fit, else the largest divisor of
    `ranks` that does (each process then stands for the same number of virtual ranks)."""
    if capacity is None or ranks <= capacity:
        return ranks
    return max(d for d in range(1, capacity + 1) if ranks % d == 0)


def study_cells(study: StudyConfig, train: TrainConfig, capacity: int | None) -> list[StudyCell]:
    """Every cell, the largest world first: the longest cells start first, so the last to end
    is a short one, and the first to end says what the study will cost. `capacity`: most real
    ranks a cell may have (None: no limit); `study.max_real_ranks` lowers it."""
    if not study.rank_counts:
        raise ConfigError("[study] rank_counts is empty: the study has no cells")
    if True in study.warmup and study.steps <= train.warmup_steps:
        raise ConfigError(
            f"[study] steps {study.steps} <= [train] warmup_steps {train.warmup_steps}: a cell "
            "with warm-up would end before it reaches its rate"
        )
    if study.max_real_ranks:
        capacity = min(capacity or study.max_real_ranks, study.max_real_ranks)
    return [
        StudyCell(n, rate, optimizer, warmup, train.seed + repeat, real_ranks_for(n, capacity))
        for n in sorted(study.rank_counts, reverse=True)
        for rate in rates_for(study, train.learning_rate, n)
        for optimizer in study.optimizers
        for warmup in study.warmup
        for repeat in range(study.repeats)
    ]
