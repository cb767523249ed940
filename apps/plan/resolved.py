"""What every stage's builder needs from the run, derived once: the run's settings, its paths and
site, and the facts that follow from them (the evaluated volume's shape and voxel size, the
segmenting model's FOV, the block grid, how the segmentation layers are stored). A fact is
computed the first time a builder asks for it (reading a volume's header, a model's settings) and
kept: every builder reads the same `RunPlan`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core import config_io
from pipeline.run.run_layout import RunPaths

if TYPE_CHECKING:
    from pipeline.inference.blocks import BlockGrid
    from pipeline.inference.flood_fill import InferenceConfig
    from pipeline.run.run_config import RunConfig
    from site_configs.spec import SiteSpec


@dataclass(frozen=True)
class InferencePass:
    """One inference pass over the volume and its stitching: where each writes."""

    prefix: str  # of its tasks' names: "" (the first pass), "second " (a consensus's second)
    inference: InferenceConfig
    blocks_dir: Path
    stitch_dir: Path
    stitch_summary: Path
    folder: Path  # the folder whose segmentation layer its stitching writes


@dataclass(frozen=True)
class RunPlan:
    """A run as the builders see it (`resolve_plan`); the facts are derived once, when first read."""

    config: RunConfig
    paths: RunPaths
    site: SiteSpec

    @functools.cached_property
    def segmenting_fov(self) -> tuple[int, int, int]:
        """The FOV of the model that segments: the given pretrained one, else the one trained."""
        if self.config.pretrained_model:
            from pipeline.inference.flood_fill import checkpoint_model_config
            from pipeline.network.released_weights import converted_checkpoint

            model = checkpoint_model_config(converted_checkpoint(self.config.pretrained_model))
            return model.fov_shape_zyx
        return self.config.train.model.fov_shape_zyx

    @property
    def eval_context(self) -> tuple[int, int, int]:
        """Voxels segmented around an evaluated ROI: the inference model's FOV radius, so a FOV
        can be centred on the ROI's faces."""
        return tuple(int(f) // 2 for f in self.segmenting_fov)

    @functools.cached_property
    def eval_shape(self) -> tuple[int, int, int]:
        """The shape of the volume that is segmented (an ROI with its context)."""
        data = self.config.data
        if data.synthetic:
            from pipeline.data.synthetic import PRESETS

            return PRESETS[data.synthetic_preset].with_geometry(data.synthetic_shape_zyx).shape_zyx
        from pipeline.data.volumes import volume_shape

        shape = volume_shape(data.eval_raw)
        if data.eval_roi:
            from pipeline.core.roi import Roi

            return Roi.parse(data.eval_roi).grown(self.eval_context, shape).shape
        return shape

    @functools.cached_property
    def voxel_size(self) -> tuple[float, float, float]:
        """The evaluated volume's voxel size (nm), read from its metadata (or the given one)."""
        data = self.config.data
        if data.synthetic:
            from pipeline.data.synthetic import PRESETS

            return PRESETS[data.synthetic_preset].voxel_size_nm
        from pipeline.data.volumes import read_header

        return read_header(data.eval_raw, data.voxel_size_nm).voxel_size_nm

    @functools.cached_property
    def blocks(self) -> BlockGrid:
        from pipeline.inference.blocks import plan_blocks

        return plan_blocks(self.eval_shape, self.config.blocks)

    @functools.cached_property
    def layout(self) -> dict:
        """How the full resolution of every segmentation layer the run writes is stored (as the
        export's settings say), a setting of every task that writes one."""
        from pipeline.export.layers import segmentation_layout

        layout = segmentation_layout(
            self.eval_shape, self.voxel_size, self.config.export, self.config.blocks.chunks
        )
        return config_io.to_dict(layout)

    @functools.cached_property
    def layer_parts(self) -> list[tuple[slice, ...]]:
        """The parts its writers write a segmentation layer in, a task each
        (pipeline.inference.stitching.layer_part)."""
        from pipeline.export.segmentation_layer import SegmentationLayout
        from pipeline.inference.stitching import layer_parts

        return layer_parts(self.blocks, config_io.from_dict(SegmentationLayout, self.layout))

    def full_resolution(self, folder: Path) -> Path:
        """The folder of the full resolution of the segmentation layer in `folder`
        (pipeline.export.segmentation_layer.new_segmentation): the export's, where evaluation and the export
        read the segmentation, or the first pass's before agglomeration."""
        from pipeline.export.layers import SEGMENTATION_LAYER, full_resolution_key

        return folder / SEGMENTATION_LAYER / full_resolution_key(self.voxel_size)

    @property
    def eval_has_labels(self) -> bool:
        return self.config.data.synthetic or bool(self.config.data.eval_labels)

    @property
    def learns_baseline(self) -> bool:
        """Whether the baseline is the learned watershed: asked for, and the run has a labelled
        training part (synthetic runs have one)."""
        baseline, data = self.config.watershed, self.config.data
        has_train_part = data.synthetic or bool(data.train_raw)
        return baseline.enabled and baseline.learned and has_train_part and self.eval_has_labels

    @property
    def selection_volume(self) -> Path:
        """Where checkpoints and the baseline's parameters are chosen: never the scored volume, a
        part of its own, else the training volume."""
        paths = self.paths
        return paths.select_volume if self.config.data.has_select_part else paths.train_volume

    @property
    def consensus_into(self) -> Path:
        """Where the consensus writes: the export's folder, or its own if agglomeration follows."""
        paths = self.paths
        return paths.consensus if self.config.agglomeration.writes_layer else paths.precomputed

    @functools.cached_property
    def inference_passes(self) -> list[InferencePass]:
        """The first pass, stitched into the export's folder unless a second pass follows; with
        `[agglomeration] consensus`, a second pass in the other seed order."""
        from pipeline.inference.flood_fill import SEED_ORDERS

        config, paths = self.config, self.paths
        second = config.agglomeration
        first = InferencePass(
            "", config.inference, paths.blocks_dir, paths.stitch_dir, paths.stitch_summary,
            paths.first_pass if second.writes_layer or second.consensus else paths.precomputed,
        )  # fmt: skip
        if not second.consensus:
            return [first]
        other = next(o for o in SEED_ORDERS if o != config.inference.seed_order)
        return [first, InferencePass(
            "second ", replace(config.inference, seed_order=other), paths.second_blocks_dir,
            paths.second_stitch_dir, paths.second_stitch_summary, paths.second_pass,
        )]  # fmt: skip

    @property
    def scored_segmentations(self) -> dict[str, Path]:
        """evaluation.json's keys and the folders of what they score: "ffn", the last step's (the
        export's, or with pairs decided the merged layer made from it and the merge graph), then
        with a second pass the steps before it."""
        second, paths = self.config.agglomeration, self.paths
        # With pairs decided the export holds the supervoxels: the merged objects are scored.
        scored = {"ffn": paths.merged if second.enabled else paths.precomputed}
        if second.writes_layer or second.consensus:
            scored["ffn_first_pass"] = paths.first_pass
        if second.writes_layer and second.consensus:
            scored["ffn_consensus"] = paths.consensus
        return scored


def resolve_plan(config: RunConfig, paths: RunPaths, site: SiteSpec) -> RunPlan:
    """The plan every builder of this run reads."""
    return RunPlan(config, paths, site)
