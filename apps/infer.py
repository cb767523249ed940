"""Segment one block of the volume with the selected checkpoint (one task per block)."""

from parsl import python_app

from apps.contracts import GroundTruthBlock, InferBlock
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def infer_block(settings: dict, io: InferBlock, inputs=(), outputs=()):
    """settings: {"inference": InferenceConfig, "start": zyx, "stop": zyx}; the staged volume is
    a copy or a record of where to read it."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import digest_arrays, input_token, run_once
    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import open_volume
    from pipeline.inference.blocks import (
        Block,
        block_progress_path,
        block_state_path,
        segment_block,
        write_block_result,
    )
    from pipeline.inference.flood_fill import InferenceConfig, inference_model
    from pipeline.selection.checkpoints import (
        chosen_checkpoint,
        chosen_predictor,
        recorded_checkpoint,
    )

    volume, selection, output = str(io.volume), str(io.selection), str(io.result)
    block = Block(tuple(settings["start"]), tuple(settings["stop"]))

    def work() -> str:
        inference = from_dict(InferenceConfig, settings["inference"])
        model = inference_model(chosen_checkpoint(selection), inference)
        # The weights' token keys the block's inference checkpoint (with the model settings,
        # their precision here among them): new weights, fresh start. The checkpoint as
        # selection.json names it (relative to the run dir), not where it is now: a block begun
        # before the run dir was moved goes on from its saved state.
        provenance = {
            "checkpoint": recorded_checkpoint(selection),
            "weights": input_token(selection),
        }
        staged = read_staged(volume)
        with open_volume(staged.raw) as raw:
            result = segment_block(
                raw, block, chosen_predictor(selection, model), model, inference, provenance,
                block_state_path(io.result.parent, block), block_progress_path(output),
                scored=staged.scored,
            )  # fmt: skip
        write_block_result(output, result)
        return digest_arrays({"labels": result.labels})

    # Keyed on the chunks of the volume the block reads: a voxel changed elsewhere keeps it.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def ground_truth_block(settings: dict, io: GroundTruthBlock, inputs=(), outputs=()):
    """A stand-in for infer_block that benchmarks of the data path use (bench/scale.py): the
    block's ground truth as its result. settings: {"start": zyx, "stop": zyx}."""
    from pipeline.core.stamps import digest_arrays, run_once
    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import open_volume
    from pipeline.inference.blocks import Block, ground_truth_block, write_block_result

    def work() -> str:
        with open_volume(read_staged(io.volume).labels) as labels:
            result = ground_truth_block(
                labels, Block(tuple(settings["start"]), tuple(settings["stop"]))
            )
        write_block_result(io.result, result)
        return digest_arrays({"labels": result.labels})

    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))
