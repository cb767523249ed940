"""Learning-rate scaling with the number of data-parallel workers (Dong et al., SC'19).

With N workers the global batch is N times larger (N counts every rank whose gradients are
averaged, the virtual ranks of `TrainConfig.virtual_ranks` included). Goyal et al. scale the rate
linearly, ramping up over the first steps; Dong et al. found linear scaling (with warm-up) good up
to about 16 workers and square-root scaling better beyond. `auto` is that finding:
lr = base * N for N <= 16, and base * 16 * sqrt(N / 16) beyond, reached after a linear warm-up.

On top of the scaling, an optional staircase decay as google-research/ffn's
`learning_rate_decay_factor`: the rate is multiplied by `decay_factor` every `decay_every_steps`.

A run that goes on at another world size (pipeline.training.trainer) follows the rule for its new size from
there (`world_learning_rate`), ramping up again when the new size's rate is higher.
"""

import math
from collections.abc import Sequence

LR_POLICIES = ("none", "linear", "sqrt", "linear_warmup", "auto")
WARMUP_POLICIES = ("linear_warmup", "auto")
LINEAR_LIMIT = 16


def target_learning_rate(base: float, workers: int, policy: str) -> float:
    """The rate after warm-up."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if policy == "none":
        return base
    if policy in ("linear", "linear_warmup"):
        return base * workers
    if policy == "sqrt":
        return base * math.sqrt(workers)
    if policy == "auto":
        if workers <= LINEAR_LIMIT:
            return base * workers
        return base * LINEAR_LIMIT * math.sqrt(workers / LINEAR_LIMIT)
    raise ValueError(f"lr_policy must be one of {LR_POLICIES}, got {policy!r}")


def world_learning_rate(
    base: float,
    worlds: Sequence[tuple[int, int]],
    policy: str,
    step: int,
    warmup_steps: int,
    decay_factor: float = 1.0,
    decay_every_steps: int = 0,
) -> float:
    """The rate at `step` (0-based) of a run whose world size was `worlds`: (first step, world
    size) of each stretch, in order, the first at step 0 (`[(0, N)]`: N ranks throughout).
    Policies with warm-up ramp each stretch linearly from the rate the run had when it began
    (`base` for the first) up to its world's target over `warmup_steps` steps: the warm-up, and a
    re-warm-up after a larger world took over; a smaller world takes its lower target at once.
    The others use the target from the stretch's first step. With `decay_every_steps` > 0 the
    result is multiplied by `decay_factor ** (step // decay_every_steps)`."""
    if not worlds or worlds[0][0] != 0:
        raise ValueError(f"worlds must begin at step 0, got {list(worlds)}")
    rate = base  # the rate the current stretch starts from
    for i, (start, workers) in enumerate(worlds):
        end = worlds[i + 1][0] if i + 1 < len(worlds) else None
        holds_step = end is None or step < end
        at = step if holds_step else end  # where this stretch's rate is read
        rate = _stretch_rate(rate, target_learning_rate(base, workers, policy), policy,
                             at - start, warmup_steps)  # fmt: skip
        if holds_step:
            break
    if decay_every_steps > 0:
        rate *= decay_factor ** (step // decay_every_steps)
    return rate


def _stretch_rate(start_rate: float, target: float, policy: str, steps_in: int, warmup: int):
    """The undecayed rate `steps_in` steps into a stretch that begins at `start_rate`."""
    ramps = policy in WARMUP_POLICIES and 0 < warmup and steps_in < warmup and target > start_rate
    return start_rate + (target - start_rate) * steps_in / warmup if ramps else target
