"""Score a segmentation against ground truth, optionally next to the seeded-watershed baseline:

    python -m pipeline.cli.metrics --segmentation seg.h5:segmentation --labels vol.h5:labels \\
        [--raw vol.h5:raw] [--output scores.json]
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import FFNError
from pipeline.data.volumes import read_labels, read_raw
from pipeline.evaluation.scores import format_scores, score_segmentation
from pipeline.evaluation.watershed import watershed_baseline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.metrics",
        description="Score a segmentation against ground truth (VI, adapted Rand, split/merge "
        "counts), optionally next to the seeded-watershed baseline.",
    )
    add = parser.add_argument
    add(
        "--segmentation", required=True, metavar="PATH.h5:DATASET", help="the segmentation to score"
    )
    add("--labels", required=True, metavar="PATH.h5:DATASET", help="ground truth")
    add("--raw", metavar="PATH.h5:DATASET", help="image: also score the watershed baseline on it")
    add("--output", type=Path, help="write the scores here as JSON")
    add("--voxel-size", nargs=3, type=float, metavar=("Z", "Y", "X"), help="in nm, if not stored")
    return parser


def _run(args: argparse.Namespace) -> dict:
    segmentation, _ = read_labels(args.segmentation, args.voxel_size)
    truth, _ = read_labels(args.labels, args.voxel_size)
    scores = {"segmentation": score_segmentation(segmentation, truth).to_dict()}
    if args.raw:
        raw, _ = read_raw(args.raw, args.voxel_size)
        scores["watershed"] = score_segmentation(watershed_baseline(raw), truth).to_dict()
    if args.output:
        with atomic_path(args.output) as tmp:
            tmp.write_text(json.dumps(scores, indent=2) + "\n")
    return scores


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        scores = _run(args)
    except FFNError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_scores(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
