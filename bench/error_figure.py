"""A figure of one ground-truth body and the segments a finished run cut it into: six sections
through the body, the image with the run's segments inside the body in colour (top row) and the
body's outline alone (bottom row). The report's "Where FFN errs most" names the bodies to look at.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/error_figure.py --run-dir data/runs/flyem-fib25 \
        --body 135478 --out bench/figures/fib25_eval_body_135478.png

Reads the run's staged volume (image, labels, the scored part) and its exported segmentation;
prints the body's voxels, mean grey value against all labelled voxels', and its segments.
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from skimage.segmentation import find_boundaries  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agglomerate import read_array, staged_eval  # noqa: E402  (bench/agglomerate.py)

from pipeline.export import segmentation_spec  # noqa: E402

SECTIONS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--body", type=int, required=True, help="a ground-truth id")
    parser.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    args = parser.parse_args()

    staged = staged_eval(args.run_dir)
    part = staged.scored.slices if staged.scored else ()
    raw, labels = read_array(staged.raw)[part], read_array(staged.labels)[part]
    segmentation = read_array(segmentation_spec(str(args.run_dir / "precomputed")))[part]
    body = labels == args.body
    if not body.any():
        sys.exit(f"no voxel of body {args.body} in the scored part")
    ids, voxels = np.unique(segmentation[body], return_counts=True)
    order = np.argsort(-voxels)
    print(f"body {args.body}: {body.sum():,} voxels, mean grey {raw[body].mean():.0f} "
          f"(all labelled voxels {raw[labels > 0].mean():.0f}); {len(ids)} segments, "
          f"{np.count_nonzero(voxels >= 1000)} of >= 1,000 voxels in it")  # fmt: skip
    print("largest:", ", ".join(f"{ids[i]} ({voxels[i]:,})" for i in order[:8]))

    z_with = np.flatnonzero(body.any(axis=(1, 2)))
    sections = np.linspace(z_with[0], z_with[-1], SECTIONS).round().astype(int)
    colours = np.random.default_rng(0).random((int(segmentation.max()) + 1, 3))
    figure, axes = plt.subplots(2, SECTIONS, figsize=(3.2 * SECTIONS, 6.8))
    for column, z in enumerate(sections):
        for row in range(2):
            axis = axes[row, column]
            axis.imshow(raw[z], cmap="gray", vmin=0, vmax=255)
            if row == 0:
                overlay = np.zeros((*raw[z].shape, 4))
                overlay[..., :3] = colours[segmentation[z]]
                overlay[..., 3] = 0.45 * body[z]
                axis.imshow(overlay)
                axis.contour(find_boundaries(segmentation[z]), [0.5], colors="y", linewidths=0.3)
            axis.contour(body[z], [0.5], colors="lime", linewidths=0.8)
            axis.set_title(f"z {z}" + (": segments in it" if row == 0 else ": the body"))
            axis.set_axis_off()
    figure.suptitle(
        f"{args.run_dir.name}: ground-truth body {args.body} (green outline) and the run's "
        f"segments inside it (colours); data: FlyEM, HHMI Janelia"
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
