"""Score the FFN segmentation and the watershed baseline against the ground truth: a task per
region counts the overlaps of its part (pipeline.evaluation.evaluate), the last sums and scores; the
learned baseline, where the run has a labelled training part, is a task of its own, over the map
of a boundary forest learned there by another (which the second pass's fill also takes), or
given: another run's, copied."""

from parsl import python_app

from apps.contracts import (
    BoundaryForest,
    CountRegion,
    Evaluate,
    GivenBoundaryForest,
    LearnedBaseline,
)
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def count_region(settings: dict, folder: str, io: CountRegion, inputs=(), outputs=()):
    """settings: {"region": "z0:z1, y0:y1, x0:x1"}; the segmentation is read from `folder`; the
    counts are those within the scored part."""
    from pipeline.core.roi import Roi
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import count_region
    from pipeline.export.layers import segmentation_spec

    def work() -> None:
        staged = read_staged(io.volume)
        region = Roi.parse(settings["region"])
        counts = count_region(staged.labels, segmentation_spec(folder), region, staged.scored)
        counts.save(str(io.counts))

    # Keyed on the region's voxels: a region changed elsewhere keeps it.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def boundary_forest(settings: dict, io: BoundaryForest, inputs=(), outputs=()):
    """The forest learned on the training part: the learned watershed's map, and the one the
    second pass's fill floods."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import learn_boundary_forest

    train = read_staged(io.train_volume)
    return run_once(settings, io.inputs(), io.outputs(),
                    lambda: learn_boundary_forest(train, io.forest))  # fmt: skip


@python_app(executors=[CPU_LABEL])
def given_boundary_forest(settings: dict, io: GivenBoundaryForest, inputs=(), outputs=()):
    """A boundary forest another run learned (`boundary_forest`), copied once checked to be
    one."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.evaluation.evaluate import copy_boundary_forest

    def work() -> str:
        copy_boundary_forest(io.source, io.forest)
        return digest_files([io.forest])  # the same forest copied again leaves the fill done

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def learned_baseline(settings: dict, io: LearnedBaseline, inputs=(), outputs=()):
    """settings: {"baseline": "learned watershed"}; the forest is `boundary_forest`'s."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import learned_baseline

    def work() -> None:
        tuned_on, volume = read_staged(io.tuned_on), read_staged(io.volume)
        learned_baseline(io.forest, tuned_on, volume, io.segmentation, io.record)

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def evaluate(settings: dict, folders: dict, io: Evaluate, inputs=(), outputs=()):
    """settings: {"watershed": WatershedConfig, "also": the keys of the steps before the
    export's segmentation that are scored too (with a second pass; else absent),
    "learned_watershed": true when the baseline is the learned one (else absent),
    "skeletons": SkeletonConfig of ERL's skeletons (with the baseline; else absent)}; the counts
    are every region's, then every region's of each of `also` in turn; `folders`: each row's
    segmentation ("ffn", then `also`'s keys -> its folder), read at the skeletons' nodes."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import score_volume
    from pipeline.evaluation.scores import OverlapCounts
    from pipeline.evaluation.watershed import WatershedConfig
    from pipeline.export.layers import segmentation_spec
    from pipeline.export.skeletons import SkeletonConfig

    def work() -> None:
        staged = read_staged(io.volume)
        also = settings.get("also", [])
        learned = f"{io.learned[0]}:segmentation" if io.learned else None
        region_counts = io.counts
        regions = len(region_counts) // (1 + len(also))
        counts = [
            OverlapCounts.total([OverlapCounts.load(p) for p in region_counts[i : i + regions]])
            for i in range(0, len(region_counts), regions)
        ]
        skeletons = settings.get("skeletons")
        score_volume(
            counts[0], staged.raw, staged.labels, from_dict(WatershedConfig, settings["watershed"]),
            str(io.evaluation), staged.scored, staged.voxel_size_nm,
            dict(zip(also, counts[1:], strict=True)), learned,
            {key: segmentation_spec(folder) for key, folder in folders.items()},
            from_dict(SkeletonConfig, skeletons) if skeletons else None,
        )  # fmt: skip

    return run_once(settings, io.inputs(), io.outputs(), work)
