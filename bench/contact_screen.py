"""What `[agglomeration] max_contact_boundary` would do on a finished run with pairs decided:
every decided pair's mean P(boundary) across its contact (as the screen measures it, in the
analysis box around its contact point, on the boundary forest's map), then per threshold the
pairs that would still be filled, their FOV evaluations and the merges among them.

Screening changes nothing of the pairs it lets through (their fills are the run's own), and a
pair screened out is not merged: so a threshold that keeps every merged pair gives the run's
own merges, and the FOVs of the pairs it keeps. The values come from `decide_pairs` itself with
every pair screened (a threshold just above 0, and a predictor that predicts nothing for the
rare pair that is not), so they are the screen's own numbers.

Run by hand (not a test), from the repository root, on a finished run with a boundary forest:

    PATH=.venv/bin:$PATH python bench/contact_screen.py \
        --run-dir data/runs/flyem-fib25-selection-second-pass --out data/bench/contact_screen.json
"""

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from agglomerate import staged_eval  # bench/agglomerate.py

from pipeline.core.atomic import atomic_path
from pipeline.data.volumes import open_volume
from pipeline.evaluation.boundary_map import boundary_reader
from pipeline.inference.flood_fill import inference_model
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import decide_pairs, load_contact_table, load_decisions
from pipeline.secondpass.part_writing import layer_reader
from pipeline.selection.checkpoints import chosen_checkpoint

THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)


def predicts_nothing(images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    return np.full(images.shape, -10.0, np.float32)


def contact_values(run_dir: Path) -> tuple[list, list]:
    """(the run's decisions, the screen's value for each, in the same order)."""
    paths = RunPaths(run_dir)
    config = load_run_config(run_dir / "config.json")
    screen_all = dataclasses.replace(config.agglomeration, max_contact_boundary=1e-9)
    model = inference_model(chosen_checkpoint(paths.selection), config.inference)
    staged = staged_eval(run_dir)
    decided, screened = [], []
    with (
        open_volume(staged.raw) as raw,
        layer_reader(str(paths.first_pass)) as read,
        boundary_reader((paths.boundary_forest, paths.eval_volume), raw.shape) as boundary,
    ):
        table = load_contact_table(paths.agglomerate_dir / "pairs.npz")
        for path in sorted((paths.agglomerate_dir / "decisions").glob("*.npz")):
            own = load_decisions(path)
            keys = {(d.a, d.b) for d in own}
            rows = [k for k, (a, b) in enumerate(table.ids.tolist()) if (a, b) in keys]
            values = decide_pairs(raw.__getitem__, read, raw.shape, table.select(np.array(rows, int)),
                                  predicts_nothing, model, config.inference, screen_all, boundary)  # fmt: skip
            by_pair = {(d.a, d.b): d.contact_boundary for d in values}
            decided += own
            screened += [by_pair[(d.a, d.b)] for d in own]
    return decided, screened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = load_run_config(args.run_dir / "config.json").agglomeration
    decided, values = contact_values(args.run_dir)
    merged = [config.merges(d) for d in decided]
    pairs = [
        {
            "a": d.a,
            "b": d.b,
            "contact_boundary": v,
            "merged": m,
            "fov_evaluations": d.fov_evaluations,
        }
        for d, v, m in zip(decided, values, merged, strict=True)
    ]
    rows = []
    for threshold in THRESHOLDS:
        kept = [p for p in pairs if p["contact_boundary"] <= threshold]
        rows.append({
            "max_contact_boundary": threshold,
            "pairs_filled": len(kept),
            "fov_evaluations": sum(p["fov_evaluations"] for p in kept),
            "merges_kept": sum(p["merged"] for p in kept),
        })  # fmt: skip
    print(f"{args.run_dir}: {len(pairs)} pairs, {sum(merged)} merged")
    print("| max_contact_boundary | pairs filled | their FOV evaluations | merges kept |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['max_contact_boundary']} | {r['pairs_filled']} | {r['fov_evaluations']:,} "
              f"| {r['merges_kept']} of {sum(merged)} |")  # fmt: skip
    print(
        "merged pairs:",
        [(p["a"], p["b"], round(p["contact_boundary"], 3)) for p in pairs if p["merged"]],
    )
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(
            json.dumps({"run_dir": str(args.run_dir), "pairs": pairs, "rows": rows})
        )


if __name__ == "__main__":
    main()
