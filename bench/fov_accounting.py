"""Where a finished run's FOV evaluations went (issue 60, point 1): every flood of the first
pass, from its block's flood records (`pipeline.inference.flood_fill.FloodRecords`), followed
through the stitching and the second pass to the exported layer, and the second pass's pair
fills (`PairDecision.fov_evaluations`).

Each FOV evaluation of the first pass is one flood's, and each flood is counted in one row:

- discarded: the flood's attempt made no object (its seed voxel fell below the move threshold,
  its object was under `min_segment_size`, or the consistency check's two floods disagreed; a
  check's flood goes with its attempt);
- kept, but wholly in a block's reflected padding (cut off with it);
- kept, but lost in stitching: its stitched id is nowhere in the first pass's layer (its voxels
  lie outside its block's core, where a neighbouring block's objects were taken);
- kept, then dropped by the second pass's `fill_min_size`: its stitched id, after the pass's
  merges, is an object under `fill_min_size` voxels, whose voxels the fill gave to neighbours;
- kept: the rest, by the size (voxels in the exported layer) of the object it is part of there
  (its stitched id after the merges): under 1,000, under 10,000, under 100,000, or more.

Across those rows, the FOVs of kept floods whose object "ended in an earlier flood's segment":
the exported segment holding most of the object's voxels (its voxels in its block's labels;
those the exported layer leaves 0 aside) is one that an earlier flood of the same block made,
i.e. that another, earlier object of the block is part of by its id (stitched, then merged; not
lost nor dropped). Its voxels end with a label an earlier object has anyway: it was merged into
that object (by the stitching, through a neighbouring block, or by the second pass's merges) or
dropped and filled into it. Its FOVs bought no segment of its own. Whether the fill would have
given its voxels that label had the flood not run is not measured (that takes a run without
it): this bounds what stopping such floods could save from above. Objects made again in a
neighbouring block (the blocks' overlaps) do not count: only one block's floods are compared.

FOV evaluations per 10⁶ voxels: of the scored part (as issue 60 counts them) and of the whole
volume segmented (the scored part's context included).

By seed pass: each pass's floods, their FOVs, the objects they kept and how many of their FOVs
went to discarded, dropped, or earlier-segment floods. Blocks written before flood records were
kept count in their own row (their stats' FOVs). A consensus run (`[agglomeration] consensus`)
is refused: its second pass's ids are not the first pass's.

Run by hand (not a test), from the repository root, on a finished run:

    PATH=.venv/bin:$PATH python bench/fov_accounting.py --run-dir data/runs/flyem-fib25 \
        --out data/bench/fov_accounting_flyem_fib25.json

It prints the Markdown tables (for BENCHMARKS.md) and writes them with the JSON beside --out
(.md).
"""

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from agglomerate import majority_truth, read_array, staged_eval  # bench/agglomerate.py

from pipeline.core.atomic import atomic_path
from pipeline.export.layers import segmentation_spec
from pipeline.inference.blocks import block_path, plan_blocks, read_block_result
from pipeline.inference.flood_fill import FLOOD_COLUMNS, FloodEnd, FloodRecords
from pipeline.inference.stitching import load_id_table
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    load_decisions,
    load_merges,
    load_sizes,
    relabel,
    segment_sizes,
    small_objects,
)

SIZE_CLASSES = (1_000, 10_000, 100_000)  # voxels: the upper bounds of the classes but the last
DISCARDED = {
    FloodEnd.SEED_TOO_WEAK: "discarded: seed too weak",
    FloodEnd.TOO_SMALL: "discarded: too small (min_segment_size)",
    FloodEnd.INCONSISTENT: "discarded: inconsistent (consistency check)",
}
CROPPED = "kept, wholly in a block's reflected padding"
LOST = "kept, lost in stitching (in no block's core)"
DROPPED = "kept, dropped by fill_min_size"
UNRECORDED = "blocks without flood records"


def size_class(voxels: int) -> str:
    """The row of a kept object of `voxels` voxels in the exported layer."""
    low = 0
    for high in SIZE_CLASSES:
        if voxels < high:
            return f"kept, final object {low:,}–{high - 1:,} voxels"
        low = high
    return f"kept, final object ≥ {low:,} voxels"


ROWS = [
    *DISCARDED.values(),
    CROPPED,
    LOST,
    DROPPED,
    *(size_class(n) for n in (0, *SIZE_CLASSES)),
    UNRECORDED,
]


def earlier_segment(objects: np.ndarray, ends_in: np.ndarray, made: np.ndarray) -> np.ndarray:
    """Per flood of a block, in order: whether its object (`objects`; 0: it made none) ended
    mostly in a segment that an earlier flood's other object is part of. `ends_in`: the exported
    segment holding most of the object's voxels; `made`: the exported segment the object is part
    of by its id (0: lost or dropped, it is part of none)."""
    first: dict[int, int] = {}  # segment: the object of the earliest flood that is part of it
    found = np.zeros(len(objects), bool)
    for k, (obj, segment, own) in enumerate(
        zip(objects.tolist(), ends_in.tolist(), made.tolist(), strict=True)
    ):
        found[k] = bool(obj) and first.get(segment, obj) != obj
        if obj and own:
            first.setdefault(own, obj)
    return found


def classify(
    ends: np.ndarray, lost: np.ndarray, dropped: np.ndarray, final_voxels: Sequence[int]
) -> list[str]:
    """Per flood, its row (`ROWS`): by its end (`FloodEnd`), then, of a kept one, whether its
    object is `lost` in stitching or `dropped` by the second pass, else by the voxels of the
    object it is part of in the exported layer (`final_voxels`)."""
    rows = []
    for k, end in enumerate(ends):
        if end in DISCARDED:
            rows.append(DISCARDED[FloodEnd(int(end))])
        elif end == FloodEnd.CROPPED:
            rows.append(CROPPED)
        elif lost[k]:
            rows.append(LOST)
        elif dropped[k]:
            rows.append(DROPPED)
        else:
            rows.append(size_class(final_voxels[k]))
    return rows


def tabulate(
    rows: Sequence[str],
    floods: FloodRecords,
    earlier: np.ndarray,
    unrecorded_fovs: int,
    decisions: Sequence[PairDecision],
    config: AgglomerationConfig,
    voxels: int,
    scored_voxels: int,
) -> dict:
    """The accounting: first-pass floods (`rows` per flood, `ROWS`; `earlier` per flood) with
    `unrecorded_fovs` from blocks without records, the second pass's pair `decisions`, per 10⁶
    voxels of the volume segmented (`voxels`, context included) and of its scored part. JSON-
    ready."""
    rows = np.asarray(rows, dtype=object)
    fovs = floods.fov_evaluations
    first_total = int(fovs.sum()) + unrecorded_fovs
    second_total = sum(d.fov_evaluations for d in decisions)
    both = first_total + second_total

    def share(n: int) -> float:
        return round(n / both, 6) if both else 0.0

    first_pass = []
    for name in ROWS:
        here = rows == name
        n = unrecorded_fovs if name == UNRECORDED else int(fovs[here].sum())
        first_pass.append({
            "row": name,
            "floods": int(here.sum()),
            "seeds": int((here & ~floods.check).sum()),  # kept: an object each
            "fov_evaluations": n,
            "share": share(n),
            "in_earlier_segment": int(fovs[here & earlier].sum()),
        })  # fmt: skip
    ends = floods.end
    by_pass = []
    for seed_pass in np.unique(floods.seed_pass):
        here = floods.seed_pass == seed_pass
        by_pass.append({
            "seed_pass": int(seed_pass),
            "floods": int(here.sum()),
            "objects_kept": int((here & (ends == FloodEnd.KEPT) & ~floods.check).sum()),
            "fov_evaluations": int(fovs[here].sum()),
            "share": share(int(fovs[here].sum())),
            "discarded": int(fovs[here & np.isin(ends, list(DISCARDED))].sum()),
            "dropped": int(fovs[here & (rows == DROPPED)].sum()),
            "in_earlier_segment": int(fovs[here & earlier].sum()),
        })  # fmt: skip
    merged = [config.merges(d) for d in decisions]
    merged_fovs = sum(d.fov_evaluations for d, m in zip(decisions, merged, strict=True) if m)
    second_pass = [
        {"row": "pair fills, merged", "pairs": sum(merged), "fov_evaluations": merged_fovs},
        {
            "row": "pair fills, not merged",
            "pairs": len(decisions) - sum(merged),
            "fov_evaluations": second_total - merged_fovs,
        },
    ]
    for row in second_pass:
        row["share"] = share(row["fov_evaluations"])
    return {
        "voxels": voxels,
        "scored_voxels": scored_voxels,
        "first_pass": first_pass,
        "by_seed_pass": by_pass,
        "second_pass": second_pass,
        "floods_truncated": int(floods.truncated.sum()),
        "consistency_check_floods": int(floods.check.sum()),
        "fov_evaluations": {
            "first_pass": first_total,
            "second_pass": second_total,
            "in_earlier_segment": int(fovs[earlier].sum()),
            "both": both,
            "both_per_mvoxel": round(both * 1e6 / voxels, 1),
            "both_per_scored_mvoxel": round(both * 1e6 / scored_voxels, 1),
        },
    }


def markdown(table: dict, title: str) -> str:
    """`tabulate`'s result as Markdown tables."""
    total = table["fov_evaluations"]
    lines = [
        f"#### FOV evaluations of {title}: where they went",
        "",
        f"First pass {total['first_pass']:,} FOV evaluations, second pass "
        f"{total['second_pass']:,}; both {total['both']:,}: {total['both_per_scored_mvoxel']:,} "
        f"per 10⁶ voxels of the scored part ({table['scored_voxels']:,} voxels), "
        f"{total['both_per_mvoxel']:,} per 10⁶ of the volume segmented ({table['voxels']:,}, "
        "its context included). "
        f"{table['floods_truncated']} floods stopped at max_fov_evaluations_per_object; "
        f"{table['consistency_check_floods']} were consistency checks.",
        "",
        "| first pass | floods | seeds | FOV evaluations | share of both passes | of which in an earlier flood's segment |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in table["first_pass"]:
        if row["fov_evaluations"] or row["floods"]:
            lines.append(
                f"| {row['row']} | {row['floods']:,} | {row['seeds']:,} | "
                f"{row['fov_evaluations']:,} | {row['share']:.1%} | {row['in_earlier_segment']:,} |"
            )
    lines.append(
        f"| first pass | | | {total['first_pass']:,} | "
        f"{total['first_pass'] / max(total['both'], 1):.1%} | {total['in_earlier_segment']:,} |"
    )
    for row in table["second_pass"]:
        lines.append(
            f"| second pass: {row['row']} | {row['pairs']:,} pairs | | "
            f"{row['fov_evaluations']:,} | {row['share']:.1%} | |"
        )
    lines += [
        "",
        "| seed pass | floods | objects kept | FOV evaluations | share of both passes | of which discarded | dropped | in an earlier flood's segment |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table["by_seed_pass"]:
        lines.append(
            f"| {row['seed_pass']} | {row['floods']:,} | {row['objects_kept']:,} | "
            f"{row['fov_evaluations']:,} | {row['share']:.1%} | {row['discarded']:,} | "
            f"{row['dropped']:,} | {row['in_earlier_segment']:,} |"
        )
    return "\n".join(lines) + "\n"


def account_run(run_dir: Path) -> dict:
    """`tabulate` of a finished run: its blocks' flood records, its stitching's id table and
    first pass's layer, its second pass's merges, dropped objects and decisions, and its
    exported layer."""
    config = load_run_config(run_dir / "config.json")
    second = config.agglomeration
    if second.consensus:
        raise SystemExit(f"{run_dir}: a consensus run; its second pass's ids are not the first's")
    paths = RunPaths(run_dir)
    exported = read_array(segmentation_spec(paths.precomputed))
    first = read_array(segmentation_spec(paths.first_pass)) if second.writes_layer else exported
    present = segment_sizes(first)[0]
    final_sizes = dict(zip(*(a.tolist() for a in segment_sizes(exported)), strict=True))
    offsets, lookup, _ = load_id_table(paths.stitch_dir / "ids.npy")
    folder = paths.agglomerate_dir
    merges = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    if (folder / "merges.npz").is_file():
        merges = load_merges(folder / "merges.npz")
    dropped = np.zeros(0, np.uint64)
    if second.fill_min_size:
        dropped = small_objects(load_sizes(folder / "sizes.npz"), merges, second.fill_min_size)
    rows, earlier, records, unrecorded = [], [], [], 0
    for k, block in enumerate(plan_blocks(exported.shape, config.blocks)):
        result = read_block_result(block_path(paths.blocks_dir, block), block)
        floods = result.floods
        if floods is None:
            unrecorded += result.stats.fov_evaluations
            continue
        if int(floods.fov_evaluations.sum()) != result.stats.fov_evaluations:
            raise SystemExit(f"{block.name}: its flood records do not add up to its FOVs")
        local = np.where(floods.end == FloodEnd.KEPT, floods.object, 0)
        stitched = np.where(local > 0, lookup[(local + offsets[k]).astype(np.int64)], 0)
        merged = relabel(stitched.copy(), *merges) if len(merges[0]) else stitched
        lost, small = ~np.isin(stitched, present), np.isin(merged, dropped)
        final_voxels = [final_sizes.get(m, 0) for m in merged.tolist()]
        rows += classify(floods.end, lost, small, final_voxels)
        majority = majority_truth(result.labels, exported[block.slices])
        ends_in = np.array([majority.get(o, 0) for o in local.tolist()], np.uint64)
        made = np.where((local > 0) & ~lost & ~small, merged, 0)
        earlier.append(earlier_segment(local, ends_in, made))
        records.append(floods)
    decisions = [d for p in sorted((folder / "decisions").glob("*.npz")) for d in load_decisions(p)]
    every = np.concatenate([np.zeros(0, bool), *earlier])
    scored = staged_eval(run_dir).scored
    scored_voxels = math.prod(scored.shape) if scored else exported.size
    return tabulate(
        rows, concatenate(records), every, unrecorded, decisions, second, int(exported.size),
        int(scored_voxels),
    )  # fmt: skip


def concatenate(records: Sequence[FloodRecords]) -> FloodRecords:
    """Several blocks' records as one."""
    every = [FloodRecords.of([]), *records]
    return FloodRecords(
        **{name: np.concatenate([getattr(r, name) for r in every]) for name in FLOOD_COLUMNS}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished workflow run")
    parser.add_argument("--out", type=Path, required=True, help="the results (.json; .md beside)")
    args = parser.parse_args()
    table = account_run(args.run_dir)
    text = markdown(table, args.run_dir.name)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(json.dumps({"run_dir": str(args.run_dir)} | table, indent=1) + "\n")
    with atomic_path(args.out.with_suffix(".md")) as tmp:
        Path(tmp).write_text(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
