"""What an export folder holds and how its parts are named, shared by the export
(pipeline.export.layers), its meshing (pipeline.export.meshes) and its skeletons
(pipeline.export.skeletons): the layers' names, the export's settings, a scale, the one place
sizes change axis order, a layer's `info` read back, and what a task records of a file it wrote.
"""

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import ConfigError, PrecomputedError
from pipeline.data.volumes import ZYX, VoxelSize

IMAGE_LAYER = "image"
SEGMENTATION_LAYER = "segmentation"
MESH_DIR = "mesh"
SKELETON_DIR = "skeletons"
PROPERTIES_DIR = "segment_properties"
# `[export] destination`: the run dir's own folder, and the schemes it may name instead.
HERE = "file://"
DESTINATION_SCHEMES = ("file", "s3", "gs")


@dataclass(frozen=True)
class ExportConfig:
    """How the precomputed layers are cut, downsampled, meshed, skeletonized and compressed."""

    # Chunk edge in voxels along the finest axis; coarser axes get proportionally fewer voxels,
    # so a chunk is about as long in nm along every axis (at every scale). Both layers' when
    # sharded; unsharded, the image's, and in a workflow run the segmentation's is the
    # stitching's (`[blocks] chunk_zyx`) at every scale.
    chunk_voxels: int = 64
    # Scales including full resolution; each halves the finest axes (see `plan_scales`).
    num_scales: int = 3
    # Largest distance (nm) a simplified mesh may move from the voxel surface; 0: no simplifying.
    mesh_max_error_nm: float = 10.0
    # gzip chunks and mesh fragments (stored as `*.gz`): cloud-volume and `pipeline.export.viewer`
    # serve them, a plain static web server does not, so the default keeps files plain. Shards
    # gzip the chunks inside them whatever this says.
    gzip: bool = False
    # Voxels per export and meshing task along each axis (an export task's region is rounded up
    # to whole chunks of the coarsest scale): bounds each task's memory, 256^3 uint64 = 128 MiB.
    task_voxels: int = 256
    # Neuroglancer's sharded format (`neuroglancer_uint64_sharded_v1`): one file per task region
    # and scale instead of one per chunk, what a parallel file system holds at 10^12 voxels
    # (pipeline.export.shards says how the shards are cut). Served with HTTP Range requests
    # (pipeline.export.viewer does); false: a file per chunk, which any static web server serves.
    sharded: bool = True
    # Skeletons of every segment (kimimaro's TEASAR, by igneous's skeleton tasks: a task per
    # region, then merges), which Neuroglancer draws with the segments; sharded like the layers
    # (`sharded`), else a file per segment (pipeline.export.skeletons).
    skeletons: bool = True
    # Where the finished export is published (pipeline.export.destination): `file://`, the run
    # dir's own folder; else a URL (`s3://`, `gs://`, `file:///elsewhere`) the last task copies
    # it to with cloud-files, where the lab's Neuroglancer links point.
    destination: str = HERE

    def __post_init__(self) -> None:
        if not (isinstance(self.task_voxels, int) and 16 <= self.task_voxels <= 4096):
            raise ConfigError(
                f"export config: task_voxels must be an integer in [16, 4096], got {self.task_voxels!r}"
            )
        if not (isinstance(self.chunk_voxels, int) and 8 <= self.chunk_voxels <= 1024):
            raise ConfigError(
                f"export config: chunk_voxels must be an integer in [8, 1024], got {self.chunk_voxels!r}"
            )
        if not (isinstance(self.num_scales, int) and 1 <= self.num_scales <= 16):
            raise ConfigError(
                f"export config: num_scales must be an integer in [1, 16], got {self.num_scales!r}"
            )
        if not (
            isinstance(self.mesh_max_error_nm, int | float)
            and 0 <= self.mesh_max_error_nm < math.inf
        ):
            raise ConfigError(
                f"export config: mesh_max_error_nm must be a number >= 0, got {self.mesh_max_error_nm!r}"
            )
        for name in ("gzip", "sharded", "skeletons"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"export config: {name} must be true or false, got {getattr(self, name)!r}"
                )
        scheme = self.destination.partition("://")[0] if isinstance(self.destination, str) else ""
        if scheme not in DESTINATION_SCHEMES or not self.destination.startswith(f"{scheme}://"):
            raise ConfigError(
                f"export config: destination must be a URL of {', '.join(DESTINATION_SCHEMES)} "
                f"(file:// alone: the run dir), got {self.destination!r}"
            )
        if self.gzip and self.destination != HERE:
            # Local gzip files are `*.gz`, which a bucket would serve under the wrong name.
            raise ConfigError("export config: gzip = true needs the default destination file://")


@dataclass(frozen=True)
class Scale:
    """One resolution level: voxel size (nm), shape and chunk size, all (z, y, x)."""

    voxel_size_nm: VoxelSize
    shape_zyx: ZYX
    chunk_zyx: ZYX


def xyz(zyx: Sequence) -> list:
    """(z, y, x) sizes as cloud-volume's (x, y, z) list: the one place sizes change axis order."""
    return list(zyx)[::-1]


def layer_url(folder: Path, layer: str) -> str:
    """cloud-volume's address of a layer of the export in `folder`."""
    return f"file://{(folder / layer).resolve()}"


def layer_scales(info: dict) -> list[Scale]:
    """The scales an `info` lists, (z, y, x)."""
    return [
        Scale(
            tuple(float(v) for v in s["resolution"][::-1]),
            tuple(s["size"][::-1]),
            tuple(s["chunk_sizes"][0][::-1]),
        )
        for s in info["scales"]
    ]


def read_info(folder: Path, layer: str) -> dict:
    """A layer's `info`; PrecomputedError naming it when there is none."""
    path = folder / layer / "info"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PrecomputedError(f"{path}: no precomputed layer there ({exc})") from None


def file_record(path: str | os.PathLike) -> list[int]:
    """What a task records of a file it wrote: its size and mtime. The mtime is what sees it
    rewritten in place with its size kept (a chunk partly zeroed); `cp -a` keeps both."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]
