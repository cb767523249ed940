"""Every error the pipeline raises on purpose, in one place.

Each message is one line that names the file (or setting) and the problem, so a user reading a
failed Parsl task's log knows what to fix without a traceback.
"""

import signal


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


class StageFailed(FFNError):
    """A stage's program (the training launch line) exited with an error. `retryable` is False
    when the program itself reported a pipeline error (exit code 2: bad input or settings, a
    diverged training): running it again would fail the same way."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message, retryable)
        self.retryable = retryable

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def from_log(cls, what: str, returncode: int, log: str, since: int = 0) -> "StageFailed":
        """The error the program printed last (its `error: ...` line), and where its log is.
        `since`: the log's size when this launch began; an appended log's earlier runs, and
        their errors, are not this failure's."""
        try:
            with open(log, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        last = errors[-1] if errors else (lines[-1] if lines else "no output")
        return cls(f"{what} {_exit_status(returncode)}: {last} (log: {log})", returncode != 2)


def _exit_status(returncode: int) -> str:
    """How a launch ended: a shell reports a child killed by signal N as 128 + N."""
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    try:
        name = signal.Signals(number).name if number else ""
    except ValueError:
        name = ""
    if not name:
        return f"exited with code {returncode}"
    why = " (out of memory, a lost node, or a kill)" if name == "SIGKILL" else ""
    return f"was killed by {name}{why}, exit code {returncode}"
