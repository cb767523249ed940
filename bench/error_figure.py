"""A figure of one ground-truth body and the segments a finished run cut it into, or of one
segment and the bodies it merges: six sections through it, the image with the pieces inside it
in colour (top row) and its outline alone (bottom row). The report's "Where FFN errs most" names
the bodies and segments to look at.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/error_figure.py --run-dir data/runs/flyem-fib25 \
        --body 135478 --out bench/figures/fib25_eval_body_135478.png
    PATH=.venv/bin:$PATH python bench/error_figure.py --run-dir data/runs/flyem-fib25-whole \
        --segment 1 --out bench/figures/fib25_whole_segment_1.png

Reads the run's staged volume (image, labels, the scored part) and its exported segmentation;
prints its voxels, mean grey value against all labelled voxels', and its pieces.
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from agglomerate import read_array, staged_eval  # bench/agglomerate.py
from skimage.segmentation import find_boundaries

from pipeline.export.layers import segmentation_spec
from pipeline.run.run_layout import RunPaths

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--body", type=int, help="a ground-truth id: the segments it is cut into")
    which.add_argument("--segment", type=int, help="a segment id: the bodies it merges")
    parser.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    args = parser.parse_args()

    staged = staged_eval(args.run_dir)
    part = staged.scored.slices if staged.scored else ()
    raw, labels = read_array(staged.raw)[part], read_array(staged.labels)[part]
    segmentation = read_array(segmentation_spec(RunPaths(args.run_dir).objects))[part]
    if args.body is not None:
        whole, inside, name, pieces = (
            labels == args.body,
            segmentation,
            f"body {args.body}",
            "segments",
        )
    else:
        whole, inside, name, pieces = (
            segmentation == args.segment,
            labels,
            f"segment {args.segment}",
            "bodies",
        )
    if not whole.any():
        sys.exit(f"no voxel of {name} in the scored part")
    ids, voxels = np.unique(inside[whole], return_counts=True)
    order = np.argsort(-voxels)
    print(f"{name}: {whole.sum():,} voxels, mean grey {raw[whole].mean():.0f} "
          f"(all labelled voxels {raw[labels > 0].mean():.0f}); {len(ids)} {pieces}, "
          f"{np.count_nonzero(voxels >= 1000)} of >= 1,000 voxels in it")  # fmt: skip
    print("largest:", ", ".join(f"{ids[i]} ({voxels[i]:,})" for i in order[:8]))
    figure = _sections(raw, whole, inside, ids[order], name, pieces)
    figure.suptitle(
        f"{args.run_dir.name}: {name} (green outline) and the {pieces} inside it (colours); "
        "data: FlyEM, HHMI Janelia"
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=60)
    print(f"wrote {args.out}")


def _sections(
    raw: np.ndarray,
    whole: np.ndarray,
    inside: np.ndarray,
    largest: np.ndarray,
    name: str,
    pieces: str,
) -> plt.Figure:
    """Six sections through `whole`: the image with the ids of `inside` in colour within it (top
    row), its outline alone (bottom row). The first 20 of `largest` (its ids, largest first) get
    tab20's distinct colours; the rest grey."""
    z_with = np.flatnonzero(whole.any(axis=(1, 2)))
    sections = np.linspace(z_with[0], z_with[-1], SECTIONS).round().astype(int)
    palette = plt.get_cmap("tab20").colors
    colour_of = dict(zip(largest[:20], palette, strict=False))
    figure, axes = plt.subplots(2, SECTIONS, figsize=(3.2 * SECTIONS, 6.8))
    for column, z in enumerate(sections):
        for row in range(2):
            axis = axes[row, column]
            axis.imshow(raw[z], cmap="gray", vmin=0, vmax=255)
            if row == 0:
                overlay = np.full((*raw[z].shape, 4), 0.5)
                for piece, colour in colour_of.items():
                    overlay[inside[z] == piece, :3] = colour
                overlay[..., 3] = 0.45 * whole[z]
                axis.imshow(overlay)
                axis.contour(find_boundaries(inside[z]), [0.5], colors="y", linewidths=0.3)
            axis.contour(whole[z], [0.5], colors="lime", linewidths=0.8)
            axis.set_title(f"z {z}: " + (f"{pieces} in it" if row == 0 else name))
            axis.set_axis_off()
    return figure


if __name__ == "__main__":
    main()
