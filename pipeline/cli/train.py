"""Train an FFN with synchronous data-parallel SGD on Horovod, one rank per process
(pipeline.training.trainer); alone, under `mpiexec -n N` / `horovodrun -np N`, or a site's launcher:

    python -m pipeline.cli.train --raw vol.h5:raw --labels vol.h5:labels \\
        --coordinates coords.npz --train-dir data/runs/demo/train [--max-steps 2000 ...]
"""

import argparse
import faulthandler
import os
import signal
import sys

from pipeline.cli import HelpFormatter, add_arguments, from_arguments, one_line_errors
from pipeline.core.owner import leash
from pipeline.training.train_config import TrainConfig, load_train_config
from pipeline.training.trainer import TrainInputs, run_training


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m pipeline.cli.train",
        description="Train an FFN with synchronous data-parallel SGD on Horovod (one rank per "
        "process). The defaults are TrainConfig's (pipeline/training/train_config.py): the paper's FFN.",
    )
    parser.add_argument("--raw", required=True, help="image volume, path.h5:dataset")
    parser.add_argument("--labels", required=True, help="ground-truth labels, path.h5:dataset")
    parser.add_argument(
        "--coordinates",
        required=True,
        help="training coordinates .npz (pipeline.preprocess.partitions)",
    )
    parser.add_argument(
        "--train-dir", required=True, help="checkpoints, metrics and config go here"
    )
    parser.add_argument(
        "--config", help="JSON or TOML file of TrainConfig settings; flags override it"
    )
    parser.add_argument(
        "--init-from", default="", help="fine-tune from these weights (ignored on resume)"
    )
    parser.add_argument(
        "--expected-ranks",
        type=int,
        help="the ranks the launch line starts; stop if Horovod sees others",
    )
    add_arguments(parser, TrainConfig)
    return parser


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # A rank that seems stuck says where: `kill -USR1 <rank>` (or to mpiexec, which passes it on)
    # prints every thread's stack to the rank's stderr, the training log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base = load_train_config(args.config) if args.config else TrainConfig()
    config = from_arguments(TrainConfig, args, base)
    inputs = TrainInputs(args.raw, args.labels, args.coordinates, args.train_dir, args.init_from)
    # A rank trains for the workflow that started it, and only while it owns the run dir: two
    # workflows never train into one train/ (pipeline.core.owner).
    with leash(f"training into {args.train_dir}"):
        summary = run_training(inputs, config, expected_ranks=args.expected_ranks)
    if summary:
        print(
            f"[train] done: step {summary['step']}, f1 {summary.get('f1', float('nan')):.3f}, {summary['fov_per_s']:.1f} FOV/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
