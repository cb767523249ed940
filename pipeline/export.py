"""Export an EM volume and its segmentation as Neuroglancer precomputed layers, with meshes.

The export folder (one atomic unit: built beside its destination, then renamed into place):

    image/                 raw EM, uint8, "raw" encoding, `num_scales` scales
    segmentation/          uint64, "compressed_segmentation" encoding (decoded by Neuroglancer)
        mesh/              legacy meshes in nm: a manifest `<id>:0` per segment and its fragments
        segment_properties/  every segment id with its voxel count (Neuroglancer lists and sorts them)
    export.json            what was written, every file with its size: the completeness record

cloud-volume writes mip 0; igneous (over cloud-volume) adds the downsampled scales, the meshes and
the mesh manifests. Its tasks run here, one after the other, in this process.

Axes: this project is (z, y, x) everywhere; cloud-volume and the precomputed format are (x, y, z).
Sizes are reversed only by `_xyz` and arrays transposed only in `_write_mip0`.

CLI: `python -m pipeline.export --raw vol.h5:raw --segmentation seg.h5:segmentation --out DIR`.
"""

import argparse
import contextlib
import io
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fastremap
import numpy as np
import tinybrain
from tqdm import tqdm

from pipeline.atomic import atomic_dir
from pipeline.cli import one_line_errors
from pipeline.errors import (
    ConfigError,
    EmptyLabelsError,
    PrecomputedError,
    VolumeDtypeError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.volumes import ZYX, VoxelSize, read_labels, read_raw

IMAGE_LAYER = "image"
SEGMENTATION_LAYER = "segmentation"
MESH_DIR = "mesh"
PROPERTIES_DIR = "segment_properties"
MANIFEST = "export.json"
MANIFEST_FORMAT = 1
# Files without which Neuroglancer cannot open the layers or find their meshes.
REQUIRED_FILES = (
    f"{IMAGE_LAYER}/info",
    f"{SEGMENTATION_LAYER}/info",
    f"{SEGMENTATION_LAYER}/{MESH_DIR}/info",
    f"{SEGMENTATION_LAYER}/{PROPERTIES_DIR}/info",
)
# Voxels per meshing task along each axis: bounds its memory (256^3 uint64 labels = 128 MiB).
MESH_TASK_VOXELS = 256


@dataclass(frozen=True)
class ExportConfig:
    """How the precomputed layers are cut, downsampled, meshed and compressed."""

    # Chunk edge in voxels along the finest axis; coarser axes get proportionally fewer voxels,
    # so a chunk is about as long in nm along every axis (at every scale).
    chunk_voxels: int = 64
    # Scales including full resolution; each halves the finest axes (see `plan_scales`).
    num_scales: int = 3
    # Largest distance (nm) a simplified mesh may move from the voxel surface; 0: no simplifying.
    mesh_max_error_nm: float = 10.0
    # gzip chunks and mesh fragments (stored as `*.gz`): cloud-volume and `pipeline.viewer`
    # serve them, a plain static web server does not, so the default keeps files plain.
    gzip: bool = False

    def __post_init__(self) -> None:
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
        if not isinstance(self.gzip, bool):
            raise ConfigError(f"export config: gzip must be true or false, got {self.gzip!r}")


@dataclass(frozen=True)
class Scale:
    """One resolution level: voxel size (nm), shape and chunk size, all (z, y, x)."""

    voxel_size_nm: VoxelSize
    shape_zyx: ZYX
    chunk_zyx: ZYX


@dataclass(frozen=True)
class ExportResult:
    """What `export_precomputed` wrote: its folder, scales, segments and files (besides its
    record `export.json`), and how long it took."""

    path: Path
    scales: tuple[Scale, ...]
    segment_count: int
    file_count: int
    seconds: float


def _xyz(zyx: Sequence) -> list:
    """(z, y, x) sizes as cloud-volume's (x, y, z) list: the one place sizes change axis order."""
    return list(zyx)[::-1]


def _downsample_factor(voxel_size_nm: VoxelSize) -> ZYX:
    """Halve every axis finer than twice the finest one.

    Isotropic voxels give (2, 2, 2); 2:1 serial-section voxels give (1, 2, 2) (z, y, x) until x
    and y catch up with z, then (2, 2, 2): voxels never get more anisotropic than they were.
    """
    finest = min(voxel_size_nm)
    return tuple(2 if size < 2 * finest else 1 for size in voxel_size_nm)


def _chunk_zyx(voxel_size_nm: VoxelSize, chunk_voxels: int) -> ZYX:
    """`chunk_voxels` along the finest axis, a power-of-two fraction of it along coarser ones."""
    finest = min(voxel_size_nm)
    return tuple(max(1, chunk_voxels >> round(math.log2(size / finest))) for size in voxel_size_nm)


def plan_scales(shape_zyx: ZYX, voxel_size_nm: VoxelSize, config: ExportConfig) -> list[Scale]:
    """The export's scales, full resolution first.

    Fewer than `config.num_scales` when an axis to halve is down to one voxel: nothing to gain.
    """
    scales = [Scale(voxel_size_nm, shape_zyx, _chunk_zyx(voxel_size_nm, config.chunk_voxels))]
    while len(scales) < config.num_scales:
        last = scales[-1]
        factor = _downsample_factor(last.voxel_size_nm)
        if any(n < 2 for n, f in zip(last.shape_zyx, factor, strict=True) if f > 1):
            break
        size = tuple(s * f for s, f in zip(last.voxel_size_nm, factor, strict=True))
        shape = tuple(-(-n // f) for n, f in zip(last.shape_zyx, factor, strict=True))
        scales.append(Scale(size, shape, _chunk_zyx(size, config.chunk_voxels)))
    return scales


def _check_inputs(
    raw: np.ndarray, segmentation: np.ndarray, voxel_size_nm: Sequence[float]
) -> tuple[np.ndarray, VoxelSize]:
    """Validate the pair; returns the segmentation as uint64 and the voxel size as floats."""
    if raw.ndim != 3:
        raise VolumeShapeError(f"export: raw must be a 3-D (z, y, x) array, got shape {raw.shape}")
    if segmentation.shape != raw.shape:
        raise VolumeShapeError(
            f"export: segmentation shape {segmentation.shape} differs from raw shape {raw.shape}"
        )
    if raw.dtype != np.uint8:
        raise VolumeDtypeError(f"export: raw must be uint8, got {raw.dtype}")
    if segmentation.dtype.kind != "u":
        raise VolumeDtypeError(
            f"export: segmentation must be an unsigned integer type (uint64), got {segmentation.dtype}"
        )
    try:
        size = tuple(float(s) for s in np.ravel(voxel_size_nm))
    except (TypeError, ValueError):
        size = ()
    if len(size) != 3 or not all(0 < s < math.inf for s in size):
        raise VoxelSizeError(
            f"export: voxel size must be 3 positive numbers (z, y, x) in nm, got {voxel_size_nm!r}"
        )
    # Nothing to mesh or show: the stage before failed, and a "successful" export would hide it.
    if not segmentation.any():
        raise EmptyLabelsError("export: segmentation is all zero (no segment to show or mesh)")
    return segmentation.astype(np.uint64, copy=False), size


def _check_replaceable(final: Path) -> None:
    """Only an earlier export (or nothing, or an empty folder) may be replaced."""
    replaceable = (
        not final.exists()
        or (final / MANIFEST).is_file()
        or (final.is_dir() and not any(final.iterdir()))
    )
    if not replaceable:
        raise PrecomputedError(f"{final}: exists and is not an export; refusing to replace it")


def _layer_url(folder: Path, layer: str) -> str:
    return f"file://{(folder / layer).resolve()}"


def _write_layer(
    folder: Path, layer: str, array: np.ndarray, scales: list[Scale], config: ExportConfig
) -> None:
    """Write every scale of one layer: the array, then its downsamplings, chunk by chunk.

    Downsampling runs here on the whole array with tinybrain (what igneous's downsampling tasks
    call): the volume is in memory anyway, and igneous's tasks build a scale only from whole
    chunks of it, so they silently leave out the last scales of small volumes.
    """
    from cloudvolume import CloudVolume

    segmentation = layer == SEGMENTATION_LAYER
    url = _layer_url(folder, layer)
    compress = "gzip" if config.gzip else False
    info = CloudVolume.create_new_info(
        num_channels=1,
        layer_type="segmentation" if segmentation else "image",
        data_type=str(array.dtype),
        encoding="compressed_segmentation" if segmentation else "raw",
        # Whole numbers as ints: scale folders are named after them (10_10_20, not 10.0_10.0_20.0).
        resolution=[int(v) if v.is_integer() else v for v in _xyz(scales[0].voxel_size_nm)],
        voxel_offset=[0, 0, 0],
        volume_size=_xyz(array.shape),
        chunk_size=_xyz(scales[0].chunk_zyx),
    )
    volume = CloudVolume(url, info=info, compress=compress, progress=False)
    for scale in scales[1:]:
        first = scales[0].voxel_size_nm
        factor = [round(s / f) for s, f in zip(scale.voxel_size_nm, first, strict=True)]
        volume.add_scale(_xyz(factor), chunk_size=_xyz(scale.chunk_zyx))
    volume.commit_info()
    # The one transpose: (z, y, x) in C order is (x, y, z) in Fortran order, so no copy is made.
    data = array.T
    downsample = (
        tinybrain.downsample_segmentation if segmentation else tinybrain.downsample_with_averaging
    )
    for mip, scale in enumerate(scales):
        if mip:
            last = scales[mip - 1].voxel_size_nm
            factor = [round(s / f) for s, f in zip(scale.voxel_size_nm, last, strict=True)]
            data = downsample(data, _xyz(factor))[0]
        CloudVolume(url, mip=mip, compress=compress, progress=False)[:, :, :] = data


def _mesh(folder: Path, config: ExportConfig) -> None:
    """Mesh every segment at full resolution, then write the manifests Neuroglancer looks up.

    igneous's tasks run here one by one, as `LocalTaskQueue(parallel=1)` would run them, but
    without its process-wide switch of multiprocessing to "spawn", which would change how the rest
    of the workflow starts processes.
    """
    # igneous imports its skeletonising dependencies too (about 2 s): only exporting pays for it.
    from igneous.task_creation import create_mesh_manifest_tasks, create_meshing_tasks
    from taskqueue import totask

    url = _layer_url(folder, SEGMENTATION_LAYER)
    # igneous prints the task set's bounds to stdout; the progress bar says enough.
    with contextlib.redirect_stdout(io.StringIO()):
        tasks = list(
            create_meshing_tasks(
                url,
                mip=0,
                shape=(MESH_TASK_VOXELS,) * 3,
                simplification=config.mesh_max_error_nm > 0,
                max_simplification_error=config.mesh_max_error_nm,
                mesh_dir=MESH_DIR,
                # The spatial index serves cloud-volume's region queries; Neuroglancer ignores it.
                spatial_index=False,
                compress="gzip" if config.gzip else False,
            )
        )
    # The manifests list the fragments that the meshing tasks wrote, so they run last.
    for task in [*tasks, *create_mesh_manifest_tasks(url)]:
        totask(task).execute()


def _write_segment_properties(folder: Path, segmentation: np.ndarray) -> int:
    """Record every segment's voxel count; returns the number of segments."""
    from cloudvolume import CloudVolume

    ids, counts = fastremap.unique(segmentation, return_counts=True)
    ids, counts = ids[ids != 0], counts[ids != 0]
    properties = {
        "@type": "neuroglancer_segment_properties",
        "inline": {
            "ids": [str(i) for i in ids],
            "properties": [
                {
                    "id": "voxels",
                    "type": "number",
                    "description": "size in voxels at full resolution",
                    # Neuroglancer's widest integer type is uint32.
                    "data_type": "uint32" if counts.max() < 2**32 else "float32",
                    "values": counts.tolist(),
                }
            ],
        },
    }
    layer = folder / SEGMENTATION_LAYER
    (layer / PROPERTIES_DIR).mkdir()
    (layer / PROPERTIES_DIR / "info").write_text(json.dumps(properties))
    volume = CloudVolume(_layer_url(folder, SEGMENTATION_LAYER))
    volume.info["segment_properties"] = PROPERTIES_DIR
    volume.commit_info()
    return len(ids)


def _write_manifest(folder: Path, summary: dict) -> int:
    """List every file with its size in `export.json`; returns the number of files."""
    files = {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    (folder / MANIFEST).write_text(
        json.dumps({"format": MANIFEST_FORMAT, **summary, "files": files}, indent=1)
    )
    return len(files)


@contextlib.contextmanager
def _naming(folder: Path) -> Iterator[None]:
    """An OS error that names no file (a full disk, seen by a library's write) names `folder`, so
    its one line says which disk."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(folder)) from exc


def export_precomputed(
    raw: np.ndarray,
    segmentation: np.ndarray,
    voxel_size_nm: Sequence[float],
    out_dir: str | Path,
    config: ExportConfig = ExportConfig(),
    progress: bool = False,
) -> ExportResult:
    """Write `raw` (uint8) and `segmentation` (unsigned ints, 0 = background), both (z, y, x), as
    precomputed layers `image` and `segmentation` with meshes under `out_dir`, atomically.

    An existing export at `out_dir` is replaced; any other non-empty folder there is an error.
    """
    started = time.perf_counter()
    segmentation, voxel_size = _check_inputs(raw, segmentation, voxel_size_nm)
    scales = plan_scales(raw.shape, voxel_size, config)
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    with (
        _naming(out_dir),
        atomic_dir(out_dir) as tmp,
        tqdm(total=4, desc="export", unit="step", disable=not progress) as bar,
    ):
        for layer, array in ((IMAGE_LAYER, raw), (SEGMENTATION_LAYER, segmentation)):
            bar.set_postfix_str(layer)
            _write_layer(tmp, layer, array, scales, config)
            bar.update()
        bar.set_postfix_str("meshes")
        _mesh(tmp, config)
        bar.update()
        bar.set_postfix_str("segment properties")
        segment_count = _write_segment_properties(tmp, segmentation)
        summary = {
            "shape_zyx": list(raw.shape),
            "voxel_size_nm": list(voxel_size),
            "scales_nm": [list(s.voxel_size_nm) for s in scales],
            "segment_count": segment_count,
        }
        file_count = _write_manifest(tmp, summary)
        bar.update()
    return ExportResult(
        out_dir, tuple(scales), segment_count, file_count, time.perf_counter() - started
    )


def export_complete(folder: str | Path) -> bool:
    """True when `folder` holds a finished export: its record lists the layers' info files and
    every file it lists is there with the size it had when written."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        if not all(name in files for name in REQUIRED_FILES):
            return False
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


# --- command line -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    defaults = ExportConfig()
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.export",
        description="Write an EM volume and its segmentation as Neuroglancer precomputed layers "
        "(image, segmentation with meshes) into a folder; view it with python -m pipeline.viewer.",
    )
    add = parser.add_argument
    add("--raw", required=True, help="raw image, path.h5:dataset (uint8)")
    add("--segmentation", required=True, help="segmentation, path.h5:dataset (integer ids)")
    add("--out", required=True, type=Path, help="export folder (replaced if it is an export)")
    add(
        "--voxel-size",
        type=float,
        nargs=3,
        metavar=("Z", "Y", "X"),
        help="voxel size in nm (default: the files' voxel_size_nm attribute)",
    )
    add("--chunk-voxels", type=int, default=defaults.chunk_voxels, help="default: %(default)s")
    add("--scales", type=int, default=defaults.num_scales, help="default: %(default)s")
    add(
        "--mesh-max-error-nm",
        type=float,
        default=defaults.mesh_max_error_nm,
        help="mesh simplification tolerance, 0 = none (default: %(default)s)",
    )
    add("--gzip", action="store_true", help="gzip chunks and meshes (needs a gzip-aware server)")
    return parser


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = ExportConfig(
        chunk_voxels=args.chunk_voxels,
        num_scales=args.scales,
        mesh_max_error_nm=args.mesh_max_error_nm,
        gzip=args.gzip,
    )
    raw, voxel_size = read_raw(args.raw, args.voxel_size)
    segmentation, _ = read_labels(args.segmentation, voxel_size)
    result = export_precomputed(raw, segmentation, voxel_size, args.out, config, progress=True)
    print(
        f"[export] wrote {result.path}: {len(result.scales)} scales, {result.segment_count} "
        f"segments, {result.file_count} files, {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
