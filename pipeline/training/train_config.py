"""The settings of a training run (`TrainConfig`) and how a run's saved settings are read back.

Apart from `pipeline.training.trainer` (TensorFlow, Horovod) so that what only reads a run's settings, e.g.
the model shape of a checkpoint, needs neither.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core import config_io
from pipeline.core.errors import ConfigError
from pipeline.network.model import ModelConfig
from pipeline.training.examples import ExampleConfig
from pipeline.training.lr_scaling import LR_POLICIES

OPTIMIZERS = ("adam", "sgd_momentum")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a training run besides its input files. The defaults are the
    paper's training: its network (`ModelConfig`'s defaults) with google/ffn's batch and rate,
    which Dong et al.'s Horovod job script kept (configs/paper.toml says where each comes from);
    a run config's `[train]` section and the flags of `python -m pipeline.cli.train` change only
    what they name."""

    model: ModelConfig = field(default_factory=ModelConfig)
    examples: ExampleConfig = field(default_factory=ExampleConfig)
    batch_size: int = 4  # FOVs per rank per step
    # Ranks simulated in each process (world size = real ranks x this): each computes gradients on
    # its own shard and batch as a real rank would, and their mean makes the update that as many
    # real ranks make. Lets a machine with fewer cores than ranks study training at that world size.
    virtual_ranks: int = 1
    learning_rate: float = (
        0.001  # base rate for one worker; lr_policy scales it with the world size
    )
    lr_policy: str = (
        "auto"  # none | linear | sqrt | linear_warmup | auto (linear <= 16 ranks, sqrt beyond)
    )
    # Steps over which lr_policy linear_warmup or auto ramps the rate up to its scaled value.
    warmup_steps: int = 100
    # The update rule: "adam" (google/ffn's and Dong et al.'s) or "sgd_momentum" (SGD with
    # `momentum`), the two the paper's study compares.
    optimizer: str = "adam"
    momentum: float = 0.9  # sgd_momentum only
    # Staircase decay (google-research/ffn's learning_rate_decay_factor): the rate is multiplied
    # by lr_decay_factor every lr_decay_every_steps steps; 0 = constant rate. Settles the weights
    # late in a run, so neighbouring checkpoints stop segmenting very differently.
    lr_decay_factor: float = 0.1
    # Steps between two decays of the rate (see lr_decay_factor); 0 = constant rate.
    lr_decay_every_steps: int = 0
    # Training stops at this global step (a resumed run counts on from its checkpoint).
    max_steps: int = 1000
    grad_clip: float = 0.7  # elementwise, as google-research/ffn
    # Seeds TensorFlow's and the example streams' randomness.
    seed: int = 0
    deterministic: bool = False  # TF op determinism: same seed, same curve (a little slower)
    intra_op_threads: int = (
        0  # 0 = TensorFlow's choice (all cores); set per rank when several share a node
    )
    # Threads that run independent TensorFlow ops side by side; 0 = TensorFlow's choice.
    inter_op_threads: int = 0
    # How often Horovod's background thread negotiates with the other ranks. Each negotiation is
    # a collective that busy-waits for the slowest rank, taking CPU from the rank's own compute
    # when ranks fill every core: 2 ranks x 1 thread here ran at 2.5 FOV/s with 1 ms, 3.1 with 25
    # (BENCHMARKS.md). A full-model step takes seconds; the demo's 0.2 s steps gained too.
    horovod_cycle_time_ms: float = 25.0
    # Steps between lines of metrics.csv and the log (each one a collective of all ranks).
    log_every_steps: int = 10
    # Save a checkpoint every this many steps, and at the last.
    checkpoint_every_steps: int = 100
    # Also save when this long has passed since the last save (checked at log steps).
    checkpoint_every_seconds: float = 600.0
    # Newest checkpoints kept; older ones are deleted.
    keep_checkpoints: int = 5

    def __post_init__(self) -> None:
        ranks = self.virtual_ranks
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(f"virtual_ranks must be an integer >= 1, got {ranks!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.lr_policy not in LR_POLICIES:
            raise ConfigError(f"lr_policy must be one of {LR_POLICIES}, got {self.lr_policy!r}")
        positive = (
            "batch_size",
            "max_steps",
            "log_every_steps",
            "checkpoint_every_steps",
            "keep_checkpoints",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.learning_rate < math.inf:
            raise ConfigError(
                f"learning_rate must be a finite number > 0, got {self.learning_rate}"
            )
        if self.grad_clip <= 0 or self.horovod_cycle_time_ms <= 0:
            raise ConfigError("grad_clip and horovod_cycle_time_ms must be > 0")
        if min(self.warmup_steps, self.intra_op_threads, self.inter_op_threads) < 0:
            raise ConfigError("warmup_steps and thread counts must be >= 0")
        if self.lr_decay_every_steps < 0 or not 0 < self.lr_decay_factor <= 1:
            raise ConfigError(
                "lr_decay_every_steps must be >= 0 and lr_decay_factor in (0, 1], got "
                f"{self.lr_decay_every_steps} and {self.lr_decay_factor}"
            )


def load_train_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    if path.suffix == ".toml":
        import tomllib

        return config_io.from_dict(TrainConfig, tomllib.loads(path.read_text()), str(path))
    values = json.loads(path.read_text())
    return config_io.from_dict(TrainConfig, values.get("config", values), str(path))
