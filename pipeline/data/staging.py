"""Data staging: put validated copies of the input volumes into the run directory, or, for a
large chunked volume to segment, a record of where to read it in place.

Either the embedded synthetic data set (a training volume and a held-out volume from two seeds of
one preset) or the user's own volumes. Staged files hold `raw` and, when known, `labels`, with the
voxel size; later stages read only these, so a run does not depend on files elsewhere changing
under it. The volume to segment, when it is zarr or precomputed (what volumes too large to copy
come as, and what many tasks can read at once), is not copied: its stage writes
`staged/eval.json` (`reads_in_place`), naming the source's box (`VolumeSpec.box`), its shape,
voxel size, a checksum of its metadata and the state of the chunk files the box is read from
(`volumes.chunk_state`), and beside it a digest of each zarr chunk of the box
(`[data] chunk_digests`), which every read checks, and per source a cell per chunk of the box
(`_keep_cells`), on which a task reading a part of the volume is keyed; every later stage reads
through `read_staged`.
"""

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pipeline.core import config_io, stamps
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import (
    ConfigError,
    EmptyLabelsError,
    MissingChunkError,
    VolumeDtypeError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.core.roi import ChunkStates, Roi, check_apart, check_roi
from pipeline.core.stamps import (
    VolumeDigest,
    digest,
    digest_files,
    volume_digest,
    write_brick_digests,
)
from pipeline.data.precomputed_volumes import info_sha256
from pipeline.data.synthetic import PRESETS, generate
from pipeline.data.volumes import (
    FILL_MISSING,
    VolumeHeader,
    VolumeSpec,
    VoxelSize,
    chunk_state,
    is_zarr,
    new_volumes,
    read_bricks,
    read_header,
)
from pipeline.data.volumes import chunk_digests as volume_chunk_digests
from pipeline.data.zarr_volumes import DIGEST, FILL_MISSING_HINT, ChunkDigests

STAGED_ATTR = "staged_from"
SCORED_ATTR = "scored_roi"  # z0:z1, y0:y1, x0:x1 within the staged volume


def resolve_volume(spec: str, folder: Path) -> str:
    """A volume spec (`path.h5:dataset`, `path.zarr:array`, either with a `[box]`) with its
    file's relative path made absolute against `folder`, the rest kept as written; a URL
    (`precomputed://...`) stays as it is."""
    if "://" in spec:
        return spec
    body, box = spec, ""
    if spec.endswith("]") and "[" in spec:  # the box, as VolumeSpec.parse takes it off
        cut = spec.rindex("[")
        body, box = spec[:cut], spec[cut:]
    path, colon, dataset = body.rpartition(":")
    # Without a dataset the spec is malformed: resolved whole, it fails later naming the file.
    return config_io.resolve_file(path if colon else body, folder) + colon + dataset + box


def _volume() -> Any:
    return config_io.path_setting(resolve_volume)


@dataclass(frozen=True)
class DataConfig:
    """The volumes of a run: training, checkpoint selection, evaluation. With no files given,
    three volumes of the synthetic preset (three seeds)."""

    synthetic_preset: str = "default"
    synthetic_shape_zyx: tuple[int, int, int] | None = None  # the preset's tissue in another box
    train_seed: int = 0
    eval_seed: int = 1
    select_seed: int = 2
    # Volumes: path.h5:dataset, path.zarr:array, precomputed://URL (file:///layer, or read
    # from a store: https://, http://, s3://, gs://) or folder:*.tif (a folder of TIFF
    # sections, in the order of their names); in a config file a relative path is relative to
    # the file's folder.
    train_raw: str = _volume()  # your training image ...
    train_labels: str = _volume()  # ... and its ground truth
    eval_raw: str = _volume()  # the volume to segment; without eval_labels it is not scored
    eval_labels: str = _volume()
    # Selection scores checkpoints on a labeled part of its own: these files, or without them
    # select_roi of the training file; with neither, on the training volume.
    select_raw: str = _volume()
    select_labels: str = _volume()
    # Parts of the files, "z0:z1, y0:y1, x0:x1" (voxels, stop excluded); "" = the whole volume.
    # Parts of one file must not overlap.
    train_roi: str = ""
    select_roi: str = ""
    eval_roi: str = ""
    voxel_size_nm: tuple[float, float, float] | None = None  # only for files without the attribute
    # A chunk of a zarr or precomputed input that does not exist reads as zeros (true), or is an
    # error naming it (false). zarr and cloud-volume can do either; a lost chunk of an image read
    # as zeros is a silent hole the model segments as nothing, so zeros must be asked for
    # (cloud-volume's `fill_missing`), e.g. for a sparse volume whose empty chunks were not written.
    fill_missing: bool = False
    # A zarr volume read in place: its staging reads each chunk of the box once and records a
    # crc32 of its bytes beside the run's staging record (never in your store), and every later
    # read of a chunk checks it: a chunk whose bytes were overwritten in place since (the same
    # length: its header still agrees) is an error naming it, not a segmentation of garbage.
    # zarr stores keep no checksum, and Blosc decodes an image chunk it stored uncompressed (EM
    # does not compress) whatever its bytes. On by default: the cost is reading the box once
    # more at staging (fast next to segmenting it) and a crc32 per chunk read, 5 ms per 256^3
    # voxels against tens for decoding them (BENCHMARKS.md, "Chunk digests"). Volumes the run
    # copies need none: it writes them itself, deflate-compressed, and zlib checks each chunk's
    # adler32 when HDF5 decodes it. A chunk's length is checked on every read, with or without.
    chunk_digests: bool = True

    def __post_init__(self) -> None:
        if self.synthetic_preset not in PRESETS:
            raise ConfigError(
                f"synthetic_preset must be one of {sorted(PRESETS)}, got {self.synthetic_preset!r}"
            )
        if bool(self.train_raw) != bool(self.train_labels):
            raise ConfigError("give both train_raw and train_labels, or neither")
        if self.eval_labels and not self.eval_raw:
            raise ConfigError("eval_labels given without eval_raw")
        if bool(self.select_raw) != bool(self.select_labels):
            raise ConfigError("give both select_raw and select_labels, or neither")
        if self.synthetic and (self.select_raw or any(self.rois.values())):
            raise ConfigError(
                "select_raw and the ROIs are parts of your files: give train_raw and eval_raw too"
            )
        if self.select_roi and not (self.select_raw or self.train_raw):
            raise ConfigError("select_roi is a part of select_raw, or of train_raw")
        for name, text in self.rois.items():
            if text:
                Roi.parse(text, name)
        if not isinstance(self.fill_missing, bool):
            raise ConfigError(f"fill_missing must be true or false, got {self.fill_missing!r}")
        if self.fill_missing and self.synthetic:
            raise ConfigError("fill_missing is about chunks of your files: give eval_raw too")
        if not isinstance(self.chunk_digests, bool):
            raise ConfigError(f"chunk_digests must be true or false, got {self.chunk_digests!r}")

    @property
    def rois(self) -> dict[str, str]:
        return {
            "train_roi": self.train_roi,
            "select_roi": self.select_roi,
            "eval_roi": self.eval_roi,
        }

    @property
    def has_select_part(self) -> bool:
        """Whether selection has a volume of its own (else it scores on the training volume)."""
        return self.synthetic or bool(self.select_raw or self.select_roi)

    @property
    def synthetic(self) -> bool:
        return not self.train_raw and not self.eval_raw


ROLES = ("train", "select", "eval")


def _role_files(data: DataConfig, role: str) -> tuple[str, str]:
    if role == "select" and not data.select_raw:  # a part of the training file
        return data.train_raw, data.train_labels
    return getattr(data, f"{role}_raw"), getattr(data, f"{role}_labels")


def role_settings(data: DataConfig, role: str, context_zyx: Sequence[int] = (0, 0, 0)) -> dict:
    """The settings staging one role's volume depends on ("train", "select" or "eval"): another
    role's change must not re-stage this one. An evaluated ROI is staged with `context_zyx`
    voxels around it (where the volume has them) and scored inside only, so objects at its faces
    can be seeded and followed."""
    if data.synthetic:
        seed = getattr(data, f"{role}_seed")
        shape = data.synthetic_shape_zyx
        return {
            "role": role,
            "synthetic_preset": data.synthetic_preset,
            "seed": seed,
            "shape_zyx": shape,
        }
    raw, labels = _role_files(data, role)
    roi = getattr(data, f"{role}_roi")
    settings = {"role": role, "raw": raw, "labels": labels, "voxel_size_nm": data.voxel_size_nm}
    if role == "eval" and reads_in_place(data):
        settings["in_place"] = True
        if not data.chunk_digests:  # only when off: the stamps of runs before it stay valid
            settings["chunk_digests"] = False
    if data.fill_missing:  # only when set: the stamps of runs without it stay as they were
        settings["fill_missing"] = True
    if roi:
        context = [int(c) for c in context_zyx] if role == "eval" else [0, 0, 0]
        settings |= {"roi": str(Roi.parse(roi)), "context_zyx": context}
    if any(VolumeSpec.parse(s).url for s in (raw, labels) if s):
        settings["remote_chunks"] = _remote_chunks(raw, labels, roi, settings.get("context_zyx"))
    return settings


def _remote_chunks(raw: str, labels: str, roi: str, context_zyx: Sequence[int] | None) -> str:
    """A digest of what the stores say now about the box to stage of each source read by URL:
    its info's sha256 and the state of the chunk files of the box (`volumes.chunk_state`: a
    HEAD request per file). In the stage's settings, so that a resume re-stages a role whose
    remote chunks changed, as the folder of a local source's chunks does (`source_files`);
    the cost, a request per chunk file of the box, is paid whenever the workflow plans."""
    states = []
    for text, is_labels in ((raw, False), (labels, True)):
        spec = VolumeSpec.parse(text) if text else None
        if spec is not None and spec.url:
            shape = read_header(spec, labels=is_labels).shape
            box = Roi.parse(roi).grown(context_zyx, shape) if roi else Roi.whole(shape)
            states.append([str(spec), metadata_sha256(spec), chunk_state(spec.part(box))])
    return digest(states)


def reads_in_place(data: DataConfig) -> bool:
    """Whether the volume to segment is read where it is (zarr or precomputed, raw and labels
    alike) rather than copied into the run."""
    specs = [VolumeSpec.parse(s) for s in (data.eval_raw, data.eval_labels) if s]
    return bool(specs) and all(s.precomputed or is_zarr(s.path) for s in specs)


def metadata_files(spec: VolumeSpec) -> list[Path]:
    """The files that describe a volume: of a precomputed layer its `info` (none of a layer
    read by URL), of a zarr array its `.zarray` (and `.zattrs`), not the chunk files of a volume
    that may hold millions; an HDF5 file is itself, and so is a folder of TIFF sections."""
    if spec.url:
        return []
    if spec.precomputed:
        return [spec.path / "info"]
    if is_zarr(spec.path):
        array = spec.path / spec.dataset
        return [array / ".zarray"] + [p for p in [array / ".zattrs"] if p.is_file()]
    return [spec.path]


def metadata_sha256(spec: VolumeSpec) -> str:
    """The sha256 of a volume's metadata: its `metadata_files`, or a remote layer's info."""
    return info_sha256(spec.url) if spec.url else digest_files(metadata_files(spec))


def chunk_folder(spec: VolumeSpec) -> Path | None:
    """The folder of a chunked volume's chunk files: a zarr array's, a precomputed layer's scale
    0 (named in its `info`); None for HDF5, a layer whose info cannot be read or one read by
    URL."""
    if spec.url:
        return None
    if spec.precomputed:
        try:
            return spec.path / json.loads((spec.path / "info").read_text())["scales"][0]["key"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    return spec.path / spec.dataset if is_zarr(spec.path) else None


def source_files(data: DataConfig, role: str) -> list[Path]:
    """The user's files a role's volume is read from (none for synthetic data), by which a
    resume notices a changed source: of a chunked volume, its metadata (`metadata_files`) and
    the folder of its chunk files, so that a chunk written, rewritten, lost or restored re-runs
    its staging (whose record then says whether the chunks of the staged box changed). Cost:
    the token of a folder (`stamps.source_token`) lists and stats every file under it when the
    workflow plans and when the stage runs, the whole volume's chunks, not only the box's. A
    layer read by URL has no file here: its stage's settings hold its state instead
    (`role_settings`, "remote_chunks")."""
    specs = [VolumeSpec.parse(s) for s in _role_files(data, role) if s]
    files = {path for spec in specs for path in metadata_files(spec)}
    folders = {chunk_folder(spec) for spec in specs} - {None}
    return sorted(files | {f for f in folders if f.is_dir()})


def check_sources(data: DataConfig, min_shape_zyx: Sequence[int]) -> None:
    """Before any job is submitted: every user volume opens, names an existing 3-D dataset of an
    accepted dtype with a voxel size, raw and labels agree in shape and voxel size, each part
    (ROI) lies inside its volume and is at least `min_shape_zyx` (the FOV), and the parts of one
    file do not overlap. Reads no voxels."""
    if data.synthetic:
        shape = PRESETS[data.synthetic_preset].with_geometry(data.synthetic_shape_zyx).shape_zyx
        if any(s < m for s, m in zip(shape, min_shape_zyx, strict=True)):
            raise VolumeShapeError(
                f"the synthetic volumes, {shape} voxels (z, y, x), are smaller than the FOV "
                f"{tuple(min_shape_zyx)}: give [data] synthetic_shape_zyx at least the FOV"
            )
        return
    parts_of: dict[Path | str, dict[str, Roi]] = {}
    for role in ROLES:
        if data.synthetic or (role == "select" and not data.has_select_part):
            continue
        raw, labels = _role_files(data, role)
        if not raw:
            if role == "eval":
                raise ConfigError("no volume to segment: give eval_raw")
            continue  # inference only: no training or selection volume
        headers = [
            read_header(spec, data.voxel_size_nm, labels=key == "labels")
            for key, spec in (("raw", raw), ("labels", labels))
            if spec
        ]
        if len({h.shape for h in headers}) > 1:
            shapes = {str(h.spec): h.shape for h in headers}
            raise VolumeShapeError(f"{role} volume: raw and labels differ in shape: {shapes}")
        if len({h.voxel_size_nm for h in headers}) > 1:
            sizes = {str(h.spec): h.voxel_size_nm for h in headers}
            raise VoxelSizeError(
                f"{role} volume: raw and labels differ in voxel size (nm): {sizes}"
            )
        shape, roi_text = headers[0].shape, getattr(data, f"{role}_roi")
        part = Roi.parse(roi_text, f"{role}_roi") if roi_text else Roi.whole(shape)
        where = f"{role}_roi" if roi_text else str(headers[0].spec)
        check_roi(part, shape, min_shape_zyx, where)
        source = headers[0].spec.url or headers[0].spec.path.resolve()
        parts_of.setdefault(source, {})[f"{role} part"] = part
    for parts in parts_of.values():
        check_apart(parts)


def stage_role(path: str | Path, settings: dict) -> str:
    """Stage the volume `role_settings` describes; returns the digest of what was staged (the
    token of pipeline.core.stamps)."""
    if "synthetic_preset" in settings:
        preset, seed, shape = (settings[k] for k in ("synthetic_preset", "seed", "shape_zyx"))
        return stage_synthetic(path, preset, seed, tuple(shape) if shape else None)
    stage = stage_in_place if settings.get("in_place") else stage_files
    fill = FILL_MISSING if settings.get("fill_missing") else ""
    digests = (
        {"chunk_digests": settings.get("chunk_digests", True)} if settings.get("in_place") else {}
    )
    return stage(
        path,
        settings["raw"] + fill,
        settings["labels"] + fill if settings["labels"] else "",
        settings["voxel_size_nm"],
        settings.get("roi", ""),
        settings.get("context_zyx", (0, 0, 0)),
        **digests,
    )


def stage_synthetic(path: str | Path, preset: str, seed: int, shape_zyx=None) -> str:
    config = dataclasses.replace(PRESETS[preset].with_geometry(shape_zyx), seed=seed)
    raw, labels = generate(config)
    provenance = json.dumps(
        {"synthetic_preset": preset, "seed": seed, "shape_zyx": config.shape_zyx}
    )
    arrays = {"raw": raw, "labels": labels}
    sha = volume_digest(arrays, [float(v) for v in config.voxel_size_nm])
    layout = {name: (array.shape, array.dtype) for name, array in arrays.items()}
    with new_volumes(path, layout, config.voxel_size_nm, {STAGED_ATTR: provenance}) as datasets:
        for name, array in arrays.items():
            datasets[name][...] = array
            write_brick_digests(datasets[name].file, sha, name)
    return sha.hexdigest()


def _source_part(
    raw_spec: str, labels_spec: str, voxel_size_nm, roi: str, context_zyx: Sequence[int]
) -> tuple[dict[str, VolumeHeader], Roi, Roi]:
    """The sources' headers {"raw", "labels"?} (checked to agree), the part named by `roi` and
    the box to stage: the part with `context_zyx` around it, as far as the volume goes."""
    raw = read_header(raw_spec, voxel_size_nm)
    sources = {"raw": raw}
    if labels_spec:
        sources["labels"] = read_header(labels_spec, raw.voxel_size_nm, labels=True)
        if sources["labels"].shape != raw.shape:
            raise VolumeShapeError(
                f"{labels_spec}: labels shape {sources['labels'].shape} differs from raw "
                f"{raw_spec} shape {raw.shape}"
            )
    part = Roi.parse(roi) if roi else Roi.whole(raw.shape)
    check_roi(part, raw.shape, (1, 1, 1), f"{raw_spec}: ROI")
    return sources, part, part.grown(context_zyx, raw.shape)


def _require_labeled(labels_spec: str, part: Roi) -> None:
    """Some voxel of the scored `part` is labeled (read brick by brick, up to the first one)."""
    for _, brick in read_bricks(labels_spec, part.slices, stamps.BRICK, labels=True):
        if brick.any():
            return
    raise EmptyLabelsError(f"{labels_spec}: no labeled voxel in the ROI {part}")


def stage_files(
    path: str | Path,
    raw_spec: str,
    labels_spec: str = "",
    voxel_size_nm=None,
    roi: str = "",
    context_zyx: Sequence[int] = (0, 0, 0),
) -> str:
    """Validate the user's volume(s) and copy them, or their `roi` with `context_zyx` around it,
    in; labels are optional (then nothing is scored). The staged region is copied brick by brick
    (`volumes.read_bricks`), so the memory of staging does not grow with the volume. The scored
    part within the staged volume is its attribute `scored_roi`; each array's brick digests are
    a dataset of it (`stamps.write_brick_digests`), on which a task reading a part of the array
    (an inference block, an evaluation region) is keyed. Returns the digest of the content
    read."""
    sources, part, staged = _source_part(raw_spec, labels_spec, voxel_size_nm, roi, context_zyx)
    shape, voxel_size = sources["raw"].shape, sources["raw"].voxel_size_nm
    provenance = json.dumps(
        {
            "raw": str(VolumeSpec.parse(raw_spec)),
            "labels": labels_spec,
            "roi": roi,
            "staged": str(staged),
            "source_shape_zyx": list(shape),
            "voxel_size_nm": list(voxel_size),
        }
    )
    attrs, described = {STAGED_ATTR: provenance}, [float(v) for v in voxel_size]
    if roi:  # the digest of a whole volume is the same, staged from a file or generated
        attrs[SCORED_ATTR] = str(part.relative_to(staged))
        described = [described, attrs[SCORED_ATTR]]
    dtypes = {"raw": np.uint8, "labels": np.uint64}
    layout = {name: (staged.shape, dtypes[name]) for name in sources}
    sha, labeled = VolumeDigest(described), False
    scored = part.relative_to(staged)
    with new_volumes(path, layout, voxel_size, attrs) as datasets:
        for name in sources:
            sha.begin(name, dtypes[name], staged.shape)
            bricks = read_bricks(sources[name].spec, staged.slices, stamps.BRICK, name == "labels")
            for start, brick in bricks:
                box = Roi(start, tuple(a + n for a, n in zip(start, brick.shape, strict=True)))
                datasets[name][box.slices] = brick
                sha.update(name, start, brick)
                if name == "labels" and not labeled and box.overlaps(scored):
                    low = np.maximum(box.start, scored.start) - box.start
                    high = np.minimum(box.stop, scored.stop) - box.start
                    labeled = bool(brick[tuple(map(slice, low, high))].any())
        if labels_spec and not labeled:
            raise EmptyLabelsError(f"{labels_spec}: no labeled voxel in the ROI {part}")
        for name in sources:  # a task reading a part of an array is keyed on its bricks
            write_brick_digests(datasets[name].file, sha, name)
    return sha.hexdigest()


def _check_in_place_dtypes(sources: dict, raw_spec: str, labels_spec: str) -> None:
    """Read in place, the voxels are what the source stores: a uint8 image, integer labels."""
    if sources["raw"].dtype != np.uint8:
        raise VolumeDtypeError(
            f"{raw_spec}: an image read in place must be uint8, got {sources['raw'].dtype} "
            "(convert it, or give it as HDF5 to have it copied and converted)"
        )
    if labels_spec and sources["labels"].dtype.kind not in "iu":
        raise VolumeDtypeError(
            f"{labels_spec}: labels read in place must be of an integer type, got "
            f"{sources['labels'].dtype}"
        )


def _chunk_digests(boxed: dict[str, str]) -> dict[str, ChunkDigests]:
    """The crc32 of each zarr chunk of each source's box (`volumes.chunk_digests`: each chunk
    read once); none of a precomputed layer."""
    found = {name: volume_chunk_digests(spec) for name, spec in boxed.items()}
    return {name: digests for name, digests in found.items() if digests is not None}


def _save_chunk_digests(record_path: Path, found: dict[str, ChunkDigests]) -> dict:
    """Keep `found` beside the record; per source the digest's name and the sidecar's sha256."""
    return {
        name: {"digest": DIGEST, "sha256": digests.save(digest_sidecar(record_path, name))}
        for name, digests in found.items()
    }


def _array_identity(record: dict, name: str) -> str:
    """What array `name` of a record is besides its voxels: its box of its source, the staged
    shape, voxel size and scored part, its source's shape, dtype and metadata (not the states
    of its chunks)."""
    source = record["sources"][0 if name == "raw" else 1]
    kept = {k: record[k] for k in ("shape_zyx", "voxel_size_nm", "scored_roi")}
    unchunked = {k: v for k, v in source.items() if k != "chunks"}
    return digest(kept | {"array": name, "spec": record[name], "source": unchunked})


def _chunk_cells(
    states: ChunkStates, digests: ChunkDigests | None, box: Roi, identity: str
) -> stamps.Cells:
    """The cells a task reading a part of a source's box is keyed on, a cell per chunk: its
    crc32 where staging recorded one (`[data] chunk_digests`: content, so a chunk written again
    with the same bytes runs nothing again), else its file's state (`chunk_state`)."""
    if digests is None:
        return stamps.Cells(identity, states.origin, states.cell, states.grid)
    origin = tuple(
        o * c - a for o, c, a in zip(digests.origin, digests.chunks, box.start, strict=True)
    )
    grid = digests.digests.astype("<u8").view(np.uint8).reshape(*digests.digests.shape, 8)
    return stamps.Cells(identity, origin, digests.chunks, grid)


def _keep_cells(path: Path, record: dict, states: dict, found: dict[str, ChunkDigests]) -> dict:
    """The record's "cell_digests": per source its chunks' cells (`_chunk_cells`; the source's
    box as the record names it), kept beside the record (`stamps.write_cell_sidecar`)."""
    kept = {}
    for name, cells in states.items():
        box, identity = VolumeSpec.parse(record[name]).box, _array_identity(record, name)
        kept[name] = stamps.write_cell_sidecar(
            path, name, _chunk_cells(cells, found.get(name), box, identity)
        )
    return kept


def _refuse_missing_chunks(chunks: dict[str, dict | None], boxed: dict[str, str]) -> None:
    """A chunk of the box that is missing is an error before any block reads the box, unless
    the spec asks for `fill_missing`."""
    for name, spec in boxed.items():
        state, parsed = chunks[name] or {}, VolumeSpec.parse(spec)
        if state.get("missing") and not parsed.fill_missing:
            where = parsed.url or parsed.path / parsed.dataset
            raise MissingChunkError(
                f"{where}: chunk {state['first_missing']} is missing "
                f"({state['missing']} of the {state['chunks']} chunks of {spec}; "
                f"{FILL_MISSING_HINT})"
            )


def stage_in_place(
    path: str | Path,
    raw_spec: str,
    labels_spec: str = "",
    voxel_size_nm=None,
    roi: str = "",
    context_zyx: Sequence[int] = (0, 0, 0),
    chunk_digests: bool = True,
) -> str:
    """Validate the user's chunked volume(s) as `stage_files` does, without copying a voxel:
    write the record `path` (JSON) that `read_staged` reads, naming the box of each source to
    read (its `roi` with `context_zyx` around it), the scored part within it, the voxel size,
    the sha256 of each source's metadata files and the state of the chunk files of the box
    (`volumes.chunk_state`: per chunk its size, mtime and ctime, digested; a stat per chunk, no
    chunk read; of a layer read by URL, what its store says of each chunk file, a HEAD request
    each), so that the record's digest changes when a chunk of the box changes. A chunk
    of the box that is missing is an error here already (not only when a block reads it)
    unless the specs ask for `fill_missing`. Read in place, the voxels are what the source
    stores: the image must be uint8 and the labels of an integer type. With `chunk_digests`,
    each zarr chunk of the box is read once (its length checked) and the crc32 of its bytes
    kept beside the record (`digest_sidecar`), which `read_staged` hands to every read. Per
    source, a cell per chunk of the box goes beside the record too (`_keep_cells`: a chunk's
    crc32, else its file's state): a task reading a part of the volume (an inference block, an
    export or evaluation region) is keyed on the chunks it reads. Returns the digest of the
    record."""
    sources, part, staged = _source_part(raw_spec, labels_spec, voxel_size_nm, roi, context_zyx)
    _check_in_place_dtypes(sources, raw_spec, labels_spec)
    boxed = {name: str(header.spec.part(staged)) for name, header in sources.items()}
    chunks = {name: chunk_state(spec, cells=True) for name, spec in boxed.items()}
    # Kept beside the record, not in it: a cell per chunk of the box.
    cells = {name: state.pop("cells") for name, state in chunks.items() if state}
    _refuse_missing_chunks(chunks, boxed)
    if labels_spec:
        _require_labeled(labels_spec, part)
    found = _chunk_digests(boxed) if chunk_digests else {}
    record = {
        "raw": boxed["raw"],
        "labels": boxed.get("labels", ""),
        "shape_zyx": list(staged.shape),
        "voxel_size_nm": list(sources["raw"].voxel_size_nm),
        "scored_roi": str(part.relative_to(staged)) if roi else "",
        "sources": [
            {
                "spec": str(header.spec),
                "shape_zyx": list(header.shape),
                "dtype": str(header.dtype),
                "metadata_sha256": metadata_sha256(header.spec),
                "chunks": chunks[name],
            }
            for name, header in sources.items()
        ],
    }
    if found:  # only when recorded: the record of a run without them is as it was
        record["chunk_digests"] = _save_chunk_digests(Path(path), found)
    if cells:
        record["cell_digests"] = _keep_cells(Path(path), record, cells, found)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n")
    return digest(record)


@dataclass(frozen=True)
class StagedVolume:
    """What later stages read of a staged volume: specs of its image and labels ("": none),
    its voxel size and the part of it that is scored (None: all)."""

    raw: str
    labels: str
    voxel_size_nm: VoxelSize
    scored: Roi | None


def digest_sidecar(record: Path, name: str) -> Path:
    """The file beside a staging record `record` that keeps the chunk digests of its source
    `name` ("raw", "labels")."""
    return record.with_name(f"{record.name}.chunks-{name}.npz")


def read_staged(path: str | Path) -> StagedVolume:
    """A staged volume: a copy (`.h5`) or the record of one read in place (`.json`), whose
    specs name the chunk digests kept beside it, where it keeps them (found beside the record
    where it is now: a run dir moved still reads them)."""
    path = Path(path)
    if path.suffix == ".json":
        record = json.loads(path.read_text())
        scored = record["scored_roi"]
        digests = record.get("chunk_digests", {})
        specs = {
            name: str(
                dataclasses.replace(
                    VolumeSpec.parse(record[name]),
                    chunk_digests=digest_sidecar(path, name),
                )
            )
            if name in digests and record[name]
            else record[name]
            for name in ("raw", "labels")
        }
        return StagedVolume(
            specs["raw"],
            specs["labels"],
            tuple(record["voxel_size_nm"]),
            Roi.parse(scored) if scored else None,
        )
    with h5py.File(path, "r") as f:
        text, labeled = f.attrs.get(SCORED_ATTR), "labels" in f
    return StagedVolume(
        f"{path}:raw",
        f"{path}:labels" if labeled else "",
        read_header(f"{path}:raw").voxel_size_nm,
        Roi.parse(str(text)) if text else None,
    )
