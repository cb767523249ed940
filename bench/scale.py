"""The data path at growing volume sizes: memory of every task, wall time, workers.

Run by hand (not a test), from the repository root, on an otherwise idle machine:

    PATH=.venv/bin:$PATH python bench/scale.py [--edges 256 512 1024] [--workers 2]
        [--speedup-edge 512] [--repeats 1]

For each edge N it writes a synthetic N^3 volume as zarr (`data/bench/scale/volume_N.zarr`:
`raw` uint8 and `labels` uint64, 10 nm voxels; cells of about 64^3 voxels on a smoothly
distorted grid, dark membranes between them, noise), then runs the workflow's own tasks on it
through Parsl on the local site: staging of the zarr volume (read in place: a record of what
to read, checked, no voxel copied), one task per block
that stands in for inference (`apps.infer.ground_truth_block`: the block's ground truth with
block-local ids, so no network runs and what is measured is the data path), stitching (pairs,
join, relabel straight into the export's precomputed segmentation layer, check), evaluation (VI / adapted Rand counted slab
by slab; no watershed) and the export as tasks (regions: the image and the segmentation's coarser scales; igneous
meshing; igneous's skeleton tasks, a region each, their plan and merges; record). Every task's
stamp records its wall time and the peak resident memory of its worker process while it ran
(`pipeline.core.stamps.run_once`); the script reports, per kind of task, the largest of them.

Then, at `--speedup-edge`, the same run with 1 worker, for the speed-up of 2 workers
(`--repeats` pairs of runs, 2 workers then 1, then 1 then 2, and so on; the median of their
ratios), and, at the smallest edge, the stitched volume against the in-memory stitching of the
same block results (`pipeline.inference.stitching.stitch`): the same partition of the voxels or not.
Every run's folder is kept (`data/bench/scale/runs/`, emptied when the script starts).

Prints Markdown tables and writes everything to --output (JSON).
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zarr

import apps.infer
import apps.stage
from apps.contracts import GroundTruthBlock, StageVolume
from apps.execute import execute
from apps.plan.evaluation import evaluate_steps
from apps.plan.export import export_steps
from apps.plan.resolved import resolve_plan
from apps.plan.segmentation import stitch_steps
from apps.plan.step import Step, plan_run, task_step
from pipeline.core.atomic import atomic_path
from pipeline.core.stamps import files_under, read_stamp
from pipeline.data.staging import DataConfig, reads_in_place, role_settings, source_files
from pipeline.data.zarr_volumes import COMPRESSOR, open_zarr
from pipeline.evaluation.watershed import WatershedConfig
from pipeline.export.layers import ExportConfig, export_complete
from pipeline.inference.blocks import BlockConfig, block_path, plan_blocks
from pipeline.run.run_config import DEMO_MODEL, RunConfig
from pipeline.run.run_layout import RunPaths
from site_configs import local

ROOT = Path(__file__).resolve().parents[1]

VOXEL_NM = (10.0, 10.0, 10.0)
CELL = 64  # voxels: the synthetic cells' edge
CHUNK = 128  # voxels: the synthetic volume's zarr chunks, written one per call
# Blocks of 128^3 overlapping by 32: a 256^3 volume already has an interior block (27 blocks
# overlap its core), so no kind of task meets more neighbours in a larger volume.
BLOCKS = BlockConfig(block_shape_zyx=(128, 128, 128), overlap_zyx=(32, 32, 32))


def _labels(start: tuple[int, int, int], shape: tuple[int, ...], edge: int) -> np.ndarray:
    """Cell ids of the voxels [start, start + shape): a grid of CELL^3 cells, its axes bent by
    sums of sines of the other coordinates (smooth, so cells stay whole and connected)."""
    z, y, x = np.meshgrid(
        *(np.arange(a, a + n, dtype=np.float32) for a, n in zip(start, shape, strict=True)),
        indexing="ij",
    )
    two_pi = np.float32(2 * np.pi)
    bent = (
        z + 9 * np.sin(two_pi * x / 197) + 6 * np.sin(two_pi * y / 151),
        y + 9 * np.sin(two_pi * z / 181) + 6 * np.sin(two_pi * x / 163),
        x + 9 * np.sin(two_pi * y / 173) + 6 * np.sin(two_pi * z / 157),
    )
    side = edge // CELL + 2
    index = [np.floor_divide(b, CELL).astype(np.int64) + 1 for b in bent]
    return (1 + (index[0] * side + index[1]) * side + index[2]).astype(np.uint64)


def _write_chunk(args: tuple[Path, int, tuple[int, int, int]]) -> None:
    path, edge, start = args
    stop = [min(a + CHUNK, edge) for a in start]
    shape = tuple(b - a for a, b in zip(start, stop, strict=True))
    # One voxel more along every axis: a membrane where the next voxel is another cell.
    grown = _labels(start, tuple(n + 1 for n in shape), edge)
    labels = grown[:-1, :-1, :-1]
    membrane = (
        (labels != grown[1:, :-1, :-1])
        | (labels != grown[:-1, 1:, :-1])
        | (labels != grown[:-1, :-1, 1:])
    )
    rng = np.random.default_rng(list(start))
    raw = np.where(membrane, 60, 170) + rng.normal(0, 12, shape)
    region = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
    open_zarr(path, "raw", "r+")[region] = np.clip(raw, 0, 255).astype(np.uint8)
    open_zarr(path, "labels", "r+")[region] = labels


def make_volume(path: Path, edge: int, processes: int) -> None:
    """The synthetic edge^3 volume, chunk by chunk (bounded memory), unless it exists."""
    if (path / ".complete").is_file():
        return
    shutil.rmtree(path, ignore_errors=True)
    group = zarr.open_group(str(path), mode="w")
    for name, dtype in (("raw", np.uint8), ("labels", np.uint64)):
        array = group.create_dataset(
            name, shape=(edge,) * 3, chunks=(CHUNK,) * 3, dtype=dtype, compressor=COMPRESSOR
        )
        array.attrs["voxel_size_nm"] = list(VOXEL_NM)
    starts = [(z, y, x) for z in range(0, edge, CHUNK) for y in range(0, edge, CHUNK)
              for x in range(0, edge, CHUNK)]  # fmt: skip
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(_write_chunk, [(path, edge, s) for s in starts])
    (path / ".complete").write_text("")


def run_config(volume: Path, name: str, sharded: bool = True) -> RunConfig:
    data = DataConfig(eval_raw=f"{volume}:raw", eval_labels=f"{volume}:labels")
    return RunConfig(
        name=name,
        # A run needs a model to segment with; the stand-in of inference runs none.
        pretrained_model=str(DEMO_MODEL),
        data=data,
        blocks=BLOCKS,
        watershed=WatershedConfig(enabled=False),  # the baseline needs the whole image
        export=ExportConfig(sharded=sharded),
    )


def bench_steps(config: RunConfig, paths: RunPaths) -> list[Step]:
    """The workflow's tasks from staging to export, inference replaced by its stand-in."""
    plan = resolve_plan(config, paths, local.SITE)
    steps = [
        task_step("stage[eval]", role_settings(config.data, "eval"),
                  StageVolume(sources=source_files(config.data, "eval"), staged=paths.eval_volume),
                  apps.stage.stage_volume),
    ]  # fmt: skip
    blocks = plan.blocks
    for i, block in enumerate(blocks):
        settings = {"start": list(block.start), "stop": list(block.stop)}
        files = GroundTruthBlock(
            volume=paths.eval_volume, result=block_path(paths.blocks_dir, block)
        )
        steps.append(task_step(f"infer[{i}]", settings, files, apps.infer.ground_truth_block))
    (first,) = plan.inference_passes
    steps += stitch_steps(plan, first)
    steps += export_steps(plan)
    steps += evaluate_steps(plan)
    return steps


def run(
    volume: Path, edge: int, workers: int, runs_dir: Path, tag: str = "", sharded: bool = True
) -> dict:
    """One fresh run of the data path on `volume` with `workers` cpu workers, in a run dir of
    its own (`runs_dir/scale-<edge>-w<workers><tag>`, which must not exist)."""
    name = f"scale-{edge}-w{workers}{tag}{'' if sharded else '-unsharded'}"
    config = run_config(volume, name, sharded)
    paths = RunPaths(runs_dir / name, reads_in_place(config.data))
    if paths.root.exists():  # its tasks would be found up to date, not run
        raise SystemExit(f"{paths.root} exists: a run needs a folder of its own")
    spec = dataclasses.replace(local.SITE, cpu_workers_per_node=workers)
    steps = bench_steps(config, paths)
    # What earlier runs wrote goes to disk now, not during this run.
    os.sync()
    started = time.perf_counter()
    status = execute(steps, plan_run(steps), local, spec, paths)
    seconds = time.perf_counter() - started
    if status:
        raise SystemExit(f"{name}: the workflow failed (status {status}); see {paths.root}/runinfo")
    tasks: dict[str, dict] = {}
    for step in steps:
        measured = (read_stamp(step.task.outputs[0]) or {}).get("measured", {})
        kind = tasks.setdefault(
            step.app_name,
            {
                "tasks": 0,
                "peak_rss_mib": 0.0,
                "start_rss_mib": 0.0,
                "seconds": 0.0,
                "cpu_seconds": 0.0,
            },
        )
        kind["tasks"] += 1
        peak, start = measured.get("peak_rss_mib") or 0.0, measured.get("start_rss_mib") or 0.0
        kind["peak_rss_mib"] = max(kind["peak_rss_mib"], peak)
        # The worker's memory when a task of this kind began (what earlier tasks left), largest.
        kind["start_rss_mib"] = max(kind["start_rss_mib"], start)
        kind["seconds"] += measured.get("seconds", 0.0)
        kind["cpu_seconds"] += measured.get("cpu_seconds", 0.0)
    scores = json.loads(paths.evaluation.read_text())["ffn"]
    # What a finished run's resume and a check of its export cost: every task found up to date,
    # the export's completeness from its records.
    started = time.perf_counter()
    stale = [name for name, why in plan_run(bench_steps(config, paths)).items() if why]
    resume_seconds = time.perf_counter() - started
    started = time.perf_counter()
    complete = export_complete(paths.precomputed)
    check_seconds = time.perf_counter() - started
    if stale or not complete:
        raise SystemExit(f"{name}: not up to date after its run ({stale[:3]}, complete {complete})")
    export = [k for k in tasks if k.startswith("export.")]
    return {
        "edge": edge,
        "voxels": edge**3,
        "workers": workers,
        "wall_seconds": round(seconds, 1),
        "blocks": len(plan_blocks((edge,) * 3, config.blocks)),
        "tasks": tasks,
        "sharded": sharded,
        "export_files": sum(1 for _ in files_under(paths.precomputed)),
        "export_task_seconds": round(sum(tasks[k]["seconds"] for k in export), 1),
        "export_check_seconds": round(check_seconds, 3),
        "resume_plan_seconds": round(resume_seconds, 3),
        "variation_of_information": scores.get("variation_of_information"),
        "run_dir": str(paths.root),
    }


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two label volumes cut the voxels into the same sets (ids may differ)."""
    pairs = np.unique(np.stack([a.ravel(), b.ravel()]), axis=1)
    return pairs.shape[1] == len(np.unique(a)) == len(np.unique(b))


def check_stitching(result: dict) -> bool:
    """The tasks' stitched volume against the in-memory stitching of the same block results."""
    from pipeline.data.volumes import read_labels
    from pipeline.export.layers import segmentation_spec
    from pipeline.inference.blocks import read_block_result
    from pipeline.inference.stitching import stitch

    paths = RunPaths(Path(result["run_dir"]))
    blocks = plan_blocks((result["edge"],) * 3, BLOCKS)
    results = [read_block_result(block_path(paths.blocks_dir, b), b) for b in blocks]
    in_memory, _ = stitch(results, (result["edge"],) * 3, BLOCKS)
    tasks, _ = read_labels(segmentation_spec(paths.precomputed))
    return same_partition(in_memory, tasks)


def table(results: list[dict], key: str = "peak_rss_mib") -> str:
    """Per kind of task, the largest `key` (MiB) and its ratio to the first run's."""
    kinds = list(dict.fromkeys(k for r in results for k in r["tasks"]))  # every run's, in order
    first = results[0]
    lines = [
        "| volume | workers | blocks | wall time | s per 10^6 voxels | "
        + " | ".join(k.split(".")[1] for k in kinds) + " |",
        "|---" * (4 + len(kinds)) + "|---|",
    ]  # fmt: skip
    for r in results:
        memory = [
            f"{r['tasks'][k][key]:.0f} MiB ({r['tasks'][k][key] / first['tasks'][k][key]:.2f}x)"
            if k in r["tasks"] and k in first["tasks"]
            else f"{r['tasks'][k][key]:.0f} MiB"
            if k in r["tasks"]
            else "-"  # unsharded: no mesh plan nor merges; sharded: no meshing task of its own
            for k in kinds
        ]
        lines.append(
            f"| {r['edge']}^3 | {r['workers']} | {r['blocks']} | {r['wall_seconds']:.0f} s | "
            f"{r['wall_seconds'] / r['voxels'] * 1e6:.3f} | " + " | ".join(memory) + " |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speedup-edge", type=int, default=512, help="0: no 1-worker run")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs for the speed-up")
    parser.add_argument("--volumes-dir", type=Path, default=ROOT / "data" / "bench" / "scale")
    parser.add_argument("--output", type=Path, default=ROOT / "data" / "bench" / "scale.json")
    parser.add_argument(
        "--unsharded-edges",
        type=int,
        nargs="*",
        default=[],
        help="also export these edges unsharded (a file per chunk), 2 workers, for comparison",
    )
    args = parser.parse_args()
    # Every run writes a folder of its own, kept for its stamps; earlier benchmarks' go first.
    runs_dir = args.volumes_dir / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    results = []
    for edge in args.edges:
        volume = args.volumes_dir / f"volume_{edge}.zarr"
        started = time.perf_counter()
        make_volume(volume, edge, args.workers)
        print(f"[scale] volume {edge}^3 ready ({time.perf_counter() - started:.0f} s)", flush=True)
        results.append(run(volume, edge, args.workers, runs_dir))
        print(
            f"[scale] {edge}^3, {args.workers} workers: {results[-1]['wall_seconds']} s", flush=True
        )
    for edge in args.unsharded_edges:
        volume = args.volumes_dir / f"volume_{edge}.zarr"
        make_volume(volume, edge, args.workers)
        results.append(run(volume, edge, args.workers, runs_dir, sharded=False))
    stitched_same = check_stitching(results[0])
    one_worker, pairs = None, []
    if args.speedup_edge:
        edge = args.speedup_edge
        volume = args.volumes_dir / f"volume_{edge}.zarr"
        make_volume(volume, edge, args.workers)
        # Pairs of runs one after the other, so that a slower spell of a shared machine slows
        # both runs of a pair; their ratios' median is the speed-up. The order turns each pair
        # (2 1, 1 2, 2 1, ...), so a machine that speeds up or slows down over the minutes does
        # not favour one worker count.
        # The first pair's 2-worker run is the one above at that edge, if there was one.
        done = next((r for r in results if r["edge"] == edge), None)
        for repeat in range(args.repeats):
            tag = f"-pair{repeat + 1}"
            if repeat % 2:
                one = run(volume, edge, 1, runs_dir, tag)
                two = run(volume, edge, args.workers, runs_dir, tag)
            else:
                two = (
                    done if done and not repeat else run(volume, edge, args.workers, runs_dir, tag)
                )
                one = run(volume, edge, 1, runs_dir, tag)
            one_worker = one_worker or one
            pairs.append([two["wall_seconds"], one["wall_seconds"]])
            print(f"[scale] {edge}^3 pair {repeat + 1}: {pairs[-1]} s", flush=True)
    record = {
        "machine": f"{platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "runs": results + ([one_worker] if one_worker else []),
        "stitched_same_as_in_memory": stitched_same,
        # [wall seconds with --workers, with 1] at --speedup-edge, per repeat.
        "speedup_pairs": pairs,
    }
    with atomic_path(args.output) as tmp:
        tmp.write_text(json.dumps(record, indent=2))
    print("peak resident memory of a task's worker while it ran, largest of its kind")
    print(table(record["runs"]))
    print(
        "\nresident memory of the worker when such a task began (what earlier tasks left), largest"
    )
    print(table(record["runs"], "start_rss_mib"))
    print(f"\nstitched {results[0]['edge']}^3 by tasks = in-memory stitching: {stitched_same}")
    print("\n| volume | export | files | export task time | check complete | resume plan |")
    print("|---|---|---|---|---|---|")
    for r in record["runs"]:
        print(
            f"| {r['edge']}^3, {r['workers']} workers | {'sharded' if r['sharded'] else 'unsharded'} "
            f"| {r['export_files']:,} | {r['export_task_seconds']} s | {r['export_check_seconds']} s "
            f"| {r['resume_plan_seconds']} s |"
        )
    if pairs:
        ratios = [one / two for two, one in pairs]
        print(
            f"{args.speedup_edge}^3: {args.workers} workers {statistics.median(ratios):.2f}x faster "
            f"than 1 (median of {len(ratios)}: " + ", ".join(f"{r:.2f}x" for r in ratios) + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
