"""Every error the pipeline raises on purpose, in one place.

Each message is one line that names the file (or setting) and the problem, so a user reading a
failed Parsl task's log knows what to fix without a traceback.
"""

import os
import re
import signal
from collections.abc import Sequence


def first_line(exc: BaseException) -> str:
    """The first line of a library's exception message, to quote inside one of ours."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class FFNError(Exception):
    """Base of all pipeline errors."""


class ConfigError(FFNError, ValueError):
    """A setting is out of range or inconsistent with another."""


class VolumeError(FFNError):
    """An input volume cannot be used."""


class VolumeReadError(VolumeError):
    """The file opens but its data cannot be read (a corrupted chunk, a truncated file)."""


class MissingChunkError(VolumeReadError):
    """A chunk of an input volume that a read needs was never written (or was lost): zarr and
    cloud-volume would read it as zeros, silently, unless `[data] fill_missing = true` asks for
    that."""


class ChunkReadError(VolumeReadError):
    """A chunk file of an input volume exists but cannot be decoded (truncated, overwritten)."""


class ChunkSizeError(ChunkReadError):
    """A chunk file's byte length disagrees with its header (Blosc's compressed size) or with
    the size of a chunk of its array: cut short, or bytes appended. Checked before the chunk is
    decoded: Blosc decodes a chunk it stored uncompressed (an EM image, which does not compress)
    from its header alone, without an error, however short the file."""


class ChunkDigestError(ChunkReadError):
    """A chunk file's bytes differ from the digest recorded when the run staged the volume
    (`[data] chunk_digests`): overwritten in place (the same length) since then, or rewritten
    during the run."""


class RemoteReadError(VolumeReadError):
    """A volume read by URL (`precomputed://https://...`, `s3://`, `gs://`) cannot be read from
    its store: no such host, no answer, refused (no credentials or rights), a server error."""


class VolumeFileMissing(VolumeError, FileNotFoundError):
    """The HDF5 file does not exist."""


class DatasetMissing(VolumeError, KeyError):
    """The file exists but has no dataset of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class VolumeShapeError(VolumeError, ValueError):
    """Not 3-D, raw and labels disagree, or smaller than the field of view."""


class VolumeDtypeError(VolumeError, TypeError):
    """A dtype the pipeline does not accept (raw must be uint8, labels an integer type)."""


class NonFiniteError(VolumeError, ValueError):
    """NaN or infinity in a volume."""


class EmptyLabelsError(VolumeError, ValueError):
    """Ground truth with no labeled voxel (all zero)."""


class VoxelSizeError(VolumeError, ValueError):
    """Voxel size missing, not three positive numbers, or raw and labels disagree."""


class CoordinatesError(FFNError, ValueError):
    """A coordinates file is missing, malformed or cannot be sharded as asked."""


class CheckpointError(FFNError):
    """A model checkpoint is missing or does not match the model."""


class BoundaryForestError(FFNError):
    """A boundary forest file cannot be read or is not one the workflow learned (a random forest
    of the learned watershed's image features)."""


class PrecomputedError(FFNError):
    """A Neuroglancer precomputed export is missing, incomplete or cannot be served."""


class InferenceError(FFNError, ValueError):
    """The predictor returned something unusable (wrong shape, NaN or infinity)."""


class MergeGraphError(FFNError, ValueError):
    """The second pass's merge graph (agglomerate/graph.csv), as edited by hand, cannot be read
    or names a segment the layer does not hold."""


class BlockResultError(FFNError, ValueError):
    """A block result file is unreadable, or belongs to another block plan or other settings."""


class TrainingDiverged(FFNError, ArithmeticError):
    """The loss or a gradient became NaN or infinite; no checkpoint is written from that state."""


class DiskFull(OSError):
    """No space (or no quota) left where an output is written; the output is not half-written.
    An OSError, not an FFNError: the same task succeeds once space is freed, so it is retried,
    and the command-line tools exit 1 as for any other failure of the file system."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class RunDirBusy(FFNError):
    """Another workflow, or a process of an earlier one, works on the run directory."""


class RunDirTaken(FFNError):
    """The workflow a task works for no longer holds the run dir (gone, or another took it)."""


class LaunchError(FFNError):
    """The ranks were not started as one job, or not one per device."""


class CheckpointNotWritten(DiskFull):
    """A training checkpoint found no room: a full disk, an exhausted quota or the file-size limit
    (`ulimit -f`). Nothing of it is kept; the checkpoint before it stays the one a run goes on
    from. Its line names the checkpoint, not the shard TensorFlow was writing."""

    def __init__(self, code: int, checkpoint: str, detail: str):
        super().__init__(code, os.strerror(code))
        self.checkpoint, self.detail = checkpoint, detail

    def __str__(self) -> str:
        return f"{self.strerror.lower()} writing checkpoint {self.checkpoint} ({self.detail})"

    def __reduce__(self):
        return type(self), (self.errno, self.checkpoint, self.detail)


class StageFailed(FFNError):
    """A stage's program (the training launch line) exited with an error. `retryable` is False
    when running it again would fail the same way: the program reported a pipeline error (exit
    code 2: bad input or settings, a diverged training), or it found no room to write (a full
    disk or quota: a retry would redo every step since the last checkpoint only to fail at the
    next one; its line says to free space, then resume)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message, retryable)
        self.retryable = retryable

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def from_log(cls, what: str, returncode: int, log: str, since: int = 0) -> "StageFailed":
        """`from_output` with the output read from the log. `since`: the log's size when this
        launch began; an appended log's earlier runs, and their errors, are not this failure's."""
        try:
            with open(log, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        return cls.from_output(what, returncode, text, log)

    @classmethod
    def from_output(cls, what: str, returncode: int, output: str, log: str) -> "StageFailed":
        """One line: how the launch ended (a rank killed by a signal named as its launcher reports
        it), the error the program printed last (its `error: ...` line; else its last line that
        is not the launcher's), and where its log is. `output`: what this launch printed."""
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        own = [
            line
            for line in lines
            if not line.startswith(_LAUNCHER_NOISE) and _signalled_rank([line])[1] is None
        ]
        last = errors[-1] if errors else (own[-1] if own else "no output")
        no_room = bool(errors) and _NO_ROOM.search(last) is not None
        return cls(
            f"{_exit_status(what, returncode, lines)}: {last} (log: {log})",
            returncode != 2 and not no_room,
        )


# An error line that says the program found no room to write (os.strerror's words).
_NO_ROOM = re.compile("no space left on device|disk quota exceeded|file too large", re.IGNORECASE)

# What MPICH's hydra mpiexec adds when a rank dies: a box of `=` lines, then these.
_LAUNCHER_NOISE = (
    "=",
    "[mpiexec@",
    "YOUR APPLICATION TERMINATED WITH THE EXIT STRING",
    "This typically refers to a problem with your application",
    "Please see the FAQ page",
)

# How launchers report a rank a signal ended. The first such line is of the rank that died first:
# the launcher ends the others then, and may report them too.
_SIGNALLED = (
    # MPICH's hydra mpiexec (the local site): the signal, not the rank (the PID in its box is of
    # whichever rank it reaps first, often one it killed itself while cleaning up).
    re.compile(r"EXIT STRING: .*\(signal (?P<number>\d+)\)"),
    # HPE's PALS mpiexec (Polaris): "<host>: rank 1 died from signal 9".
    re.compile(r"\brank (?P<rank>\d+) died from signal (?P<number>\d+)"),
    # Slurm's srun: "srun: error: <host>: task 1: Killed" (the signal's description).
    re.compile(r"^srun: error: .*: tasks? (?P<rank>[\d,-]+): (?P<description>[^:]+)$"),
)
_DESCRIBED = {signal.strsignal(s): s.value for s in signal.Signals if signal.strsignal(s)}


def _signalled_rank(lines: list[str]) -> tuple[str | None, int | None]:
    """(rank or None, signal number) of the first rank a launcher reports killed by a signal;
    (None, None) when none is."""
    for line in lines:
        for pattern in _SIGNALLED:
            if match := pattern.search(line):
                found = match.groupdict()
                number = (
                    int(found["number"])
                    if found.get("number")
                    else _DESCRIBED.get(found.get("description", "").strip())
                )
                if number is not None:
                    return found.get("rank"), number
    return None, None


def _exit_status(what: str, returncode: int, lines: Sequence[str] = ()) -> str:
    """How `what`'s launch ended: a rank killed by a signal as its launcher reports it (`lines`,
    the launch's output), else as the shell reports a child killed by signal N: 128 + N."""
    rank, number = _signalled_rank(list(lines))
    if number is None:
        who = what
        number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    elif rank is None:
        who = f"a {what} rank"
    else:
        who = f"{what} rank {rank}" if rank.isdigit() else f"{what} ranks {rank}"
    try:
        name = signal.Signals(number).name if number else ""
    except ValueError:
        name = ""
    if not name:
        return f"{what} exited with code {returncode}"
    why = " (out of memory, a lost node, or a kill)" if name == "SIGKILL" else ""
    verb = "were" if who.startswith(f"{what} ranks") else "was"
    return f"{who} {verb} killed by {name}{why}, exit code {returncode}"
