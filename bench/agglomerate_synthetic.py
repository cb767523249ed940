"""Does agglomeration help? FFN's first pass on a synthetic volume, then agglomeration of the
touching pairs (pipeline.agglomeration), scored before and after against the ground truth.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/agglomerate_synthetic.py --seed 1

Seed 1 is the demo's scored volume, seed 2 its selection volume: settings are tuned (if at all)
on seed 2 and reported on seed 1. The model is the shipped demo model, the first pass
`pipeline.inference.segment` with the demo's inference settings (`InferenceConfig()`) on the
whole volume; its result is kept in --workdir, so a second run only agglomerates.

Prints VI split / merge before and after, how many pairs were tested and merged (and how many of
the merged pairs are truly one object: the same majority ground-truth id), the FOV evaluations
and time of both passes, and the CPU; --output writes the same as JSON.

Measured 2026-11-27, 2-core AMD EPYC shared with other jobs (times are rough), default
`AgglomerationConfig` (min_recovered 0.9 chosen on seed 2):
  seed 2: VI split / merge 0.683 / 0.522 -> 0.561 / 0.601 (total 1.205 -> 1.162); 377 pairs,
          10 merged (9 one object); 17,640 FOVs against the first pass's 28,253.
  seed 1: VI split / merge 0.978 / 0.756 -> 0.898 / 1.119 (total 1.735 -> 2.017); 564 pairs,
          14 merged (6 one object); 22,537 FOVs against 27,618. The 8 wrong merges look like the
          right ones (Jaccard and recovered shares >= 0.92): the demo model's fills cross those
          boundaries. The 6 right merges alone would give 0.910 / 0.763 (1.673).
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from machine import cpu_name  # bench/machine.py

import pipeline  # noqa: F401  (sets TensorFlow's oneDNN flag before TF loads)
from pipeline.agglomeration import (
    AgglomerationConfig,
    candidate_pairs,
    decide_pairs,
    merge_lookup,
    relabel,
)
from pipeline.inference import (
    InferenceConfig,
    checkpoint_model_config,
    predictor_from_checkpoint,
    segment,
)
from pipeline.metrics import score_segmentation
from pipeline.synthetic import SyntheticConfig, generate

CHECKPOINT = Path(__file__).resolve().parents[1] / "models/demo-synthetic/checkpoints/ckpt-0"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--seed", type=int, default=1, help="synthetic volume: 1 scored, 2 for tuning")
    add("--workdir", type=Path, default=Path("data/bench/agglomerate"))
    add("--output", type=Path, default=None, help="write the results here as JSON")
    defaults = AgglomerationConfig()
    add("--min-jaccard", type=float, default=defaults.min_jaccard)
    add("--min-recovered", type=float, default=defaults.min_recovered)
    add("--max-fov-evaluations-per-fill", type=int, default=defaults.max_fov_evaluations_per_fill)
    add("--min-contact", type=int, default=defaults.min_contact)
    return parser


def first_pass(raw, predict, model, path: Path) -> tuple[np.ndarray, int, float]:
    """(segmentation, FOV evaluations, seconds) of the first pass, from `path` if kept there."""
    if path.is_file():
        with np.load(path) as kept:
            return kept["segmentation"], int(kept["fov_evaluations"]), float(kept["seconds"])
    segmentation, stats = segment(raw, predict, model, InferenceConfig(), progress=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        segmentation=segmentation,
        fov_evaluations=stats.fov_evaluations,
        seconds=stats.seconds,
    )
    return segmentation, stats.fov_evaluations, stats.seconds


def majority_truth(segmentation: np.ndarray, labels: np.ndarray) -> dict[int, int]:
    """Each segment's most overlapping ground-truth id (0 ignored)."""
    both = (segmentation > 0) & (labels > 0)
    keys, counts = np.unique(
        np.stack([segmentation[both], labels[both]], axis=1), axis=0, return_counts=True
    )
    order = np.lexsort((-counts, keys[:, 0]))
    segments, first = np.unique(keys[order, 0], return_index=True)
    return dict(zip(segments.tolist(), keys[order[first], 1].tolist(), strict=True))


def scores(segmentation: np.ndarray, labels: np.ndarray) -> dict:
    s = score_segmentation(segmentation, labels)
    return {
        "vi_split": s.vi_split,
        "vi_merge": s.vi_merge,
        "vi": s.vi,
        "adapted_rand_error": s.adapted_rand_error,
        "segments": s.segments,
        "split_objects": s.split_objects,
        "merged_segments": s.merged_segments,
    }


def main() -> None:
    args = _parser().parse_args()
    config = AgglomerationConfig(
        min_jaccard=args.min_jaccard,
        min_recovered=args.min_recovered,
        max_fov_evaluations_per_fill=args.max_fov_evaluations_per_fill,
        min_contact=args.min_contact,
    )
    model = checkpoint_model_config(CHECKPOINT)
    predict = predictor_from_checkpoint(CHECKPOINT, model)
    raw, labels = generate(SyntheticConfig(seed=args.seed))
    path = args.workdir / f"first_pass_seed{args.seed}.npz"
    segmentation, first_fovs, first_seconds = first_pass(raw, predict, model, path)

    started = time.perf_counter()
    table = candidate_pairs(segmentation, min_contact=config.min_contact, max_gap=config.max_gap)
    decisions = decide_pairs(
        lambda box: raw[box],
        lambda box: segmentation[box],
        segmentation.shape,
        table,
        predict,
        model,
        InferenceConfig(),
        config,
    )
    merged = np.array([(d.a, d.b) for d in decisions if d.merge], np.uint64).reshape(-1, 2)
    agglomerated = relabel(segmentation, *merge_lookup(merged))
    seconds = time.perf_counter() - started

    truth = majority_truth(segmentation, labels)
    same = [truth.get(d.a, -1) == truth.get(d.b, -2) for d in decisions]
    result = {
        "seed": args.seed,
        "cpu": cpu_name(),
        "config": dataclasses.asdict(config),
        "first_pass": {"fov_evaluations": first_fovs, "seconds": first_seconds},
        "agglomeration": {
            "pairs": len(decisions),
            "pairs_one_object": int(sum(same)),
            "merged": int(len(merged)),
            "merged_one_object": int(
                sum(s for s, d in zip(same, decisions, strict=True) if d.merge)
            ),
            "unseeded": int(sum(not d.seeded for d in decisions)),
            "fov_evaluations": int(sum(d.fov_evaluations for d in decisions)),
            "seconds": seconds,
        },
        "before": scores(segmentation, labels),
        "after": scores(agglomerated, labels),
        "decisions": [
            dataclasses.asdict(d) | {"one_object": s} for d, s in zip(decisions, same, strict=True)
        ],
    }
    for stage in ("before", "after"):
        s = result[stage]
        print(
            f"{stage:6s} VI split {s['vi_split']:.3f}  merge {s['vi_merge']:.3f}  total {s['vi']:.3f}"
            f"  ARE {s['adapted_rand_error']:.3f}  segments {s['segments']}"
            f"  split objects {s['split_objects']}  merged segments {s['merged_segments']}"
        )
    a = result["agglomeration"]
    print(
        f"pairs {a['pairs']} (one object: {a['pairs_one_object']}), merged {a['merged']} "
        f"(one object: {a['merged_one_object']}), unseeded {a['unseeded']}"
    )
    print(
        f"FOV evaluations: first pass {first_fovs} in {first_seconds:.0f} s, "
        f"agglomeration {a['fov_evaluations']} in {seconds:.0f} s"
    )
    print(f"CPU: {result['cpu']}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
