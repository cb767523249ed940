"""What a training fault costs, measured through the workflow (issue 34).

Run by hand (not a test), from the repository root, with nothing else running:

    PATH=.venv/bin:$PATH python bench/training_faults.py --output data/bench/training_faults.json

Every run is `workflow.py --stages stage preprocess train select` on configs/tiny.toml with a
longer training (`STEPS` steps, a checkpoint every `INTERVAL`, a log row every step so a fault can
land on any step). Runs:
- undisturbed, seeds 0, 1, 2 on 2 ranks: the spread a fault's result is judged against; and on
  1 rank, since a run that changed its world size trained part of the way as either;
- `kill`: seed 0 on 2 ranks; one rank killed (SIGKILL) at a random step; the workflow's retry goes
  on from the last checkpoint;
- `2->1` and `1->2`: seed 0 stopped (SIGTERM of workflow.py) at a random step, then `--resume
  --move-site` to a site of the other rank count (this machine with 1 rank of 2 threads: a file
  written here, as a user's site file); the training goes on from the last checkpoint.
Per run: wall time of every command, steps computed twice (the last step logged before the fault
minus the step the next launch went on from), the selected checkpoint and its held-out F1.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py

from pipeline.core.atomic import atomic_path
from pipeline.training.train_metrics import last_metrics
from pipeline.training.trainer import local_ranks

ROOT = Path(__file__).resolve().parents[1]

STEPS, INTERVAL = 300, 50
STAGES = ["--stages", "stage", "preprocess", "train", "select"]
ONE_RANK_SITE = '''"""This machine with one training rank of all its cores (bench/training_faults.py)."""
from dataclasses import replace

from site_configs import local

SITE = replace(local.SITE, name="local-one-rank", ranks_per_node=1, threads_per_rank=local._CORES)
make_config = local.make_config
'''


def bench_config(folder: Path, seed: int) -> Path:
    text = (ROOT / "configs" / "tiny.toml").read_text()
    for old, new in {
        "max_steps = 30": f"max_steps = {STEPS}\nseed = {seed}",
        "log_every_steps = 10": "log_every_steps = 1",
        "checkpoint_every_steps = 10": f"checkpoint_every_steps = {INTERVAL}",
        "last_checkpoints = 2": "last_checkpoints = 3",
        "held_out_fovs = 16": "held_out_fovs = 64",
    }.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / f"seed{seed}.toml"
    path.write_text(text)
    return path


def logged_step(train_dir: Path) -> int:
    """The last step in the training's metrics.csv; 0 before its first row."""
    try:
        return int((last_metrics(train_dir / "metrics.csv") or {}).get("step", 0))
    except ValueError:  # a row half-written
        return 0


def workflow(args: list[str], fault=None) -> tuple[float, int | None]:
    """Runs workflow.py with `args`; `fault(process)` is polled while it runs and returns the
    step it struck at once it has. Returns (wall seconds, that step)."""
    started = time.monotonic()
    command = [sys.executable, "workflow.py", *args]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as process:
        struck = None
        while process.poll() is None:
            if fault is not None and struck is None:
                struck = fault(process)
            time.sleep(0.02)
        out = process.stdout.read()
    if process.returncode not in (0, -signal.SIGTERM, 143) or (fault and struck is None):
        raise SystemExit(f"{' '.join(command)}: exit {process.returncode}\n{out[-3000:]}")
    return time.monotonic() - started, struck


def kill_one_rank_at(step: int, train_dir: Path):
    def fault(_process) -> int | None:
        ranks = local_ranks(train_dir)
        if logged_step(train_dir) >= step and len(ranks) == 2:
            random.choice(ranks).kill()
            return logged_step(train_dir)
        return None

    return fault


def stop_workflow_at(step: int, train_dir: Path):
    def fault(process) -> int | None:
        if logged_step(train_dir) >= step:
            process.send_signal(signal.SIGTERM)
            return logged_step(train_dir)
        return None

    return fault


def outcome(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "train" / "train_summary.json").read_text())
    selection = json.loads((run_dir / "selection.json").read_text())
    return {
        "steps": summary["step"],
        "resumed_from_step": summary["resumed_from_step"],
        "worlds": summary["worlds"],
        "selected_step": selection["step"],
        "held_out_f1": selection["score"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="data/bench/training_faults")
    parser.add_argument("--output", default="data/bench/training_faults.json")
    parser.add_argument("--seed", type=int, default=None, help="of the fault steps (random)")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    one_rank_site = work / "one_rank_site.py"
    one_rank_site.write_text(ONE_RANK_SITE)
    chooser = random.Random(args.seed)
    results = []

    def run(name: str, seed: int, plan) -> None:
        run_dir = work / name
        if (run_dir / "selection.json").is_file():
            print(f"[bench] {name}: done before, kept")
            results.append(json.loads((run_dir / "bench.json").read_text()))
            return
        config = bench_config(work, seed)
        record = {"run": name, "seed": seed, **plan(run_dir, config)}
        record |= outcome(run_dir)
        if "struck_at_step" in record:
            record["steps_recomputed"] = record["struck_at_step"] - record["resumed_from_step"]
        with atomic_path(run_dir / "bench.json") as tmp:
            tmp.write_text(json.dumps(record, indent=1))
        print(f"[bench] {json.dumps(record)}", flush=True)
        results.append(record)

    def undisturbed(site: str, label: str):
        def plan(run_dir: Path, config: Path) -> dict:
            command = ["--site", site, "--config", str(config), "--run-dir", str(run_dir)]
            wall, _ = workflow([*command, *STAGES])
            return {"fault": label, "wall_s": round(wall, 1)}

        return plan

    def killed(run_dir: Path, config: Path) -> dict:
        step = chooser.randint(INTERVAL + 1, STEPS - 1)
        fault = kill_one_rank_at(step, run_dir / "train")
        wall, struck = workflow(
            ["--config", str(config), "--run-dir", str(run_dir), *STAGES], fault
        )
        return {"fault": "kill -9 of one of 2 ranks", "wall_s": round(wall, 1),
                "struck_at_step": struck}  # fmt: skip

    def resized(first_site: str, then_site: str, label: str):
        def plan(run_dir: Path, config: Path) -> dict:
            step = chooser.randint(INTERVAL + 1, STEPS - 1)
            fault = stop_workflow_at(step, run_dir / "train")
            common = ["--run-dir", str(run_dir), *STAGES]
            first, struck = workflow(
                ["--site", first_site, "--config", str(config), *common], fault
            )
            then, _ = workflow(["--site", then_site, "--move-site", "--resume", *common])
            return {"fault": label, "wall_s": round(first + then, 1), "struck_at_step": struck}

        return plan

    for seed in (0, 1, 2):
        run(f"undisturbed-seed{seed}", seed, undisturbed("local", "none"))
    for seed in (0, 1, 2):  # what a world-size change is a mixture of
        run(f"undisturbed-1rank-seed{seed}", seed, undisturbed(str(one_rank_site), "none, 1 rank"))
    run("kill", 0, killed)
    run("2to1", 0, resized("local", str(one_rank_site), "stopped at 2 ranks, went on at 1"))
    run("1to2", 0, resized(str(one_rank_site), "local", "stopped at 1 rank, went on at 2"))

    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "steps": STEPS,
        "checkpoint_every_steps": INTERVAL,
        "runs": results,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[bench] wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
