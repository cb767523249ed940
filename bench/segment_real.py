"""Real EM: every method on the same evaluated part of the FlyEM medulla file, in one table.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/segment_real.py [--no-runs] [--whole [CONFIG] | --part CONFIG]

Runs (or, finished, reuses: a finished run's resume takes seconds) the workflow runs
  configs/flyem.toml            FFN trained here from scratch (train / select / eval parts of one file)
  configs/flyem_fib25.toml      the FFN authors' FIB-25 weights, inference only
  configs/flyem_fib25_bf16.toml the same in bfloat16 (fast on CPUs with AMX)
  configs/flyem_finetune.toml   the FIB-25 weights fine-tuned on the training part
Each run gives a row per segmentation it scores: with FFN's second pass on (`[agglomeration]`),
its first pass and the pass's result (with `fill_unsegmented`, also the merges alone, before
the fill). For the bf16 run, a copy of it is resumed with consensus
on too (its first pass reused): rows for FFN + consensus and + consensus + agglomeration.
Then the baselines:
  * a seeded watershed over a random-forest boundary map (pipeline.evaluation.learned_watershed) learned
    on the training part, its parameters tuned by VI on the selection part: the one the runs'
    own evaluation made (`baseline/learned_watershed.h5`);
  * the workflow's own watershed (distance transform of FFN's edge map, defaults untuned), as the
    evaluation stage of configs/flyem.toml's run scored it;
and the authors' reference segmentation (../shared/data/flyem_medulla_google_ffn_fib25.h5),
cut to the same part. All are scored on the evaluated part only (its context excluded); besides
the scores, each segmentation's unsegmented share within 16 voxels of the file's own faces (where
FFN as published seeds nothing) and how it differs from the authors' segmentation (VI with theirs
as the truth: split = ours cut their objects, merge = ours joined them).

--whole scores all 125 sections instead: configs/flyem_fib25_bf16_whole.toml's run (or the
CONFIG given, e.g. configs/flyem_fib25_whole.toml in fp32; first pass and second pass), the
learned watershed (the forest the config's fill floods, learned on the training part of the run
that saved it, tuned on that run's selection part: it has seen the labels of most of these
voxels, flattered) and the authors' segmentation.
--part CONFIG scores one run's part alone (e.g. configs/flyem_fib25_unseen.toml): its rows, the
learned watershed its evaluation made, the authors' segmentation.
Prints a Markdown table and writes everything to --output (JSON).
"""

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from agglomerate import read_array, staged_eval  # bench/agglomerate.py
from machine import write_result  # bench/machine.py

from pipeline.core.config_io import save_json
from pipeline.core.roi import Roi
from pipeline.core.stamps import read_stamp
from pipeline.evaluation.evaluate import load_boundary_forest
from pipeline.evaluation.learned_watershed import learned_watershed
from pipeline.evaluation.scores import score_segmentation
from pipeline.export.layers import segmentation_spec
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.run.run_report import stage_wall_times
from pipeline.secondpass.agglomeration import relabel

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "FFN trained here": "configs/flyem.toml",
    "FIB-25 weights": "configs/flyem_fib25.toml",
    "FIB-25 weights, bf16": "configs/flyem_fib25_bf16.toml",
    "FIB-25 fine-tuned": "configs/flyem_finetune.toml",
}
# Runs copied and resumed with consensus on as well (their first pass reused).
WITH_CONSENSUS = ("FIB-25 weights, bf16",)
WHOLE = "configs/flyem_fib25_bf16_whole.toml"
# evaluation.json's keys for the steps before a second pass's result: their rows' suffixes and
# the folders (under the run dir) of the segmentations they score.
STEPS_BEFORE = {
    "ffn_first_pass": (", first pass", "agglomerate/first_pass"),
    "ffn_consensus": (" + consensus", "agglomerate/consensus"),
}
# The converted FIB-25 weights the configs name (absolute, as a loaded config names them), and
# the precision each was converted with.
MODELS = {
    str(ROOT / "data/models/fib25"): "float32",
    str(ROOT / "data/models/fib25-bf16"): "mixed_bfloat16",
}
FIB25_CHECKPOINT = ROOT.parent / "shared/models/google-ffn-fib25/model.ckpt-27465036"
REFERENCE = ROOT.parent / "shared/data/flyem_medulla_google_ffn_fib25.h5:segmentation"
REFERENCE_ROW = "authors' FIB-25 segmentation (reference, made on the whole file)"
FACE_SHELL = 16  # voxels: half the FIB-25 FOV, where FFN as published cannot centre a FOV


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--no-runs", action="store_true", help="only read finished runs, start none")
    one_run = parser.add_mutually_exclusive_group()
    one_run.add_argument(
        "--whole",
        nargs="?",
        const=WHOLE,
        metavar="CONFIG",
        help=f"score all 125 sections: CONFIG's run (default {WHOLE})",
    )
    one_run.add_argument("--part", metavar="CONFIG", help="score one run's part alone")
    add("--runs-dir", type=Path, default=ROOT / "data" / "runs")
    add("--output", type=Path, default=ROOT / "data" / "bench" / "segment_real.json")
    return parser


def _run_workflow(config: str) -> None:
    settings = load_run_config(config)
    model = settings.pretrained_model or settings.train_init_from
    if model in MODELS and not (ROOT / model / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "pipeline.cli.pretrained", "--checkpoint", str(FIB25_CHECKPOINT),
             "--out", model, "--precision", MODELS[model]],
            cwd=ROOT, check=True,
        )  # fmt: skip
    subprocess.run(
        [sys.executable, "workflow.py", "--site", "local", "--config", config], cwd=ROOT, check=True
    )


def _run_with_consensus(run_dir: Path) -> Path:
    """A copy of a finished run resumed with consensus on: only the second inference pass and
    the steps after it run."""
    copy = run_dir.with_name(run_dir.name + "-consensus")
    if not copy.exists():
        shutil.copytree(run_dir, copy, symlinks=True)
    settings = load_run_config(run_dir / "config.json")
    second = dataclasses.replace(settings.agglomeration, consensus=True)
    config = save_json(
        copy.with_suffix(".json"), dataclasses.replace(settings, agglomeration=second)
    )
    subprocess.run(
        [sys.executable, "workflow.py", "--run-dir", str(copy), "--config", str(config), "--resume"],
        cwd=ROOT, check=True,
    )  # fmt: skip
    return copy


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ffn_rows(name: str, run_dir: Path) -> dict[str, dict]:
    """A finished run's rows: what it exported, and with FFN's second pass on, each step before."""
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    second = load_run_config(run_dir / "config.json").agglomeration
    times = stage_wall_times(run_dir / "monitoring.db")
    part, truth = _staged(run_dir)
    first_pass = {
        "fov_evaluations": _read_json(run_dir / "inference/stitch.json")["inference"]["fov_evaluations"],
        "train_s": times.get("train"),
        "select_s": times.get("select"),
        "infer_s": times.get("infer"),
    }  # fmt: skip
    cost = _second_pass(run_dir, times)
    before = {  # what each step before the last cost
        "ffn_first_pass": {},
        "ffn_consensus": {k: v for k, v in cost.items() if k.startswith("consensus")},
    }
    rows = {}
    for key, (suffix, folder) in STEPS_BEFORE.items():
        if key in evaluation:
            rows[name + suffix] = (
                first_pass
                | before[key]
                | {
                    "segmentation": read_array(segmentation_spec(run_dir / folder))[part],
                    "scores": evaluation[key],
                }
            )
    steps = [(" + consensus", second.consensus), (" + agglomeration", second.enabled)]
    merged = name + "".join(label for label, on in steps if on)
    if second.fill_unsegmented and second.enabled:  # the merges alone: the first pass relabelled
        start = "agglomerate/consensus" if second.consensus else "agglomerate/first_pass"
        with np.load(run_dir / "agglomerate/merges.npz") as merges:
            ids, targets = merges["ids"], merges["targets"]
        unfilled = relabel(read_array(segmentation_spec(run_dir / start))[part], ids, targets)
        rows[merged] = first_pass | cost | _scored(unfilled, truth)
    merged += " + fill" if second.fill_unsegmented else ""
    rows[merged] = (
        first_pass
        | cost
        | {
            "segmentation": read_array(segmentation_spec(RunPaths(run_dir).objects))[part],
            "scores": evaluation["ffn"],
        }
    )
    return rows


def _second_pass(run_dir: Path, times: dict[str, float]) -> dict:
    """What FFN's second pass cost: a consensus's second inference pass, agglomeration's pairs."""
    cost = {}
    again = _read_json(run_dir / "inference/second/stitch.json")
    if again:  # the copy's resume ran only the second inference pass
        cost["consensus_fov_evaluations"] = again["inference"]["fov_evaluations"]
        cost["consensus_s"] = (times.get("infer") or 0) + (times.get("consensus") or 0)
    agglomerated = _read_json(run_dir / "agglomerate/agglomerate.json")
    if agglomerated:
        cost |= {
            "pairs": agglomerated["pairs"],
            "merged_pairs": agglomerated["merged_pairs"],
            "agglomeration_fov_evaluations": agglomerated["fov_evaluations"],
            "agglomeration_s": times.get("agglomerate"),
        }
    return cost


def _read(path: Path, name: str) -> np.ndarray:
    return read_array(f"{path}:{name}")


def _staged(run_dir: Path) -> tuple[tuple[slice, ...], np.ndarray]:
    """A run's scored part (slices of its staged volume) and the ground truth there."""
    staged = staged_eval(run_dir)
    part = staged.scored.slices if staged.scored else (slice(None),) * 3
    return part, read_array(staged.labels)[part]


def _scored(segmentation: np.ndarray, truth: np.ndarray) -> dict:
    return {
        "segmentation": segmentation,
        "scores": score_segmentation(segmentation, truth).to_dict(),
    }


def _watershed_row(
    run_dir: Path, segmentation: np.ndarray, params: dict, trials: int, seconds: dict
) -> dict:
    """A learned watershed's row: its scores on the run's scored part, how it was tuned and
    what each step took (`seconds`: train, tune, segment)."""
    part, truth = _staged(run_dir)
    return _scored(segmentation[part], truth) | {
        "params": params,
        "tuning_trials": trials,
        "train_s": seconds["train"],
        "select_s": seconds["tune"],
        "infer_s": seconds["segment"],
    }


def _runs_watershed(run_dir: Path) -> dict:
    """The learned watershed a run's evaluation made (learned on the training part, tuned on the
    selection part, segmenting the staged evaluated volume), cut to the scored part."""
    record = json.loads((run_dir / "baseline/learned_watershed.json").read_text())
    forest = read_stamp(run_dir / "baseline/boundary_forest.joblib")  # a task of its own
    return _watershed_row(
        run_dir,
        _read(run_dir / "baseline/learned_watershed.h5", "segmentation"),
        record["params"],
        len(record["tuning_trials"]),
        record["seconds"] | {"train": forest["measured"]["seconds"]},
    )


def _forest_watershed(forest_path: Path, run_dir: Path) -> dict:
    """The watershed of the forest at `forest_path` (the one the run's fill flooded, learned on
    the training part of the run that saved it), tuned on that run's staged selection part,
    segmenting this run's staged volume."""
    selection = forest_path.parents[1] / "staged" / "select.h5"
    result = learned_watershed(
        load_boundary_forest(forest_path),
        (_read(selection, "raw"), _read(selection, "labels")),
        read_array(staged_eval(run_dir).raw),
    )
    # The forest's learning time is the saving run's.
    train_s = read_stamp(forest_path)["measured"]["seconds"]
    return _watershed_row(
        run_dir,
        result.segmentation,
        result.params.__dict__,
        len(result.trials),
        result.seconds | {"train": train_s},
    )


def _reference(eval_roi: str | None, run_dir: Path) -> dict:
    path, dataset = str(REFERENCE).rsplit(":", 1)
    with h5py.File(path, "r") as f:
        reference = f[dataset][Roi.parse(eval_roi).slices if eval_roi else ()]
    _, truth = _staged(run_dir)
    return _scored(reference.astype(np.uint64), truth)


def _face_shell(roi: Roi, file_shape: tuple[int, ...], width: int = FACE_SHELL) -> np.ndarray:
    """True on the voxels of `roi` within `width` of the file's own faces."""
    near = np.zeros(roi.shape, bool)
    for axis, (start, stop, size) in enumerate(zip(roi.start, roi.stop, file_shape, strict=True)):
        coordinate = np.arange(start, stop)
        close = np.minimum(coordinate, size - 1 - coordinate) < width
        near |= close.reshape([-1 if a == axis else 1 for a in range(3)])
    return near


def _compare(rows: dict[str, dict], truth: np.ndarray, shell: np.ndarray) -> None:
    """Add to each row its unsegmented share in the face shell and, against the authors'
    segmentation, how the two differ object by object; drop the arrays."""
    reference = rows[REFERENCE_ROW]["segmentation"]
    labeled = truth > 0
    for row in rows.values():
        segmentation = row.pop("segmentation", None)
        if segmentation is None:
            continue
        row["shell_unsegmented_fraction"] = float(
            (segmentation[shell & labeled] == 0).mean() if (shell & labeled).any() else 0.0
        )
        versus = score_segmentation(segmentation, reference)  # the reference as the truth
        row["versus_reference"] = {
            k: versus.to_dict()[k]
            for k in ("vi_split", "vi_merge", "vi", "split_objects", "merged_segments")
        }


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value / 60:.1f} min"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _versus(value: dict | None) -> str:
    return "–" if value is None else f"{value['vi_split']:.2f} / {value['vi_merge']:.2f}"


def _second_pass_cell(row: dict) -> str:
    cells = []
    if "consensus_fov_evaluations" in row:
        cells.append(
            f"consensus: {row['consensus_fov_evaluations']:,} FOVs, {_seconds(row['consensus_s'])}"
        )
    if "pairs" in row:
        cells.append(
            f"agglomeration: {row['pairs']} pairs, {row['merged_pairs']} merged, "
            f"{row['agglomeration_fov_evaluations']:,} FOVs, {_seconds(row['agglomeration_s'])}"
        )
    return "; ".join(cells) or "–"


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| method | VI split / merge / total | adapted Rand error | unsegmented | segments "
        "| unsegmented within 16 of the file's faces | against the authors' (VI split / merge) "
        "| FOV evaluations | training | selection / tuning | inference | second pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        s = row["scores"]
        fovs = row.get("fov_evaluations")
        lines.append(
            f"| {name} | {s['vi_split']:.2f} / {s['vi_merge']:.2f} / **{s['vi']:.2f}** "
            f"| {s['adapted_rand_error']:.3f} | {100 * s['unsegmented_fraction']:.1f} % "
            f"| {s['segments']} | {_share(row.get('shell_unsegmented_fraction'))} "
            f"| {_versus(row.get('versus_reference'))} | {'–' if fovs is None else f'{fovs:,}'} "
            f"| {_seconds(row.get('train_s'))} | {_seconds(row.get('select_s'))} "
            f"| {_seconds(row.get('infer_s'))} | {_second_pass_cell(row)} |"
        )
    return "\n".join(lines)


LEARNED_ROW = "watershed on a random-forest boundary map (tuned on the selection part)"


def _part_rows(args: argparse.Namespace) -> tuple[dict[str, dict], Path]:
    """Every finished run's rows on the evaluated part, then the baselines'; and a run dir whose
    staged volume is that part."""
    if not args.no_runs:
        for config in CONFIGS.values():
            _run_workflow(config)
    rows, runs = {}, {}
    for name, config in CONFIGS.items():
        run_dir = args.runs_dir / load_run_config(config).name
        if not (run_dir / "evaluation.json").is_file():
            print(f"{name}: no finished run in {run_dir}, left out", file=sys.stderr)
            continue
        runs[name] = run_dir
        rows |= _ffn_rows(name, run_dir)
        if name in WITH_CONSENSUS:
            copy = run_dir.with_name(run_dir.name + "-consensus")
            if not args.no_runs:
                _run_with_consensus(run_dir)
            # Scored with consensus (not the copied run's own evaluation): its first pass's
            # times are the run's.
            if "ffn_consensus" in _read_json(copy / "evaluation.json"):
                base = rows.get(f"{name}, first pass") or rows[name]
                first = {k: base[k] for k in ("train_s", "select_s", "infer_s")}
                rows |= {k: v | first for k, v in _ffn_rows(name, copy).items() if k not in rows}
    if not runs:
        sys.exit(f"no finished run in {args.runs_dir}")
    learned = [r for r in runs.values() if (r / "baseline/learned_watershed.h5").is_file()]
    if learned:
        rows[LEARNED_ROW] = _runs_watershed(learned[0])
    scratch = runs.get("FFN trained here")
    if scratch is not None:
        evaluation = json.loads((scratch / "evaluation.json").read_text())
        rows["watershed on the image's edge distance (workflow's, untuned)"] = {
            "scores": evaluation["watershed"],
            "infer_s": evaluation["watershed_seconds"],
        }
    return rows, next(iter(runs.values()))


def _one_run(args: argparse.Namespace, config: str) -> tuple[str, Path]:
    """The row name and the finished run of `config` (run first unless --no-runs)."""
    if not args.no_runs:
        _run_workflow(config)
    settings = load_run_config(config)
    precision = "bf16" if MODELS.get(settings.pretrained_model) == "mixed_bfloat16" else "fp32"
    return f"FIB-25 weights, {precision}, {settings.name}", args.runs_dir / settings.name


def _whole_rows(args: argparse.Namespace) -> tuple[dict[str, dict], Path]:
    """The whole-file run's rows, and the learned watershed on the same voxels (learned and
    tuned on the parts that the run whose forest the config takes staged)."""
    name, run_dir = _one_run(args, args.whole)
    rows = _ffn_rows(name, run_dir)
    forest = Path(load_run_config(args.whole).boundary_forest)
    rows[LEARNED_ROW + ", both parts inside this cube"] = _forest_watershed(forest, run_dir)
    return rows, run_dir


def _one_part_rows(args: argparse.Namespace) -> tuple[dict[str, dict], Path]:
    """One run's rows on its part, and the learned watershed its evaluation made there."""
    name, run_dir = _one_run(args, args.part)
    return _ffn_rows(name, run_dir) | {LEARNED_ROW: _runs_watershed(run_dir)}, run_dir


def main() -> int:
    args = _parser().parse_args()
    os.chdir(ROOT)
    rows, scored_run = (_whole_rows if args.whole else _one_part_rows if args.part else _part_rows)(
        args
    )
    eval_roi = load_run_config(scored_run / "config.json").data.eval_roi
    rows[REFERENCE_ROW] = _reference(eval_roi, scored_run)
    with h5py.File(str(REFERENCE).rsplit(":", 1)[0], "r") as f:
        file_shape = f["segmentation"].shape
    roi = Roi.parse(eval_roi) if eval_roi else Roi((0, 0, 0), file_shape)
    _compare(rows, _staged(scored_run)[1], _face_shell(roi, file_shape))
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "eval_roi": eval_roi,
        "rows": rows,
    }
    one_run = args.whole or args.part
    output = (
        args.output.with_stem(f"{args.output.stem}_{scored_run.name}") if one_run else args.output
    )
    print(table(rows))
    print(
        f"\n{result['machine']}; all times wall-clock on it; written to {write_result(output, result)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
