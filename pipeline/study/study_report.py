"""A study's report: `study/report.md`, its figures (Dong et al.'s Fig. 3-6) and results.json."""

import json
import math
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.study import analysis
from pipeline.study.study_grid import StudyCell, StudyConfig
from pipeline.training.train_metrics import read_metrics


def load_cells(cells: list[StudyCell], cells_dir: Path) -> list[analysis.CellMetrics]:
    return [
        analysis.CellMetrics(c, read_metrics(cells_dir / c.name / "metrics.csv")) for c in cells
    ]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, png: Path) -> str:
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    _pyplot().close(fig)
    return png.name


def plot_learning_rates(summary: dict, png: Path) -> str:
    """Fig. 4: normalized score against rate per N; best rates with the rules' lines."""
    plt = _pyplot()
    fig, (ax_norm, ax_best) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, by_rate in summary["normalized"].items():
        rates = sorted(by_rate)
        ax_norm.plot(rates, [by_rate[r] for r in rates], marker="o", label=f"N={n}")
    ax_norm.set(xscale="log", xlabel="learning rate (after scaling)", ylabel="score / best at N",
                title="normalized accuracy")  # fmt: skip
    ax_norm.legend(fontsize=8)
    ax_norm.xaxis.set_minor_formatter(_pyplot().NullFormatter())
    ns = sorted(summary["best_rate"])
    per_seed_rates = summary["scores"]
    for n in ns:  # every rate tried, faint, so the grid shows
        ax_best.scatter([n] * len(per_seed_rates[n]), list(per_seed_rates[n]), color="0.85", s=12)
    ax_best.plot(ns, [summary["best_rate"][n] for n in ns], "o-", color="black", label="best rate")
    for rule, style in (("linear", "--"), ("sqrt", ":")):
        ax_best.plot(ns, [summary["rules"][rule][n] for n in ns], style, label=f"{rule} rule")
    _rank_axis(ax_best, ns)
    ax_best.set(yscale="log", xlabel="ranks N", ylabel="learning rate",
                title=f"best rate: a = {summary['exponent']:.2f} in lr* ~ N^a")  # fmt: skip
    ax_best.legend(fontsize=8)
    for ax in (ax_norm, ax_best):
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(summary["setting"])
    fig.tight_layout()
    return _save(fig, png)


def plot_time_to_f1(summary: dict, threshold: float, png: Path) -> str:
    """Fig. 5: steps to the F1 threshold per N at its best rate, with the ideal 1/N line."""
    plt = _pyplot()
    rows = {n: r for n, r in summary["time_to_f1"].items() if r["steps"] is not None}
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if rows:
        ns = sorted(rows)
        ax.plot(ns, [rows[n]["steps"] for n in ns], "o-", label="measured")
        first = rows[ns[0]]["steps"] * ns[0]
        ax.plot(ns, [first / n for n in ns], "--", color="0.5", label="ideal (steps / N)")
        ax.legend()
        _rank_axis(ax, ns)
    ax.set(yscale="log", xlabel="ranks N", ylabel=f"steps to F1 >= {threshold}",
           title=summary["setting"])  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return _save(fig, png)


def plot_curves(cells: list[analysis.CellMetrics], summary: dict, png: Path) -> str:
    """Fig. 6: the four metrics against step at each N's best rate, mean +- 1 sd over seeds."""
    plt = _pyplot()
    names = ("accuracy", "precision", "recall", "f1")
    fig, axes = plt.subplots(1, 4, figsize=(16, 4), sharey=True)
    for n, rate in summary["best_rate"].items():
        curves = analysis.mean_curves(cells, n, rate)
        for ax, name in zip(axes, names, strict=True):
            mean, sd = curves[name], curves[f"{name}_sd"]
            ax.plot(curves["step"], mean, label=f"N={n}")
            ax.fill_between(curves["step"], mean - sd, mean + sd, alpha=0.2)
    for ax, name in zip(axes, names, strict=True):
        ax.set(xlabel="step", title=name, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{summary['setting']}: best rate per N, mean +- 1 sd over seeds")
    fig.tight_layout()
    return _save(fig, png)


def plot_strong_scaling(scaling: dict, png: Path) -> str:
    """Fig. 3: FOV/s and efficiency against N for the cells on real ranks."""
    plt = _pyplot()
    ns = sorted(scaling)
    fig, (ax_speed, ax_eff) = plt.subplots(1, 2, figsize=(11, 4))
    ax_speed.plot(ns, [scaling[n]["fov_per_s"] for n in ns], "o-", label="measured")
    ax_speed.plot(ns, [scaling[ns[0]]["fov_per_s"] * n / ns[0] for n in ns], "--", color="0.5",
                  label="ideal")  # fmt: skip
    for ax in (ax_speed, ax_eff):
        _rank_axis(ax, ns)
    ax_speed.set(xlabel="ranks N", ylabel="FOV/s", title="training throughput")
    ax_speed.legend()
    ax_eff.plot(ns, [scaling[n]["efficiency"] for n in ns], "o-")
    ax_eff.set(xlabel="ranks N", ylabel="efficiency", ylim=(0, 1.1), title="scaling efficiency")
    for ax in (ax_speed, ax_eff):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, png)


def _rank_axis(ax, ns: list[int]) -> None:
    """A log axis of rank counts labelled with the counts themselves."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _rate(value: float) -> str:
    return f"{value:.3g}"


def _setting_lines(summary: dict, figures: dict[str, str], threshold: float) -> list[str]:
    sd = summary["exponent_sd"]
    spread = (
        f" +- {sd:.2f} (sd over {len(summary['exponent_per_seed'])} seeds)"
        if not math.isnan(sd)
        else ""
    )
    lines = [
        f"## {summary['setting']}", "",
        f"**{summary['answer']}**", "",
        f"Fitted exponent a in lr* ~ N^a: {summary['exponent']:.2f}{spread} (linear rule: 1, square root: 0.5).",
        "Rules through the smallest N's best rate; \"closer\": the rule that, applied from the previous "
        "N's best rate, lands nearer this N's (\"either\": within half a step of the rate grid).",
        "", "| N | best rate | linear rule | sqrt rule | closer | steps to F1 | wall s to F1 | step efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for n, best in summary["best_rate"].items():
        f1 = summary["time_to_f1"][n]
        steps = (
            "not reached"
            if f1["steps"] is None
            else f"{f1['steps']:.0f} ({f1['reached']}/{f1['seeds']})"
        )
        wall = "-" if f1["wall_s"] is None else f"{f1['wall_s']:.0f}"
        eff = "-" if f1["step_efficiency"] is None else f"{f1['step_efficiency']:.2f}"
        lines.append(
            f"| {n} | {_rate(best)} | {_rate(summary['rules']['linear'][n])} | "
            f"{_rate(summary['rules']['sqrt'][n])} | {summary['closer_rule'][n]} | {steps} | {wall} | {eff} |"
        )
    lines += [
        "",
        f"![Fig. 4]({figures['rates']})",
        f"![Fig. 5: steps to F1 >= {threshold}]({figures['f1']})",
        f"![Fig. 6]({figures['curves']})",
    ]
    return lines


def write_study_report(study_dir: Path, study: StudyConfig, cells: list[StudyCell]) -> Path:
    """report.md, the figures and results.json in `study_dir`; each cell's metrics are in
    `study_dir/cells/<cell name>/metrics.csv`."""
    loaded = load_cells(cells, study_dir / "cells")
    summaries, lines = [], []
    for i, setting in enumerate(analysis.settings_of(loaded)):
        summary = analysis.setting_summary(loaded, study, setting)
        mine = analysis.of_setting(loaded, setting)
        figures = {
            "rates": plot_learning_rates(summary, study_dir / f"fig4_rates_{i}.png"),
            "f1": plot_time_to_f1(summary, study.f1_threshold, study_dir / f"fig5_time_to_f1_{i}.png"),
            "curves": plot_curves(mine, summary, study_dir / f"fig6_curves_{i}.png"),
        }  # fmt: skip
        summaries.append(summary)
        lines += _setting_lines(summary, figures, study.f1_threshold) + [""]
    scaling = analysis.strong_scaling(loaded)
    virtual = sorted({c.ranks for c in cells if c.real_ranks < c.ranks})
    head = [
        "# Learning-rate and scaling study", "",
        f"{len(cells)} cells: rank counts {', '.join(map(str, sorted({c.ranks for c in cells})))}"
        f" ({'virtual ranks at ' + ', '.join(map(str, virtual)) if virtual else 'all on real ranks'}), "
        f"{study.repeats} seed(s), {study.steps} steps each. A cell's score: its mean voxel accuracy "
        f"over the last {study.score_fraction:.0%} of its steps (training batches).", "",
    ]  # fmt: skip
    if scaling:
        figure = plot_strong_scaling(scaling, study_dir / "fig3_strong_scaling.png")
        lines += [
            "## Strong scaling (cells on real ranks)", "",
            "| N | FOV/s | efficiency | cells |", "|---|---|---|---|",
            *(f"| {n} | {r['fov_per_s']:.1f} | {r['efficiency']:.2f} | {r['cells']} |" for n, r in scaling.items()),
            "", f"![Fig. 3]({figure})",
        ]  # fmt: skip
    results = {
        "settings": summaries,
        "strong_scaling": scaling,
        "cells": [_cell_record(c) for c in loaded],
    }
    with atomic_path(study_dir / "results.json") as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=_plain) + "\n")
    report = study_dir / "report.md"
    with atomic_path(report) as tmp:
        tmp.write_text("\n".join(head + lines) + "\n")
    return report


def _cell_record(c: analysis.CellMetrics) -> dict:
    cell = c.cell
    return {
        "name": cell.name, "ranks": cell.ranks, "real_ranks": cell.real_ranks,
        "virtual_ranks": cell.virtual_ranks, "learning_rate": cell.learning_rate,
        "optimizer": cell.optimizer, "warmup": cell.warmup, "seed": cell.seed,
        "final": {k: float(v[-1]) for k, v in c.metrics.items()},
    }  # fmt: skip


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value)}")
