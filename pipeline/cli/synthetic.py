"""Write a synthetic EM volume with ground truth (datasets raw and labels):

    python -m pipeline.cli.synthetic OUT.h5 [--preset NAME] [--seed N] [--shape Z Y X] \\
        [--voxel-size Z Y X]
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from pipeline.cli import HelpFormatter
from pipeline.core.errors import ConfigError
from pipeline.data.synthetic import PRESETS, generate
from pipeline.data.volumes import write_volumes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.synthetic",
        description="Write a synthetic EM volume with ground truth (datasets raw and labels). "
        "Object counts follow the box's size in nm, so --shape and --voxel-size keep the "
        "preset's tissue density.",
    )
    parser.add_argument("output", help="HDF5 file to write, e.g. data/synthetic.h5")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default: %(default)s\nthe volume's size and contents (pipeline.data.synthetic): "
        + "; ".join(
            f"{name}, {'x'.join(map(str, preset.shape_zyx))} voxels (z, y, x) of "
            f"{'x'.join(f'{v:g}' for v in preset.voxel_size_nm)} nm"
            for name, preset in sorted(PRESETS.items())
        ),
    )
    parser.add_argument("--seed", type=int, help="random seed (default: the preset's)")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        metavar=("Z", "Y", "X"),
        help="volume shape in voxels (default: the preset's)",
    )
    parser.add_argument(
        "--voxel-size",
        type=float,
        nargs=3,
        metavar=("Z", "Y", "X"),
        help="voxel size in nm (default: the preset's)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    try:
        config = PRESETS[args.preset].with_geometry(args.shape, args.voxel_size)
        if args.seed is not None:
            config = dataclasses.replace(config, seed=args.seed)
        raw, labels = generate(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    attrs = {"synthetic_config": json.dumps(dataclasses.asdict(config))}
    path = write_volumes(
        args.output, {"raw": raw, "labels": labels}, config.voxel_size_nm, attrs=attrs
    )
    print(
        f"wrote {path}: shape {raw.shape} (z, y, x), voxel size {config.voxel_size_nm} nm, "
        f"{int(labels.max())} objects, {time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
