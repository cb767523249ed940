"""Second-pass evidence from the learned watershed: merge two touching FFN segments that lie
mostly inside one watershed segment (issue 58's idea). Tried on a finished run's final layer.

For each segment, the learned-watershed segment holding most of its voxels and that share; two
touching segments (at least `min_contact` voxel faces) with the same one, each at least `share`
inside it, and a mean P(boundary) by the forest along their contact of at most `max_boundary`
("no boundary between them"; 1.0 does not look), are merged; with `share` None the watershed
is not looked at, the contact alone decides. By default on the run's exported
layer (after its second pass); with `--before-fill` on the first pass with the run's own merges,
then the small objects are dropped and the rest filled as the second pass does. Every setting of
the grid is scored in the run's scored part.

The run must have a learned watershed (a `train_roi` and a `select_roi`). Overlap counts and
contact sums add up over the parts of a volume, so the rule could run part by part; it is not in
the workflow: on the selection part no setting of it lowered VI (BENCHMARKS.md, "The learned
watershed as second-pass evidence").

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/watershed_evidence.py \
        --run-dir data/runs/flyem-fib25-selection-second-pass \
        --out data/bench/watershed_evidence_selection.json
    PATH=.venv/bin:$PATH python bench/watershed_evidence.py --before-fill \
        --run-dir data/runs/flyem-fib25-selection-second-pass \
        --out data/bench/watershed_evidence_selection_before_fill.json

The choice over several tuning runs' records (`--choose`, either placement or both): the setting
with the lowest VI summed over the runs, taken only if that sum is below the sum with no pair
merged and the summed adapted Rand error is not above it either; otherwise none:

    PATH=.venv/bin:$PATH python bench/watershed_evidence.py --choose data/bench/watershed_evidence_*.json
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

# share None: the watershed not looked at (the contact's P(boundary) alone decides).
SHARES = (None, 0.5, 0.6, 0.7, 0.8, 0.9)
MIN_CONTACTS = (1, 50, 200)
MAX_BOUNDARY = (1.0, 0.7, 0.6, 0.5, 0.4)  # 1.0: the contact's P(boundary) not looked at


def dominant_basins(overlaps: OverlapCounts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segments, basins, shares): each segment of `overlaps` (segment ids as its "truth", basin
    ids as its "prediction"), the basin holding most of its voxels and the share it holds (of
    the segment's voxels, basin 0 included in the total, never dominant)."""
    segments, first = np.unique(overlaps.truth_ids, return_index=True)
    totals = np.add.reduceat(overlaps.voxels, first) if len(first) else np.zeros(0, np.int64)
    basin_voxels = np.where(overlaps.predicted_ids > 0, overlaps.voxels, 0)
    # Largest basin overlap per segment: sort by (segment, voxels) and take each group's last.
    order = np.lexsort((basin_voxels, overlaps.truth_ids))
    last = np.r_[first[1:], len(order)] - 1
    best = order[last] if len(order) else order
    shares = basin_voxels[best] / np.maximum(totals, 1)
    basins = np.where(basin_voxels[best] > 0, overlaps.predicted_ids[best], 0)
    return segments, basins.astype(np.uint64), shares


def contact_boundary_sums(
    segmentation: np.ndarray, boundary: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pairs (N, 2) with a < b, sums, faces): for each pair of touching non-zero segments, the
    sum over their shared voxel faces of the two voxels' mean P(boundary), and the faces."""
    pairs, values = [], []
    for axis in range(3):
        low, high = [slice(None)] * 3, [slice(None)] * 3
        low[axis], high[axis] = slice(None, -1), slice(1, None)
        u, v = segmentation[tuple(low)], segmentation[tuple(high)]
        touching = (u != v) & (u > 0) & (v > 0)
        a, b = u[touching], v[touching]
        pairs.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
        values.append((boundary[tuple(low)][touching] + boundary[tuple(high)][touching]) / 2)
    return summed_contacts(np.concatenate(pairs), np.concatenate(values), None)


def summed_contacts(
    pairs: np.ndarray, sums: np.ndarray, faces: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the same pair added up (`faces` None: one face per row), pairs sorted."""
    faces = np.ones(len(pairs), np.int64) if faces is None else faces
    ids, group = np.unique(pairs.astype(np.uint64).reshape(-1, 2), axis=0, return_inverse=True)
    group = group.reshape(-1)
    return (
        ids,
        np.bincount(group, sums, len(ids)),
        np.bincount(group, faces, len(ids)).astype(np.int64),
    )


def supported_pairs(
    pairs: np.ndarray,
    contact_boundary: np.ndarray,
    dominant: tuple[np.ndarray, np.ndarray, np.ndarray],
    min_share: float | None,
    max_boundary: float,
) -> np.ndarray:
    """The rows of `pairs` (N, 2) whose two segments have the same dominant basin, each with at
    least `min_share` of its voxels in it, and whose contact's mean P(boundary)
    (`contact_boundary`, per row) is at most `max_boundary`."""
    segments, basins, shares = dominant
    pairs = np.asarray(pairs, np.uint64).reshape(-1, 2)
    where = np.searchsorted(segments, pairs)
    known = np.all(where < len(segments), axis=1)
    where = np.minimum(where, max(len(segments) - 1, 0))
    known &= np.all(segments[where] == pairs, axis=1) if len(segments) else False
    basin, share = basins[where], shares[where]
    keep = (
        known
        & (basin[:, 0] == basin[:, 1])
        & (basin[:, 0] > 0)
        & ((share.min(axis=1) >= min_share) if min_share is not None else True)
        & (np.asarray(contact_boundary) <= max_boundary)
    )
    return pairs[keep]


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


SETTING_KEYS = ("share", "min_contact", "max_boundary")


def chosen_setting(records: list[dict]) -> dict:
    """The setting (placement included) the tuning runs' `records` (`main` outputs, each run with
    one or both placements) choose together: the lowest VI summed over the runs, if below no
    pair merged's without a higher summed adapted Rand error; with each run's scores and the
    sums, or `{"setting": "no pair merged"}` and the sums."""

    def totals(rows: list[dict]) -> tuple[float, float]:
        return sum(r["vi"] for r in rows), sum(r["adapted_rand_error"] for r in rows)

    per_run: dict[str, dict] = {}
    for record in records:
        rows = per_run.setdefault(record["run_dir"], {})
        for row in record["rows"]:
            key = row.get("setting") or (record["before_fill"], *(row[k] for k in SETTING_KEYS))
            rows.setdefault(key, row)  # "no pair merged" is the run's own layer either way
    runs = list(per_run.values())
    baseline = totals([rows["no pair merged"] for rows in runs])
    settings = [k for k in runs[0] if isinstance(k, tuple) and all(k in r for r in runs)]
    best = min(settings, key=lambda k: totals([rows[k] for rows in runs])[0])
    vi, are = totals([rows[best] for rows in runs])
    sums = {"no_pair_merged_vi": round(baseline[0], 4), "no_pair_merged_are": round(baseline[1], 4)}
    if vi < baseline[0] and are <= baseline[1]:
        setting = dict(zip(("before_fill", *SETTING_KEYS), best, strict=True))
        return setting | sums | {"vi": round(vi, 4), "runs": [rows[best] for rows in runs]}
    return {"setting": "no pair merged", "best_vi": round(vi, 4)} | sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--choose", nargs="+", type=Path, help="tuning runs' records: print the setting they choose"
    )
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument(
        "--before-fill",
        action="store_true",
        help="apply the rule to the first pass with the run's merges, then drop and fill",
    )
    parser.add_argument(
        "--setting",
        type=json.loads,
        help="score only this setting of the grid (on a scored part: the one --choose chose), "
        'e.g. \'{"share": null, "min_contact": 200, "max_boundary": 0.5}\'',
    )
    parser.add_argument("--out", type=Path, help="the results (.json)")
    args = parser.parse_args()
    if args.choose:
        records = [json.loads(path.read_text()) for path in args.choose]
        print(json.dumps(chosen_setting(records), indent=1))
        return
    if not (args.run_dir and args.out):
        parser.error("--run-dir and --out are needed to score a run")

    paths = RunPaths(args.run_dir)
    staged = staged_eval(args.run_dir)
    part = staged.scored.slices if staged.scored else ()
    labels = read_array(staged.labels)
    watershed = read_array(f"{paths.learned_baseline}:segmentation")
    forest = load_boundary_forest(paths.boundary_forest)
    boundary = boundary_probability(forest, read_array(staged.raw), BoundaryForestConfig())
    layer = read_array(segmentation_spec(paths.objects))
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
    grid = itertools.product(SHARES, MIN_CONTACTS, MAX_BOUNDARY)
    if args.setting:
        grid = [tuple(args.setting[k] for k in SETTING_KEYS)]
    for share, min_contact, max_boundary in grid:
        if share is None and max_boundary >= 1.0:
            continue  # every touching pair: one object
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
