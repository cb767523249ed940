"""Every error the pipeline raises on purpose, in one place.

Each message is one line that names the file (or setting) and the problem, so a user reading a
failed Parsl task's log knows what to fix without a traceback.
"""


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


class PrecomputedError(FFNError):
    """A Neuroglancer precomputed export is missing, incomplete or cannot be served."""


class InferenceError(FFNError, ValueError):
    """The predictor returned something unusable (wrong shape, NaN or infinity)."""


class BlockResultError(FFNError, ValueError):
    """A block result file is unreadable, or belongs to another block plan or other settings."""


class TrainingDiverged(FFNError, ArithmeticError):
    """The loss or a gradient became NaN or infinite; no checkpoint is written from that state."""


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
    def from_log(cls, what: str, returncode: int, log: str) -> "StageFailed":
        """The error the program printed last (its `error: ...` line), and where its log is."""
        try:
            with open(log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            lines = []
        errors = [line for line in lines if line.startswith("error:")]
        last = errors[-1] if errors else (lines[-1] if lines else "no output")
        return cls(f"{what} exited with code {returncode}: {last} (log: {log})", returncode != 2)
