"""What planning the workflow's DAG costs the coordinating process for a large volume.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/plan_dag.py [--edge 10000] [--block 256 512 512]
        [--overlap 64] [--parsl-tasks 20000]

For a volume of edge^3 voxels (a zarr array with its metadata only: no chunk is written or
read), the workflow's own `dag_steps` and `plan_run` with a pretrained model (no training), the
given blocks and the default export and evaluation: how many tasks of each kind, the time each
call took and the process's peak resident memory. Then what Parsl holds for tasks submitted and
waiting on an input (`--parsl-tasks` trivial apps on a thread pool, none runs until the input is
set): resident memory and submission time per task, to scale to the DAG's count.
"""

import argparse
import collections
import concurrent.futures
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from apps.plan.dag import dag_steps
from apps.plan.resolved import resolve_plan
from apps.plan.step import plan_run
from pipeline.core.memory import peak_memory_mib, resident_memory_mib
from pipeline.data.staging import DataConfig, reads_in_place
from pipeline.inference.blocks import BlockConfig
from pipeline.run.run_config import RunConfig
from pipeline.run.run_layout import RunPaths
from site_configs import local

ROOT = Path(__file__).resolve().parents[1]


def metadata_only_volume(folder: Path, edge: int) -> Path:
    """`raw` and `labels` of edge^3 voxels at 10 nm, as zarr metadata without a chunk."""
    path = folder / "volume.zarr"
    group = zarr.open_group(str(path), mode="w")
    for name, dtype in (("raw", np.uint8), ("labels", np.uint64)):
        array = group.create_dataset(name, shape=(edge,) * 3, chunks=(128,) * 3, dtype=dtype)
        array.attrs["voxel_size_nm"] = [10.0, 10.0, 10.0]
    return path


def plan(volume: Path, run_dir: Path, block: tuple, overlap: int) -> None:
    data = DataConfig(eval_raw=f"{volume}:raw", eval_labels=f"{volume}:labels")
    blocks = BlockConfig(block_shape_zyx=block, overlap_zyx=(overlap,) * 3)
    config = RunConfig(
        name="plan",
        data=data,
        pretrained_model=str(ROOT / "models" / "demo-synthetic"),
        blocks=blocks,
    )
    paths = RunPaths(run_dir, reads_in_place(config.data))
    before = resident_memory_mib()
    started = time.perf_counter()
    steps = dag_steps(resolve_plan(config, paths, local.SITE))
    planned = time.perf_counter()
    plan_run(steps)
    done = time.perf_counter()
    kinds = collections.Counter(step.app_name for step in steps)
    print(f"{len(steps):,} tasks:", ", ".join(f"{app} {n:,}" for app, n in kinds.items()))
    print(
        f"dag_steps {planned - started:.1f} s, plan_run {done - planned:.1f} s; resident "
        f"{before:.0f} MiB before, peak {peak_memory_mib():.0f} MiB"
    )


def parsl_pending(count: int, run_dir: Path) -> None:
    import parsl
    from parsl import python_app
    from parsl.config import Config
    from parsl.executors import ThreadPoolExecutor

    @python_app
    def task(settings: dict, inputs=()) -> int:
        return 0

    parsl.load(Config(executors=[ThreadPoolExecutor(max_threads=1)], run_dir=str(run_dir)))
    try:
        gate: concurrent.futures.Future = concurrent.futures.Future()
        before, started = resident_memory_mib(), time.perf_counter()
        futures = [task({"block": i, "start": [i, 0, 0]}, inputs=[gate]) for i in range(count)]
        seconds, grown = time.perf_counter() - started, resident_memory_mib() - before
        gate.set_result(None)
        for future in futures:
            future.result()
    finally:
        parsl.dfk().cleanup()
    print(
        f"Parsl, {count:,} tasks waiting on an input: {seconds:.1f} s to submit, +{grown:.0f} MiB "
        f"({grown * 1024 / count:.1f} KiB and {seconds / count * 1e3:.2f} ms a task)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge", type=int, default=10_000, help="voxels per axis")
    parser.add_argument("--block", type=int, nargs=3, default=[256, 512, 512], help="z y x")
    parser.add_argument("--overlap", type=int, default=64)
    parser.add_argument("--parsl-tasks", type=int, default=20_000, help="0: skip")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.processor() or platform.platform()}")
    with tempfile.TemporaryDirectory() as tmp:
        volume = metadata_only_volume(Path(tmp), args.edge)
        # Parsl first: the plan's steps, once dropped, would leave freed memory to reuse.
        if args.parsl_tasks:
            parsl_pending(args.parsl_tasks, Path(tmp) / "runinfo")
        print(f"{args.edge}^3 voxels, blocks {tuple(args.block)} overlapping by {args.overlap}")
        plan(volume, Path(tmp) / "run", tuple(args.block), args.overlap)


if __name__ == "__main__":
    main()
