"""One chunk of a volume read in place, edited: what a resume runs again (issue 60, point 4).

Run by hand (not a test), from the repository root, on an otherwise idle machine:

    PATH=.venv/bin:$PATH python bench/chunk_edit.py [--edge 512] [--workers 2]
        [--folder data/bench/chunk_edit] [--chunk 2 2 2]

The volume and the data path are bench/scale.py's: a synthetic edge^3 zarr volume in 128^3
chunks read in place, blocks of 128^3 overlapping by 32, inference replaced by its stand-in
(the block's ground truth, `apps.infer.ground_truth_block`, keyed like inference on the part of
the volume it reads; no network runs), the stitching, the sharded export and the evaluation's
counts as the workflow plans them. A fresh run; a plan of the finished run (every task must be
up to date); then one chunk of the labels, what the stand-in reads (chunk `--chunk`, grid
coordinates), is written again in the user's store with a plane of new ids across it (every cell
there split in two, as a membrane found there would), and the run is resumed: per kind of task,
how many ran (their stamps were written anew) of how many, and the wall times, printed and
written to bench/results/chunk_edit.json. The run's folder (`--folder`/run) is emptied first;
the volume is made anew after an edit.
"""

import argparse
import dataclasses
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
from machine import cpu_name, write_result  # bench/machine.py
from scale import CHUNK, bench_steps, make_volume, run_config  # bench/scale.py

from apps.execute import execute
from apps.plan.step import plan_run
from pipeline.core.roi import Roi
from pipeline.core.stamps import STAMP_SUFFIX, holds_stamp
from pipeline.data.staging import reads_in_place
from pipeline.data.zarr_volumes import open_zarr
from pipeline.run.run_layout import RunPaths
from site_configs import local

ROOT = Path(__file__).resolve().parents[1]


def stamp_states(steps) -> dict[str, tuple[int, int]]:
    """Per task, its stamp file's inode and mtime: a task that runs writes it anew."""
    states = {}
    for step in steps:
        output = step.task.outputs[0]
        held = output if holds_stamp(output) else output.with_name(output.name + STAMP_SUFFIX)
        stat = os.stat(held)
        states[step.task.name] = (stat.st_ino, stat.st_mtime_ns)
    return states


def kind(name: str) -> str:
    """A task's kind: its name without its index ("stitch[relabel 3]" -> "stitch[relabel]")."""
    stage, _, rest = name.partition("[")
    words = [w for w in rest.rstrip("]").split() if not w.isdigit()]
    return f"{stage}[{' '.join(words)}]" if rest and words else stage


def split_chunk(volume: Path, chunk: tuple[int, int, int]) -> Roi:
    """Chunk `chunk` of the labels written again with every cell split by the plane halfway
    along x: one chunk file of the user's store changes. Returns the chunk's box."""
    start = tuple(c * CHUNK for c in chunk)
    box = Roi(start, tuple(a + CHUNK for a in start))
    (volume / ".complete").unlink()  # edited: the next run makes the volume anew
    labels = open_zarr(volume, "labels", "r+")
    part = labels[box.slices]
    part[..., CHUNK // 2 :] += np.uint64(10**9)  # ids no cell has
    labels[box.slices] = part
    return box


def timed_run(steps, paths: RunPaths, workers: int) -> float:
    """Plan `steps` and run what is not up to date, as the workflow does; wall seconds."""
    spec = dataclasses.replace(local.SITE, cpu_workers_per_node=workers)
    os.sync()  # what earlier runs wrote goes to disk now, not during this run
    started = time.perf_counter()
    status = execute(steps, plan_run(steps), local, spec, paths)
    if status:
        raise SystemExit(f"the run failed (status {status}); see {paths.root}/runinfo")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edge", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=ROOT / "data" / "bench" / "chunk_edit")
    parser.add_argument("--chunk", type=int, nargs=3, default=[2, 2, 2])
    args = parser.parse_args()
    volume = args.folder / f"volume_{args.edge}.zarr"
    shutil.rmtree(args.folder / "run", ignore_errors=True)
    make_volume(volume, args.edge, args.workers)
    config = run_config(volume, f"chunk-edit-{args.edge}")
    paths = RunPaths(args.folder / "run", reads_in_place(config.data))
    fresh = timed_run(bench_steps(config, paths), paths, args.workers)
    steps = bench_steps(config, paths)
    before = stamp_states(steps)
    started = time.perf_counter()
    stale = [name for name, why in plan_run(steps).items() if why]
    plan_seconds = time.perf_counter() - started
    if stale:
        raise SystemExit(f"not up to date after its run: {stale[:3]}")
    box = split_chunk(volume, tuple(args.chunk))
    resumed = timed_run(bench_steps(config, paths), paths, args.workers)
    after = stamp_states(steps)
    ran = Counter(kind(name) for name in after if after[name] != before[name])
    total = Counter(kind(name) for name in after)
    result = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "edge": args.edge,
        "workers": args.workers,
        "chunk": str(box),
        "fresh_seconds": round(fresh, 1),
        "unchanged_plan_seconds": round(plan_seconds, 2),
        "resume_seconds": round(resumed, 1),
        "ran": {k: [ran[k], total[k]] for k in total},
    }
    write_result(ROOT / "bench" / "results" / "chunk_edit.json", result)
    print(f"{args.edge}^3, chunk {box} of the labels split; {args.workers} workers")
    print(f"fresh run {fresh:.0f} s; plan of the finished run {plan_seconds:.1f} s (nothing stale)")
    print(f"resume after the edit {resumed:.0f} s\n\n| task | ran | of |\n|---|---|---|")
    for name in total:
        print(f"| {name} | {ran[name]} | {total[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
