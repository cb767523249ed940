"""Real EM: every method on the same evaluated part of the FlyEM medulla file, in one table.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/segment_real.py [--no-runs]

Runs (or, finished, reuses: a finished run's resume takes seconds) the workflow runs
  configs/flyem.toml            FFN trained here from scratch (train / select / eval parts of one file)
  configs/flyem_fib25.toml      the FFN authors' FIB-25 weights, inference only
  configs/flyem_fib25_bf16.toml the same in bfloat16 (fast on CPUs with AMX)
  configs/flyem_finetune.toml   the FIB-25 weights fine-tuned on the training part
then the baselines on the staged parts of the first run:
  * a seeded watershed over a random-forest boundary map (pipeline.boundary_watershed) learned
    on the training part, its parameters tuned by VI on the selection part;
  * the workflow's own watershed (distance transform of FFN's edge map, defaults untuned), as the
    evaluation stage scores it;
and the authors' reference segmentation (../shared/data/flyem_medulla_google_ffn_fib25.h5),
cut to the same part. All are scored on the evaluated part only (its context excluded); besides
the scores, each segmentation's unsegmented share within 16 voxels of the file's own faces (where
FFN as published seeds nothing) and how it differs from the authors' segmentation (VI with theirs
as the truth: split = ours cut their objects, merge = ours joined them).
Prints a Markdown table and writes everything to --output (JSON).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.atomic import atomic_path  # noqa: E402
from pipeline.boundary_watershed import learned_watershed  # noqa: E402
from pipeline.export import segmentation_spec  # noqa: E402
from pipeline.metrics import score_segmentation  # noqa: E402
from pipeline.report import stage_wall_times  # noqa: E402
from pipeline.roi import Roi  # noqa: E402
from pipeline.run_config import load_run_config  # noqa: E402
from pipeline.staging import read_staged  # noqa: E402
from pipeline.volumes import open_volume  # noqa: E402

CONFIGS = {
    "FFN trained here": "configs/flyem.toml",
    "FIB-25 weights": "configs/flyem_fib25.toml",
    "FIB-25 weights, bf16": "configs/flyem_fib25_bf16.toml",
    "FIB-25 fine-tuned": "configs/flyem_finetune.toml",
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


def _ffn_row(run_dir: Path) -> dict:
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    stitched = json.loads((run_dir / "inference" / "stitch.json").read_text())
    times = stage_wall_times(run_dir / "monitoring.db")
    part = read_staged(run_dir / "staged" / "eval.h5").scored.slices
    return {
        "segmentation": _read_spec(segmentation_spec(run_dir / "precomputed"))[part],
        "scores": evaluation["ffn"],
        "fov_evaluations": stitched["inference"]["fov_evaluations"],
        "train_s": times.get("train"),
        "select_s": times.get("select"),
        "infer_s": times.get("infer"),
    }


def _read(path: Path, name: str) -> np.ndarray:
    return _read_spec(f"{path}:{name}")


def _read_spec(spec: str) -> np.ndarray:
    with open_volume(spec) as array:
        return array[...]


def _forest_watershed(staged: Path) -> dict:
    """Learn on the training part, tune on the selection part, segment the evaluated part."""
    result = learned_watershed(
        (_read(staged / "train.h5", "raw"), _read(staged / "train.h5", "labels")),
        (_read(staged / "select.h5", "raw"), _read(staged / "select.h5", "labels")),
        _read(staged / "eval.h5", "raw"),
    )
    part = read_staged(staged / "eval.h5").scored.slices
    truth = _read(staged / "eval.h5", "labels")[part]
    segmentation = result.segmentation[part]
    return {
        "segmentation": segmentation,
        "scores": score_segmentation(segmentation, truth).to_dict(),
        "params": result.params.__dict__,
        "tuning_trials": result.trials,
        "train_s": result.seconds["train"],
        "select_s": result.seconds["tune"],
        "infer_s": result.seconds["segment"],
    }


def _reference(eval_roi: str, staged_eval: Path) -> dict:
    path, dataset = str(REFERENCE).rsplit(":", 1)
    roi = Roi.parse(eval_roi)
    with h5py.File(path, "r") as f:
        reference = f[dataset][roi.slices]
    part = read_staged(staged_eval).scored.slices
    truth = _read(staged_eval, "labels")[part]
    reference = reference.astype(np.uint64)
    return {"segmentation": reference, "scores": score_segmentation(reference, truth).to_dict()}


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


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| method | VI split / merge / total | adapted Rand error | unsegmented | segments "
        "| unsegmented within 16 of the file's faces | against the authors' (VI split / merge) "
        "| FOV evaluations | training | selection / tuning | inference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {_seconds(row.get('infer_s'))} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = _parser().parse_args()
    os.chdir(ROOT)
    if not args.no_runs:
        for config in CONFIGS.values():
            _run_workflow(config)
    rows = {}
    for name, config in CONFIGS.items():
        run_dir = args.runs_dir / load_run_config(config).name
        if (run_dir / "evaluation.json").is_file():
            rows[name] = _ffn_row(run_dir)
        else:
            print(f"{name}: no finished run in {run_dir}, left out", file=sys.stderr)
    scratch = load_run_config(CONFIGS["FFN trained here"])
    staged = args.runs_dir / scratch.name / "staged"
    rows["watershed on a random-forest boundary map (tuned on the selection part)"] = (
        _forest_watershed(staged)
    )
    evaluated = args.runs_dir / scratch.name / "evaluation.json"
    if evaluated.is_file():
        evaluation = json.loads(evaluated.read_text())
        rows["watershed on the image's edge distance (workflow's, untuned)"] = {
            "scores": evaluation["watershed"],
            "infer_s": evaluation["watershed_seconds"],
        }
    else:
        print(f"the workflow's watershed: no {evaluated}, left out", file=sys.stderr)
    rows[REFERENCE_ROW] = _reference(scratch.data.eval_roi, staged / "eval.h5")
    roi = Roi.parse(scratch.data.eval_roi)
    truth = _read(staged / "eval.h5", "labels")[read_staged(staged / "eval.h5").scored.slices]
    with h5py.File(str(REFERENCE).rsplit(":", 1)[0], "r") as f:
        file_shape = f["segmentation"].shape
    _compare(rows, truth, _face_shell(roi, file_shape))
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "eval_roi": scratch.data.eval_roi,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.output) as tmp:
        tmp.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(table(rows))
    print(f"\n{result['machine']}; all times wall-clock on it; written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
