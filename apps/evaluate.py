"""Score the FFN segmentation and the watershed baseline against the ground truth: a task per
region counts the overlaps of its part (pipeline.evaluation.evaluate), the last sums and scores; the
learned baseline, where the run has a labelled training part, is a task of its own, over the map
of a boundary forest learned there by another (which the second pass's fill also takes), or
given: another run's, copied."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def count_region(settings: dict, folder: str, inputs=(), outputs=()):
    """settings: {"region": "z0:z1, y0:y1, x0:x1"}; inputs: staged labeled volume, the
    segmentation's full resolution (in the export `folder`); outputs[0]: the region's overlap
    counts within the scored part (.npz)."""
    from pipeline.core.roi import Roi
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import count_region
    from pipeline.export.layers import segmentation_spec

    volume = inputs[0].filepath
    output = outputs[0].filepath

    def work() -> None:
        staged = read_staged(volume)
        region = Roi.parse(settings["region"])
        count_region(staged.labels, segmentation_spec(folder), region, staged.scored).save(output)

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def boundary_forest(settings: dict, inputs=(), outputs=()):
    """inputs[0]: the staged training part; outputs[0]: the boundary forest learned there
    (joblib): the learned watershed's map, and the one the second pass's fill floods."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import learn_boundary_forest

    train, output = read_staged(inputs[0].filepath), outputs[0].filepath
    return run_once(settings, [inputs[0].filepath], [output],
                    lambda: learn_boundary_forest(train, output))  # fmt: skip


@python_app(executors=[CPU_LABEL])
def given_boundary_forest(settings: dict, inputs=(), outputs=()):
    """inputs[0]: a boundary forest another run learned (`boundary_forest`); outputs[0]: its
    copy in this run, once checked to be one."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.evaluation.evaluate import copy_boundary_forest

    source, output = inputs[0].filepath, outputs[0].filepath

    def work() -> str:
        copy_boundary_forest(source, output)
        return digest_files([output])  # the same forest copied again leaves the fill done

    return run_once(settings, [source], [output], work)


@python_app(executors=[CPU_LABEL])
def learned_baseline(settings: dict, inputs=(), outputs=()):
    """settings: {"baseline": "learned watershed"}; inputs: the boundary forest (`boundary_forest`),
    the staged selection and evaluated volumes; outputs: the segmentation (HDF5) and its record
    (.json)."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import learned_baseline

    paths = [f.filepath for f in inputs]
    segmentation, record = (f.filepath for f in outputs)

    def work() -> None:
        learned_baseline(paths[0], *map(read_staged, paths[1:]), segmentation, record)

    return run_once(settings, paths, [segmentation, record], work)


@python_app(executors=[CPU_LABEL])
def evaluate(settings: dict, inputs=(), outputs=()):
    """settings: {"watershed": WatershedConfig, "also": the keys of the steps before the
    export's segmentation that are scored too (with a second pass; else absent),
    "learned_watershed": true when the baseline is the learned one (else absent)}; inputs:
    staged labeled volume, then every region's counts, then every region's counts of each of
    `also` in turn, then the learned baseline's segmentation if any; outputs[0]:
    evaluation.json."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import read_staged
    from pipeline.evaluation.evaluate import score_volume
    from pipeline.evaluation.scores import OverlapCounts
    from pipeline.evaluation.watershed import WatershedConfig

    paths = [f.filepath for f in inputs]
    output = outputs[0].filepath

    def work() -> None:
        staged = read_staged(paths[0])
        also = settings.get("also", [])
        learned = f"{paths[-1]}:segmentation" if settings.get("learned_watershed") else None
        region_counts = paths[1:-1] if learned else paths[1:]
        regions = len(region_counts) // (1 + len(also))
        counts = [
            OverlapCounts.total([OverlapCounts.load(p) for p in region_counts[i : i + regions]])
            for i in range(0, len(region_counts), regions)
        ]
        score_volume(
            counts[0], staged.raw, staged.labels, from_dict(WatershedConfig, settings["watershed"]),
            output, staged.scored, staged.voxel_size_nm, dict(zip(also, counts[1:], strict=True)),
            learned,
        )  # fmt: skip

    return run_once(settings, paths, [output], work)
