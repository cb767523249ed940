"""Pick the best of a training run's last checkpoints on a held-out volume (writes selection.json):

    python -m pipeline.cli.selection --train-dir RUN --raw held.h5:raw --labels held.h5:labels

`python -m pipeline.cli.infer --checkpoint` takes the selection.json it writes.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, add_arguments, from_arguments, one_line_errors
from pipeline.core import config_io
from pipeline.data.volumes import read_volume_pair
from pipeline.selection.checkpoints import SELECTION_FILE, SelectionConfig, select_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.selection",
        description="Pick the best of a training run's last checkpoints on a held-out volume.",
    )
    add = parser.add_argument
    add(
        "--train-dir", required=True, type=Path, help="the training run (checkpoints/, config.json)"
    )
    add("--raw", required=True, metavar="PATH.h5:DATASET", help="held-out image")
    add("--labels", required=True, metavar="PATH.h5:DATASET", help="held-out ground truth")
    add(
        "--output",
        type=Path,
        help=f"default: TRAIN_DIR/{SELECTION_FILE}\nwhere the choice is written (JSON; "
        "python -m pipeline.cli.infer --checkpoint takes it)",
    )
    add("--config", help="JSON file of SelectionConfig settings; flags override it")
    add("--voxel-size", nargs=3, type=float, metavar=("Z", "Y", "X"), help="in nm, if not stored")
    add(
        "--min-object-voxels",
        type=int,
        default=0,
        metavar="N",
        help="centre no held-out FOV on a smaller object: the training's partitions setting "
        "(default: %(default)s, every object)",
    )
    add_arguments(parser, SelectionConfig)
    return parser


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    base = config_io.load_json(SelectionConfig, args.config) if args.config else SelectionConfig()
    config = from_arguments(SelectionConfig, args, base)
    volume = read_volume_pair(args.raw, args.labels, voxel_size_nm=args.voxel_size)
    record = select_checkpoint(
        args.train_dir, volume, config, args.output, min_object_voxels=args.min_object_voxels
    )
    for row in record["candidates"]:
        print(
            f"step {row['step']:>8}  fov_f1 {row['fov_f1']:.4f}"
            + (f"  vi {row['vi']:.4f}" if "vi" in row else "")
        )
    print(f"selected {record['checkpoint']} ({record['criterion']} {record['score']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
