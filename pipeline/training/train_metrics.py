"""Training metrics: voxel confusion counts, their summary, the CSV/TensorBoard log and the plot."""

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path

# Order of the counts that ranks sum with one allreduce.
COUNT_NAMES = ("loss_sum", "batches", "tp", "fp", "fn", "tn", "fovs")
CSV_COLUMNS = (
    "step",
    "wall_s",
    "loss",
    "accuracy",
    "precision",
    "recall",
    "f1",
    "object_fraction",
    "learning_rate",
    "fov_per_s",
    "world_size",  # ranks (real x virtual) that made the step: a run may go on at another size
)


def last_metrics(path: str | Path) -> dict[str, float] | None:
    """The last row of a training's metrics.csv, or None if it has none yet."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    return {k: float(v) for k, v in rows[-1].items() if v not in ("", None)} if rows else None


def confusion_counts(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """tp, fp, fn, tn of the predicted object mask (p >= 0.5, i.e. logit >= 0) against labels > 0.5."""
    predicted, truth = logits >= 0, labels > 0.5
    tp = np.count_nonzero(predicted & truth)
    fp = np.count_nonzero(predicted & ~truth)
    fn = np.count_nonzero(~predicted & truth)
    return np.array([tp, fp, fn, predicted.size - tp - fp - fn], dtype=np.float64)


def summarize(counts: Sequence[float]) -> dict[str, float]:
    """Loss and voxel accuracy/precision/recall/F1 from summed counts (COUNT_NAMES order)."""
    loss_sum, batches, tp, fp, fn, tn, _ = counts
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return {
        "loss": loss_sum / batches if batches else math.nan,
        "accuracy": (tp + tn) / (tp + fp + fn + tn) if tp + fp + fn + tn else math.nan,
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        # Share of voxels in the object: what a constant prediction would score against.
        "object_fraction": (tp + fn) / (tp + fp + fn + tn) if tp + fp + fn + tn else math.nan,
    }


class MetricsLog:
    """Appends rows to `metrics.csv` and mirrors them to TensorBoard.

    On resume from a checkpoint at `resumed_step`, rows logged after it by the interrupted run are
    dropped, so the curve continues from the checkpoint instead of repeating steps. Rows of a log
    written with fewer columns keep theirs, the others left empty.
    """

    def __init__(self, train_dir: Path, resumed_step: int = 0):
        import tensorflow as tf

        self.path = train_dir / "metrics.csv"
        kept = []
        if self.path.exists() and resumed_step > 0:
            with self.path.open(newline="") as f:
                kept = [row for row in csv.DictReader(f) if float(row["step"]) <= resumed_step]
        with atomic_path(self.path) as tmp, tmp.open("w", newline="") as out:
            writer = csv.DictWriter(out, CSV_COLUMNS, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        self._writer = tf.summary.create_file_writer(str(train_dir / "tensorboard"))

    def write(self, row: dict[str, float]) -> None:
        import tensorflow as tf

        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow(
                [f"{row[c]:.6g}" if isinstance(row[c], float) else row[c] for c in CSV_COLUMNS]
            )
        with self._writer.as_default(step=int(row["step"])):
            for name in CSV_COLUMNS[2:]:
                tf.summary.scalar(name, row[name])
        self._writer.flush()


def read_metrics(path: Path) -> dict[str, np.ndarray]:
    """Each column as floats; NaN where a row has no value (a column added after it was written)."""
    with Path(path).open() as f:
        rows = list(csv.DictReader(f))
    return {c: np.array([float(r.get(c) or "nan") for r in rows]) for c in CSV_COLUMNS}


def world_changes(metrics: dict[str, np.ndarray]) -> list[tuple[float, int, int]]:
    """(step, old size, new size) of each change in the log: the step is the last logged at the old
    size, where the run went on from (a checkpoint on a log step)."""
    sizes, steps = metrics["world_size"], metrics["step"]
    return [
        (float(steps[i - 1]), int(sizes[i - 1]), int(sizes[i]))
        for i in range(1, len(sizes))
        if np.isfinite(sizes[i - 1]) and np.isfinite(sizes[i]) and sizes[i] != sizes[i - 1]
    ]


def plot_curves(metrics_csv: Path, png: Path) -> Path:
    """Loss and voxel metrics against step, like Dong et al.'s Fig. 6."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(metrics_csv)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(m["step"], m["loss"], color="tab:red")
    ax_loss.set(xlabel="step", ylabel="loss (sigmoid cross-entropy)", title="training loss")
    for name in ("accuracy", "precision", "recall", "f1"):
        ax_acc.plot(m["step"], m[name], label=name)
    ax_acc.set(
        xlabel="step", ylabel="voxel metric", ylim=(0, 1.02), title="object-mask metrics (p >= 0.5)"
    )
    for step, old, new in world_changes(m):
        for ax in (ax_loss, ax_acc):
            ax.axvline(step, color="dimgrey", linestyle="--", linewidth=1)
            ax.annotate(f"{old} -> {new} ranks", xy=(step, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -11), textcoords="offset points", fontsize=8, color="dimgrey",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
    ax_acc.legend(loc="lower right")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return png
