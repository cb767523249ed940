"""Join the block segmentations into one volume with global ids."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def stitch(blocks: dict, inputs=(), outputs=()):
    """inputs: the staged volume, then every block result; outputs: segmentation.h5, stitch.json."""
    import dataclasses
    import json

    from pipeline.blocks import BlockConfig, read_block_result, stitch
    from pipeline.config import from_dict
    from pipeline.volumes import read_raw, write_volumes

    raw, voxel_size = read_raw(f"{inputs[0].filepath}:raw")
    results = [read_block_result(f.filepath) for f in inputs[1:]]
    segmentation, stats = stitch(results, raw.shape, from_dict(BlockConfig, blocks))
    write_volumes(outputs[0].filepath, {"segmentation": segmentation}, voxel_size)
    summary = {"stitch": dataclasses.asdict(stats), "blocks": [r.stats.to_dict() for r in results]}
    with open(outputs[1].filepath, "w") as f:
        json.dump(summary, f, indent=2)
    return outputs[0].filepath
