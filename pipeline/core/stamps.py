"""A task's "done": a stamp beside its outputs that says what they were made from.

A task is one stage (or one inference block). When it has written every output, it writes
`OUTPUT.stamp.json` beside each of them (the same record, so whatever reads any one output finds
it):

    identity  digest of the task's settings and of the tokens of its inputs
    settings  the settings themselves, so a later run can say which one changed
    inputs    [name, token] per input, so a later run can say which one changed
    outputs   {name: state}: size and mtime of a file; of a folder, its files, bytes and a
              digest of every file's name, size and mtime (`FOLDER_STATE`)
    token     what tasks downstream key on: a digest of the content where the task computes
              one (staged volumes, chosen weights, block labels, the segmentation), else a
              fresh random value, so whatever reads this output runs again after it is rebuilt

A task is up to date when its stamp's identity equals the one computed now and every output
still has the state it was stamped with; anything else (no stamp, a changed setting or input, an
output missing, truncated or rewritten) makes it run again. An input with no stamp beside it is
a source file (the user's volume, a pretrained model): its token is a digest of its path, size,
mtime, ctime and inode, and staging records the digest of the content it read.

A stamp holds no path of the run dir: outputs are named by their file name, inputs by their last
two path parts, tokens are digests. So a run dir moved, or copied with its mtimes (`cp -a`,
shutil.copytree), is up to date with its own files and never with the dir it came from. An
output's state has its mtime, not its ctime: a copy has new ctimes and would run every task
again, so a rewrite that puts size and mtime back (`os.utime`) is not seen (no output is read).

A task may also name files it did not make but that its output names (a selection's chosen
checkpoint): their states are recorded as the stamp's "checked" ({path relative to the outputs'
folder: state}), and a change to any of them (a checkpoint cut short) makes the task run again.
They key nothing: the task's identity, its token and what reads it are as without them, and a
stamp made before they were recorded holds none (it is up to date as it was).

An output named `*.record` (STAMPED_INSIDE_SUFFIX), a JSON object, holds its stamp itself, as
its "stamp" key, and has no stamp file. Its state is not recorded (embedding the stamp changes
it): it is trusted while its stamp parses and has the task's identity. Its task wrote it whole,
atomically; one truncated or edited by hand no longer parses or has no stamp, and runs again.

A task that reads a part of an input says which (`regions`, a `Part` per input): it is keyed on
the digests of the cells of that part (`region_token`) where the input keeps them, so a voxel
changed elsewhere leaves it up to date. A staged copy keeps its arrays' 128^3 bricks' digests;
a volume read in place, a cell per chunk of its source (the chunk's crc32, `[data]
chunk_digests`, else its file's state); an output of a task that saves them (`save_cells`: the
stitching's id table per block, its layer per chunk), their digest being its token. So one
chunk edited re-runs the inference blocks whose boxes hold it, the parts of the layer that read
those blocks, and the export and evaluation regions over them. A stamp made before its task
read parts (or these parts) stays up to date while its inputs' whole tokens are as they were.

`plan()` decides for a whole DAG before anything is submitted (the workflow prints it);
`run_once()` is what each task does on its worker, where the inputs rebuilt earlier in the same
run are known.
"""

import contextlib
import copy
import functools
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.energy import EnergyMeter
from pipeline.core.memory import peak_memory_mib, reset_peak_memory, resident_memory_mib
from pipeline.core.owner import leash
from pipeline.core.roi import Roi, grid_starts

if TYPE_CHECKING:  # h5py is imported where a staged volume is read
    import h5py

STAMP_SUFFIX = ".stamp.json"
# An output named so is a JSON object that holds its own stamp (its "stamp" key): an export
# writes a small record per task, up to millions of them on a parallel file system, where a
# stamp file beside each would double the files (and the metadata operations).
STAMPED_INSIDE_SUFFIX = ".record"


def digest(value: object) -> str:
    """sha256 of the canonical JSON of `value` (dict keys sorted)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# Voxels per axis of the bricks a staged volume's digest is made of (`VolumeDigest`).
BRICK = 128


class VolumeDigest:
    """A digest of named 3-D arrays made of one sha256 per brick (BRICK^3 on a grid from the
    arrays' origin, clipped at their end), fed in any order: a volume too large to hold is
    digested while it is copied, brick by brick, in the order its chunks are read. The same
    voxels give the same digest whether held whole (`digest_volumes`) or fed brick by brick."""

    def __init__(self, extra: object = None) -> None:
        self._extra = extra
        self._arrays: dict[str, list] = {}
        self._bricks: dict[tuple[str, tuple[int, ...]], str] = {}

    def begin(self, name: str, dtype: np.dtype, shape: Sequence[int]) -> None:
        self._arrays[name] = [str(np.dtype(dtype)), [int(n) for n in shape]]

    def update(self, name: str, start: Sequence[int], brick: np.ndarray) -> None:
        """`brick`: array `name`'s voxels in the brick of the grid that starts at `start`."""
        sha = hashlib.sha256(np.ascontiguousarray(brick).data).hexdigest()
        self._bricks[(name, tuple(int(a) for a in start))] = sha

    def hexdigest(self) -> str:
        bricks = sorted([name, list(start), sha] for (name, start), sha in self._bricks.items())
        return digest({"extra": self._extra, "arrays": self._arrays, "bricks": bricks})

    def identity(self, name: str) -> str:
        """What array `name` is besides its voxels: `extra` (voxel size, scored part), dtype
        and shape."""
        return digest({"extra": self._extra, "array": self._arrays[name]})

    def brick_grid(self, name: str) -> np.ndarray:
        """Array `name`'s brick digests on the brick grid: (bricks along z, y, x, 32) uint8."""
        grid = np.zeros([-(-n // BRICK) for n in self._arrays[name][1]] + [32], np.uint8)
        for (array, start), sha in self._bricks.items():
            if array == name:
                grid[tuple(a // BRICK for a in start)] = np.frombuffer(bytes.fromhex(sha), np.uint8)
        return grid


def volume_digest(arrays: dict[str, np.ndarray], extra: object = None) -> VolumeDigest:
    """`VolumeDigest` of named 3-D arrays held whole."""
    sha = VolumeDigest(extra)
    for name, array in arrays.items():
        sha.begin(name, array.dtype, array.shape)
        for start in grid_starts(array.shape, BRICK):
            sha.update(name, start, array[tuple(slice(a, a + BRICK) for a in start)])
    return sha


def digest_volumes(arrays: dict[str, np.ndarray], extra: object = None) -> str:
    """The hex digest of `volume_digest`."""
    return volume_digest(arrays, extra).hexdigest()


@dataclass(frozen=True)
class Part:
    """What of an input a task reads, which alone keys it where the input keeps digests of its
    cells (`region_token`): the voxels `roi` of its array `array` (of a staged volume "raw" or
    "labels"; an output that keeps one grid, `save_cells`, has one array), or with `roi` None
    none of them, only what the array is (its shape, voxel size, dtype): a task that makes a
    layer of the volume's shape. A bare Roi in a task's regions is Part(roi) of the image."""

    roi: Roi | None
    array: str = "raw"


# A task that reads no voxel of an input, only what it is.
NO_VOXELS = Part(None)


@dataclass(frozen=True, eq=False)
class Cells:
    """Digests of the cells of a grid over an array: `grid` (cells along each axis, then a
    cell's digest bytes), cells of shape `cell` from `origin` (the first cell's start in the
    array's coordinates, <= 0: a chunk grid's, from the source's origin, over a box of it), and
    `identity`, what the array is besides its voxels (shape, voxel size, dtype, scored part)."""

    identity: str
    origin: tuple[int, ...]
    cell: tuple[int, ...]
    grid: np.ndarray

    def token(self, roi: Roi | None) -> str:
        """Token of the part `roi` of the array: its identity and the digests of the cells
        `roi` meets (with `roi` None, its identity alone)."""
        if roi is None:
            return digest({"volume": self.identity})
        met = tuple(
            slice(max(0, (a - o) // c), max(0, -(-(b - o) // c)))
            for a, b, o, c in zip(roi.start, roi.stop, self.origin, self.cell, strict=True)
        )
        sha = hashlib.sha256(self.grid[met].tobytes()).hexdigest()
        return digest({"volume": self.identity, "bricks": sha})

    def digest(self) -> str:
        """Of everything the cells say: the token of the output that keeps them (`save_cells`)."""
        grid = hashlib.sha256(np.ascontiguousarray(self.grid).tobytes()).hexdigest()
        return digest(
            {
                "identity": self.identity,
                "origin": list(self.origin),
                "cell": list(self.cell),
                "shape": list(self.grid.shape),
                "grid": grid,
            }
        )


# The dataset of a staged HDF5 volume that keeps its image's brick digests (`write_brick_digests`),
# so that a task reading a part of it is keyed on that part only (`region_token`); another
# array's are in the dataset of that name with "_NAME" added (`_brick_dataset`).
BRICK_DIGESTS = "brick_sha256"


def _brick_dataset(name: str) -> str:
    return BRICK_DIGESTS if name == "raw" else f"{BRICK_DIGESTS}_{name}"


def write_brick_digests(staged: "h5py.File", sha: VolumeDigest, name: str = "raw") -> None:
    """Keep array `name`'s brick digests in the staged file being written (so they appear with
    it, atomically): 32 bytes a brick, 16 MB at 10^12 voxels; with the array's `identity` and
    the brick size they are on."""
    dataset = staged.create_dataset(_brick_dataset(name), data=sha.brick_grid(name))
    dataset.attrs["identity"] = sha.identity(name)
    dataset.attrs["brick"] = BRICK


def write_cell_sidecar(record: Path, name: str, cells: Cells) -> dict:
    """Keep the cells of array `name` of a volume read in place beside its staging record
    `record` (`_cell_sidecar`), atomically; returns what the record says of them (the grid's
    sha256, the identity, the cell and the origin), written after them, so a record never takes
    the cells of another staging for its own."""
    with atomic_path(_cell_sidecar(record, name)) as tmp, open(tmp, "wb") as out:
        np.save(out, cells.grid)
    sha = hashlib.sha256(cells.grid.tobytes()).hexdigest()
    return {
        "sha256": sha,
        "identity": cells.identity,
        "cell": list(cells.cell),
        "origin": list(cells.origin),
    }


def _cell_sidecar(record: Path, name: str) -> Path:
    return record.with_name(f"{record.name}.cells-{name}.npy")


def _brick_sidecar(record: Path) -> Path:
    """Where a record of an older version kept its image's brick states (128^3 bricks)."""
    return record.with_name(record.name + ".bricks.npy")


def _record_cells(record: Path, name: str) -> Cells | None:
    """The cells of array `name` a staging record keeps beside it (`write_cell_sidecar`; of an
    older version, its image's bricks), None where it keeps none or they are not its own."""
    held = json.loads(record.read_text())
    entry = (held.get("cell_digests") or {}).get(name)
    if entry:
        sidecar, origin, cell = _cell_sidecar(record, name), entry["origin"], entry["cell"]
    elif name == "raw" and held.get("brick_digests"):
        entry = held["brick_digests"]
        sidecar, origin, cell = _brick_sidecar(record), [0, 0, 0], [entry["brick"]] * 3
    else:
        return None
    try:
        grid = np.load(sidecar)
    except (OSError, ValueError):
        return None
    if hashlib.sha256(grid.tobytes()).hexdigest() != entry["sha256"]:
        return None  # not the states this record was written with
    return Cells(str(entry["identity"]), tuple(origin), tuple(cell), grid)


def _dataset_cells(path: Path, name: str) -> Cells | None:
    """The brick digests of array `name` a staged HDF5 volume keeps (`write_brick_digests`)."""
    import h5py  # here: the workflow imports this module before it needs HDF5

    if not h5py.is_hdf5(path):
        return None
    with h5py.File(path, "r") as staged:
        if _brick_dataset(name) not in staged:
            return None
        dataset = staged[_brick_dataset(name)]
        brick = int(dataset.attrs["brick"])
        return Cells(str(dataset.attrs["identity"]), (0, 0, 0), (brick,) * 3, dataset[()])


CELLS_SUFFIX = ".cells.npz"


def cells_path(output: str | os.PathLike) -> Path:
    """Where an output that keeps its cells (`save_cells`) keeps them: beside it."""
    output = as_path(output)
    return output.with_name(output.name + CELLS_SUFFIX)


def save_cells(output: str | os.PathLike, cells: Cells) -> str:
    """Keep `cells`, the digests of the parts of `output` (an id table per block, a layer per
    chunk), beside it, atomically; returns their digest, which its task returns as its token
    (`run_once`): the cells are trusted only while the output's stamp has that token, and a
    task reading a part of `output` is keyed on that part's cells (`region_token`)."""
    with atomic_path(cells_path(output)) as tmp, open(tmp, "wb") as out:
        np.savez(
            out, identity=cells.identity, origin=cells.origin, cell=cells.cell, grid=cells.grid
        )
    return cells.digest()


def _saved_cells(output: Path, token: str | None) -> Cells | None:
    try:
        with np.load(cells_path(output)) as held:
            origin, cell = (tuple(int(v) for v in held[k]) for k in ("origin", "cell"))
            cells = Cells(str(held["identity"]), origin, cell, held["grid"])
    except (OSError, ValueError, KeyError):
        return None
    return cells if cells.digest() == token else None  # another making's, or not its own


@functools.lru_cache(maxsize=8)
def _held_cells(path: Path, name: str, token: str | None, state: tuple[int, ...]) -> Cells | None:
    """The cells of array `name` of `path` (`region_token`), read whole once per state of the
    file that keeps them: the plan asks for every block of the volume."""
    if cells_path(path).is_file():
        return _saved_cells(path, token)
    if path.suffix == ".json":
        return _record_cells(path, name)
    return _dataset_cells(path, name) if path.is_file() else None


def region_token(
    path: str | os.PathLike, region: Roi | Part, token: str | None = None
) -> str | None:
    """Token of the part `region` of an output that a task reads (a Roi: of a staged volume's
    image): the output's identity and the digests of the cells the part meets, so a voxel
    changed elsewhere leaves it as it was. A staged copy keeps its arrays' 128^3 bricks' digests;
    a volume read in place the crc32 of each chunk of the source (`[data] chunk_digests`), else
    its chunk files' states; an output saved with `save_cells` (its stamp's token `token`) its
    cells. None when the output keeps none (staged before they were kept, made before its task
    saved them, a shard file of a precomputed layer): then the output's token."""
    path, part = Path(path), region if isinstance(region, Part) else Part(region)
    held = cells_path(path) if cells_path(path).is_file() else path
    try:
        stat = held.stat()
    except OSError:
        return None
    cells = _held_cells(path, part.array, token, (stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return None if cells is None else cells.token(part.roi)


def digest_arrays(arrays: dict[str, np.ndarray], extra: object = None) -> str:
    """sha256 over named arrays (name, dtype, shape and bytes) and `extra` (e.g. a voxel size)."""
    sha = hashlib.sha256(json.dumps(extra, default=str).encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        sha.update(f"{name}:{array.dtype}:{array.shape}".encode())
        sha.update(array.data)
    return sha.hexdigest()


def digest_files(paths: Iterable[str | os.PathLike]) -> str:
    """sha256 over the bytes of the files, in order (for small outputs such as weights)."""
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    return sha.hexdigest()


def as_path(path: str | os.PathLike) -> Path:
    """`path` as a Path; one already is kept, not parsed again (planning a run of thousands of
    tasks spent a third of its time there)."""
    return path if isinstance(path, Path) else Path(path)


def stamp_path(output: str | os.PathLike) -> Path:
    output = as_path(output)
    return output.with_name(output.name + STAMP_SUFFIX)


def holds_stamp(output: str | os.PathLike) -> bool:
    """Whether `output` holds its stamp itself (STAMPED_INSIDE_SUFFIX), by its name alone."""
    return as_path(output).name.endswith(STAMPED_INSIDE_SUFFIX)


def _stamp_file(output: str | os.PathLike) -> Path:
    """The file `output`'s stamp is in: the output itself where it holds it, else beside it."""
    return as_path(output) if holds_stamp(output) else stamp_path(output)


def forget(output: str | os.PathLike) -> None:
    """Take `output` for not made: its stamp goes (an output that holds its stamp, with it), so
    the next run makes it again."""
    _stamp_file(output).unlink(missing_ok=True)


def _file_state(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def output_state(path: str | os.PathLike) -> object:
    """What must be unchanged for an output to be trusted; None when it is missing."""
    path = as_path(path)
    if path.is_file():
        return _file_state(path)
    if path.is_dir():  # a folder (the export)
        return folder_state(path)
    return None


def files_under(
    folder: str | os.PathLike, root: str | os.PathLike | None = None
) -> Iterator[tuple[str, int]]:
    """(path relative to `root`, default `folder`, with "/"; size) of every file under `folder`,
    in the order the folders list them: a folder's listing is read as it goes, not held (nor
    sorted)."""
    for name, stat in _stats_under(folder, folder if root is None else root):
        yield name, stat.st_size


def _stats_under(
    folder: str | os.PathLike, root: str | os.PathLike
) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to `root` with "/", stat) of every file under `folder`: one scandir walk,
    one stat a file, no file read."""
    with os.scandir(folder) as listing:
        for entry in listing:
            if entry.is_dir(follow_symlinks=False):
                yield from _stats_under(entry.path, root)
            elif entry.is_file():
                yield os.path.relpath(entry.path, root).replace(os.sep, "/"), entry.stat()


# What the digest of a folder's state covers, the state's last item. A state recorded before it
# (three items: names and sizes only) is compared as it was made (`_state_as_recorded`), so an
# upgrade does not run every stitch and export again; the task's next run records this one.
FOLDER_STATE = "name size mtime_ns"


def folder_state(folder: Path, with_mtime: bool = True) -> list:
    """[files, bytes, digest of every file's name, size and mtime, FOLDER_STATE] under `folder`
    (with `with_mtime` False: [files, bytes, digest of names and sizes], the older state). The
    digest is a sum of one sha256 per file, so its order does not matter: nothing is held or
    sorted (an export of 10^12 voxels has tens of millions of files).

    The mtime is what sees a file rewritten in place with its size kept (a chunk partly zeroed):
    the stat that gives the size gives it too, so the walk costs no more. Not ctime, though it
    would also see a rewrite whose mtime was put back (`os.utime` cannot set ctime): every copy
    of a file has a new ctime, so a copied run dir (`cp -a`, shutil.copytree) would run every
    task with a folder output again, and a moved one across file systems too. A rewrite that
    restores size and mtime is only seen by reading the content, which a stamp does not."""
    files = size = total = 0
    for name, stat in _stats_under(folder, folder):
        text = f"{name}\0{stat.st_size}" + (f"\0{stat.st_mtime_ns}" if with_mtime else "")
        one = hashlib.sha256(text.encode()).digest()
        total = (total + int.from_bytes(one, "big")) % (1 << 256)
        files, size = files + 1, size + stat.st_size
    state = [files, size, f"{total:064x}"]
    return [*state, FOLDER_STATE] if with_mtime else state


def _state_as_recorded(path: Path, recorded: object) -> object:
    """`output_state(path)` as `recorded` was made: a folder's state of an older stamp (names
    and sizes) is read the older way."""
    if isinstance(recorded, list) and len(recorded) == 3 and path.is_dir():
        return folder_state(path, with_mtime=False)
    return output_state(path)


def source_token(path: str | os.PathLike) -> str:
    """Token of a file not made by the run. ctime and inode change with any rewrite or
    replacement, even one that restores size and mtime; a folder or a checkpoint prefix
    (`ckpt-N` for `ckpt-N.index`, ...) is the set of its files."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif path.exists():
        files = [path]
    else:
        files = sorted(path.parent.glob(path.name + ".*"))
    states = []
    for p in files:
        stat = p.stat()
        states.append([str(p), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
    return digest(["source", str(path.resolve()), states])


def read_stamp(output: str | os.PathLike) -> dict | None:
    """The stamp of `output`'s task; None where there is none, or it (or the output holding
    it) is missing or does not parse."""
    try:
        record = json.loads(_stamp_file(output).read_text())
    except (OSError, ValueError):
        return None
    if holds_stamp(output):
        record = record.get("stamp") if isinstance(record, dict) else None
    return record if isinstance(record, dict) and "identity" in record else None


def input_token(
    path: str | os.PathLike,
    region: Roi | Part | None = None,
    stamps: Callable[[str | os.PathLike], dict | None] = read_stamp,
) -> str:
    """A task's output is keyed by its stamp's token, or with `region`, the part of it a task
    reads, by that part's (`region_token`) where the output keeps what it takes; a source file
    by its own identity. `stamps` reads an output's stamp (`plan` reads each once)."""
    stamp = stamps(path)
    if not stamp or "token" not in stamp:
        return source_token(path)
    return (region is not None and region_token(path, region, stamp["token"])) or stamp["token"]


def input_tokens(
    inputs: Sequence[Path],
    regions: Sequence[Roi | Part | None] = (),
    stamps: Callable[[str | os.PathLike], dict | None] = read_stamp,
) -> list[str]:
    """`input_token` of each input; `regions`: per input the part of it read (None, or past
    the end of `regions`: all of it)."""
    parts = [*regions, *[None] * (len(inputs) - len(regions))]
    return [input_token(p, r, stamps) for p, r in zip(inputs, parts, strict=True)]


# Top-level task settings recorded in the stamp but not part of the task's identity: a training's
# "ranks" (pipeline.training.trainer goes on from its checkpoints at another world size, so a finished
# training is not run again for another node count; an unfinished one goes on at it).
NOT_IN_IDENTITY = ("ranks",)


def task_identity(settings: dict, input_tokens: Sequence[str]) -> str:
    kept = {k: v for k, v in settings.items() if k not in NOT_IN_IDENTITY}
    return digest({"settings": kept, "inputs": list(input_tokens)})


# Settings added after runs were stamped, oldest first, each by its path (sections, then its
# name) at the value that does what those runs did: a stamp made before a setting existed stays
# up to date while the setting is at that value, so a new version of the workflow does not make
# every earlier run's training stale (its checkpoints' lineage keeps them alike:
# pipeline.training.trainer.BOOKKEEPING).
ADDED_SETTINGS: tuple[dict[tuple[str, ...], object], ...] = (
    {("train", "virtual_ranks"): 1},
    {("train", "optimizer"): "adam", ("train", "momentum"): 0.9},
    {("agglomeration", "fill_min_size"): 0},
    {("partitions", "min_object_voxels"): 0},
    # "auto" keys no arithmetic (a run resumed on another CPU keeps the blocks it made), so the
    # runs from before it, made in their weights' precision, count as made under it.
    {
        ("inference", "precision"): "auto",
        ("selection", "inference", "precision"): "auto",
        ("watershed", "edges", "precision"): "auto",
    },
    {("agglomeration", "skip_second_fill"): False},
    {
        (*section, name): value
        for section in (("inference",), ("selection", "inference"))
        for name, value in (("move_step_scale", 1.0), ("long_move_threshold", 0.99))
    },
    {
        ("inference", "min_unseen_share"): 0.0,
        ("selection", "inference", "min_unseen_share"): 0.0,
        ("agglomeration", "max_contact_boundary"): 1.0,
    },
)


def _as_stamped_before(settings: dict, since: int) -> dict | None:
    """`settings` as a version without the settings added from ADDED_SETTINGS[since] on stamped
    them; None where one of those is not at its old value (no such version did this)."""
    older = copy.deepcopy(settings)
    for added in ADDED_SETTINGS[since:]:
        for (*sections, name), value in added.items():
            parts = [older]
            for section in sections:
                part = parts[-1].get(section)
                if not isinstance(part, dict):
                    break
                parts.append(part)
            else:
                if name in parts[-1]:
                    if parts[-1].pop(name) != value:
                        return None
                    # A section of added settings only was not there at all.
                    for section, part, outer in zip(
                        reversed(sections), reversed(parts[1:]), reversed(parts[:-1]), strict=True
                    ):
                        if part:
                            break
                        del outer[section]
    return older


def _identities(settings: dict, input_tokens: Sequence[str], stamped: dict) -> Iterator[str]:
    """The task's identity now, then as each version before settings were added stamped it;
    versions that put NOT_IN_IDENTITY in the identity did so with the values `stamped` holds.
    Lazily: a task stamped by this version is matched by the first."""
    yield task_identity(settings, input_tokens)
    olders = [_as_stamped_before(settings, since) for since in range(len(ADDED_SETTINGS))]
    yield from (task_identity(older, input_tokens) for older in olders if older is not None)
    then = {k: stamped[k] for k in NOT_IN_IDENTITY if k in stamped}
    if then:
        for older in [settings, *olders]:
            if older is not None:
                yield digest({"settings": older | then, "inputs": list(input_tokens)})


def _keyed(
    settings: dict,
    inputs: Sequence[Path],
    regions: Sequence[Roi | Part | None],
    stamps: Callable[[str | os.PathLike], dict | None],
    tokens: Sequence[str],
    stamped: dict,
) -> Iterator[str]:
    """`_identities` with the tokens of the parts of the inputs the task reads, then, where it
    reads parts, with those of the whole inputs: as a version that did not key it on parts (or
    on these parts: a stitching's or an export's task before issue 60) stamped it, so that an
    upgrade runs nothing again while the inputs are as they were. Lazily."""
    yield from _identities(settings, tokens, stamped)
    if any(r is not None for r in regions):
        yield from _identities(settings, input_tokens(inputs, (), stamps), stamped)


def _plain(settings: dict) -> dict:
    """As the settings read back from a stamp (tuples become lists)."""
    return json.loads(json.dumps(settings, default=str))


def _changed_settings(old: object, new: object, prefix: str = "") -> list[str]:
    """'name old -> new' for every leaf setting that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        changes = []
        for key in sorted(set(old) | set(new)):
            changes += _changed_settings(old.get(key), new.get(key), f"{prefix}{key}.")
        return changes
    if old != new:
        return [f"{prefix.rstrip('.')} {json.dumps(old)} -> {json.dumps(new)}"]
    return []


def _display(path: Path) -> str:
    """An input's name in messages: its last two path parts (staged/eval.h5)."""
    return "/".join(path.parts[-2:])


def why_stale(
    settings: dict,
    inputs: Sequence[Path],
    outputs: Sequence[Path],
    regions: Sequence[Roi | Part | None] = (),
    stamps: Callable[[str | os.PathLike], dict | None] = read_stamp,
) -> str | None:
    """None when the task's outputs are up to date, else the reason it must run; `regions`: the
    parts of its inputs the task reads (`input_tokens`); `stamps` reads a stamp (`read_stamp`)."""
    settings = _plain(settings)
    stamp = stamps(outputs[0])
    if stamp is None:
        if not any(as_path(o).exists() for o in outputs):
            return "not run yet"
        return "outputs not stamped (interrupted, or made by an older version)"
    tokens = input_tokens(inputs, regions, stamps)
    stamped = stamp.get("settings") or {}
    if stamp["identity"] not in _keyed(settings, inputs, regions, stamps, tokens, stamped):
        changes = _changed_settings(stamped, settings)
        if changes:
            return "settings changed: " + "; ".join(changes)
        before = dict(stamp.get("inputs", []))
        changed = [
            _display(p) for p, t in zip(inputs, tokens, strict=True) if before.get(_display(p)) != t
        ]
        return "input changed: " + ", ".join(changed or ["inputs"])
    recorded = stamp.get("outputs", {})
    for output in map(as_path, outputs):
        if holds_stamp(output):
            held = stamps(output)
            if held is None and not output.exists():
                return f"output missing: {_display(output)}"
            if held is None or held["identity"] != stamp["identity"]:
                return f"output changed since it was made: {_display(output)}"
            continue
        before = recorded.get(output.name)
        state = _state_as_recorded(output, before)
        if state is None:
            return f"output missing: {_display(output)}"
        if before != state:
            return f"output changed since it was made: {_display(output)}"
    return _changed_checked(stamp, as_path(outputs[0]))


def made_from(
    settings: dict,
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    regions: Sequence[Roi | Part | None] = (),
) -> bool:
    """Whether `output`'s stamp says its task made it from `settings` and `inputs` as they are
    now, whatever the output's state since: a file its task wrote and a user then edited (the
    second pass's merge graph), not one made from other inputs."""
    stamp = read_stamp(output)
    if stamp is None:
        return False
    inputs = [as_path(p) for p in inputs]
    tokens = input_tokens(inputs, regions)
    keyed = _keyed(
        _plain(settings), inputs, regions, read_stamp, tokens, stamp.get("settings") or {}
    )
    return stamp["identity"] in keyed


def _blind_to_rewrites(outputs: Sequence[Path]) -> bool:
    """Whether the outputs' stamp holds a folder state made before mtimes were recorded (names
    and sizes): a file rewritten in place with its size kept would still match it, so a task
    killed half-way could be taken for done; such a stamp goes before the task works."""
    recorded = (read_stamp(outputs[0]) or {}).get("outputs", {}) if outputs else {}
    return any(isinstance(state, list) and len(state) == 3 for state in recorded.values())


def checked_states(files: Iterable[str | os.PathLike], folder: Path) -> dict:
    """{path relative to `folder` (the outputs' folder) with "/", absolute outside it: state}
    of `files`, the stamp's "checked" (`why_stale`)."""
    states, folder = {}, Path(os.path.abspath(folder))
    for file in (Path(os.path.abspath(f)) for f in files):
        name = os.path.relpath(file, folder) if file.is_relative_to(folder) else str(file)
        states[name.replace(os.sep, "/")] = output_state(file)
    return states


def _changed_checked(stamp: dict, output: Path) -> str | None:
    """Why a file of the stamp's "checked" (`checked_states`, relative to the folder of
    `output`, the task's first) is no longer as recorded, or None."""
    for name, before in (stamp.get("checked") or {}).items():
        state = output_state(output.parent / name)
        if state != before:
            change = "is missing" if state is None else "changed since it was made"
            return f"{_display(Path(name))}, which {output.name} names, {change}"
    return None


def write_stamp(
    settings: dict,
    inputs: Sequence[Path],
    outputs: Sequence[Path],
    states: dict,
    token: str | None = None,
    measured: dict | None = None,
    regions: Sequence[Roi | Part | None] = (),
    checked: dict | None = None,
) -> dict:
    """Record that `outputs`, whose states (`output_state`, by name; none for an output that
    holds its stamp) are `states`, were made from `settings` and `inputs` (call after writing
    them; `regions`: the parts of the inputs read, `input_tokens`); `measured`: what making
    them cost (seconds, peak memory); `checked`: the states of files they name
    (`checked_states`)."""
    settings, tokens = _plain(settings), input_tokens(inputs, regions)
    record = {
        "identity": task_identity(settings, tokens),
        "settings": settings,
        "inputs": [[_display(p), t] for p, t in zip(inputs, tokens, strict=True)],
        "outputs": states,
        "token": token or uuid.uuid4().hex,
        "measured": measured or {},
    }
    if checked:
        record["checked"] = checked
    for output in outputs:
        _save_stamp(output, record)
    return record


def _save_stamp(output: str | os.PathLike, record: dict) -> None:
    """Write `record` as `output`'s stamp, atomically: into the output where it holds its stamp
    (its task must have written a JSON object there), else beside it."""
    if holds_stamp(output):
        try:
            held = json.loads(as_path(output).read_text())
        except ValueError:
            held = None
        if not isinstance(held, dict):
            raise ValueError(
                f"{output}: an output named *{STAMPED_INSIDE_SUFFIX} holds its task's stamp, so "
                "the task must write a JSON object there"
            )
        text = json.dumps(held | {"stamp": record})
    else:
        text = json.dumps(record, indent=1) + "\n"
    with atomic_path(_stamp_file(output)) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def kept_stamp(output: str | os.PathLike) -> Iterator[None]:
    """Around a repair that writes `output` again as its task made it (the same content; a new
    mtime, and where the output holds its stamp, none): its task's stamp is read before and put
    back after, identity and token kept, with the output's new state, so the task and what
    reads its output stay up to date. Nothing where it had no stamp (made outside a run), nor
    when the block raises (the output is not as its task made it)."""
    output = as_path(output)
    stamp = read_stamp(output)
    yield
    if stamp is None:
        return
    if not holds_stamp(output):
        if output.name not in stamp.get("outputs", {}):
            return
        stamp["outputs"][output.name] = output_state(output)
    _save_stamp(output, stamp)


def run_once(
    settings: dict,
    inputs: Iterable[str | os.PathLike],
    outputs: Iterable[str | os.PathLike],
    work: Callable[[], str | None],
    regions: Sequence[Roi | Part | None] = (),
    checked: Callable[[], Iterable[str | os.PathLike]] | None = None,
) -> str:
    """Run `work` unless the outputs are up to date; stamp them after, with its wall time and
    the peak resident memory of this process while it ran (`measured`: seconds, cpu_seconds,
    peak_rss_mib, start_rss_mib). `work` may return
    a digest of the content it wrote (the token). `regions`: per input the part of it `work`
    reads (a Roi; None or left out: all of it), which alone keys the task where the input keeps
    its parts' digests (a staged volume, `region_token`); `checked`, called after `work`: files
    the outputs name that the task did not make (the stamp's "checked"), a change to which runs
    it again. Returns "ran" or "up to date"."""
    inputs, outputs = [Path(p) for p in inputs], [Path(p) for p in outputs]
    # Working for the workflow that owns the run dir, and only while it does (kill -9 of it and
    # its watchdog, or another workflow took the run): no two write into one run.
    with leash(f"the task making {outputs[0] if outputs else 'nothing'}"):
        if why_stale(settings, inputs, outputs, regions) is None:
            return "up to date"
        return _run_and_stamp(settings, inputs, outputs, work, regions, checked)


def _run_and_stamp(
    settings: dict,
    inputs: list[Path],
    outputs: list[Path],
    work: Callable[[], str | None],
    regions: Sequence[Roi | Part | None],
    checked: Callable[[], Iterable[str | os.PathLike]] | None,
) -> str:
    # A stamp beside its outputs stays while the task works: it records their states, so an
    # output the task changes (and then is killed) no longer matches it, and one the task never
    # touched (it failed first: an input cut short) is good again once that input is as it was.
    # An output that holds its stamp goes (it is its own record), and so do all the stamps where
    # one records a folder as it was before mtimes were: a rewrite in place would match it.
    blind = _blind_to_rewrites(outputs)
    for output in outputs:
        if blind or holds_stamp(output):
            _stamp_file(output).unlink(missing_ok=True)
    reset_peak_memory()
    held_before = resident_memory_mib()
    started, cpu_started = time.perf_counter(), time.process_time()
    with EnergyMeter() as energy:  # the node's energy counters while it works
        token = work()
    if token is not None and not isinstance(token, str):
        raise TypeError(f"run_once: work() must return a digest (str) or None, got {token!r}")
    # Read inside the measured window: stamping a folder of many files is part of the task.
    # None of an output that holds its stamp: embedding it changes the state (left out, not
    # None, which is a missing output's; `why_stale` checks its stamp instead).
    states = {o.name: output_state(o) for o in outputs if not holds_stamp(o)}
    measured = {
        "seconds": round(time.perf_counter() - started, 3),
        # Below `seconds` where the task waited for a core (or for I/O).
        "cpu_seconds": round(time.process_time() - cpu_started, 3),
        "peak_rss_mib": peak_memory_mib(),
        # What the worker held before: a peak grown from there is the task's, a grown
        # starting point is what earlier tasks left behind.
        "start_rss_mib": held_before,
        **energy.measured(),  # "energy": the readings, or why the node's cannot be read here
    }
    named = checked_states(checked(), outputs[0].parent) if checked is not None else None
    write_stamp(settings, inputs, outputs, states, token, measured, regions, named)
    return "ran"


@dataclass(frozen=True)
class Task:
    """One task of the DAG as the planner sees it."""

    name: str  # "infer[2]"
    stage: str  # "infer"
    settings: dict
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]
    regions: tuple[Roi | Part | None, ...] = ()  # per input the part the task reads (run_once)


def plan(
    tasks: Sequence[Task], runnable: Callable[[Task], bool] = lambda t: True
) -> dict[str, str | None]:
    """{task name: None if up to date, else why it runs}, tasks given in dependency order. A
    task whose input another task rebuilds runs after it ("after train"); `runnable` False
    keeps a task as it is (--stages), stale or not."""
    # Nothing is written while planning: each stamp is read once, however many tasks read its
    # output (a block's result is read by its 26 neighbours' tasks).
    stamps = functools.cache(read_stamp)
    rebuilt_by: dict[Path, str] = {}  # the outputs of the tasks that run: their stage
    reasons: dict[str, str | None] = {}
    for task in tasks:
        if not runnable(task):
            reasons[task.name] = None
            continue
        rebuilt = rebuilt_by and sorted({rebuilt_by[i] for i in task.inputs if i in rebuilt_by})
        reasons[task.name] = (
            f"after {', '.join(rebuilt)}"
            if rebuilt
            else why_stale(task.settings, task.inputs, task.outputs, task.regions, stamps)
        )
        if reasons[task.name]:
            rebuilt_by.update(dict.fromkeys(task.outputs, task.stage))
    return reasons
