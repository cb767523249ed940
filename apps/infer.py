"""Segment one block of the volume with the selected checkpoint (one task per block)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def infer_block(start: list, stop: list, inference: dict, inputs=(), outputs=()):
    """inputs: the staged volume, selection.json; outputs[0]: the block's result file."""
    from pathlib import Path

    import h5py

    from pipeline.blocks import (
        Block,
        block_done,
        block_state_path,
        segment_block,
        write_block_result,
    )
    from pipeline.config import from_dict
    from pipeline.inference import (
        InferenceConfig,
        checkpoint_model_config,
        predictor_from_checkpoint,
    )
    from pipeline.selection import chosen_checkpoint

    output = outputs[0].filepath
    if not block_done(output):
        checkpoint = chosen_checkpoint(inputs[1].filepath)
        model = checkpoint_model_config(checkpoint)
        with h5py.File(inputs[0].filepath, "r") as f:
            block = Block(tuple(start), tuple(stop))
            result = segment_block(
                f["raw"], block, predictor_from_checkpoint(checkpoint, model), model,
                from_dict(InferenceConfig, inference), {"checkpoint": str(checkpoint)},
                block_state_path(Path(output).parent, block),
            )  # fmt: skip
        write_block_result(output, result)
    return output
