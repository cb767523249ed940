"""Export an EM volume and its segmentation as Neuroglancer precomputed layers, with meshes:

    python -m pipeline.cli.export --raw vol.h5:raw --segmentation seg.h5:segmentation --out DIR

View the folder with `python -m pipeline.cli.viewer --precomputed DIR`.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.cli import HelpFormatter, field_help, one_line_errors
from pipeline.data.volumes import read_labels, read_raw
from pipeline.export.destination import publish
from pipeline.export.folder_layout import HERE
from pipeline.export.layers import ExportConfig, export_precomputed


def _parser() -> argparse.ArgumentParser:
    defaults = ExportConfig()
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.export",
        description="Write an EM volume and its segmentation as Neuroglancer precomputed layers "
        "(image, segmentation with meshes and skeletons) into a folder; view it with "
        "python -m pipeline.cli.viewer.",
    )
    add = parser.add_argument
    add("--raw", required=True, help="raw image, path.h5:dataset (uint8)")
    add("--segmentation", required=True, help="segmentation, path.h5:dataset (integer ids)")
    add("--out", required=True, type=Path, help="export folder (replaced if it is an export)")
    add(
        "--voxel-size",
        type=float,
        nargs=3,
        metavar=("Z", "Y", "X"),
        help="voxel size in nm (default: the files' voxel_size_nm attribute)",
    )
    add(
        "--chunk-voxels",
        type=int,
        default=defaults.chunk_voxels,
        help="default: %(default)s\n" + field_help(ExportConfig, "chunk_voxels").replace("%", "%%"),
    )
    add(
        "--scales",
        type=int,
        default=defaults.num_scales,
        help="default: %(default)s\n" + field_help(ExportConfig, "num_scales").replace("%", "%%"),
    )
    add(
        "--mesh-max-error-nm",
        type=float,
        default=defaults.mesh_max_error_nm,
        help="mesh simplification tolerance, 0 = none (default: %(default)s)",
    )
    add("--gzip", action="store_true", help="gzip chunks and meshes (needs a gzip-aware server)")
    add(
        "--unsharded",
        action="store_true",
        help="a file per chunk and legacy meshes (any static web server serves them; the "
        "default, sharded, needs one that answers Range requests, as pipeline.cli.viewer does)",
    )
    add("--no-skeletons", action="store_true", help="no skeletons of the segments (kimimaro's)")
    add(
        "--destination",
        default=defaults.destination,
        help="default: %(default)s (the folder --out)\n"
        + field_help(ExportConfig, "destination").replace("%", "%%"),
    )
    return parser


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = ExportConfig(
        chunk_voxels=args.chunk_voxels,
        num_scales=args.scales,
        mesh_max_error_nm=args.mesh_max_error_nm,
        gzip=args.gzip,
        sharded=not args.unsharded,
        skeletons=not args.no_skeletons,
        destination=args.destination,
    )
    raw, voxel_size = read_raw(args.raw, args.voxel_size)
    segmentation, _ = read_labels(args.segmentation, voxel_size)
    result = export_precomputed(raw, segmentation, voxel_size, args.out, config, progress=True)
    if config.destination != HERE:
        publish(args.out, config.destination)
        print(f"[export] published to {config.destination}")
    print(
        f"[export] wrote {result.path}: {len(result.scales)} scales, {result.segment_count} "
        f"segments, {result.file_count} files, {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
