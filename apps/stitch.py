"""Join the block segmentations into one volume with global ids."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def stitch(settings: dict, inputs=(), outputs=()):
    """settings: {"blocks": BlockConfig}; inputs: the staged volume, then every block result;
    outputs: segmentation.h5, stitch.json."""
    import dataclasses
    import json

    from pipeline.atomic import atomic_path
    from pipeline.blocks import BlockConfig, read_block_result
    from pipeline.config import from_dict
    from pipeline.stamps import digest_arrays, run_once
    from pipeline.stitching import stitch
    from pipeline.volumes import read_raw, write_volumes

    paths = [f.filepath for f in inputs]
    segmentation_out, summary_out = (f.filepath for f in outputs)

    def work() -> str:
        raw, voxel_size = read_raw(f"{paths[0]}:raw")
        results = [read_block_result(p) for p in paths[1:]]
        segmentation, stats = stitch(results, raw.shape, from_dict(BlockConfig, settings["blocks"]))
        write_volumes(segmentation_out, {"segmentation": segmentation}, voxel_size)
        summary = {
            "stitch": dataclasses.asdict(stats),
            "blocks": [r.stats.to_dict() for r in results],
        }
        with atomic_path(summary_out) as tmp:
            tmp.write_text(json.dumps(summary, indent=2))
        return digest_arrays({"segmentation": segmentation}, list(voxel_size))

    return run_once(settings, paths, [segmentation_out, summary_out], work)
