"""Run configs (`--config run.toml`, pipeline/run/run_config.py): a section changes only what it
names over its class's own defaults, the ones `pipeline.cli.train --help` shows; the demo's
settings are the demo's alone; relative paths mean relative to the config file; the paper's
config for HPC sites."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
from workflow_runs import ROOT, workflow

from pipeline.core import config_io
from pipeline.network.model import ModelConfig, weight_count
from pipeline.run.run_config import RunConfig, demo_config, load_run_config
from pipeline.training.train_config import TrainConfig


def toml(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(text)
    return path


def test_a_train_section_naming_max_steps_trains_the_papers_ffn(tmp_path):
    config = load_run_config(toml(tmp_path, "[train]\nmax_steps = 5\n"))
    assert config.train.model == ModelConfig()  # FOV 17 x 33 x 33, depth 9, 32 features
    assert config.train == TrainConfig(max_steps=5)  # every other setting at its default


def test_a_model_section_naming_depth_keeps_the_other_model_defaults(tmp_path):
    config = load_run_config(toml(tmp_path, "[train.model]\ndepth = 3\n"))
    assert config.train == TrainConfig(model=ModelConfig(depth=3))


def test_a_config_that_names_no_setting_runs_each_sections_own_defaults(tmp_path):
    config = load_run_config(toml(tmp_path, 'name = "mine"\n'))
    assert config == RunConfig(name="mine")
    for section in dataclasses.fields(RunConfig):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            assert value == type(value)(), section.name  # e.g. blocks, partitions: no demo sizes


def test_the_small_model_and_fine_tuning_are_the_demos_alone():
    demo = demo_config()
    assert demo.train.model == ModelConfig(
        fov_shape_zyx=(9, 17, 17), deltas_zyx=(2, 4, 4), depth=5, features=16
    )
    assert demo.train_init_from and demo.train.learning_rate < TrainConfig().learning_rate
    assert RunConfig().train == TrainConfig() and not RunConfig().train_init_from


def flags(config: object, prefix: str = "") -> dict[str, str]:
    """--flag: value, as `pipeline.cli.add_arguments` names a config's fields."""
    shown = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            shown |= flags(value, f"{prefix}{field.name}-")
        else:
            shown[(prefix + field.name).replace("_", "-")] = str(value)
    return shown


def test_train_help_shows_the_defaults_an_empty_train_section_gets(tmp_path, monkeypatch, capsys):
    from pipeline.cli import train as train_cli

    monkeypatch.setenv("COLUMNS", "300")  # a default on one line, under or beside its flag
    with pytest.raises(SystemExit):
        train_cli.main(["--help"])
    help_text = capsys.readouterr().out
    shown = dict(re.findall(r"^  --([a-z-]+)[^\n]*?\s+default: (.+)$", help_text, re.MULTILINE))
    assert shown == flags(load_run_config(toml(tmp_path, "[train]\n")).train)
    assert shown["model-depth"] == "9" and shown["batch-size"] == "4"


def test_relative_paths_resolve_against_the_config_files_folder(tmp_path, monkeypatch):
    path = toml(
        tmp_path / "configs",
        'pretrained_model = "../models/fib25"\ntrain_init_from = "../models/start"\n'
        "[data]\n"
        'train_raw = "../data/vol.h5:volumes/raw"\ntrain_labels = "../data/vol.h5:volumes/labels"\n'
        'eval_raw = "../data/big.zarr:raw[0:32, 0:64, 0:64]"\n',
    )
    loaded = []
    for here in (tmp_path, tmp_path / "configs", ROOT):
        monkeypatch.chdir(here)
        loaded.append(load_run_config(path))
    assert loaded[0] == loaded[1] == loaded[2]
    config, base = loaded[0], tmp_path.resolve()
    assert config.pretrained_model == str(base / "models" / "fib25")
    assert config.train_init_from == str(base / "models" / "start")
    assert config.data.train_raw == f"{base}/data/vol.h5:volumes/raw"  # the dataset kept
    assert config.data.train_labels == f"{base}/data/vol.h5:volumes/labels"
    assert config.data.eval_raw == f"{base}/data/big.zarr:raw[0:32, 0:64, 0:64]"
    # The run's config.json names them absolutely: a resume reads the same files from anywhere.
    saved = config_io.save_json(tmp_path / "config.json", config)
    assert json.loads(saved.read_text())["data"]["train_raw"] == config.data.train_raw
    monkeypatch.chdir(tmp_path / "configs")
    assert load_run_config(saved) == config


def test_urls_and_absolute_paths_stay_as_written_where_relative_ones_resolve(tmp_path):
    layer = "precomputed://file:///data/seg"
    remote = "precomputed://gs://bucket/em/image"
    path = toml(
        tmp_path,
        f'pretrained_model = "/models/fib25"\n[data]\neval_raw = "{remote}"\n'
        f'eval_labels = "{layer}"\ntrain_raw = "vol.h5:raw"\ntrain_labels = "vol.h5:labels"\n',
    )
    config = load_run_config(path)
    assert (config.data.eval_raw, config.data.eval_labels) == (remote, layer)
    assert config.pretrained_model == "/models/fib25"
    assert config.data.train_raw == f"{tmp_path.resolve()}/vol.h5:raw"


def test_the_paper_config_trains_the_papers_472353_weight_ffn():
    config = load_run_config(ROOT / "configs" / "paper.toml")
    model = config.train.model
    assert model == ModelConfig() and model.fov_shape_zyx == (17, 33, 33)
    assert weight_count(model.depth, model.features) == 472_353
    assert (config.train.batch_size, config.train.learning_rate) == (4, 0.001)
    assert config.train.lr_policy == "auto" and not config.train_init_from  # from scratch
    assert config.train.checkpoint_every_seconds <= 300  # a lost interval costs every node


@pytest.mark.shared  # configs/paper.toml's data
def test_the_paper_config_plans_on_polaris(tmp_path):
    done = workflow(
        "--site", "polaris", "--config", str(ROOT / "configs" / "paper.toml"),
        "--run-dir", str(tmp_path / "run"), "--dry-run",
    )  # fmt: skip
    assert "472,353 weights; batch 4 per rank" in done.stdout
    assert "PBSProProvider" in done.stdout


def test_the_fill_of_unsegmented_voxels_needs_a_training_part(tmp_path):
    from pipeline.core.errors import ConfigError

    eval_only = f'[data]\neval_raw = "{tmp_path / "em.h5"}:raw"\n'  # checked when staged
    text = eval_only + "[agglomeration]\nfill_unsegmented = true\n"
    with pytest.raises(ConfigError, match="give \\[data\\] train_raw and train_labels"):
        load_run_config(toml(tmp_path, text))
    synthetic = "[agglomeration]\nfill_unsegmented = true\n"  # without pairs' agglomeration
    assert load_run_config(toml(tmp_path, synthetic)).agglomeration.writes_layer


def test_a_run_without_a_training_part_fills_over_a_forest_another_run_learned(tmp_path):
    """`boundary_forest`, relative to the config's folder like every path setting; only for the
    fill, and only where the run has no training part of its own to learn one on."""
    from pipeline.core.errors import ConfigError

    # A pretrained model on new tissue: the run for which another run's forest is meant.
    eval_only = f'[data]\neval_raw = "{tmp_path / "em.h5"}:raw"\n'
    given = 'pretrained_model = "models/fib25"\nboundary_forest = "runs/a/baseline/boundary_forest.joblib"\n'
    fill = "[agglomeration]\nfill_unsegmented = true\n"
    config = load_run_config(toml(tmp_path, given + eval_only + fill))
    assert config.boundary_forest == str(tmp_path / "runs/a/baseline/boundary_forest.joblib")
    with pytest.raises(ConfigError, match="needs \\[agglomeration\\] fill_unsegmented = true"):
        load_run_config(toml(tmp_path, given + eval_only))
    with pytest.raises(ConfigError, match="learns its own forest on its labelled training part"):
        load_run_config(toml(tmp_path, given + fill))  # the synthetic demo's training part


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_run_with_no_model_to_segment_with_is_refused_before_its_run_dir_is_made(
    tmp_path, dry_run
):
    """Only a volume to segment: no training volume, no pretrained model. Refused in one line by
    the dry run and by the run, before anything is written (it failed 16 s into the run, in the
    training volume's staging, leaving a run dir that then needed --resume)."""
    config = toml(tmp_path, f'[data]\neval_raw = "{tmp_path / "em.h5"}:raw"\n')
    run_dir = tmp_path / "run"
    done = workflow(
        "--config", str(config), "--run-dir", str(run_dir), *(["--dry-run"] if dry_run else []),
        expect=2, timeout=300,
    )  # fmt: skip
    assert done.stderr.strip().splitlines() == [
        "error: the run has no model to segment with: give [data] train_raw and train_labels to "
        "train one, or pretrained_model (a model folder, as python -m pipeline.cli.pretrained "
        "writes)"
    ]
    assert not run_dir.exists() and "stage" not in done.stdout
