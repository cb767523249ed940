"""Segment one block of the volume with the selected checkpoint (one task per block)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def infer_block(settings: dict, inputs=(), outputs=()):
    """settings: {"inference": InferenceConfig, "start": zyx, "stop": zyx}; inputs: the staged
    volume, selection.json; outputs[0]: the block's result file."""
    from pathlib import Path

    import h5py

    from pipeline.blocks import (
        Block,
        block_progress_path,
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
    from pipeline.staging import scored_part
    from pipeline.stamps import digest_arrays, input_token, run_once

    volume, selection = (f.filepath for f in inputs)
    output = outputs[0].filepath

    def work() -> str:
        checkpoint = chosen_checkpoint(selection)
        model = checkpoint_model_config(checkpoint)
        block = Block(tuple(settings["start"]), tuple(settings["stop"]))
        # The weights' token keys the block's inference checkpoint: new weights, fresh start.
        provenance = {"checkpoint": str(checkpoint), "weights": input_token(selection)}
        with h5py.File(volume, "r") as f:
            result = segment_block(
                f["raw"], block, predictor_from_checkpoint(checkpoint, model), model,
                from_dict(InferenceConfig, settings["inference"]), provenance,
                block_state_path(Path(output).parent, block), block_progress_path(output),
                scored=scored_part(volume),
            )  # fmt: skip
        write_block_result(output, result)
        return digest_arrays({"labels": result.labels})

    return run_once(settings, [volume, selection], [output], work)


@python_app(executors=[CPU_LABEL])
def ground_truth_block(settings: dict, inputs=(), outputs=()):
    """A stand-in for infer_block that benchmarks of the data path use (bench/scale.py): the
    block's ground truth as its result. settings: {"start": zyx, "stop": zyx}; inputs: the
    staged labeled volume; outputs[0]: the block's result file."""
    import h5py

    from pipeline.blocks import Block, ground_truth_block, write_block_result
    from pipeline.stamps import digest_arrays, run_once

    volume, output = inputs[0].filepath, outputs[0].filepath

    def work() -> str:
        with h5py.File(volume, "r") as f:
            result = ground_truth_block(
                f["labels"], Block(tuple(settings["start"]), tuple(settings["stop"]))
            )
        write_block_result(output, result)
        return digest_arrays({"labels": result.labels})

    return run_once(settings, [volume], [output], work)
