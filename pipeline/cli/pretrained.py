"""Import a released FFN model (a google-research/ffn convstack_3d TF1 checkpoint, e.g. FIB-25)
into this workflow's format, `OUT/checkpoints/ckpt-0` + `OUT/config.json`; given one of our own
checkpoints (`TRAIN_DIR/checkpoints/ckpt-N`), ship its weights in the same layout:

    python -m pipeline.cli.pretrained \\
        --checkpoint ../shared/models/google-ffn-fib25/model.ckpt-27465036 \\
        --out data/models/fib25 [--fov-zyx 33 33 33 --deltas-zyx 8 8 8]
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, field_help, one_line_errors
from pipeline.network.model import ModelConfig
from pipeline.network.released_weights import (
    FIB25_DELTAS_ZYX,
    FIB25_FOV_ZYX,
    FIB25_IMAGE_MEAN,
    FIB25_IMAGE_STDDEV,
    is_convstack_checkpoint,
)
from pipeline.selection.released_models import convert_checkpoint, ship_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.pretrained",
        description="Convert a google-research/ffn convstack_3d TF1 checkpoint (e.g. the FIB-25 "
        "model) into this workflow's format: OUT/checkpoints/ckpt-0 + OUT/config.json.",
    )
    add = parser.add_argument
    add(
        "--checkpoint",
        required=True,
        help="TF1 checkpoint prefix (PATH.index must exist); or one of ours "
        "(TRAIN_DIR/checkpoints/ckpt-N): its weights and its run's settings, the options below unused",
    )
    add("--out", required=True, type=Path, help="folder to write (a train-dir-like layout)")
    add(
        "--fov-zyx",
        type=int,
        nargs=3,
        default=FIB25_FOV_ZYX,
        metavar=("Z", "Y", "X"),
        help="field of view the model was trained with (not in the checkpoint; default: FIB-25's "
        "%(default)s)",
    )
    add(
        "--deltas-zyx",
        type=int,
        nargs=3,
        default=FIB25_DELTAS_ZYX,
        metavar=("Z", "Y", "X"),
        help="FOV move step (default: %(default)s)",
    )
    add(
        "--image-mean",
        type=float,
        default=FIB25_IMAGE_MEAN,
        help="default: FIB-25's %(default)s\n"
        + field_help(ModelConfig, "image_mean").replace("%", "%%"),
    )
    add(
        "--image-stddev",
        type=float,
        default=FIB25_IMAGE_STDDEV,
        help="default: FIB-25's %(default)s\n"
        + field_help(ModelConfig, "image_stddev").replace("%", "%%"),
    )
    add(
        "--precision",
        choices=("float32", "mixed_bfloat16"),
        default="float32",
        help="what inference with it computes in (bf16: about 4x faster on CPUs with AMX; "
        "default: %(default)s, as the authors)",
    )
    add("--overwrite", action="store_true", help="replace OUT if it exists")
    return parser


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not is_convstack_checkpoint(args.checkpoint):
        path = ship_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
        source = json.loads((args.out / "config.json").read_text())["pretrained"]
        print(f"wrote {path}: the weights of {source['source']} (step {source['global_step']})")
        return 0
    path = convert_checkpoint(
        args.checkpoint,
        args.out,
        args.fov_zyx,
        args.deltas_zyx,
        args.image_mean,
        args.image_stddev,
        precision=args.precision,
        overwrite=args.overwrite,
    )
    source = json.loads((args.out / "config.json").read_text())["pretrained"]
    step = f", step {source['global_step']}" if source["global_step"] is not None else ""
    print(
        f"wrote {path}: convstack_3d depth {source['depth']}, {source['features']} features{step}; "
        f"FOV {tuple(args.fov_zyx)}, deltas {tuple(args.deltas_zyx)} (z, y, x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
