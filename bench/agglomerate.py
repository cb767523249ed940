"""Does agglomeration help? A first pass, then agglomeration of its touching pairs
(pipeline.secondpass.agglomeration), scored before and after against the ground truth.

Run by hand (not a test), from the repository root, on one of:

    PATH=.venv/bin:$PATH python bench/agglomerate.py --synthetic-seed 1
    PATH=.venv/bin:$PATH python bench/agglomerate.py --run-dir data/runs/flyem-fib25-selection

--synthetic-seed: the demo model (`models/demo-synthetic`) segments a synthetic volume with the
demo's inference settings (`pipeline.inference.flood_fill.segment`, whole volume; kept in --workdir, so a
second run only agglomerates). Seed 1 is the demo's scored volume, seed 2 its selection volume.

--run-dir: a finished workflow run with labels: its staged volume (the scored part and its
context), its stitched segmentation, its model (selection.json) and inference settings. The
pairs are found and filled over the whole staged volume; scores are of the scored part only,
as the workflow's evaluation scores it. configs/flyem_fib25_selection.toml is the run where the
thresholds are chosen (the selection part), configs/flyem_fib25.toml the one that is scored.

Every pair's measures are written to --output (JSON), so that thresholds can be chosen from
them without filling again: --sweep prints the scores a grid of thresholds would give (on the
tuning volume), --decisions FILE reuses the fills of an earlier --output instead of filling.
--budgets 1 2 4 8 measures every pair as fills of at most that many FOV evaluations would, from
one fill per side with the largest (`pipeline.secondpass.agglomeration.pair_measures`), so the sweep also
tells what a smaller budget costs and scores, and what larger minimum contacts would (a subset
of the same pairs).
--fill STAGED_TRAIN_H5 needs no fills of pairs either: it scores the fill of the voxels the first
pass left unsegmented (`pipeline.secondpass.agglomeration.fill_unsegmented`, the boundary map learned on
that staged training part, e.g. data/runs/flyem-fib25/staged/train.h5), the same after dropping
the objects under each of FILL_MIN_SIZES voxels (`fill_min_size`), and perfect decisions on the
filled segmentation's touching pairs.
--oracle needs no fills: it scores what perfect decisions would give (merge a candidate pair when
its two segments' majority ground-truth ids agree) at several minimum contacts, the most any
thresholds on the fills' measures could reach; a ceiling to read before tuning them.
Prints VI split / merge before and after, the pairs tested and merged (and how many of the
merged pairs are truly one object: the same majority ground-truth id), the FOV evaluations and
time of both passes, and the CPU.
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import fastremap
import numpy as np
from machine import cpu_name  # bench/machine.py
from tqdm import tqdm

import pipeline  # noqa: F401  (sets TensorFlow's oneDNN flag before TF loads)
from pipeline.data.staging import StagedVolume, read_staged
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.data.volumes import open_volume
from pipeline.evaluation.learned_watershed import learned_boundary_map
from pipeline.evaluation.scores import score_segmentation
from pipeline.export.layers import segmentation_spec
from pipeline.inference.flood_fill import (
    InferenceConfig,
    checkpoint_model_config,
    predictor_from_checkpoint,
    segment,
)
from pipeline.run.run_config import load_run_config
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    candidate_pairs,
    fill_unsegmented,
    merge_lookup,
    merged_pairs,
    pair_measures,
    relabel,
    segment_sizes,
    small_objects,
)
from pipeline.selection.checkpoints import chosen_checkpoint

ROOT = Path(__file__).resolve().parents[1]

DEMO_CHECKPOINT = ROOT / "models/demo-synthetic/checkpoints/ckpt-0"
SWEEP_RECOVERED = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
SWEEP_JACCARD = (0.3, 0.5, 0.7, 0.8)
# Larger minimum contacts than the fills were made with: a subset of the same pairs, no filling.
SWEEP_MIN_CONTACT = (50, 100, 200, 500, 1000, 2000)
ORACLE_MIN_CONTACT = (1, 10, 50, 100, 200, 500, 1000)
FILL_MIN_SIZES = (100, 300, 600, 1000, 1500, 2000, 3000)


@dataclasses.dataclass
class FirstPass:
    """What agglomeration starts from, and where it is scored."""

    raw: np.ndarray
    labels: np.ndarray
    segmentation: np.ndarray
    scored: tuple[slice, ...]
    checkpoint: Path
    inference: InferenceConfig
    fov_evaluations: int
    seconds: float | None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic-seed", type=int, help="1 scored, 2 for tuning")
    source.add_argument("--run-dir", type=Path, help="a finished workflow run with labels")
    add("--workdir", type=Path, default=ROOT / "data/bench/agglomerate")
    add("--output", type=Path, default=None, help="write the results here as JSON")
    add("--decisions", type=Path, default=None, help="an earlier --output: its fills, reused")
    add("--sweep", action="store_true", help="print the scores over a grid of thresholds")
    add("--oracle", action="store_true", help="only score perfect decisions (no fills)")
    add("--fill", type=Path, default=None, help="a staged training part: score the fill of 0s")
    add(
        "--budgets",
        type=int,
        nargs="+",
        default=[],
        help="FOV evaluations per fill to measure at too",
    )
    defaults = AgglomerationConfig()
    for field in dataclasses.fields(AgglomerationConfig):
        add(f"--{field.name.replace('_', '-')}", type=field.type, default=getattr(defaults, field.name))  # fmt: skip
    return parser


def read_array(spec: str) -> np.ndarray:
    """A whole volume (`pipeline.data.volumes` spec) in memory."""
    with open_volume(spec) as array:
        return array[...]


def synthetic_first_pass(seed: int, workdir: Path) -> FirstPass:
    """The demo model's first pass on synthetic volume `seed`, from `workdir` if kept there."""
    raw, labels = generate(SyntheticConfig(seed=seed))
    path = workdir / f"first_pass_seed{seed}.npz"
    if not path.is_file():
        model = checkpoint_model_config(DEMO_CHECKPOINT)
        predict = predictor_from_checkpoint(DEMO_CHECKPOINT, model)
        segmentation, stats = segment(raw, predict, model, InferenceConfig(), progress=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, segmentation=segmentation, fov_evaluations=stats.fov_evaluations,
            seconds=stats.seconds,
        )  # fmt: skip
    with np.load(path) as kept:
        return FirstPass(
            raw, labels, kept["segmentation"], (slice(None),) * 3, DEMO_CHECKPOINT,
            InferenceConfig(), int(kept["fov_evaluations"]), float(kept["seconds"]),
        )  # fmt: skip


def staged_eval(run_dir: Path) -> StagedVolume:
    """A run's evaluated volume: its copy, or the record of it read in place."""
    copy = run_dir / "staged/eval.h5"
    return read_staged(copy if copy.is_file() else run_dir / "staged/eval.json")


def run_first_pass(run_dir: Path) -> FirstPass:
    """A finished workflow run's staged volume and stitched segmentation (whole staged region)."""
    staged = staged_eval(run_dir)
    if not staged.labels:
        sys.exit(f"{run_dir}: its evaluated volume has no labels; nothing to score")
    stitched = json.loads((run_dir / "inference/stitch.json").read_text())
    config = load_run_config(run_dir / "config.json")
    # What the run's own agglomeration started from (its consensus, or its first pass); without
    # agglomeration, what it exported.
    second = config.agglomeration
    start = "precomputed"
    if second.writes_layer:
        start = "agglomerate/consensus" if second.consensus else "agglomerate/first_pass"
    return FirstPass(
        read_array(staged.raw),
        read_array(staged.labels),
        read_array(segmentation_spec(run_dir / start)),
        staged.scored.slices if staged.scored else (slice(None),) * 3,
        chosen_checkpoint(run_dir / "selection.json"),
        config.inference,
        int(stitched["inference"]["fov_evaluations"]),
        None,
    )


def majority_truth(segmentation: np.ndarray, labels: np.ndarray) -> dict[int, int]:
    """Each segment's most overlapping ground-truth id (0 ignored)."""
    both = (segmentation > 0) & (labels > 0)
    keys, counts = np.unique(
        np.stack([segmentation[both], labels[both]], axis=1), axis=0, return_counts=True
    )
    order = np.lexsort((-counts, keys[:, 0]))
    segments, first = np.unique(keys[order, 0], return_index=True)
    return dict(zip(segments.tolist(), keys[order[first], 1].tolist(), strict=True))


def scores(segmentation: np.ndarray, first: FirstPass) -> dict:
    s = score_segmentation(segmentation[first.scored], first.labels[first.scored])
    return {
        "vi_split": s.vi_split,
        "vi_merge": s.vi_merge,
        "vi": s.vi,
        "adapted_rand_error": s.adapted_rand_error,
        "segments": s.segments,
    }


def agglomerated(segmentation: np.ndarray, merged: np.ndarray) -> np.ndarray:
    return relabel(segmentation.copy(), *merge_lookup(merged)) if len(merged) else segmentation


def fill_pairs(
    first: FirstPass, config: AgglomerationConfig, budgets: list[int]
) -> tuple[dict[int, list[PairDecision]], list[int], float]:
    """Every candidate pair's measures at each budget (ascending), its contact (voxel faces),
    and the seconds it took."""
    model = checkpoint_model_config(first.checkpoint)
    predict = predictor_from_checkpoint(first.checkpoint, model)
    started = time.perf_counter()
    table = candidate_pairs(
        first.segmentation, min_contact=config.min_contact, max_gap=config.max_gap
    )
    by_budget: dict[int, list[PairDecision]] = {b: [] for b in budgets}
    for ids, point in tqdm(zip(table.ids, table.points, strict=True), "pairs", len(table)):
        measures = pair_measures(
            lambda box: first.raw[box], lambda box: first.segmentation[box],
            first.segmentation.shape, (int(ids[0]), int(ids[1])), point, predict, model,
            first.inference, config, budgets,
        )  # fmt: skip
        for budget, decision in zip(budgets, measures, strict=True):
            by_budget[budget].append(decision)
    return by_budget, table.contacts.tolist(), time.perf_counter() - started


def sweep(
    first: FirstPass,
    by_budget: dict[int, list[PairDecision]],
    contacts: list[int],
    config: AgglomerationConfig,
) -> list[dict]:
    """Scores and cost over budgets, minimum contacts and thresholds, from the same fills."""
    rows = []
    min_contacts = [config.min_contact, *(c for c in SWEEP_MIN_CONTACT if c > config.min_contact)]
    grid = itertools.product(by_budget.items(), min_contacts, SWEEP_JACCARD, SWEEP_RECOVERED)
    for (budget, decisions), min_contact, jaccard, recovered in grid:
        tested = [d for d, c in zip(decisions, contacts, strict=True) if c >= min_contact]
        fovs = sum(d.fov_evaluations for d in tested)
        thresholds = dataclasses.replace(config, min_jaccard=jaccard, min_recovered=recovered)
        merged = merged_pairs(tested, thresholds)
        after = scores(agglomerated(first.segmentation, merged), first)
        rows.append({"budget": budget, "min_contact": min_contact, "pairs": len(tested),
                     "fov_evaluations": fovs, "min_jaccard": jaccard, "min_recovered": recovered,
                     "merged": len(merged)} | after)  # fmt: skip
        print(
            f"budget {budget:3d} min_contact {min_contact:3d}: {len(tested):4d} pairs, "
            f"{fovs / first.fov_evaluations:4.0%} of the first pass's FOVs; min_jaccard "
            f"{jaccard:.2f} min_recovered {recovered:.2f}: merged {len(merged):3d}  VI "
            f"{after['vi_split']:.3f} / {after['vi_merge']:.3f} / {after['vi']:.3f}  "
            f"ARE {after['adapted_rand_error']:.3f}"
        )
    return rows


def oracle(first: FirstPass, config: AgglomerationConfig) -> list[dict]:
    """Scores if every candidate pair were decided by the ground truth (merged when both
    segments' majority ids agree), at each minimum contact: agglomeration's ceiling."""
    truth = majority_truth(first.segmentation, first.labels)
    table = candidate_pairs(first.segmentation, min_contact=1, max_gap=config.max_gap)
    one_object = np.array([truth.get(int(a), -1) == truth.get(int(b), -2) for a, b in table.ids])
    rows = []
    for min_contact in ORACLE_MIN_CONTACT:
        tested = table.contacts >= min_contact
        merged = table.ids[tested & one_object]
        after = scores(agglomerated(first.segmentation, merged), first)
        rows.append({"min_contact": min_contact, "pairs": int(tested.sum()),
                     "merged": len(merged)} | after)  # fmt: skip
        print(
            f"oracle min_contact {min_contact:4d}: {int(tested.sum()):5d} pairs, {len(merged):4d} "
            f"one object  VI {after['vi_split']:.3f} / {after['vi_merge']:.3f} / {after['vi']:.3f}"
            f"  ARE {after['adapted_rand_error']:.3f}"
        )
    return rows


def fill(first: FirstPass, train_volume: Path, config: AgglomerationConfig) -> dict:
    """Scores of the first pass with its unsegmented voxels filled over a boundary map learned
    on `train_volume`, and of perfect decisions on the filled segmentation's pairs."""
    train = read_staged(train_volume)
    started = time.perf_counter()
    boundary = learned_boundary_map((read_array(train.raw), read_array(train.labels)), first.raw)
    learned = time.perf_counter()
    filled = fill_unsegmented(first.segmentation, boundary)
    seconds = {"boundary_map": learned - started, "fill": time.perf_counter() - learned}
    scored = first.labels[first.scored] > 0
    unsegmented = float(np.mean(first.segmentation[first.scored][scored] == 0))
    result = {"unsegmented": unsegmented, "seconds": seconds, "before": scores(first.segmentation, first),
              "filled": scores(filled, first)}  # fmt: skip
    for name in ("before", "filled"):
        s = result[name]
        print(f"{name:7s} VI {s['vi_split']:.3f} / {s['vi_merge']:.3f} / {s['vi']:.3f}  ARE "
              f"{s['adapted_rand_error']:.3f}  segments {s['segments']}")  # fmt: skip
    print(f"unsegmented (labelled voxels of the scored part): {unsegmented:.1%}; {seconds}")
    result["dropped_then_filled"] = []
    sizes = segment_sizes(first.segmentation)
    for min_size in FILL_MIN_SIZES:
        small = small_objects(sizes, (np.zeros(0, np.uint64),) * 2, min_size)
        kept = fastremap.mask(first.segmentation, small)
        s = scores(fill_unsegmented(kept, boundary), first)
        result["dropped_then_filled"].append({"fill_min_size": min_size, "dropped": len(small)} | s)
        print(f"objects under {min_size:4d} voxels dropped ({len(small):3d}), then filled: VI "
              f"{s['vi_split']:.3f} / {s['vi_merge']:.3f} / {s['vi']:.3f}  ARE "
              f"{s['adapted_rand_error']:.3f}  segments {s['segments']}")  # fmt: skip
    result["oracle_filled"] = oracle(dataclasses.replace(first, segmentation=filled), config)
    return result


def _decisions(records: list[dict]) -> list[PairDecision]:
    fields = {f.name for f in dataclasses.fields(PairDecision)}
    return [PairDecision(**{k: v for k, v in d.items() if k in fields}) for d in records]


def main() -> None:
    args = _parser().parse_args()
    config = AgglomerationConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(AgglomerationConfig)}
    )
    if args.run_dir:
        first = run_first_pass(args.run_dir)
    else:
        first = synthetic_first_pass(args.synthetic_seed, args.workdir)
    if args.fill:
        result = {"source": str(args.run_dir or f"synthetic seed {args.synthetic_seed}"),
                  "cpu": cpu_name(), "fill": fill(first, args.fill, config)}  # fmt: skip
        if args.output is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=1))
        return
    if args.oracle:
        print("before", scores(first.segmentation, first))
        rows = oracle(first, config)
        if args.output is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            source = str(args.run_dir or f"synthetic seed {args.synthetic_seed}")
            args.output.write_text(json.dumps({"source": source, "oracle": rows}))
        return
    budget = config.max_fov_evaluations_per_fill
    if args.decisions:
        kept = json.loads(args.decisions.read_text())
        by_budget = {int(b): _decisions(d) for b, d in kept["by_budget"].items()}
        contacts, seconds = kept["contacts"], kept["agglomeration"]["seconds"]
    else:
        budgets = sorted({*args.budgets, budget})
        by_budget, contacts, seconds = fill_pairs(first, config, budgets)
    decisions = by_budget[budget]
    merged = merged_pairs(decisions, config)
    truth = majority_truth(first.segmentation, first.labels)
    same = [truth.get(d.a, -1) == truth.get(d.b, -2) for d in decisions]
    merged_set = {tuple(p) for p in merged.tolist()}
    result = {
        "source": str(args.run_dir or f"synthetic seed {args.synthetic_seed}"),
        "cpu": cpu_name(),
        "config": dataclasses.asdict(config),
        "first_pass": {"fov_evaluations": first.fov_evaluations, "seconds": first.seconds},
        "agglomeration": {
            "pairs": len(decisions),
            "pairs_one_object": int(sum(same)),
            "merged": int(len(merged)),
            "merged_one_object": int(
                sum(s for s, d in zip(same, decisions, strict=True) if (d.a, d.b) in merged_set)
            ),  # fmt: skip
            "unseeded": int(sum(not d.seeded for d in decisions)),
            "fov_evaluations": int(sum(d.fov_evaluations for d in decisions)),
            "seconds": seconds,
        },
        "before": scores(first.segmentation, first),
        "after": scores(agglomerated(first.segmentation, merged), first),
        "decisions": [
            dataclasses.asdict(d) | {"one_object": s} for d, s in zip(decisions, same, strict=True)
        ],  # fmt: skip
        "by_budget": {b: [dataclasses.asdict(d) for d in ds] for b, ds in by_budget.items()},
        "contacts": contacts,
    }
    for stage in ("before", "after"):
        s = result[stage]
        print(
            f"{stage:6s} VI split {s['vi_split']:.3f}  merge {s['vi_merge']:.3f}  total {s['vi']:.3f}"
            f"  ARE {s['adapted_rand_error']:.3f}  segments {s['segments']}"
        )
    a = result["agglomeration"]
    print(
        f"pairs {a['pairs']} (one object: {a['pairs_one_object']}), merged {a['merged']} "
        f"(one object: {a['merged_one_object']}), unseeded {a['unseeded']}"
    )
    print(
        f"FOV evaluations: first pass {first.fov_evaluations}, agglomeration "
        f"{a['fov_evaluations']} in {seconds:.0f} s; CPU: {result['cpu']}"
    )
    if args.sweep:
        result["sweep"] = sweep(first, by_budget, contacts, config)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
