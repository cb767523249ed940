"""Segment a volume with a trained FFN from the command line, whole or in overlapping blocks:

    python -m pipeline.cli.infer --raw vol.h5:raw --checkpoint CKPT --output seg.h5 \\
        [--block-shape-zyx Z Y X --overlap-zyx Z Y X --blocks-dir DIR]

CKPT is `TRAIN_DIR/checkpoints/ckpt-N` or a `selection.json` (pipeline.selection.checkpoints).
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, add_arguments, from_arguments, one_line_errors
from pipeline.core import config_io
from pipeline.data.volumes import read_raw, write_volumes
from pipeline.inference.blocks import BlockConfig
from pipeline.inference.flood_fill import (
    SEGMENTATION_DATASET,
    InferenceConfig,
    inference_model,
    predictor_from_checkpoint,
    segment,
)
from pipeline.inference.stitching import segment_blockwise
from pipeline.selection.checkpoints import chosen_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.infer",
        description="Segment a volume with a trained FFN, whole or in overlapping blocks.",
    )
    add = parser.add_argument
    add("--raw", required=True, metavar="PATH.h5:DATASET", help="image volume, (z, y, x) uint8")
    add(
        "--checkpoint",
        required=True,
        help="TRAIN_DIR/checkpoints/ckpt-N, or a selection.json from pipeline.selection.checkpoints",
    )
    add(
        "--output",
        required=True,
        type=Path,
        metavar="PATH.h5",
        help=f"segmentation, written as dataset '{SEGMENTATION_DATASET}'",
    )
    add("--config", help="JSON file of InferenceConfig settings; flags override it")
    add(
        "--blocks-dir",
        type=Path,
        help="with --block-shape-zyx: per-block results, so a restarted run skips finished "
        "blocks (default: OUTPUT's name + '.blocks')",
    )
    add("--voxel-size", nargs=3, type=float, metavar=("Z", "Y", "X"), help="in nm, if not stored")
    add_arguments(parser, InferenceConfig)
    blocks = parser.add_argument_group(
        "blocks", "give --block-shape-zyx to segment in overlapping blocks and stitch them"
    )
    add_arguments(blocks, BlockConfig)
    return parser


def _run(args: argparse.Namespace) -> dict:
    base = config_io.load_json(InferenceConfig, args.config) if args.config else InferenceConfig()
    config = from_arguments(InferenceConfig, args, base)
    checkpoint = chosen_checkpoint(args.checkpoint)
    model = inference_model(checkpoint, config)
    raw, voxel_size = read_raw(args.raw, args.voxel_size)
    predict = predictor_from_checkpoint(checkpoint, model)
    if args.block_shape_zyx:
        blocks = from_arguments(BlockConfig, args)
        blocks_dir = args.blocks_dir or args.output.with_name(args.output.name + ".blocks")
        provenance = {"checkpoint": str(checkpoint), "raw": args.raw}
        segmentation, summary = segment_blockwise(
            raw, predict, model, config, blocks, blocks_dir, provenance=provenance, progress=True
        )
    else:
        segmentation, stats = segment(raw, predict, model, config, progress=True)
        summary = {"inference": stats.to_dict()}
    attrs = {
        "checkpoint": str(checkpoint),
        "raw": args.raw,
        "inference_config": json.dumps(config_io.to_dict(config)),
        "model_config": json.dumps(config_io.to_dict(model)),
        "summary": json.dumps(summary),
    }
    write_volumes(args.output, {SEGMENTATION_DATASET: segmentation}, voxel_size, attrs)
    return summary


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    summary = _run(args)
    stats = summary["inference"]
    print(
        f"wrote {args.output}: {stats['objects']} objects from {stats['fov_evaluations']} FOV "
        f"evaluations in {stats['seconds']:.1f} s ({stats['voxels_per_second']:.0f} voxels/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
