"""Second-pass evidence from the learned watershed: merge two touching FFN segments that lie
mostly inside one watershed segment (issue 58's idea). Tried on a finished run's final layer.

For each segment of the run's exported segmentation (the first pass with its second pass), its
dominant learned-watershed segment and the share of its voxels inside it; two touching segments
(at least `--min-contact` voxel faces) with the same dominant watershed segment, each at least
`--share` inside it, are merged. Scored in the run's scored part for every setting of the grid.
The run must have a learned watershed (a `train_roi` and a `select_roi`).

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/watershed_evidence.py \
        --run-dir data/runs/flyem-fib25-selection-second-pass \
        --out data/bench/watershed_evidence_selection.json
"""

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
from agglomerate import read_array, staged_eval  # bench/agglomerate.py

from pipeline.core.atomic import atomic_path
from pipeline.evaluation.scores import OverlapCounts, largest_errors, score_counts
from pipeline.export.layers import segmentation_spec
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import candidate_pairs, merge_lookup, relabel

SHARES = (0.5, 0.6, 0.7, 0.8, 0.9)
MIN_CONTACTS = (1, 50, 200)


def dominant_watershed(
    segmentation: np.ndarray, watershed: np.ndarray
) -> dict[int, tuple[int, float]]:
    """Each segment's watershed segment with most of its voxels, and that share of them."""
    counts = OverlapCounts.of(segmentation, watershed)
    dominant: dict[int, tuple[int, float]] = {}
    sizes: dict[int, int] = {}
    for segment, basin, voxels in zip(
        counts.truth_ids, counts.predicted_ids, counts.voxels, strict=True
    ):
        segment, voxels = int(segment), int(voxels)
        sizes[segment] = sizes.get(segment, 0) + voxels
        if basin and voxels > dominant.get(segment, (0, 0))[1]:
            dominant[segment] = (int(basin), voxels)
    return {s: (b, v / sizes[s]) for s, (b, v) in dominant.items()}


def supported_pairs(pairs: np.ndarray, dominant: dict, share: float) -> np.ndarray:
    """The pairs whose two segments share a dominant watershed segment, each at least `share`."""
    keep = [
        (a, b)
        for a, b in pairs.tolist()
        if a in dominant
        and b in dominant
        and dominant[a][0] == dominant[b][0]
        and min(dominant[a][1], dominant[b][1]) >= share
    ]
    return np.array(keep, np.uint64).reshape(-1, 2)


def scored(segmentation: np.ndarray, labels: np.ndarray) -> dict:
    counts = OverlapCounts.of(labels, segmentation)
    scores = score_counts(counts)
    split = largest_errors(counts, n=3)["split"]
    return {
        "vi": round(scores.vi_split + scores.vi_merge, 4),
        "vi_split": round(scores.vi_split, 4),
        "vi_merge": round(scores.vi_merge, 4),
        "adapted_rand_error": round(scores.adapted_rand_error, 4),
        "largest_split_bodies": [[row["id"], round(row["bits"], 3)] for row in split],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the results (.json)")
    args = parser.parse_args()

    paths = RunPaths(args.run_dir)
    staged = staged_eval(args.run_dir)
    part = staged.scored.slices if staged.scored else ()
    labels = read_array(staged.labels)
    segmentation = read_array(segmentation_spec(str(args.run_dir / "precomputed")))
    watershed = read_array(f"{paths.learned_baseline}:segmentation")
    dominant = dominant_watershed(segmentation, watershed)
    contacts = candidate_pairs(segmentation)
    rows = [{"setting": "the run's layer"} | scored(segmentation[part], labels[part])]
    rows.append({"setting": "learned watershed"} | scored(watershed[part], labels[part]))
    for share, min_contact in itertools.product(SHARES, MIN_CONTACTS):
        pairs = supported_pairs(contacts.ids[contacts.contacts >= min_contact], dominant, share)
        merged = relabel(segmentation.copy(), *merge_lookup(pairs))
        row = {"share": share, "min_contact": min_contact, "pairs_merged": len(pairs)}
        rows.append(row | scored(merged[part], labels[part]))
        print(json.dumps(rows[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(
            json.dumps({"run_dir": str(args.run_dir), "rows": rows}, indent=1) + "\n"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
