"""The from-scratch recipe's learning curve on real EM: VI on the evaluated part after 10, 20, 40
and 60 minutes of training, with and without FFN's second pass (agglomeration).

Run by hand (not a test), from the repository root, on a quiet machine (the minutes are the
training's own wall-clock):

    PATH=.venv/bin:$PATH python bench/learning_curve.py [--minutes 10 20 40 60]

1. configs/flyem.toml's recipe (its model, parts of the file, 2 ranks, rate and its drop every
   15,000 steps) is trained through the workflow (`--stages stage preprocess train`), every
   checkpoint kept: 1,000 steps first, to measure the step rate here, then on from there to the
   steps that rate gives for the last mark;
2. for each mark, the checkpoint whose training time is nearest it (metrics.csv's wall-clock,
   summed over the two launches);
3. each of those segments the evaluated part as the workflow would (its staged volume, the
   recipe's inference settings, one block) and is scored on the scored part, before and after
   agglomeration. Agglomeration's settings are chosen on the selection part, once, for the last
   checkpoint (bench/agglomerate.py's sweep over budgets, minimum contacts and thresholds).

Kept in --run-dir, so a second run only does what is missing. Prints a Markdown table and writes
everything to --output (JSON).
"""

import argparse
import csv
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

from agglomerate import FirstPass, agglomerated, fill_pairs, read_array, scores, sweep
from machine import cpu_name, write_result  # bench/machine.py

import pipeline  # noqa: F401  (sets TensorFlow's oneDNN flag before TF loads)
from pipeline.core.config_io import save_json
from pipeline.core.errors import InferenceError
from pipeline.data.staging import read_staged
from pipeline.inference.flood_fill import (
    checkpoint_model_config,
    predictor_from_checkpoint,
    segment,
)
from pipeline.run.run_config import RunConfig, load_run_config
from pipeline.secondpass.agglomeration import AgglomerationConfig, merged_pairs
from pipeline.selection.checkpoints import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]

RECIPE = ROOT / "configs/flyem.toml"
CALIBRATION_STEPS = 1000
CHECKPOINT_EVERY = 500  # steps; the recipe logs its metrics every 500 too
BUDGETS = (4, 8, 16)  # FOV evaluations per fill the selection part's sweep tries
MIN_CONTACT = 50  # the sweep's smallest minimum contact (it tries larger ones from the same fills)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--minutes", type=float, nargs="+", default=[10, 20, 40, 60])
    add("--run-dir", type=Path, default=ROOT / "data/runs/flyem-curve")
    add("--output", type=Path, default=ROOT / "data/bench/learning_curve.json")
    return parser


def train(run_dir: Path, recipe: RunConfig, max_steps: int) -> None:
    """The recipe's training to `max_steps`, every checkpoint kept; goes on from the last one."""
    kept = dataclasses.replace(
        recipe.train,
        max_steps=max_steps,
        checkpoint_every_steps=CHECKPOINT_EVERY,
        keep_checkpoints=10**6,
        checkpoint_every_seconds=1e9,
    )
    config = save_json(run_dir.with_suffix(".json"), dataclasses.replace(recipe, train=kept))
    resume = ["--resume"] if (run_dir / "config.json").is_file() else []
    command = [sys.executable, "workflow.py", "--run-dir", str(run_dir), "--config", str(config)]
    subprocess.run([*command, *resume, "--stages", "stage", "preprocess", "train"], cwd=ROOT, check=True)  # fmt: skip


def training_minutes(metrics_csv: Path) -> dict[int, tuple[float, float]]:
    """Each logged step's (minutes of training, loss); a launch's wall-clock starts at 0, so a
    launch that goes on from a checkpoint adds to the one before."""
    with open(metrics_csv, newline="") as f:
        rows = [(int(float(r["step"])), float(r["wall_s"]), float(r["loss"])) for r in csv.DictReader(f)]  # fmt: skip
    minutes, offset, previous = {}, 0.0, 0.0
    for step, wall_s, loss in rows:
        if wall_s < previous:
            offset += previous
        previous = wall_s
        minutes[step] = ((offset + wall_s) / 60, loss)
    return minutes


def first_pass(checkpoint: Path, staged_path: Path, recipe: RunConfig) -> FirstPass:
    """The checkpoint's segmentation of a staged part, in one block as the workflow's."""
    staged = read_staged(staged_path)
    raw, labels = read_array(staged.raw), read_array(staged.labels)
    model = checkpoint_model_config(checkpoint)
    segmentation, stats = segment(raw, predictor_from_checkpoint(checkpoint, model), model, recipe.inference)  # fmt: skip
    scored = staged.scored.slices if staged.scored else (slice(None),) * 3
    return FirstPass(
        raw, labels, segmentation, scored, checkpoint, recipe.inference,
        stats.fov_evaluations, stats.seconds,
    )  # fmt: skip


def choose_agglomeration(first: FirstPass) -> tuple[AgglomerationConfig, dict]:
    """The settings of bench/agglomerate.py's sweep that score best on `first` (ties: fewer FOV
    evaluations), and that row."""
    base = AgglomerationConfig(enabled=True, min_contact=MIN_CONTACT)
    by_budget, contacts, _ = fill_pairs(first, base, list(BUDGETS))
    rows = sweep(first, by_budget, contacts, base)
    best = min(rows, key=lambda r: (round(r["vi"], 4), r["fov_evaluations"]))
    chosen = dataclasses.replace(
        base,
        min_contact=best["min_contact"],
        max_fov_evaluations_per_fill=best["budget"],
        min_jaccard=best["min_jaccard"],
        min_recovered=best["min_recovered"],
    )
    return chosen, best


def agglomerate(first: FirstPass, config: AgglomerationConfig) -> dict:
    by_budget, _, seconds = fill_pairs(first, config, [config.max_fov_evaluations_per_fill])
    decisions = by_budget[config.max_fov_evaluations_per_fill]
    merged = merged_pairs(decisions, config)
    return {
        "pairs": len(decisions),
        "merged": len(merged),
        "fov_evaluations": sum(d.fov_evaluations for d in decisions),
        "seconds": seconds,
        "scores": scores(agglomerated(first.segmentation, merged), first),
    }


def _cell(s: dict | None) -> str:
    if s is None:
        return "–"
    return f"{s['vi_split']:.2f} / {s['vi_merge']:.2f} / **{s['vi']:.2f}** ({s['adapted_rand_error']:.3f})"


def table(points: list[dict]) -> str:
    lines = [
        "| mark | training (min) | step | loss | first pass: VI split / merge / total (adapted Rand) "
        "| + agglomeration | pairs, merged | FOV evaluations: first pass + agglomeration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        if "error" in p:
            lines.append(f"| {p['mark']:g} min | {p['minutes']:.1f} | {p['step']:,} | {p['loss']:.3f} | {p['error']} | | | |")  # fmt: skip
            continue
        a = p["agglomeration"] or {
            "scores": None,
            "pairs": "–",
            "merged": "–",
            "fov_evaluations": 0,
        }
        lines.append(
            f"| {p['mark']:g} min | {p['minutes']:.1f} | {p['step']:,} | {p['loss']:.3f} "
            f"| {_cell(p['first_pass'])} | {_cell(a['scores'])} | {a['pairs']}, {a['merged']} "
            f"| {p['fov_evaluations']:,} + {a['fov_evaluations']:,} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = _parser().parse_args()
    recipe = load_run_config(RECIPE)
    run_dir = args.run_dir.resolve()
    metrics = run_dir / "train/metrics.csv"
    if not metrics.is_file():
        train(run_dir, recipe, CALIBRATION_STEPS)
    minutes = training_minutes(metrics)
    last = max(minutes)
    if minutes[last][0] < max(args.minutes):  # steps for the last mark at the measured rate
        rate = last / minutes[last][0]
        steps = math.ceil(rate * max(args.minutes) / CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        train(run_dir, recipe, max(steps, last + CHECKPOINT_EVERY))
        minutes = training_minutes(metrics)
    every = {int(path.name.split("-")[1]): path for path in list_checkpoints(run_dir / "train")}
    kept = {step: path for step, path in every.items() if step in minutes}
    chosen_steps = [min(kept, key=lambda s: abs(minutes[s][0] - mark)) for mark in args.minutes]
    try:
        selection = first_pass(kept[chosen_steps[-1]], run_dir / "staged/select.h5", recipe)
        settings, best = choose_agglomeration(selection)
    except InferenceError as error:
        settings, best = None, {"error": str(error)}
    print(f"agglomeration chosen on the selection part: {best}")
    points = []
    for mark, step in zip(args.minutes, chosen_steps, strict=True):
        point = {"mark": mark, "minutes": minutes[step][0], "step": step, "loss": minutes[step][1]}
        try:
            first = first_pass(kept[step], run_dir / "staged/eval.h5", recipe)
        except InferenceError as error:  # an early network's logits can run away as they feed back
            points.append(point | {"error": str(error)})
            print(f"{mark:g} min (step {step}): no segmentation: {error}", flush=True)
            continue
        points.append(point | {
            "first_pass": scores(first.segmentation, first),
            "fov_evaluations": first.fov_evaluations, "inference_s": first.seconds,
            "agglomeration": agglomerate(first, settings) if settings else None,
        })  # fmt: skip
        print(table(points[-1:]), flush=True)
    result = {
        "cpu": cpu_name(),
        "recipe": str(RECIPE.relative_to(ROOT)),
        "agglomeration": (dataclasses.asdict(settings) if settings else {})
        | {"selection_part": best},
        "points": points,
    }
    print(table(points))
    print(f"\nCPU: {result['cpu']}; written to {write_result(args.output, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
