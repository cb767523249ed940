"""Segments' pieces made a region at a time, gathered into sharded files: what the sharded meshes
(pipeline.export.meshes) and the skeletons (pipeline.export.skeletons) share.

Each region's task keeps the pieces of its segments in one MapBuffer file, `<task>.frags` (a
segment id -> its piece), in the mesh or skeleton folder (`where`). After every such task, one
plan (`plan_shards`) assigns the segments to shards by igneous's hashed sharding and lists, for
each segment, the tasks holding its pieces: one file, `PLAN`, whatever the shard count. A merge
task then reads its shards' part of the plan (`shard_segments`) and a segment's pieces alone
(`read_piece`), a segment at a time; `merge_in_turn` runs one merge task's shards in turn.

igneous's own way keeps a spatial index file per task and a `.labels` file per shard besides, and
every merge task reads the whole spatial index.
"""

import io
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import PrecomputedError
from pipeline.core.memory import release_memory

FRAGMENTS_SUFFIX = ".frags"
# The shards' plan (`plan_shards`), beside the fragments.
PLAN = "plan.npy"


def fragments_path(where: Path, index: int) -> Path:
    """Where region task `index` keeps its segments' pieces (named after the task, so the plan
    need not list names)."""
    return Path(where) / f"{index}{FRAGMENTS_SUFFIX}"


def write_fragments(path: Path, pieces: dict[int, bytes]) -> None:
    """A task's pieces (segment id -> encoded piece) as igneous writes them (a MapBuffer,
    brotli), atomically: a task cut short leaves no file."""
    from mapbuffer import MapBuffer

    with atomic_path(path) as tmp:
        tmp.write_bytes(MapBuffer(pieces, compress="br").tobytes())


def hashed_sharding(segment_count: int, shards: int, data_encoding: str) -> dict:
    """The `sharding` spec for `segment_count` segments in about `shards` shards, by igneous's
    rules (`compute_shard_params_for_hashed`, as its sharded mesh and skeleton merges call it):
    2^round(log2(`shards`)) shards, or more where the segments would overflow the indices sized
    for a 100 Mbit/s reader (8 KiB shard index, 32 KiB minishard indices); murmurhash spreads
    the segments (a shard's count varies by about its square root). The export asks for a shard
    per few regions, so a shard holds about as many segments whatever the volume's size
    (igneous's command asks for one per 1000 segments: at 256^3 one shard would hold every
    segment, at 1024^3 a thousand)."""
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification
    from igneous.task_creation.common import compute_shard_params_for_hashed

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    shard_bits, minishard_bits, preshift_bits = compute_shard_params_for_hashed(
        num_labels=segment_count,
        shard_index_bytes=2**13,
        minishard_index_bytes=2**15,
        min_shards=shards,
    )
    spec = ShardingSpecification(
        type="neuroglancer_uint64_sharded_v1",
        preshift_bits=preshift_bits,
        hash="murmurhash3_x86_128",
        minishard_bits=minishard_bits,
        shard_bits=shard_bits,
        minishard_index_encoding="gzip",
        data_encoding=data_encoding,
    )
    return json.loads(spec.to_json())  # its numbers as ints (it holds numpy's)


def shard_name(spec: dict, shard_number: int) -> str:
    """A shard's name (hex, as wide as its bits need): cloud-volume's and shardcomputer's."""
    return format(shard_number, "x").zfill(math.ceil(spec["shard_bits"] / 4))


class _FileBytes:
    """A file's bytes, read where a MapBuffer slices them (its index, then one value at a time).
    Given the file itself, MapBuffer maps it whole, and every page it reads stays resident as
    the process's memory: a merge task reading its segments across every region's fragments
    would hold them all."""

    def __init__(self, file: "io.BufferedReader") -> None:
        self._file, self._size = file, os.fstat(file.fileno()).st_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, where: slice) -> bytes:
        start, stop, _ = where.indices(self._size)
        self._file.seek(start)
        return self._file.read(max(0, stop - start))


def _fragment_ids(path: Path) -> np.ndarray:
    """The segment ids a `.frags` file holds pieces of (its index only, not its pieces)."""
    from mapbuffer import MapBuffer

    with open(path, "rb") as f:
        return np.fromiter(MapBuffer(_FileBytes(f)).keys(), np.uint64)


def plan_shards(where: Path, fragments: dict[int, Path], shards: int, data_encoding: str) -> dict:
    """Once, after every region task (`fragments`: task index -> its `.frags` file, for the
    tasks that wrote one) and before any merge task: the `hashed_sharding` of their segments in
    about `shards` shards, then the plan `PLAN` (what igneous keeps in a `.labels` file per
    shard and finds in the spatial index, `_write_plan`). Shards of an earlier plan go first.
    Returns the sharding spec. Holds every (segment, task) pair of the volume: 16 bytes each,
    plus shardcomputer's lists (about 50 bytes a segment), once."""
    import shardcomputer

    where = Path(where)
    segments = [_fragment_ids(path) for path in fragments.values()]
    owners = [
        np.full(ids.size, task, np.uint64) for task, ids in zip(fragments, segments, strict=True)
    ]
    pairs = np.concatenate([np.zeros(0, np.uint64), *segments])
    tasks = np.concatenate([np.zeros(0, np.uint64), *owners])
    ids = np.unique(pairs)
    spec = hashed_sharding(ids.size, shards, data_encoding)
    for stale in where.glob("*.shard"):
        stale.unlink()
    assigned = shardcomputer.assign_labels_to_shards(
        ids, spec["preshift_bits"], spec["shard_bits"], spec["minishard_bits"]
    )
    count = 2 ** spec["shard_bits"]
    shard_of = np.zeros(ids.size, np.uint64)
    for shard in range(count):
        members = np.asarray(assigned.get(shard_name(spec, shard), []), np.uint64)
        shard_of[np.searchsorted(ids, members)] = shard
    _write_plan(where / PLAN, count, shard_of[np.searchsorted(ids, pairs)], pairs, tasks)
    return spec


def _write_plan(
    path: Path, count: int, shards: np.ndarray, segments: np.ndarray, tasks: np.ndarray
) -> None:
    """The plan of `count` shards from (shard, segment, fragment task) triples, as one uint64
    array a merge task maps and slices (`shard_segments`), reading only its shard's part:
    [count, segments n, pairs m, shard -> first segment (count + 1), segment ids (n, by shard
    then id), segment -> first pair (n + 1), the tasks holding each segment's fragments (m)]."""
    order = np.lexsort((tasks, segments, shards))
    segments, shards, tasks = segments[order], shards[order], tasks[order]
    firsts = np.flatnonzero(np.diff(segments, prepend=segments[:1] + 1) != 0)
    ids, owners = segments[firsts], shards[firsts]
    by_shard = np.searchsorted(owners, np.arange(count + 1))
    parts = [[count, ids.size, tasks.size], by_shard, ids, [*firsts, tasks.size], tasks]
    # Each as uint64 first: int64 and uint64 together would make floats (ids past 2^53 lost).
    plan = np.concatenate([np.asarray(part, np.uint64) for part in parts])
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, plan)


def _plan(where: Path) -> np.ndarray:
    """The plan, mapped, its size checked; PrecomputedError when it is missing or cut short."""
    path = Path(where) / PLAN
    try:
        plan = np.load(path, mmap_mode="r")
        count, n, m = (int(v) for v in plan[:3])
        if plan.size != 3 + count + 1 + n + n + 1 + m:
            raise ValueError(f"{plan.size} numbers for {count} shards, {n} segments, {m} pairs")
    except (OSError, ValueError) as exc:
        raise PrecomputedError(f"{path}: no whole plan of the shards ({exc})") from None
    return plan


def planned_shard_count(where: Path) -> int:
    """The number of shards (some maybe empty) the plan in `where` holds: read back, so a
    resumed run needs no segment ids."""
    return int(_plan(where)[0])


def shard_segments(where: Path, shard: int) -> Iterator[tuple[int, np.ndarray]]:
    """(segment id, the fragment tasks holding its pieces) of every segment of `shard`, from
    the plan (`_write_plan`); PrecomputedError when it is missing or cut short."""
    plan = _plan(where)
    count, n = int(plan[0]), int(plan[1])
    if not 0 <= shard < count:
        raise ValueError(f"shard {shard} of {count}")
    ids_at, pairs_at = 3 + count + 1, 3 + count + 1 + n
    tasks_at = pairs_at + n + 1
    first, last = int(plan[3 + shard]), int(plan[3 + shard + 1])
    starts = np.asarray(plan[pairs_at + first : pairs_at + last + 1], np.int64)
    for k, segment in enumerate(np.asarray(plan[ids_at + first : ids_at + last])):
        yield int(segment), np.asarray(plan[tasks_at + starts[k] : tasks_at + starts[k + 1]])


def read_piece(where: Path, task: int, segment: int, decode: Callable[[bytes], object]) -> object:
    """`segment`'s piece in fragment task `task`'s file, read alone (`_FileBytes`) and decoded:
    the file is opened and closed again, so a merge holds no file open between segments (a
    shard's segments come from regions all over the volume)."""
    from mapbuffer import MapBuffer

    with open(fragments_path(where, task), "rb") as f:
        return MapBuffer(_FileBytes(f), frombytesfn=decode)[segment]


def write_shard(
    where: Path,
    spec: dict,
    shard_number: int,
    encoded: dict[int, bytes],
    manifests: dict[int, int] | None = None,
) -> Path:
    """Shard `shard_number` of the segments `encoded` (id -> bytes; `manifests`: for meshes,
    where each one's manifest begins), synthesized by cloud-volume, written atomically: a task
    cut short leaves no shard. PrecomputedError when the segments are not all of that shard."""
    from cloudvolume.datasource.precomputed.sharding import (
        ShardingSpecification,
        synthesize_shard_files,
    )

    path = Path(where) / f"{shard_name(spec, shard_number)}.shard"
    shards = synthesize_shard_files(ShardingSpecification.from_dict(spec), encoded, manifests)
    if list(shards) != [path.name]:
        raise PrecomputedError(f"{path}: the plan's segments made shards {list(shards)}")
    with atomic_path(path) as tmp:
        tmp.write_bytes(shards[path.name])
    return path


def merge_in_turn(
    merge: Callable[[int], dict[str, list[int]]], index: int, count: int, shards: int
) -> dict[str, list[int]]:
    """Merge task `index` of `count`: every shard (of `shards`) whose number is `index` modulo
    `count` (`merge(shard)`, returning the files it wrote), one after the other: about a shard
    a merge task, a fixed number of them (the workflow's tasks are known before it runs)."""
    if not 0 <= index < count:
        raise ValueError(f"merge task {index} of {count}")
    files = {}
    for shard in range(index, shards, count):
        files |= merge(shard)
        # A shard's memory handed back before the next: held on, its fragmented heap grew a
        # merge task's peak by up to 20 MB after region tasks in the same worker.
        release_memory()
    return files
