"""The FFN workflow: EM volume to a segmentation browsable in Neuroglancer, as one Parsl DAG.

    python workflow.py --site local                      # this machine, the synthetic demo
    python workflow.py --site theta --config run.toml    # the same DAG on an HPC site
    python workflow.py --site local --resume             # skip what a previous run finished
    python workflow.py --site theta --dry-run            # print the DAG and the site, submit nothing
    python workflow.py view --run-dir data/runs/demo     # open the result in Neuroglancer

stage_volume(train), stage_volume(eval) -> preprocess -> train (MPI, N ranks) -> select_checkpoint
-> infer_block x B (parallel) -> stitch -> evaluate, export -> report.md
"""

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parsl.data_provider.files import File

import pipeline  # noqa: F401  (oneDNN on before TensorFlow loads)
from pipeline import config as config_io
from pipeline.blocks import block_path, plan_blocks
from pipeline.errors import FFNError
from pipeline.run_config import RunConfig, load_run_config

ROOT = Path(__file__).resolve().parent
STAGES = ("stage", "preprocess", "train", "select", "infer", "stitch", "evaluate", "export")


@dataclass(frozen=True)
class RunPaths:
    """Where every stage's outputs live in a run directory."""

    root: Path

    def __getattr__(self, name: str) -> Path:
        return self.root / _LAYOUT[name]


_LAYOUT = {
    "train_volume": "staged/train.h5",
    "eval_volume": "staged/eval.h5",
    "partitions": "preprocess/partitions.h5",
    "coordinates": "preprocess/coordinates.npz",
    "train_dir": "train",
    "train_summary": "train/train_summary.json",
    "train_log": "train/train.log",
    "selection": "selection.json",
    "blocks_dir": "inference/blocks",
    "segmentation": "inference/segmentation.h5",
    "stitch_summary": "inference/stitch.json",
    "evaluation": "evaluation.json",
    "precomputed": "precomputed",
    "report": "report.md",
    "config": "config.json",
}


def _eval_shape(config: RunConfig) -> tuple[int, int, int]:
    if config.data.synthetic:
        from pipeline.synthetic import PRESETS

        return (
            PRESETS[config.data.synthetic_preset]
            .with_geometry(config.data.synthetic_shape_zyx)
            .shape_zyx
        )
    from pipeline.volumes import volume_shape

    return volume_shape(config.data.eval_raw)


def training_command(config: RunConfig, paths: RunPaths, launch) -> str:
    train_config = paths.train_dir / "requested_config.json"
    program = [
        sys.executable, "-m", "pipeline.train",
        "--raw", f"{paths.train_volume}:raw", "--labels", f"{paths.train_volume}:labels",
        "--coordinates", str(paths.coordinates), "--train-dir", str(paths.train_dir),
        "--config", str(train_config), "--intra-op-threads", str(launch.threads_per_rank),
    ]  # fmt: skip
    if config.train_init_from:
        program += ["--init-from", str(Path(config.train_init_from).resolve())]
    return launch.command(shlex.join(program))


# What a stage leaves behind, and which stages' outputs it reads: --stages checks these first.
_STAGE_OUTPUTS = {
    "stage": [_LAYOUT["train_volume"], _LAYOUT["eval_volume"]],
    "preprocess": [_LAYOUT["coordinates"]],
    "train": [_LAYOUT["train_summary"]],
    "select": [_LAYOUT["selection"]],
    "infer": [_LAYOUT["blocks_dir"]],
    "stitch": [_LAYOUT["segmentation"]],
}
_STAGE_INPUTS = {
    "preprocess": ["stage"],
    "train": ["stage", "preprocess"],
    "select": ["stage", "train"],
    "infer": ["stage", "select"],
    "stitch": ["stage", "infer"],
    "evaluate": ["stage", "stitch"],
    "export": ["stage", "stitch"],
}


def check_stage_inputs(stages: frozenset[str], root: Path) -> None:
    """Every stage left out by --stages whose outputs a selected stage reads must have left them."""
    for stage in [s for s in STAGES if s in stages]:
        for needed in [n for n in _STAGE_INPUTS.get(stage, []) if n not in stages]:
            missing = [p for p in _STAGE_OUTPUTS[needed] if not (root / p).exists()]
            if missing:
                raise FFNError(
                    f"--stages leaves out {needed!r}, but {stage!r} needs its output {root / missing[0]}; run it too"
                )


class _FromEarlierRun:
    """Stands in for a stage left out by --stages (check_stage_inputs made sure its outputs exist)."""

    def __init__(self, outputs: list):
        self.outputs = outputs


class _Submitter:
    """Submits a stage's app, or stands in for it when --stages leaves it out."""

    def __init__(self, selected: frozenset[str]):
        self.selected = selected
        self.futures: dict[str, list] = {}

    def __call__(self, stage: str, app, *args, outputs: list, **kwargs):
        if stage not in self.selected:
            return _FromEarlierRun(outputs)
        future = app(*args, outputs=outputs, **kwargs)
        self.futures.setdefault(stage, []).append(future)
        return future


def _submit_training(config: RunConfig, paths: RunPaths, site, submit: _Submitter, eval_volume):
    """Stage the training volume, preprocess, train, select; returns the selection's future."""
    from apps.preprocess import preprocess
    from apps.select import select_checkpoint
    from apps.stage import stage_volume
    from apps.train import train

    data = config_io.to_dict(config.data)
    train_volume = submit(
        "stage", stage_volume, data, "train", outputs=[File(str(paths.train_volume))]
    )
    coords = submit(
        "preprocess", preprocess, config_io.to_dict(config.partitions_for_training()),
        inputs=[train_volume.outputs[0]], outputs=[File(str(paths.partitions)), File(str(paths.coordinates))],
    )  # fmt: skip
    launch = site.SITE.mpi_launch(config.train_nodes)
    paths.train_dir.mkdir(parents=True, exist_ok=True)
    config_io.save_json(paths.train_dir / "requested_config.json", config.train)
    trained = submit(
        "train", train, training_command(config, paths, launch),
        inputs=[train_volume.outputs[0], coords.outputs[1]], outputs=[File(str(paths.train_summary))],
        stdout=str(paths.train_log), stderr=str(paths.train_log),
        parsl_resource_specification=launch.resource_specification,
    )  # fmt: skip
    scored_on = eval_volume if _eval_has_labels(config) else train_volume
    return submit(
        "select", select_checkpoint, str(paths.train_dir), config_io.to_dict(config.selection),
        inputs=[trained.outputs[0], scored_on.outputs[0]], outputs=[File(str(paths.selection))],
    )  # fmt: skip


def build_dag(
    config: RunConfig, paths: RunPaths, site, stages: frozenset[str] = frozenset(STAGES)
) -> dict:
    """Submit the stages; returns {stage name: futures}. Parsl runs them as their inputs resolve.

    With a pretrained model there is no training: its checkpoint is written as the selection."""
    from apps.evaluate import evaluate
    from apps.export import export
    from apps.infer import infer_block
    from apps.stage import stage_volume
    from apps.stitch import stitch

    submit = _Submitter(stages)
    data = config_io.to_dict(config.data)
    eval_volume = submit(
        "stage", stage_volume, data, "eval", outputs=[File(str(paths.eval_volume))]
    )
    if config.pretrained_model:  # run() wrote its selection.json
        selected = _FromEarlierRun([File(str(paths.selection))])
    else:
        selected = _submit_training(config, paths, site, submit, eval_volume)
    blocks = [
        submit(
            "infer",
            infer_block,
            list(block.start),
            list(block.stop),
            config_io.to_dict(config.inference),
            inputs=[eval_volume.outputs[0], selected.outputs[0]],
            outputs=[File(str(block_path(paths.blocks_dir, block)))],
        )  # fmt: skip
        for block in plan_blocks(_eval_shape(config), config.blocks)
    ]
    stitched = submit(
        "stitch", stitch, config_io.to_dict(config.blocks),
        inputs=[eval_volume.outputs[0], *(b.outputs[0] for b in blocks)],
        outputs=[File(str(paths.segmentation)), File(str(paths.stitch_summary))],
    )  # fmt: skip
    segmented = [eval_volume.outputs[0], stitched.outputs[0]]
    submit(
        "export",
        export,
        config_io.to_dict(config.export),
        inputs=segmented,
        outputs=[File(str(paths.precomputed))],
    )
    if _eval_has_labels(config):
        submit(
            "evaluate", evaluate, config_io.to_dict(config.watershed),
            inputs=segmented, outputs=[File(str(paths.evaluation))],
        )  # fmt: skip
    return submit.futures


def _eval_has_labels(config: RunConfig) -> bool:
    return config.data.synthetic or bool(config.data.eval_labels)


def describe_dag(config: RunConfig, paths: RunPaths, site) -> str:
    from site_configs import describe

    blocks = plan_blocks(_eval_shape(config), config.blocks)
    if config.pretrained_model:
        return "\n".join([
            f"run {config.name} in {paths.root}: inference only with {config.pretrained_model}",
            f"  stage      -> {paths.eval_volume}",
            f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel",
            "  stitch, evaluate (with labels), export, report", describe(site.SITE, paths.root),
        ])  # fmt: skip
    launch = site.SITE.mpi_launch(config.train_nodes)
    lines = [
        f"run {config.name} in {paths.root}",
        f"  stage      -> {paths.train_volume}, {paths.eval_volume}",
        f"  preprocess -> {paths.coordinates}",
        f"  train      {launch.num_ranks} rank(s) on {launch.num_nodes} node(s), "
        f"{config.train.max_steps} steps -> {paths.train_dir}",
        f"             $ {training_command(config, paths, launch)}",
        f"  select     -> {paths.selection}",
        f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel -> {paths.blocks_dir}",
        f"  stitch     -> {paths.segmentation}",
        f"  evaluate   -> {paths.evaluation}"
        if _eval_has_labels(config)
        else "  evaluate   (no labels: skipped)",
        f"  export     -> {paths.precomputed}",
        f"  report     -> {paths.report}",
        describe(site.SITE, paths.root),
    ]
    return "\n".join(lines)


def _watch(futures: dict, paths: RunPaths) -> dict[str, str]:
    """Print each stage's start and end, and training progress, until every task is done."""
    reported: dict[int, str] = {}
    last_train_line, started = "", time.monotonic()
    tasks = [(stage, f) for stage, fs in futures.items() for f in fs]
    while True:
        for stage, future in tasks:
            state = future.task_record["status"].name
            if reported.get(id(future)) == state:
                continue
            reported[id(future)] = state
            name = stage if len(futures[stage]) == 1 else f"{stage}[{futures[stage].index(future)}]"
            elapsed = f"{time.monotonic() - started:6.0f} s"
            if state in ("launched", "running"):
                print(f"[workflow] {elapsed} {name} started", flush=True)
            elif state == "exec_done":
                print(f"[workflow] {elapsed} {name} finished", flush=True)
            elif state == "memo_done":
                print(f"[workflow] {elapsed} {name} skipped: done in an earlier run", flush=True)
            elif state in ("failed", "dep_fail"):
                print(f"[workflow] {elapsed} {name} {state.replace('_', ' ')}", flush=True)
        training = "train" in futures and reported.get(id(futures["train"][0])) in (
            "launched",
            "running",
        )
        line = _last_train_line(paths.train_log) if training else ""
        if line and line != last_train_line:
            print(f"[workflow]          {line}", flush=True)
            last_train_line = line
        if all(f.done() for _, f in tasks):
            return {id(f): reported[id(f)] for _, f in tasks}
        time.sleep(2)


def _last_train_line(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [
        line for line in log.read_text(errors="replace").splitlines() if line.startswith("[train]")
    ]
    return lines[-1] if lines else ""


def run(args: argparse.Namespace) -> int:
    import parsl

    from site_configs import load_site

    config = load_run_config(args.config)
    site = load_site(args.site)
    paths = RunPaths(Path(args.run_dir or ROOT / "data" / "runs" / config.name).resolve())
    if args.dry_run:
        print(describe_dag(config, paths, site))
        return 0
    if (paths.root / "runinfo").exists() and not args.resume:
        print(
            f"error: {paths.root} holds an earlier run; add --resume, or choose another --run-dir",
            file=sys.stderr,
        )
        return 2
    stages = frozenset(args.stages or STAGES)
    if config.pretrained_model:  # inference only: the model's checkpoint is the selection
        from pipeline.pretrained import write_pretrained_selection

        write_pretrained_selection(config.pretrained_model, paths.selection)
        stages = stages - {"preprocess", "train", "select"}
    check_stage_inputs(stages, paths.root)  # before any worker starts
    paths.root.mkdir(parents=True, exist_ok=True)
    config_io.save_json(paths.config, config)
    if args.resume:
        from pipeline.report import last_run_summary

        print(f"[workflow] resuming: {last_run_summary(paths.root / 'monitoring.db')}")
    parsl.load(site.make_config(paths.root))
    try:
        futures = build_dag(config, paths, site, stages)
        states = _watch(futures, paths)
        failures = [f for fs in futures.values() for f in fs if f.exception() is not None]
    finally:
        parsl.dfk().cleanup()
    if failures:
        print(f"[workflow] failed: {failures[0].exception()}", file=sys.stderr)
        return 1
    if all(s == "memo_done" for s in states.values()):
        print("[workflow] nothing to do: every stage was already complete in an earlier run")
    from pipeline.report import write_report

    write_report(paths.root)
    print(
        f"[workflow] done: {paths.report}; view it with: python workflow.py view --run-dir {paths.root}"
    )
    return 0


def view(args: argparse.Namespace) -> int:
    from pipeline.viewer import serve_forever

    serve_forever(
        Path(args.run_dir) / _LAYOUT["precomputed"], port=args.port, viewer_port=args.viewer_port
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="?", default="run", choices=["run", "view"])
    parser.add_argument(
        "--site", default="local", help="local, theta, polaris, slurm, or a path to a site module"
    )
    parser.add_argument(
        "--config", help="TOML of run settings (see configs/); default: the local demo"
    )
    parser.add_argument("--run-dir", help="default: data/runs/<name from the config>")
    parser.add_argument(
        "--resume", action="store_true", help="reuse what an earlier run in --run-dir finished"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the DAG and site settings; run nothing"
    )
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, metavar="STAGE",
        help=f"run only these ({', '.join(STAGES)}); the others' outputs must exist from an earlier run",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=0, help="view: data server port (0 = any free)")
    parser.add_argument(
        "--viewer-port", type=int, default=0, help="view: Neuroglancer port (0 = any free)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "view":
            if not args.run_dir:
                raise FFNError("view needs --run-dir")
            return view(args)
        return run(args)
    except FFNError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
