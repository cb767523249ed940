"""The example configs in configs/: each one loads, and the real-data ones name parts that pass
the checks a run makes before it starts (skipped where ../shared/data is not beside the repo)."""

from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.core.roi import Roi
from pipeline.data.staging import check_sources
from pipeline.network.released_weights import FIB25_FOV_ZYX
from pipeline.run.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    config = load_run_config(path)
    assert config.name and not config.data.voxel_size_nm  # voxel sizes come from the files


@pytest.mark.shared  # the file the flyem configs split
@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if p.name.startswith("flyem")], ids=lambda p: p.name
)
def test_the_flyem_configs_split_the_shared_file_into_parts_apart(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the configs name the file relative to themselves, not to here
    config = load_run_config(path)
    fov = FIB25_FOV_ZYX if config.pretrained_model else config.train.model.fov_shape_zyx
    check_sources(config.data, fov)
    assert config.inference.reflect_faces


def test_the_flyem_runs_score_the_same_part_of_the_same_file():
    flyem = [load_run_config(p) for p in CONFIGS if p.name.startswith("flyem")]
    apart = ("-selection", "-whole", "-unseen", "-selection-second-pass", "-training-crop")
    scored = [c for c in flyem if not c.name.endswith(apart)]
    assert len(scored) == 4
    assert len({(c.data.eval_raw, c.data.eval_labels, c.data.eval_roi) for c in scored}) == 1
    # And their reports' baseline, the learned watershed, learns and is tuned on the same parts.
    assert len({(c.data.train_roi, c.data.select_roi) for c in scored}) == 1


@pytest.mark.parametrize("name", ["flyem_fib25_selection.toml", "flyem_fib25_bf16_selection.toml"])
def test_the_runs_where_second_pass_settings_are_chosen_score_only_the_selection_part(name):
    """The selection-part FIB-25 configs score a part of the selection part, apart from the
    evaluated part (its context may reach the image there: only image, never labels)."""
    parts = load_run_config(ROOT / "configs" / "flyem.toml").data
    tuning = load_run_config(ROOT / "configs" / name).data
    selection, scored = Roi.parse(parts.select_roi), Roi.parse(tuning.eval_roi)
    assert all(a <= b for a, b in zip(selection.start, scored.start, strict=True))
    assert all(b <= a for a, b in zip(selection.stop, scored.stop, strict=True))
    assert not scored.overlaps(Roi.parse(parts.eval_roi))
    assert (tuning.eval_raw, tuning.eval_labels) == (parts.train_raw, parts.train_labels)


def test_the_fib25_runs_that_are_scored_share_one_second_pass_chosen_on_the_selection_part():
    """The settings chosen on the selection part are the ones every scored FIB-25 run uses,
    the whole file's and the unseen part's too; the selection runs themselves leave the pass off
    (their first pass is what the settings are chosen on)."""
    fib25 = [load_run_config(p) for p in CONFIGS if p.name.startswith("flyem_fib25")]
    tuning_runs = ("-selection", "-second-pass", "-training-crop")
    scored = [c.agglomeration for c in fib25 if not c.name.endswith(tuning_runs)]
    tuning = [c.agglomeration for c in fib25 if c.name.endswith("-selection")]
    assert len(scored) == 5 and len(set(scored)) == 1
    assert scored[0].enabled and scored[0].fill_unsegmented and scored[0].fill_min_size
    assert len(tuning) == 2 and not any(c.enabled or c.consensus for c in tuning)


def test_the_selection_half_with_the_second_pass_tunes_its_watershed_on_the_other_half():
    """configs/flyem_fib25_selection_second_pass.toml, where a setting that uses the learned
    watershed is chosen: the selection run's part and first pass, the scored runs' second pass,
    and a watershed tuned on the selection part's other half, apart from every scored part."""
    configs = ROOT / "configs"
    half = load_run_config(configs / "flyem_fib25_selection_second_pass.toml")
    selection = load_run_config(configs / "flyem_fib25_selection.toml")
    parts = load_run_config(configs / "flyem.toml").data
    assert half.data.eval_roi == selection.data.eval_roi
    assert half.inference == selection.inference
    assert half.agglomeration == load_run_config(configs / "flyem_fib25.toml").agglomeration
    assert half.data.train_roi == parts.train_roi
    whole_selection, tuned = Roi.parse(parts.select_roi), Roi.parse(half.data.select_roi)
    assert tuned.intersection(whole_selection) == tuned
    assert not tuned.overlaps(Roi.parse(half.data.eval_roi))
    assert not tuned.overlaps(Roi.parse(parts.eval_roi))


def test_the_training_crop_scores_training_voxels_its_forest_has_not_seen():
    """configs/flyem_fib25_training_crop.toml, where a setting aimed at dark, thin bodies is
    chosen: a part of the training part (the selection part holds no such body), segmented and
    passed a second time as the scored runs are, with a forest learned on the rest of the
    training part and a watershed tuned on the selection part."""
    configs = ROOT / "configs"
    crop = load_run_config(configs / "flyem_fib25_training_crop.toml")
    scored = load_run_config(configs / "flyem_fib25.toml")
    parts = load_run_config(configs / "flyem.toml").data
    training, part = Roi.parse(parts.train_roi), Roi.parse(crop.data.eval_roi)
    forest = Roi.parse(crop.data.train_roi)
    assert part.intersection(training) == part and forest.intersection(training) == forest
    assert not part.overlaps(forest)
    assert crop.data.select_roi == parts.select_roi
    assert (crop.inference, crop.agglomeration) == (scored.inference, scored.agglomeration)


def test_the_fib25_selection_runs_segment_as_the_runs_they_choose_for():
    """What is chosen on a selection run's first pass holds for the scored run only if both
    segment alike."""
    fib25 = {p.stem: load_run_config(p) for p in CONFIGS if p.name.startswith("flyem_fib25")}
    for scored in ("flyem_fib25", "flyem_fib25_bf16"):
        assert fib25[scored].inference == fib25[f"{scored}_selection"].inference


@pytest.mark.parametrize("precision", ["", "_bf16"])
def test_the_whole_file_run_scores_every_section_and_learns_nothing_there(precision):
    """It fills over the forest the evaluated part's run of the same precision learned."""
    whole = load_run_config(ROOT / "configs" / f"flyem_fib25{precision}_whole.toml")
    assert not whole.data.eval_roi
    data = whole.data
    assert not (data.train_raw or data.select_raw or data.train_roi or data.select_roi)
    part_run = load_run_config(ROOT / "configs" / f"flyem_fib25{precision}.toml").name
    assert whole.boundary_forest == str(
        ROOT / "data/runs" / part_run / "baseline/boundary_forest.joblib"
    )
    assert (
        whole.inference
        == load_run_config(ROOT / "configs" / f"flyem_fib25{precision}.toml").inference
    )


def test_the_unseen_part_is_apart_from_every_part_of_the_flyem_configs():
    """configs/flyem_fib25_unseen.toml scores the file's one quarter that no part names, with
    the evaluated part's run's settings (only its scored part differs)."""
    unseen = load_run_config(ROOT / "configs" / "flyem_fib25_unseen.toml")
    evaluated = load_run_config(ROOT / "configs" / "flyem_fib25.toml")
    scored = Roi.parse(unseen.data.eval_roi)
    parts = evaluated.data
    assert not any(
        scored.overlaps(Roi.parse(r)) for r in (parts.train_roi, parts.select_roi, parts.eval_roi)
    )
    same = replace(unseen, name=evaluated.name, data=replace(unseen.data, eval_roi=parts.eval_roi))
    assert same == evaluated


def test_the_demo_fine_tunes_the_shipped_model_and_a_config_file_starts_from_scratch():
    from pipeline.run.run_config import DEMO_MODEL
    from pipeline.training.train_config import load_train_config

    demo = load_run_config(None)
    assert Path(demo.train_init_from) == DEMO_MODEL
    shipped = load_train_config(DEMO_MODEL / "config.json").model
    assert shipped == demo.train.model  # same shape and image normalisation
    assert all(load_run_config(path).train_init_from != str(DEMO_MODEL) for path in CONFIGS)
