"""Learning-rate scaling with the number of data-parallel workers (Dong et al., SC'19).

With N workers the global batch is N times larger. Goyal et al. scale the rate linearly, ramping
up over the first steps; Dong et al. found linear scaling (with warm-up) good up to about 16
workers and square-root scaling better beyond. `auto` is that finding:
lr = base * N for N <= 16, and base * 16 * sqrt(N / 16) beyond, reached after a linear warm-up.
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
    base: float, workers: int, policy: str, step: int, warmup_steps: int
) -> float:
    """The rate at `step` (0-based): policies with warm-up ramp linearly from `base` to the target
    over `warmup_steps` steps; the others use the target from the first step."""
    target = target_learning_rate(base, workers, policy)
    if policy not in ("linear_warmup", "auto") or warmup_steps <= 0 or step >= warmup_steps:
        return target
    return base + (target - base) * step / warmup_steps
