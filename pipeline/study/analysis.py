"""The numbers of a study's answer (Dong et al., SC'19, Fig. 3-6) from its cells' metrics.

Every function here is pure: cells and their logged metrics (`metrics.csv` rows) in, numbers out.
A "setting" is an optimizer with warm-up on or off; each setting is analysed on its own.
"""

import math
from dataclasses import dataclass

import numpy as np

from pipeline.study.study_grid import StudyCell, StudyConfig


@dataclass(frozen=True)
class CellMetrics:
    cell: StudyCell
    metrics: dict[
        str, np.ndarray
    ]  # metrics.csv's columns (pipeline.training.train_metrics.read_metrics)

    def score(self, fraction: float, name: str = "accuracy") -> float:
        """Mean of `name` over the rows logged in the last `fraction` of the cell's steps (the
        last row at least)."""
        steps = self.metrics["step"]
        late = steps >= steps[-1] * (1 - fraction)
        late[-1] = True
        return float(np.mean(self.metrics[name][late]))

    def first_reaching(
        self, threshold: float, name: str = "f1", window: int = 3
    ) -> tuple[float, float] | None:
        """(step, wall seconds) of the first logged row where the mean of `name` over it and the
        `window` - 1 rows before reaches `threshold` (one training batch's F1 is noisy: a single
        row crosses a threshold long before the training holds it); None if none does."""
        values = self.metrics[name]
        window = min(window, values.size)
        means = np.convolve(values, np.ones(window) / window, mode="valid")
        reached = np.flatnonzero(means >= threshold) + window - 1
        if not reached.size:
            return None
        row = reached[0]
        return float(self.metrics["step"][row]), float(self.metrics["wall_s"][row])

    def fov_per_s(self) -> float:
        """Median speed over the logged intervals after the first (which pays for start-up)."""
        speeds = self.metrics["fov_per_s"]
        return float(np.median(speeds[1:] if speeds.size > 1 else speeds))


def settings_of(cells: list[CellMetrics]) -> list[tuple[str, bool]]:
    return list(dict.fromkeys((c.cell.optimizer, c.cell.warmup) for c in cells))


def setting_name(setting: tuple[str, bool]) -> str:
    optimizer, warmup = setting
    return f"{optimizer}, {'linear warm-up' if warmup else 'no warm-up'}"


def of_setting(cells: list[CellMetrics], setting: tuple[str, bool]) -> list[CellMetrics]:
    return [c for c in cells if (c.cell.optimizer, c.cell.warmup) == setting]


def rate_table(cells: list[CellMetrics], study: StudyConfig) -> dict[int, dict[float, list[float]]]:
    """{N: {rate: [score of each seed]}} for the cells of one setting."""
    table: dict[int, dict[float, list[float]]] = {}
    for c in cells:
        table.setdefault(c.cell.ranks, {}).setdefault(c.cell.learning_rate, []).append(
            c.score(study.score_fraction)
        )
    return table


def best_rates(table: dict[int, dict[float, list[float]]], seed: int | None = None) -> dict:
    """{N: the rate with the highest mean score} (or, with `seed`, that seed's highest score)."""
    best = {}
    for n, by_rate in table.items():
        scores = {r: (s[seed] if seed is not None else np.mean(s)) for r, s in by_rate.items()}
        best[n] = max(scores, key=scores.get)
    return best


def fit_exponent(best: dict[int, float]) -> float:
    """a in lr* = c N^a, least squares in log-log; nan with fewer than two rank counts."""
    if len(best) < 2:
        return math.nan
    n = np.log(list(best))
    rate = np.log(list(best.values()))
    return float(np.polyfit(n, rate, 1)[0])


def rule_rates(best: dict[int, float]) -> dict[str, dict[int, float]]:
    """The linear and square-root rules' rates at each N, through the smallest N's best rate."""
    n0 = min(best)
    return {
        "linear": {n: best[n0] * n / n0 for n in best},
        "sqrt": {n: best[n0] * math.sqrt(n / n0) for n in best},
    }


def closer_rule(best: float, linear: float, sqrt: float, spacing: float) -> str:
    """Which rule's rate lies closer to the best rate (in log); "either" when they differ by
    less than half the grid's step `spacing` (a ratio), which the grid cannot tell apart."""
    to_linear, to_sqrt = abs(math.log(best / linear)), abs(math.log(best / sqrt))
    if abs(to_linear - to_sqrt) < math.log(spacing) / 2:
        return "either"
    return "linear" if to_linear < to_sqrt else "sqrt"


def step_rules(
    best: dict[int, float], table: dict[int, dict[float, list[float]]]
) -> dict[int, str]:
    """At each N after the smallest: which rule, applied from the previous N's best rate, lands
    closer to this N's best (the paper's shift is a change of rule at some N, not a line
    through N = 1)."""
    ns = sorted(best)
    rules = {ns[0]: "-"}
    for before, n in zip(ns, ns[1:], strict=False):
        grow = n / before
        rules[n] = closer_rule(best[n], best[before] * grow, best[before] * math.sqrt(grow),
                               grid_spacing(list(table[n])))  # fmt: skip
    return rules


def grid_spacing(rates: list[float]) -> float:
    """The largest ratio between neighbouring rates tried (1 for a single rate)."""
    rates = sorted(rates)
    return max((b / a for a, b in zip(rates, rates[1:], strict=False)), default=1.0)


def answer(rules: dict[int, str], exponent: float, spread: float) -> str:
    """Which rule to use up to which rank count, after the fitted exponent of the best rate."""
    fitted = f"The best rate grows as N^{exponent:.2f}" + (
        f" (+- {spread:.2f} over seeds)" if not math.isnan(spread) else ""
    )
    decided = {n: r for n, r in rules.items() if r in ("linear", "sqrt")}
    if not decided:
        return (
            f"{fitted}; rank count by rank count the grid cannot tell the linear and square-root "
            "rules apart (both land within half a grid step of the best rate): use a finer grid."
        )
    undecided_beyond = [n for n in rules if rules[n] == "either" and n > max(decided)]
    beyond = (
        f"; beyond {max(decided)} ranks the grid cannot tell them apart" if undecided_beyond else ""
    )
    linear_up_to = max((n for n in decided if decided[n] == "linear"), default=None)
    sqrt_from = min((n for n in decided if decided[n] == "sqrt"), default=None)
    if sqrt_from is None:
        return (
            f"{fitted}. Scale the learning rate linearly (with warm-up) up to {linear_up_to} "
            f"ranks: the paper's shift to the square root does not appear up to there{beyond}."
        )
    if linear_up_to is None:
        return (
            f"{fitted}. Scale the learning rate by the square root of the rank count from "
            f"{sqrt_from} ranks on: linear scaling is better at no rank count studied, so the "
            f"paper's shift (linear up to about 16 ranks) does not appear{beyond}."
        )
    if linear_up_to < sqrt_from:
        return (
            f"{fitted}. Scale the learning rate linearly up to {linear_up_to} ranks and by the "
            f"square root beyond (from {sqrt_from} ranks on): the paper's shift{beyond}."
        )
    return (
        f"{fitted}. Neither rule holds throughout, no clear shift: "
        + ", ".join(f"{n} ranks: {decided[n]}" for n in sorted(decided))
        + f"{beyond}."
    )


def setting_summary(cells: list[CellMetrics], study: StudyConfig, setting) -> dict:
    """Fig. 4 and 5 of one setting: normalized scores, best rates, the exponent, the rules."""
    cells = of_setting(cells, setting)
    table = rate_table(cells, study)
    best = best_rates(table)
    seeds = min(len(s) for by_rate in table.values() for s in by_rate.values())
    per_seed = [fit_exponent(best_rates(table, seed)) for seed in range(seeds)]
    spread = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else math.nan
    rules = rule_rates(best)
    closer = step_rules(best, table)
    return {
        "setting": setting_name(setting),
        "scores": {
            n: {r: [float(v) for v in s] for r, s in sorted(by_rate.items())}
            for n, by_rate in sorted(table.items())
        },
        "normalized": {
            n: {
                r: float(np.mean(s) / max(np.mean(v) for v in by_rate.values()))
                for r, s in by_rate.items()
            }
            for n, by_rate in sorted(table.items())
        },
        "best_rate": dict(sorted(best.items())),
        "exponent": fit_exponent(best),
        "exponent_per_seed": per_seed,
        "exponent_sd": spread,
        "rules": rules,
        "closer_rule": closer,
        "answer": answer(closer, fit_exponent(best), spread),
        "time_to_f1": time_to_f1(cells, best, study.f1_threshold),
    }


def time_to_f1(cells: list[CellMetrics], best: dict[int, float], threshold: float) -> dict:
    """Fig. 5 at each N's best rate: steps and wall time until F1 >= threshold (mean over the
    seeds that reach it), and the step efficiency against the smallest N: steps_1 / (N steps_N)
    x N_1 (1 when N times the batch needs 1/N of the steps)."""
    out = {}
    for n, rate in sorted(best.items()):
        reached = [
            c.first_reaching(threshold)
            for c in cells
            if (c.cell.ranks, c.cell.learning_rate) == (n, rate)
        ]
        hits = [r for r in reached if r is not None]
        out[n] = {
            "seeds": len(reached),
            "reached": len(hits),
            "steps": float(np.mean([h[0] for h in hits])) if hits else None,
            "wall_s": float(np.mean([h[1] for h in hits])) if hits else None,
        }
    n0 = min(out)
    for n, row in out.items():
        first = out[n0]["steps"]
        row["step_efficiency"] = first * n0 / (n * row["steps"]) if first and row["steps"] else None
    return out


def strong_scaling(cells: list[CellMetrics]) -> dict[int, dict[str, float]]:
    """Fig. 3 from the cells that ran on real ranks: FOV/s (mean over cells) and the efficiency
    against the smallest N, FOV/s_N / (N/N_1 x FOV/s_1)."""
    speeds: dict[int, list[float]] = {}
    for c in cells:
        if c.cell.real_ranks == c.cell.ranks:
            speeds.setdefault(c.cell.ranks, []).append(c.fov_per_s())
    out = {n: {"fov_per_s": float(np.mean(s)), "cells": len(s)} for n, s in sorted(speeds.items())}
    if out:
        n0 = min(out)
        for n, row in out.items():
            row["efficiency"] = row["fov_per_s"] / (n / n0 * out[n0]["fov_per_s"])
    return out


def mean_curves(cells: list[CellMetrics], ranks: int, rate: float) -> dict[str, np.ndarray]:
    """Fig. 6: accuracy, precision, recall and F1 against step, mean and sd over seeds, for the
    cells of one N and rate (rows up to the shortest seed's)."""
    runs = [c.metrics for c in cells if (c.cell.ranks, c.cell.learning_rate) == (ranks, rate)]
    rows = min(len(m["step"]) for m in runs)
    out = {"step": runs[0]["step"][:rows]}
    for name in ("accuracy", "precision", "recall", "f1"):
        values = np.stack([m[name][:rows] for m in runs])
        out[name] = values.mean(axis=0)
        out[f"{name}_sd"] = values.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(rows)
    return out
