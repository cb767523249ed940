"""Second-pass evidence from the learned watershed: merge two touching FFN segments that lie
mostly inside one watershed segment (issue 58's idea). Tried on a finished run's final layer.

For each segment of the run's exported segmentation (the first pass with its second pass), its
dominant learned-watershed segment and the share of its voxels inside it; two touching segments
(at least `--min-contact` voxel faces) with the same dominant watershed segment, each at least
`--share` inside it, are merged (with `--before-fill`: applied to the first pass with the run's
own merges, before the small objects are dropped and the rest filled, as the second pass would); optionally only where the forest's mean P(boundary) along their
contact is at most `MAX_BOUNDARY` ("no boundary between them"). Scored in the run's scored part
for every setting of the grid.
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

import fastremap
import numpy as np
from agglomerate import read_array, staged_eval  # bench/agglomerate.py

from pipeline.core.atomic import atomic_path
from pipeline.evaluation.evaluate import load_boundary_forest
from pipeline.evaluation.learned_watershed import BoundaryForestConfig, boundary_probability
from pipeline.evaluation.scores import OverlapCounts, largest_errors, score_counts
from pipeline.export.layers import segmentation_spec
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import (
    fill_unsegmented,
    load_merges,
    load_sizes,
    merge_lookup,
    relabel,
    small_objects,
)
from pipeline.secondpass.watershed_evidence import (
    contact_boundary_sums,
    dominant_basins,
    supported_pairs,
)

SHARES = (0.5, 0.6, 0.7, 0.8, 0.9)
MIN_CONTACTS = (1, 50, 200)
MAX_BOUNDARY = (1.0, 0.7, 0.5)  # 1.0: the contact's P(boundary) not looked at


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


def evidence(segmentation: np.ndarray, watershed: np.ndarray, boundary: np.ndarray):
    """What the rule looks at: touching pairs, their contacts' P(boundary) sums and faces, and
    each segment's dominant basin."""
    contacts, boundary_sums, faces = contact_boundary_sums(segmentation, boundary)
    return (
        contacts,
        boundary_sums,
        faces,
        dominant_basins(OverlapCounts.of(segmentation, watershed)),
    )


def as_pairs(merges: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """A merge table (ids, targets) as the pairs that make it."""
    ids, targets = merges
    moved = ids != targets
    return np.stack([ids[moved], targets[moved]], axis=1).astype(np.uint64)


def before_fill(run_dir: Path, boundary: np.ndarray):
    """The run's first pass with its own merges, and a function that adds pairs to those merges,
    drops the small objects and fills as the run's second pass does (here on the whole volume
    at once, the run part by part with a margin)."""
    paths = RunPaths(run_dir)
    first = read_array(segmentation_spec(str(paths.first_pass)))
    own = load_merges(run_dir / "agglomerate/merges.npz")
    sizes = load_sizes(run_dir / "agglomerate/sizes.npz")
    min_size = load_run_config(run_dir / "config.json").agglomeration.fill_min_size

    def second_pass(pairs: np.ndarray) -> np.ndarray:
        merges = merge_lookup(np.concatenate([as_pairs(own), pairs]))
        merged = relabel(first.copy(), *merges)
        dropped = small_objects(sizes, merges, min_size) if min_size else []
        if len(dropped):
            merged = fastremap.mask(merged, dropped, in_place=True)
        return fill_unsegmented(merged, boundary)

    return relabel(first.copy(), *own), second_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument(
        "--before-fill",
        action="store_true",
        help="apply the rule to the first pass with the run's merges, then drop and fill",
    )
    parser.add_argument("--out", type=Path, required=True, help="the results (.json)")
    args = parser.parse_args()

    paths = RunPaths(args.run_dir)
    staged = staged_eval(args.run_dir)
    part = staged.scored.slices if staged.scored else ()
    labels = read_array(staged.labels)
    watershed = read_array(f"{paths.learned_baseline}:segmentation")
    forest = load_boundary_forest(paths.boundary_forest)
    boundary = boundary_probability(forest, read_array(staged.raw), BoundaryForestConfig())
    layer = read_array(segmentation_spec(str(args.run_dir / "precomputed")))
    if args.before_fill:
        segmentation, finish = before_fill(args.run_dir, boundary)
    else:
        segmentation = layer

        def finish(pairs: np.ndarray) -> np.ndarray:
            return relabel(layer.copy(), *merge_lookup(pairs))

    contacts, boundary_sums, faces, dominant = evidence(segmentation, watershed, boundary)
    rows = [{"setting": "the run's layer"} | scored(layer[part], labels[part])]
    rows.append({"setting": "learned watershed"} | scored(watershed[part], labels[part]))
    rows.append(
        {"setting": "no pair merged"}
        | scored(finish(np.zeros((0, 2), np.uint64))[part], labels[part])
    )
    print(json.dumps(rows[-1]))
    for share, min_contact, max_boundary in itertools.product(SHARES, MIN_CONTACTS, MAX_BOUNDARY):
        enough = faces >= min_contact
        mean_boundary = boundary_sums[enough] / faces[enough]
        pairs = supported_pairs(contacts[enough], mean_boundary, dominant, share, max_boundary)
        row = {"share": share, "min_contact": min_contact, "max_boundary": max_boundary}
        row["pairs_merged"] = len(pairs)
        rows.append(row | scored(finish(pairs)[part], labels[part]))
        print(json.dumps(rows[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(
            json.dumps(
                {"run_dir": str(args.run_dir), "before_fill": args.before_fill, "rows": rows},
                indent=1,
            )
            + "\n"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
