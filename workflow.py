"""Run the FFN pipeline on a site: `python workflow.py --site local`.

Interim version: the Parsl DAG (issue 5) is not built yet. This runs, in order and without Parsl,
the stages that exist today on the local machine: synthetic data staging, partitions + seed
coordinates, and 2-rank Horovod training through the venv's `mpiexec`. Inference, evaluation and
the Neuroglancer export are not built yet, and it says so at the end.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pipeline  # noqa: F401  (oneDNN on before TensorFlow loads)
from pipeline import partitions, synthetic

ROOT = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--site", default="local", choices=["local"], help="only 'local' exists so far"
    )
    parser.add_argument("--run-dir", default=str(ROOT / "data" / "runs" / "demo"))
    parser.add_argument("--ranks", type=int, default=2, help="Horovod ranks (mpiexec -n)")
    parser.add_argument("--train-steps", type=int, default=300)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    staged = run_dir / "staged" / "train.h5"
    coords = run_dir / "preprocess" / "coordinates.npz"

    print(f"[workflow] stage data -> {staged}", flush=True)
    if not staged.exists():
        synthetic.main([str(staged), "--preset", "default", "--seed", "0"])
    print(f"[workflow] partitions + coordinates -> {coords}", flush=True)
    if not coords.exists():
        # Margin = the training canvas radius for FOV (17, 33, 33) and deltas (4, 8, 8).
        partitions.main([
            "--labels", f"{staged}:labels", "--partitions-out", str(run_dir / "preprocess" / "partitions.h5"),
            "--coordinates-out", str(coords), "--margin", "12", "24", "24", "--samples-per-class", "2000",
        ])  # fmt: skip
    print(f"[workflow] training, {args.ranks} Horovod ranks -> {run_dir / 'train'}", flush=True)
    mpiexec = shutil.which(
        "mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    subprocess.run(
        [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "pipeline.train",
         "--raw", f"{staged}:raw", "--labels", f"{staged}:labels", "--coordinates", str(coords),
         "--train-dir", str(run_dir / "train"), "--max-steps", str(args.train_steps),
         "--batch-size", "2", "--model-depth", "5", "--model-features", "16",
         "--intra-op-threads", "1", "--log-every-steps", "25"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    print(
        f"[workflow] done: curves in {run_dir / 'train' / 'curves.png'}. Not built yet: checkpoint selection, "
        "inference, evaluation, Neuroglancer export and the Parsl DAG (issues 4 and 5)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
