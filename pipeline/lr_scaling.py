"""Learning-rate scaling with the number of data-parallel workers (Dong et al., SC'19).

With N workers the global batch is N times larger (N counts every rank whose gradients are
averaged, the virtual ranks of `TrainConfig.virtual_ranks` included). Goyal et al. scale the rate
linearly, ramping up over the first steps; Dong et al. found linear scaling (with warm-up) good up
to about 16 workers and square-root scaling better beyond. `auto` is that finding:
lr = base * N for N <= 16, and base * 16 * sqrt(N / 16) beyond, reached after a linear warm-up.

On top of the scaling, an optional staircase decay as google-research/ffn's
`learning_rate_decay_factor`: the rate is multiplied by `decay_factor` every `decay_every_steps`.
"""

import math

LR_POLICIES = ("none", "linear", "sqrt", "linear_warmup", "auto")
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


def scaled_learning_rate(
    base: float,
    workers: int,
    policy: str,
    step: int,
    warmup_steps: int,
    decay_factor: float = 1.0,
    decay_every_steps: int = 0,
) -> float:
    """The rate at `step` (0-based): policies with warm-up ramp linearly from `base` to the target
    over `warmup_steps` steps; the others use the target from the first step. With
    `decay_every_steps` > 0 the result is multiplied by `decay_factor ** (step // decay_every_steps)`.
    """
    target = target_learning_rate(base, workers, policy)
    if policy in ("linear_warmup", "auto") and 0 < warmup_steps and step < warmup_steps:
        rate = base + (target - base) * step / warmup_steps
    else:
        rate = target
    if decay_every_steps > 0:
        rate *= decay_factor ** (step // decay_every_steps)
    return rate
