"""Partition a label volume as FFN does and sample balanced training coordinates:

    python -m pipeline.cli.partitions --labels vol.h5:labels --partitions-out parts.h5 \\
        --coordinates-out coords.npz
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, one_line_errors
from pipeline.preprocess.partitions import PARTITIONS_DATASET, PartitionConfig, preprocess


def _parser() -> argparse.ArgumentParser:
    defaults = PartitionConfig()
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.partitions",
        description="Partition a label volume as FFN does; sample balanced training coordinates.",
    )
    add = parser.add_argument
    add("--labels", required=True, metavar="PATH.h5:DATASET", help="ground truth, (z, y, x)")
    add(
        "--partitions-out",
        required=True,
        type=Path,
        metavar="PATH.h5",
        help=f"partition map, written as dataset '{PARTITIONS_DATASET}'",
    )
    add(
        "--coordinates-out",
        required=True,
        type=Path,
        metavar="PATH.npz",
        help="training coordinates to write (pipeline.cli.train --coordinates)",
    )
    add(
        "--name",
        help="volume name stored with the coordinates; training must use the same "
        "(default: the labels file's stem)",
    )
    add(
        "--lom-radius",
        nargs=3,
        type=int,
        metavar=("Z", "Y", "X"),
        default=defaults.lom_radius_zyx,
        help="local object mask radius (default: %(default)s)",
    )
    add(
        "--margin",
        nargs=3,
        type=int,
        metavar=("Z", "Y", "X"),
        help="border never sampled, at least the radius (default: the radius)",
    )
    add(
        "--thresholds",
        nargs="+",
        type=float,
        metavar="T",
        default=defaults.thresholds,
        help="increasing own-label fractions in (0, 1] (default: FFN's, %(default)s)",
    )
    add(
        "--samples-per-class",
        type=int,
        metavar="N",
        default=defaults.samples_per_class,
        help="coordinates drawn from each class (default: %(default)s)",
    )
    add("--seed", type=int, default=defaults.seed, help="sampling seed (default: %(default)s)")
    add(
        "--min-object-voxels",
        type=int,
        metavar="N",
        default=defaults.min_object_voxels,
        help="never sample objects with fewer voxels, the annotation's specks (default: "
        "%(default)s, every object; FFN's --min_size is 10000)",
    )
    add(
        "--voxel-size",
        nargs=3,
        type=float,
        metavar=("Z", "Y", "X"),
        help="in nm; needed only when the labels carry no voxel_size_nm attribute",
    )
    return parser


def _run(args: argparse.Namespace) -> None:
    config = PartitionConfig(
        thresholds=tuple(args.thresholds),
        lom_radius_zyx=tuple(args.lom_radius),
        margin_zyx=None if args.margin is None else tuple(args.margin),
        samples_per_class=args.samples_per_class,
        seed=args.seed,
        min_object_voxels=args.min_object_voxels,
    )
    preprocess(
        args.labels, args.partitions_out, args.coordinates_out, config,
        name=args.name, voxel_size_nm=args.voxel_size,
    )  # fmt: skip


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
