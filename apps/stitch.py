"""Join the block segmentations into one volume with global ids."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def stitch(settings: dict, inputs=(), outputs=()):
    """settings: {"blocks": BlockConfig}; inputs: the staged volume, then every block result in
    plan order; outputs: segmentation.h5, stitch.json. Holds a few blocks at a time, never the
    whole volume."""
    import dataclasses
    import hashlib
    import json
    from functools import lru_cache

    from pipeline.atomic import atomic_path
    from pipeline.blocks import BlockConfig, plan_blocks, read_block_result
    from pipeline.config import from_dict
    from pipeline.stamps import run_once
    from pipeline.stitching import stitch_blocks
    from pipeline.volumes import new_volume, read_header

    paths = [f.filepath for f in inputs]
    segmentation_out, summary_out = (f.filepath for f in outputs)
    config = from_dict(BlockConfig, settings["blocks"])

    def work() -> str:
        header = read_header(f"{paths[0]}:raw")
        blocks = plan_blocks(header.shape, config)
        # A block and its neighbours stay read while their cores are relabelled.
        load = lru_cache(maxsize=32)(lambda i: read_block_result(paths[1 + i], blocks[i]))
        digest = hashlib.sha256(json.dumps(list(header.shape)).encode())
        with new_volume(segmentation_out, "segmentation", header.shape, "uint64",
                        header.voxel_size_nm) as dataset:  # fmt: skip

            def write(core, ids) -> None:
                dataset[core] = ids
                digest.update(f"{core}".encode() + ids.tobytes())

            stats = stitch_blocks(blocks, lambda i: load(i).labels, header.shape, config, write)
        summary = {
            "stitch": dataclasses.asdict(stats),
            "blocks": [load(i).stats.to_dict() for i in range(len(blocks))],
        }
        with atomic_path(summary_out) as tmp:
            tmp.write_text(json.dumps(summary, indent=2))
        return digest.hexdigest()

    return run_once(settings, paths, [segmentation_out, summary_out], work)
