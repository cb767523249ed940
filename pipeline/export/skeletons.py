"""Skeletons of an export's segmentation: igneous's skeleton tasks (kimimaro's TEASAR), run here a
region at a time in bounded memory, then merged a segment at a time into a precomputed skeleton
source, which the segmentation's `info` names (`skeletons`) and Neuroglancer draws with the
segments. igneous's steps for sharded skeletons, as the sharded meshes take theirs
(pipeline.export.meshes; both gather their pieces with pipeline.export.fragment_shards):

1. `skeleton_part`, a task per export region: igneous's SkeletonTask of the region and one voxel
   past its high faces (igneous's overlap: kimimaro's `fix_borders` ends a skeleton crossing a
   face at the centre of its cross-section there, the same point in the neighbour's skeleton,
   so the merge joins them), reading those voxels of the full resolution only; its skeletons in
   one `<task>.frags` file (igneous's `sharded=True` output, named after the task, atomically).
2. `skeleton_shard_plan`, once after them: the plan of the shards, the skeleton `info` and the
   segmentation `info`'s `skeletons` key. Written here, not when the export begins, so turning
   skeletons on for an export made without them runs the skeleton tasks only.
3. `merge_skeleton_part`, a task per few shards: igneous's ShardedSkeletonMergeTask's steps, a
   segment at a time (its pieces joined and consolidated, kimimaro's postprocess: loops removed,
   close pieces joined, ticks shorter than `TICK_NM` cut), into a `.shard` per shard, or, for
   an unsharded export, a file per segment named by its id (either is what Neuroglancer and
   cloud-volume read). Unlike igneous's task, which holds every skeleton of its shard at once,
   this holds the shard's encoded skeletons and one segment's pieces.

Skeletons are traced with the settings of the ground truth's skeletons that ERL is measured along
(pipeline.evaluation.erl.SkeletonConfig), in nm, vertices at voxel centres; a segment under its
`dust_voxels` within a region gets none there. Files under `segmentation/skeletons/`: `info`, a
`.frags` per region holding a skeleton, the plan, and the shards (or a file per segment).

Axes: the project is (z, y, x); igneous and cloud-volume are (x, y, z).
"""

import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError
from pipeline.core.roi import Roi
from pipeline.data.volumes import ZYX
from pipeline.export.folder_layout import (
    SEGMENTATION_LAYER,
    SKELETON_DIR,
    file_record,
    layer_url,
    read_info,
    xyz,
)
from pipeline.export.fragment_shards import (
    fragments_path,
    merge_in_turn,
    plan_shards,
    planned_shard_count,
    read_piece,
    shard_name,
    shard_segments,
    write_fragments,
    write_shard,
)

if TYPE_CHECKING:  # imported where used: cloud-volume takes seconds to import
    from cloudvolume import Skeleton


# Branches shorter than this (nm) that the merge of a segment's pieces leaves are cut: TEASAR
# traces none shorter than its invalidation radius, `const_nm` and more, so what is shorter is
# where two regions' pieces meet.
@dataclass(frozen=True)
class SkeletonConfig:
    """kimimaro's settings for the ground-truth skeletons, for thin neurites.

    TEASAR traces a body from its farthest point, then from the farthest point not yet within
    `scale` x (the distance to the boundary) + `const_nm` of a traced path, and so on; a branch
    shorter than that radius is not traced. kimimaro's default constant, 300 nm, is made for
    whole neurons; 100 nm keeps more of the thin branches: on the synthetic evaluation volume
    (tubes 40 to 120 nm in radius) the skeletons came within 100 nm of 98 % of the generator's
    centrelines against 95 % with 300 nm, for more skeleton away from them (20 % of it against
    14 %; BENCHMARKS.md, "ERL along ground-truth skeletons"). The rest are kimimaro's defaults:
    branch points moved to the bodies' centres (fix_branching), skeletons ending at the centre
    of the volume's faces they touch (fix_borders), somata looked for only 750 nm or more inside
    a body."""

    scale: float = 1.5
    const_nm: float = 100.0
    # Pieces of a body under this many voxels get no skeleton: slivers that a part's border cuts
    # off (the synthetic volumes' smallest object is this size).
    dust_voxels: int = 100

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.const_nm >= 0):
            raise ConfigError(
                f"skeletons: scale must be > 0 and const_nm >= 0, got {self.scale}, {self.const_nm}"
            )
        if not (isinstance(self.dust_voxels, int) and self.dust_voxels >= 0):
            raise ConfigError(
                f"skeletons: dust_voxels must be an integer >= 0, got {self.dust_voxels!r}"
            )


TICK_NM = SkeletonConfig().const_nm

# The skeleton `info` (cloud-volume's, as igneous writes it: vertices in nm, an identity
# transform, float32 attributes only, for older Neuroglancers) but the sharding.
SKELETON_INFO = {
    "@type": "neuroglancer_skeletons",
    "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
    "vertex_attributes": [{"id": "radius", "data_type": "float32", "num_components": 1}],
    "mip": 0,
}


def skeleton_dir(folder: Path) -> Path:
    """The skeletons' folder in the export `folder`."""
    return Path(folder) / SEGMENTATION_LAYER / SKELETON_DIR


def skeletonizing_options() -> dict:
    """The options igneous's `create_skeletonizing_tasks` takes and hands to each SkeletonTask:
    full resolution, TEASAR as the ground truth's skeletons (`SkeletonConfig`), kimimaro's own
    fixes at branches and borders, a MapBuffer of skeletons per task, no spatial index (the plan
    says where a segment's pieces are)."""
    config = SkeletonConfig()
    return {
        "mip": 0,
        "teasar_params": {"scale": config.scale, "const": config.const_nm},
        "dust_threshold": config.dust_voxels,
        "fix_branching": True,
        "fix_borders": True,
        "fix_avocados": False,
        "fill_holes": 0,
        "sharded": True,
        "spatial_index": False,
    }


def skeleton_read(region: Roi, shape_zyx: ZYX) -> Roi:
    """The voxels the skeleton task of `region` reads: the region and one voxel past its high
    faces (igneous's overlap), within the volume (of `shape_zyx`)."""
    stop = tuple(min(b + 1, n) for b, n in zip(region.stop, shape_zyx, strict=True))
    return Roi(region.start, stop)


def _igneous_skeleton_task(folder: Path, region: Roi):
    """igneous's SkeletonTask of `region` (voxels), made as `create_skeletonizing_tasks` makes
    each of its set: the region and a voxel past its high faces, which the task clamps to the
    volume."""
    from igneous.tasks import SkeletonTask

    return SkeletonTask(
        cloudpath=layer_url(folder, SEGMENTATION_LAYER),
        shape=[n + 1 for n in xyz(region.shape)],
        offset=xyz(region.start),
        will_postprocess=True,
        info=None,
        object_ids=None,
        mask_ids=None,
        progress=False,
        parallel=1,  # the task's own core: the workers share the node
        fill_missing=False,
        frag_path=None,
        spatial_grid_shape=xyz(region.shape),
        synapses=None,
        dust_global=False,
        fix_autapses=False,
        timestamp=None,
        cross_sectional_area=False,
        cross_sectional_area_smoothing_window=5,
        root_ids_cloudpath=None,
        cross_sectional_area_repair_sec_per_label=0,
        **skeletonizing_options(),
    )


def skeleton_part(folder: Path, index: int, region: Roi) -> dict[str, list[int]]:
    """Skeleton task `index`: igneous's SkeletonTask of export region `index` (`region`), its
    skeletons in one `.frags` file. Returns the file written (`file_record`), or nothing for a
    region without a segment to skeletonize."""
    folder = Path(folder)
    task = _igneous_skeleton_task(folder, region)
    path = fragments_path(skeleton_dir(folder), index)
    path.unlink(missing_ok=True)  # a stale one (its region since emptied) is not this run's

    def upload(volume, where: str, bbox, skeletons: dict) -> None:  # igneous's `upload_batch`
        if skeletons:
            write_fragments(path, {k: s.to_precomputed() for k, s in skeletons.items()})

    task.upload_batch = upload
    task.execute()
    return {path.relative_to(folder).as_posix(): file_record(path)} if path.exists() else {}


def skeleton_shard_plan(
    folder: Path, fragments: dict[int, Path], shards: int, sharded: bool
) -> int:
    """Once, after every skeleton task (`fragments`: task index -> its `.frags` file, for the
    tasks that wrote one) and before any merge task: the plan of about `shards` shards
    (`fragment_shards.plan_shards`; skeletons gzipped in them, as igneous stores them), the
    skeleton `info` (`SKELETON_INFO`, `sharded`: with the plan's sharding) and the segmentation
    `info`'s `skeletons` key, each atomically. An earlier plan's shards or segment files go.
    Returns the number of shards (`planned_shard_count`), which unsharded only divide the
    segments among the merge tasks."""
    folder = Path(folder)
    where = skeleton_dir(folder)
    spec = plan_shards(where, fragments, shards, data_encoding="gzip")  # makes the folder
    for stale in where.iterdir():
        if stale.name.isdigit():  # a segment's skeleton, unsharded
            stale.unlink()
    with atomic_path(where / "info") as tmp:
        tmp.write_text(json.dumps(SKELETON_INFO | ({"sharding": spec} if sharded else {})))
    _name_skeletons(folder, SKELETON_DIR)
    return 2 ** spec["shard_bits"]


def _name_skeletons(folder: Path, name: str | None) -> None:
    """The segmentation `info`'s `skeletons` key set to `name` (None: no key), atomically, if it
    is not already: tasks reading it meanwhile see the old file or the new one."""
    info = read_info(folder, SEGMENTATION_LAYER)
    if info.get("skeletons") == name:
        return
    if name is None:
        del info["skeletons"]
    else:
        info["skeletons"] = name
    with atomic_path(folder / SEGMENTATION_LAYER / "info") as tmp:
        tmp.write_text(json.dumps(info))


def drop_skeletons(folder: Path) -> None:
    """An export's skeletons gone (skeletons turned off): the segmentation `info` names none,
    their folder is removed."""
    _name_skeletons(Path(folder), None)
    shutil.rmtree(skeleton_dir(folder), ignore_errors=True)


def _postprocess(skeleton: "Skeleton") -> "Skeleton":
    """kimimaro's `postprocess` of a segment's pieces merged, its steps in turn: loops removed,
    pieces closer than their radii joined, ticks under `TICK_NM` cut (no dust removed: the
    tasks' `dust_voxels` did). Each step begins by splitting the skeleton into its connected
    pieces, which takes uint32 edges; osteoid 0.6's `consolidate`, which ends each step, makes
    them int64 (kimimaro 5.8's own `postprocess` fails on them), so they are made uint32
    before each."""
    from kimimaro import post

    def uint32(skeleton: "Skeleton") -> "Skeleton":
        skeleton.edges = skeleton.edges.astype(np.uint32)
        return skeleton

    skeleton = post.remove_loops(uint32(skeleton.consolidate()))
    skeleton = post.join_close_components(uint32(skeleton), restrict_by_radius=True)
    return post.remove_ticks(uint32(skeleton), TICK_NM).consolidate()


def merge_skeleton_shard(folder: Path, shard_number: int) -> dict[str, list[int]]:
    """Shard `shard_number` (of `planned_shard_count`) of the skeletons, as igneous's
    ShardedSkeletonMergeTask makes it, a segment at a time: its pieces merged, consolidated and
    postprocessed by kimimaro (loops, close pieces, ticks under `TICK_NM`); the shard file
    synthesized by cloud-volume, or unsharded a file per segment, each written atomically.
    Returns the files written (`file_record`); nothing for a shard without a skeleton."""
    from cloudvolume import Skeleton

    folder = Path(folder)
    where = skeleton_dir(folder)
    count = planned_shard_count(where)
    if not 0 <= shard_number < count:
        raise ValueError(f"skeleton shard {shard_number} of {count}")
    info = json.loads((where / "info").read_text())
    spec = info.get("sharding")
    if spec:
        (where / f"{shard_name(spec, shard_number)}.shard").unlink(missing_ok=True)
    decode = partial(Skeleton.from_precomputed, vertex_attributes=info["vertex_attributes"])
    encoded = {}
    for segment, tasks in shard_segments(where, shard_number):
        pieces = [read_piece(where, int(task), segment, decode) for task in tasks]
        skeleton = _postprocess(Skeleton.simple_merge(pieces))
        if not skeleton.empty():
            encoded[segment] = skeleton.to_precomputed()
    if spec:
        paths = [write_shard(where, spec, shard_number, encoded)] if encoded else []
    else:
        paths = [where / str(segment) for segment in encoded]
        for path, content in zip(paths, encoded.values(), strict=True):
            with atomic_path(path) as tmp:
                tmp.write_bytes(content)
    return {path.relative_to(folder).as_posix(): file_record(path) for path in paths}


def merge_skeleton_part(folder: Path, index: int, count: int) -> dict[str, list[int]]:
    """Merge task `index` of `count`: every skeleton shard whose number is `index` modulo
    `count` (`merge_skeleton_shard`), one after the other. Returns the files written."""
    shards = planned_shard_count(skeleton_dir(folder))
    return merge_in_turn(lambda n: merge_skeleton_shard(folder, n), index, count, shards)
