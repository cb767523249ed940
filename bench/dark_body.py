"""Why FFN cuts a dark, thin body: the network alone following it from seeds inside it.

For one ground-truth body inside a part of the FlyEM file, floods from seeds inside the body
(peaks of its own distance transform) on an empty canvas: no other object competes, so what
stops a flood is the network and the move threshold alone. Each flood is made twice: on the
image as it is and with the body's voxels brightened to the median body's mean grey (an oracle
change, a diagnosis only: if the brightened body is followed, its darkness is what stops FFN).
For every FOV the script records the six faces' best object probability and whether the body
goes on through that face, so "where each fill stops and why" is counted: faces the body crosses
where the network stayed below the move threshold.

Run by hand (not a test), from the repository root, after converting the FIB-25 weights:

    PATH=.venv/bin:$PATH python bench/dark_body.py --roi "0:125, 0:122, 0:250" --body 135478 \
        --name training --out bench/figures/dark_body_training.png
    PATH=.venv/bin:$PATH python bench/dark_body.py --roi "61:125, 122:250, 122:250" --body 135478 \
        --name evaluated --out bench/figures/dark_body_evaluated.png

Prints a JSON summary (also written beside the figure). With `--grey-by-depth`, only the grey of
the body and of the other bodies by distance to their surfaces, in the part (no floods):

    PATH=.venv/bin:$PATH python bench/dark_body.py --roi "61:125, 0:122, 64:192" --body 135478 \
        --name "training crop" --out unused.png --grey-by-depth
"""

import argparse
import json
from pathlib import Path

import h5py
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from scipy import ndimage
from skimage.feature import peak_local_max

from pipeline.core.atomic import atomic_path
from pipeline.core.roi import Roi
from pipeline.inference.flood_fill import (
    Canvas,
    InferenceConfig,
    checkpoint_model_config,
    predictor_from_checkpoint,
)
from pipeline.network.model import ModelConfig, normalize_image

ROOT = Path(__file__).resolve().parents[1]
FLYEM = ROOT.parent / "shared/data/flyem_medulla.h5"
CHECKPOINT = ROOT / "data/models/fib25/checkpoints/ckpt-0"
# The authors' inference settings for this model (configs/flyem_fib25.toml).
SETTINGS = InferenceConfig(seed_probability=0.95, pad_probability=0.05, move_threshold=0.9)
MIN_BODY_VOXELS = 20_000  # bodies large enough to have a meaningful mean grey


class RecordingCanvas(Canvas):
    """A canvas that keeps every FOV's position and prediction (logits) in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[tuple[tuple[int, ...], np.ndarray]] = []

    def _evaluate(self, batch):
        predictions = super()._evaluate(batch)
        self.records.extend(zip(batch, predictions.copy(), strict=True))
        return predictions


def final_probability(canvas: RecordingCanvas) -> np.ndarray:
    """The flood's object probability as the canvas held it when the flood ended (NaN where no
    FOV predicted): the recorded predictions written back in order, FFN's keep-background rule
    applied as `Canvas.flood` applies it."""
    logits = np.full(canvas.shape, np.nan, np.float32)
    for pos, prediction in canvas.records:
        box = canvas._fov(pos)
        old, new = logits[box], prediction.copy()
        if canvas.config.keep_background:
            np.copyto(new, old, where=(old < 0) & (new > old))
        logits[box] = new
    return 1 / (1 + np.exp(-logits))


def face_records(canvas: RecordingCanvas, body: np.ndarray, model: ModelConfig) -> list[dict]:
    """For each FOV and each of its six faces (the planes `deltas` from the centre, within the
    central box): the face's best object probability and whether the body crosses it."""
    deltas = np.array(model.deltas_zyx)
    moves = []
    for pos, prediction in canvas.records:
        centre = np.array(prediction.shape) // 2
        origin = np.array(pos) - centre
        for axis in range(3):
            for sign in (-1, 1):
                face = [slice(c - d, c + d + 1) for c, d in zip(centre, deltas, strict=True)]
                face[axis] = centre[axis] + sign * deltas[axis]
                in_volume = tuple(
                    slice(f.start + o, f.stop + o) if isinstance(f, slice) else f + o
                    for f, o in zip(face, origin, strict=True)
                )
                best = float(prediction[tuple(face)].max())
                moves.append(
                    {
                        "probability": float(1 / (1 + np.exp(-best))),
                        "body_crosses": bool(body[in_volume].sum() >= 10),
                    }
                )
    return moves


def seeds_in(body: np.ndarray, radius: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` voxels deep inside `body`, apart from each other, where a FOV fits."""
    depth = ndimage.distance_transform_edt(body)
    fits = np.zeros(body.shape, bool)
    fits[tuple(slice(r, s - r) for r, s in zip(radius, body.shape, strict=True))] = True
    return peak_local_max(depth * fits, min_distance=8, num_peaks=count, exclude_border=False)


def flood_all(raw, body, seeds, predict, model) -> tuple[np.ndarray, list[dict], list[dict]]:
    """Floods from each seed on its own: the largest probability any of them gave each voxel,
    each flood's summary and every face record."""
    union = np.zeros(raw.shape, np.float32)
    floods, faces = [], []
    threshold = SETTINGS.segment_threshold
    for seed in seeds:
        canvas = RecordingCanvas(normalize_image(raw, model), predict, model, SETTINGS)
        found = canvas.flood(tuple(int(s) for s in seed))
        probability = np.nan_to_num(final_probability(canvas))
        union = np.maximum(union, probability)
        kept = found is not None
        mask = probability >= threshold if kept else np.zeros(raw.shape, bool)
        floods.append(
            {
                "seed_zyx": [int(s) for s in seed],
                "fov_evaluations": len(canvas.records),
                "kept": kept,
                "body_voxels_covered": int((mask & body).sum()),
                "voxels_outside_body": int((mask & ~body).sum()),
            }
        )
        faces += face_records(canvas, body, model)
    return union, floods, faces


def stopping_summary(faces: list[dict], move_threshold: float) -> dict:
    """Faces the body crosses: how many the network let the flood move through."""
    crossed = np.array([f["probability"] for f in faces if f["body_crosses"]])
    if crossed.size == 0:
        return {"faces_body_crosses": 0}
    return {
        "faces_body_crosses": int(crossed.size),
        "of_them_moved_through": round(float(np.mean(crossed >= move_threshold)), 3),
        "probability_quartiles": [round(float(q), 3) for q in np.percentile(crossed, [25, 50, 75])],
    }


def body_means(raw: np.ndarray, labels: np.ndarray) -> dict[int, float]:
    ids, counts = np.unique(labels, return_counts=True)
    means = ndimage.mean(raw, labels, ids)
    return {
        int(i): float(m)
        for i, c, m in zip(ids, counts, means, strict=True)
        if i and c >= MIN_BODY_VOXELS
    }


def box_boundary_map(forest_path: Path, raw_file: np.ndarray, box: Roi) -> np.ndarray:
    """The forest's P(boundary) over `box`, from the box and the image its features need."""
    from pipeline.evaluation.evaluate import load_boundary_forest
    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, box_boundary_probability

    return box_boundary_probability(
        load_boundary_forest(forest_path),
        raw_file.__getitem__,
        box.slices,
        raw_file.shape,
        BoundaryForestConfig(),
    )


def lifted_dark_interiors(raw: np.ndarray, boundary: np.ndarray, below: float) -> np.ndarray:
    """The image with the voxels the forest calls cytoplasm (P(boundary) < `below`) raised toward
    the grey of confident cytoplasm (P(boundary) < 0.1), in proportion to how sure the forest is;
    membranes (P(boundary) >= `below`) untouched. No labels: a rule for any tissue."""
    cytoplasm_grey = float(np.median(raw[boundary < 0.1]))
    local = ndimage.gaussian_filter(raw.astype(np.float32), 1.0)
    weight = np.clip(1 - boundary / below, 0, 1)
    lifted = raw + weight * np.clip(cytoplasm_grey - local, 0, None)
    return np.clip(lifted.round(), 0, 255).astype(np.uint8)


def grey_by_depth(raw: np.ndarray, labels: np.ndarray, body_id: int) -> dict[str, dict]:
    """Grey (mean, 10th/50th/90th percentile) of the body's voxels by their distance to its
    surface, of the voxels just outside it, and of the other bodies' surfaces and insides."""
    body = labels == body_id
    inside, outside = ndimage.distance_transform_edt(body), ndimage.distance_transform_edt(~body)
    surface = np.zeros(labels.shape, bool)  # a voxel with a differently labelled 6-neighbour
    for axis in range(3):
        for step in (1, -1):
            surface |= np.roll(labels, step, axis) != labels
    from_surface = ndimage.distance_transform_edt(~surface)
    others = ~body & (labels != 0)
    bands = {
        "body, 3 or more voxels inside": inside >= 3,
        "body, within 2 voxels of its surface": (inside >= 1) & (inside < 3),
        "outside the body, within 2 voxels": (outside >= 1) & (outside < 3),
        "outside the body, 3-5 voxels": (outside >= 3) & (outside < 6),
        "other bodies' surfaces": others & (from_surface < 1.5),
        "other bodies, 3 or more voxels inside": others & (from_surface >= 3),
    }
    return {
        name: {"voxels": int(band.sum()), "mean": round(float(raw[band].mean()), 1)}
        | dict(
            zip(("p10", "p50", "p90"), np.percentile(raw[band], [10, 50, 90]).tolist(), strict=True)
        )
        for name, band in bands.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roi", required=True, help="the part, 'z0:z1, y0:y1, x0:x1'")
    parser.add_argument("--body", type=int, required=True, help="a ground-truth body id")
    parser.add_argument("--name", required=True, help="the part's name, for titles")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    parser.add_argument(
        "--forest",
        type=Path,
        help="a boundary forest (a run's baseline/boundary_forest.joblib): adds floods on the "
        "image with the dark voxels it calls cytoplasm lifted (lifted_dark_interiors)",
    )
    parser.add_argument("--lift-below", type=float, default=0.5, help="P(boundary) lifted under")
    parser.add_argument("--grey-by-depth", action="store_true", help="only grey_by_depth")
    args = parser.parse_args()

    with h5py.File(FLYEM, "r") as f:
        raw_file, labels_file = f["volumes/raw"][:], f["volumes/labels/neuron_ids"][:]
    part = Roi.parse(args.roi)
    if args.grey_by_depth:
        by_depth = grey_by_depth(raw_file[part.slices], labels_file[part.slices], args.body)
        print(json.dumps(by_depth, indent=1))
        return
    body_file = np.zeros(labels_file.shape, bool)
    body_file[part.slices] = labels_file[part.slices] == args.body
    model = checkpoint_model_config(CHECKPOINT)
    radius = np.array(model.fov_shape_zyx) // 2
    # The body's box inside the part, with a FOV of context around it (the file permitting).
    zyx = np.argwhere(body_file)
    box = Roi(tuple(zyx.min(0)), tuple(zyx.max(0) + 1)).grown(radius, raw_file.shape)
    raw, body = raw_file[box.slices], body_file[box.slices]

    means = body_means(raw_file, labels_file)
    median_body = float(np.median(list(means.values())))
    brightened = raw.astype(np.float32)
    brightened[body] += median_body - raw[body].mean()
    brightened = np.clip(brightened.round(), 0, 255).astype(np.uint8)

    predict = predictor_from_checkpoint(CHECKPOINT, model)
    seeds = seeds_in(body, radius, args.seeds)
    depth = ndimage.distance_transform_edt(body)
    results = {}
    unions = {}
    conditions = [("as is", raw), ("body brightened (oracle)", brightened)]
    if args.forest:
        boundary = box_boundary_map(args.forest, raw_file, box)
        lifted = lifted_dark_interiors(raw, boundary, args.lift_below)
        conditions.append((f"dark cytoplasm lifted (P(b) < {args.lift_below})", lifted))
        added = lifted.astype(np.float32) - raw
        print(
            f"mean grey added: {added[body].mean():.1f} in the body, {added[~body].mean():.1f} outside"
        )
    for condition, image in conditions:
        union, floods, faces = flood_all(image, body, seeds, predict, model)
        unions[condition] = union
        results[condition] = {
            "floods": floods,
            "stops": stopping_summary(faces, SETTINGS.move_threshold),
            # Any flood's, kept or dropped: what the network gave the body at all.
            "body_voxels_any_flood_covers": int(
                ((union >= SETTINGS.segment_threshold) & body).sum()
            ),
            "median_probability_in_body": round(float(np.median(union[body])), 3),
            "crossed_face_probabilities": [f["probability"] for f in faces if f["body_crosses"]],
        }
        print(
            condition,
            json.dumps(
                {k: v for k, v in results[condition].items() if k != "crossed_face_probabilities"}
            ),
        )

    summary = {
        "part": args.name,
        "roi": args.roi,
        "body": args.body,
        "body_voxels": int(body.sum()),
        "body_grey_mean_std": [round(float(raw[body].mean()), 1), round(float(raw[body].std()), 1)],
        "labelled_grey_mean_std": [
            round(float(raw_file[labels_file > 0].mean()), 1),
            round(float(raw_file[labels_file > 0].std()), 1),
        ],
        "model_normalisation_mean_std": [model.image_mean, model.image_stddev],
        "median_body_mean_grey": round(median_body, 1),
        "darker_bodies_of_20000_voxels": int(sum(m < raw[body].mean() for m in means.values())),
        "bodies_of_20000_voxels": len(means),
        # Twice a body voxel's median distance to the body's surface: a width, in voxels.
        "body_thickness_voxels_median": round(float(2 * np.median(depth[body])), 1),
    } | {
        k: {kk: vv for kk, vv in v.items() if kk != "crossed_face_probabilities"}
        for k, v in results.items()
    }
    print(json.dumps(summary, indent=1))
    figure = draw(raw, body, unions, results, raw_file, labels_file, model, summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out) as tmp:
        figure.savefig(tmp, dpi=60, format="png")
    with atomic_path(args.out.with_suffix(".json")) as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")


def draw(raw, body, unions, results, raw_file, labels_file, model, summary) -> plt.Figure:
    """Top: the body's grey values against the file's and the model's expectation, and the
    probabilities the network gave the faces the body crosses. Below: sections with the largest
    object probability any flood gave each voxel, as is and with the body brightened."""
    sections = np.linspace(*np.flatnonzero(body.any(axis=(1, 2)))[[0, -1]], 5).round().astype(int)
    figure = plt.figure(figsize=(16, 3.7 * (1 + len(unions))))
    grid = figure.add_gridspec(1 + len(unions), 5)
    grey = figure.add_subplot(grid[0, :2])
    bins = np.arange(0, 257, 4)
    grey.hist(
        raw_file[labels_file > 0].ravel(),
        bins,
        density=True,
        alpha=0.5,
        label="all labelled voxels (file)",
    )
    grey.hist(raw[body].ravel(), bins, density=True, alpha=0.6, label=f"body {summary['body']}")
    x = np.linspace(0, 255, 256)
    mean, std = model.image_mean, model.image_stddev
    grey.plot(
        x,
        np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * np.sqrt(2 * np.pi)),
        "k--",
        label=f"N({mean:.0f}, {std:.0f}): the model's normalisation",
    )
    grey.set_xlabel("grey value")
    grey.legend(fontsize=8)
    faces = figure.add_subplot(grid[0, 2:4])
    for condition, result in results.items():
        faces.hist(
            result["crossed_face_probabilities"],
            np.linspace(0, 1, 21),
            alpha=0.5,
            label=condition,
        )
    faces.axvline(SETTINGS.move_threshold, color="k", ls="--", label="move threshold")
    faces.set_xlabel("best object probability on a FOV face the body crosses")
    faces.legend(fontsize=8)
    text = figure.add_subplot(grid[0, 4])
    text.set_axis_off()
    lines = [
        f"{c}: {r['body_voxels_any_flood_covers']:,} of {summary['body_voxels']:,} body voxels,\n  median P in body {r['median_probability_in_body']}"
        for c, r in results.items()
    ]
    text.text(0, 0.5, "\n".join(lines), fontsize=8, va="center")
    for row, (condition, union) in enumerate(unions.items(), start=1):
        for column, z in enumerate(sections):
            axis = figure.add_subplot(grid[row, column])
            axis.imshow(raw[z], cmap="gray", vmin=0, vmax=255)
            axis.imshow(np.ma.masked_less(union[z], 0.1), cmap="magma", vmin=0, vmax=1, alpha=0.5)
            axis.contour(body[z], [0.5], colors="lime", linewidths=0.8)
            axis.set_title(f"{condition}, z {z}", fontsize=8)
            axis.set_axis_off()
    figure.suptitle(
        f"{summary['part']} part: body {summary['body']} (green) and the object probability of floods seeded inside it; data: FlyEM, HHMI Janelia"
    )
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    main()
