"""The settings of one workflow run, read from `--config run.toml`, saved as `config.json`.

Each section is the stage's own config class and its defaults are that class's: `[train]` is
`TrainConfig`, whose defaults are the paper's FFN (`ModelConfig`'s) and batch, the ones
`python -m pipeline.cli.train --help` prints. A `--config` file changes only what it names over
them, and a relative path in it is relative to the file's folder. The few settings of the run
itself (its name, `train_nodes`, the models it starts from) are documented at their fields below.

What runs without `--config` is the local demo, `demo_config()`: the synthetic volumes, a reduced
FFN fine-tuned for minutes from the small model the project trained on the same synthetic tissue
(`models/demo-synthetic`, its README says how), four inference blocks. `configs/` holds examples,
among them `paper.toml`, the paper's model and batch for HPC sites. This module only groups the
sections.
"""

import json
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pipeline.core import config_io
from pipeline.core.errors import ConfigError
from pipeline.data.staging import DataConfig
from pipeline.evaluation.evaluate import EvaluationConfig
from pipeline.evaluation.watershed import WatershedConfig
from pipeline.export.layers import ExportConfig
from pipeline.inference.blocks import BlockConfig
from pipeline.inference.flood_fill import InferenceConfig
from pipeline.network.model import ModelConfig
from pipeline.preprocess.partitions import PartitionConfig
from pipeline.secondpass.agglomeration import AgglomerationConfig
from pipeline.selection.checkpoints import SelectionConfig
from pipeline.study.study_grid import StudyConfig
from pipeline.training.examples import canvas_radius
from pipeline.training.train_config import TrainConfig

# models/demo-synthetic: the demo's starting weights, shipped with the repository.
DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "demo-synthetic"
# Per rank: the demo's 2 ranks go on at 1e-4 in all (the linear rule), the rate the model ended
# its training with; at the full rate of its first 50,000 steps a demo's steps would first undo
# what they learned.
DEMO_FINE_TUNING_RATE = 5e-5


@dataclass(frozen=True)
class RunConfig:
    # The run's folder is data/runs/<name> unless --run-dir says otherwise.
    name: str = "demo"
    data: DataConfig = field(default_factory=DataConfig)
    partitions: PartitionConfig = field(default_factory=PartitionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Nodes of the training task, and so of its batch job; 0 = the site's job size
    # (nodes_per_block). Ranks = nodes x the site's ranks_per_node.
    train_nodes: int = 0
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    blocks: BlockConfig = field(default_factory=BlockConfig)
    # FFN's second pass after stitching: off unless enabled.
    agglomeration: AgglomerationConfig = field(default_factory=AgglomerationConfig)
    watershed: WatershedConfig = field(default_factory=WatershedConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # The paper's learning-rate and scaling study (`python workflow.py study`): a grid of trainings
    # of [train] on the training volume. A config whose rank_counts are set is a study.
    study: StudyConfig = field(default_factory=StudyConfig)
    # A model folder made by `python -m pipeline.cli.pretrained` (e.g. the authors' FIB-25 weights):
    # preprocessing, training and selection are skipped and this model segments the volume.
    # "": none, the run trains its own.
    pretrained_model: str = config_io.path_setting()
    # Fine-tune instead: start the training stage from these weights (same kinds of source);
    # "": from scratch.
    train_init_from: str = config_io.path_setting()
    # The boundary forest the second pass's fill floods the map of, learned by another run (its
    # baseline/boundary_forest.joblib), for a run without a labelled training part (e.g. a
    # pretrained model on new tissue): copied into this run. "": the run learns its own.
    boundary_forest: str = config_io.path_setting()

    def __post_init__(self) -> None:
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"run name {self.name!r}: use letters, digits, '-' and '_'")
        if self.train_nodes < 0:
            raise ConfigError(
                f"train_nodes must be >= 0 (0: the site's job size), got {self.train_nodes}"
            )
        self._check_model_source()
        self._check_boundary_forest()

    def _check_model_source(self) -> None:
        """A run segments with a model: one it trains (on the synthetic data or train_raw), or a
        pretrained one. Checked before a run dir is made or the dry run shows a plan."""
        if not (self.data.synthetic or self.data.train_raw or self.pretrained_model):
            raise ConfigError(
                "the run has no model to segment with: give [data] train_raw and train_labels to "
                "train one, or pretrained_model (a model folder, as python -m "
                "pipeline.cli.pretrained writes)"
            )

    def _check_boundary_forest(self) -> None:
        """The fill's forest is learned on the training part or given, not both."""
        has_train_part = self.data.synthetic or bool(self.data.train_raw)
        if self.boundary_forest and has_train_part:
            raise ConfigError(
                f"boundary_forest {self.boundary_forest!r}: this run learns its own forest on "
                "its labelled training part; give one or the other"
            )
        if self.boundary_forest and not self.agglomeration.reads_boundary_map:
            raise ConfigError(
                f"boundary_forest {self.boundary_forest!r} is the second pass's map: it needs "
                "[agglomeration] fill_unsegmented = true (or max_contact_boundary below 1)"
            )
        if self.agglomeration.reads_boundary_map and not (has_train_part or self.boundary_forest):
            raise ConfigError(
                "[agglomeration] fill_unsegmented and max_contact_boundary read a boundary map "
                "learned on a labelled training part: give [data] train_raw and train_labels, or "
                "boundary_forest (a forest another run learned, its baseline/boundary_forest.joblib)"
            )

    def partitions_for_training(self) -> PartitionConfig:
        """Coordinates must leave room for the training canvas (FOV + moves) around them."""
        canvas = canvas_radius(self.train.model, self.train.examples)
        margin = np.maximum(canvas, self.partitions.margin)
        return replace(self.partitions, margin_zyx=tuple(int(m) for m in margin))


def demo_config() -> RunConfig:
    """What runs without `--config`: the local demo, sized for a 2-core machine and the
    synthetic volume (64 x 128 x 128 voxels), fine-tuning the shipped demo model."""
    return RunConfig(
        # Up to 13 classes x 2,000 coordinates: more than the 4,000 FOVs the demo trains on.
        partitions=PartitionConfig(samples_per_class=2000),
        train=TrainConfig(
            # The shape of models/demo-synthetic: at ~140 FOV/s on 2 cores an hour trains it far
            # enough to beat the watershed (BENCHMARKS "Run D"); the paper's FOV of 17 x 33 x 33
            # trains at 17.
            model=ModelConfig(
                fov_shape_zyx=(9, 17, 17), deltas_zyx=(2, 4, 4), depth=5, features=16
            ),
            batch_size=2,  # per rank
            learning_rate=DEMO_FINE_TUNING_RATE,
            max_steps=1000,
            log_every_steps=50,
            checkpoint_every_steps=250,
        ),
        # FOVs the flood has nearly all seen are not evaluated, as configs/flyem_fib25*.toml
        # (chosen on the FlyEM selection half): on the demo 0.51x the FOV evaluations, VI 1.072
        # -> 1.024 (BENCHMARKS.md, "FOVs the flood has already seen").
        inference=InferenceConfig(min_unseen_share=0.02),
        blocks=BlockConfig(block_shape_zyx=(64, 80, 80)),  # the volume in 4 blocks, in parallel
        # The second pass's fill, not its pair merges: on the synthetic selection volume (seed 2)
        # the fill took the shipped model's VI from 1.205 to 0.775; agglomeration and consensus
        # made the demo worse (BENCHMARKS.md).
        # Objects under 1,000 voxels (google/ffn's recommended minimum) dropped before the fill:
        # on seed 2, 0.775 -> 0.742.
        agglomeration=AgglomerationConfig(fill_unsegmented=True, fill_min_size=1000),
        train_init_from=str(DEMO_MODEL),
    )


def load_run_config(path: str | Path | None) -> RunConfig:
    """No file: the demo. A TOML file: its settings over the defaults of each section's class,
    its relative paths made absolute against its folder. A run's saved `config.json` (every
    setting resolved, paths absolute): as it is."""
    if path is None:
        return demo_config()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found")
    if path.suffix == ".json":
        try:
            return config_io.from_dict(RunConfig, json.loads(path.read_text()), str(path))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    # A section names only what it changes: from_dict builds each class from its own defaults.
    values = config_io.resolve_paths(RunConfig, values, path.resolve().parent)
    return config_io.from_dict(RunConfig, values, str(path))
