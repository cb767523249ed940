"""Strong scaling past this machine, by model: measure the step and Horovod's allreduce on 1-2
ranks here, fit a latency-bandwidth model of ring allreduce plus a straggler and a cycle term,
check it against a real 2-rank step, and project FOV/s and efficiency to 1,024 nodes of Theta
(Aries) and Polaris (Slingshot 11) beside Dong et al.'s (SC'19) Fig. 3 point.

Run by hand (not a test), from the repository root with the venv on PATH, on a quiet machine:

    PATH=$PWD/.venv/bin:$PATH python bench/scaling_model.py [--model paper|small]
        [--batch-size 4] [--steps 30] [--sizes 4096 16384 ...] [--repeats 50] [--quick]

Measures, each in its own process (thread settings and the MPI launch take effect there):
  (a) the training step (`pipeline.training.trainer.make_train_step`, the runtime of `_init_runtime`, random
      tensors as bench/train_throughput.py's bare step) on 1 rank x `--threads` threads: every
      step's time, mean mu and sd sigma; again as two independent 1-rank processes side by side,
      which load this machine's cores as the 2-rank run does;
  (b) `hvd.allreduce` of float32 tensors of `--sizes` bytes and of the model's gradients, 2 ranks,
      with Horovod's MPI controller (`mpiexec -n 2`) and with Gloo (`horovodrun --gloo -np 2`:
      Gloo needs horovodrun's rendezvous; under mpiexec, HOROVOD_CONTROLLER=gloo gives two worlds
      of one), at a short cycle (`--fast-cycle-ms`: the copy and the network) and at the
      training's (`--cycle-ms`, TrainConfig's 25 ms, entered at a random phase of the cycle as a
      training step is);
  (c) the real 2-rank step (2 ranks x `--threads`, the training's cycle), with MPI and with Gloo.

The model (`step_model`): a synchronous step over p ranks takes
    mu + sigma E[max of p standard normals] + t_allreduce(p, m) + cycle term,
  - ring allreduce of the m gradient bytes: t(p, m) = 2(p-1) alpha + 2(p-1)/p m beta, alpha and
    beta fitted to (b)'s medians at the short cycle, t(2, m) = 2 alpha + m beta (least squares on
    the relative error); a reduction term cannot be told from beta with 2 ranks, so beta holds it;
  - stragglers: the slowest of p ranks, each mu + sigma z; E[max] is computed exactly (it is
    0.56 at p = 2, 3.25 at 1,024); sigma sqrt(2 ln p), its large-p bound (1.18, 3.72), is
    printed beside it for the paper's point;
  - Horovod's cycle: the allreduce waits for the next cycle start, so the step is a whole number
    of cycles after the previous allreduce; half a cycle on average when sigma >> the cycle;
  - one rank has no allreduce and no cycle (`make_train_step` skips them in a world of one).
Check: the 2-rank prediction from (a)'s side-by-side mu, sigma and (b)'s fit against (c).
Projection: one rank of batch 4 per node, the paper's model, a node's compute from the paper's
Fig. 3 (KNL: 0.72 FOV/s), sigma / mu measured in (a) (1 rank alone) and the sigma / mu that gives
the paper's 71 % at 1,024 nodes; each site's published (not measured) latency and bandwidth, and
the per-cycle negotiation (2 ceil(log2 p) alpha). Writes `--json` and `--png`; `--quick` runs the
small model with few steps and sizes, a smoke run whose numbers mean nothing.
"""

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from machine import cpu_name  # bench/machine.py

import pipeline  # noqa: F401  (sets oneDNN on before TensorFlow loads)
from pipeline.core.atomic import atomic_path
from pipeline.network.model import ModelConfig, weight_count
from pipeline.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
MARK = "SCALING_MODEL_RESULT "  # the child's result line (horovodrun prefixes "[0]<stdout>:")

MODELS = {
    # ModelConfig's defaults, the paper's network: FOV 33 x 33 x 17 (x, y, z), the input module
    # + 8 residual modules (depth 9), 32 features: 472,353 weights.
    "paper": ModelConfig(),
    # configs/study.toml's: FOV 17 x 17 x 9 (x, y, z), depth 3, 8 features; quick to run.
    "small": ModelConfig(fov_shape_zyx=(9, 17, 17), deltas_zyx=(2, 4, 4), depth=3, features=8),
}

# Dong et al., SC'19, Fig. 3 (read off the figure, so approximate): about 523 FOV/s on 1,024 KNL
# nodes at about 71 % efficiency. One KNL node (one rank, batch 4) then trained
# 523 / (0.71 x 1024) = 0.72 FOV/s, the compute rate the projection gives every node.
PAPER_NODES = 1024
PAPER_FOV_PER_S = 523.0
PAPER_EFFICIENCY = 0.71
NODE_FOV_PER_S = PAPER_FOV_PER_S / (PAPER_EFFICIENCY * PAPER_NODES)
PAPER_BATCH = 4  # per rank, one rank per node (configs/paper.toml)


@dataclass(frozen=True)
class Site:
    name: str
    latency_s: float  # alpha: one message's MPI latency between nodes
    bandwidth: float  # bytes/s one rank's node injects (beta = 1 / bandwidth)
    nodes: int  # the machine's compute nodes: projections beyond are hypothetical
    source: str


# Published nominal figures, quoted from memory of the sources named (no internet here): not
# measured, not verified against the documents. Real MPI latency on a loaded dragonfly, and on
# KNL's slow cores, is higher.
SITES = {
    "theta": Site(
        name="Theta (Cray XC40, Aries dragonfly)",
        # Aries: ~1.3 us MPI latency, ~10 GB/s injection per node (Alverson et al., "Cray XC
        # Series Network", Cray white paper WP-Aries01-1112, 2012).
        latency_s=1.3e-6,
        bandwidth=10e9,
        # 4,392 KNL 7230 nodes (ALCF, docs.alcf.anl.gov/theta/hardware-overview/machine-overview).
        nodes=4392,
        source="Alverson et al., Cray XC Series Network (2012): ~1.3 us, ~10 GB/s per node; "
        "ALCF Theta machine overview: 4,392 nodes. Nominal, not measured.",
    ),
    "polaris": Site(
        name="Polaris (HPE Slingshot 11, dragonfly)",
        # Slingshot: 200 Gb/s = 25 GB/s per port and direction; MPI latency ~2 us (De Sensi et
        # al., "An In-Depth Analysis of the Slingshot Interconnect", SC'20, measured with
        # earlier NICs). A Polaris node has a pair of Slingshot 11 adapters (ALCF, docs.alcf.
        # anl.gov/polaris/hardware-overview/machine-overview); one rank per node uses one.
        latency_s=2.0e-6,
        bandwidth=25e9,
        nodes=560,  # the same ALCF page: 560 nodes, so 1,024 is hypothetical
        source="De Sensi et al., SC'20: ~2 us, 200 Gb/s per port; ALCF Polaris machine overview: "
        "560 nodes, 2 Slingshot 11 adapters per node. Nominal, not measured.",
    ),
}


# ---------------------------------------------------------------------------------------------
# Measurements (child processes)


def _runtime(threads: int, cycle_ms: float, model: ModelConfig, batch_size: int = PAPER_BATCH):
    """TensorFlow and Horovod set up as a training rank is (`pipeline.training.trainer._init_runtime`)."""
    from pipeline.training.trainer import _init_runtime

    config = TrainConfig(
        model=model,
        batch_size=batch_size,
        intra_op_threads=threads,
        inter_op_threads=1,
        horovod_cycle_time_ms=cycle_ms,
    )
    hvd, tf = _init_runtime(config)
    return hvd, tf, config


def step_times(args: argparse.Namespace) -> dict:
    """Every step's seconds of the training's own step on random tensors, on every rank."""
    from pipeline.network.model import build_model
    from pipeline.training.trainer import make_optimizer, make_train_step

    hvd, tf, config = _runtime(args.threads, args.cycle_ms, MODELS[args.model], args.batch_size)
    model = build_model(config.model)
    optimizer = make_optimizer(tf, config)
    optimizer.build(model.trainable_variables)
    train_step = make_train_step(model, optimizer, config.grad_clip)
    shape = (config.batch_size, *config.model.fov_shape_zyx, 1)
    images = tf.random.normal(shape)
    batches = [(images, images, tf.cast(images > 0, tf.float32))]
    for _ in range(2):  # trace, and the first allreduce's negotiation (response cache)
        bool(train_step(batches)[2])
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        bool(train_step(batches)[2])  # waits for the update: the step is synchronous
        times.append(time.perf_counter() - start)
    from horovod.tensorflow.functions import allgather_object

    return {
        "ranks": hvd.size(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "cycle_ms": config.horovod_cycle_time_ms,
        "controller": "mpi" if hvd.mpi_enabled() else "gloo",
        "step_s_per_rank": allgather_object(times) if hvd.size() > 1 else [times],
    }


def _timed_allreduce(fn, tensors, repeats: int, phase_s: float, rng) -> list[float]:
    """Seconds of each of `repeats` calls after 3 untimed ones. Before each call every rank sleeps
    the same random time in [0, phase_s): the call starts at a random phase of Horovod's cycle, as
    a training step's allreduce does, yet on all ranks at once (no rank waits for another)."""
    for _ in range(3):
        fn(tensors)
    times = []
    for _ in range(repeats):
        time.sleep(rng.uniform(0, phase_s))
        start = time.perf_counter()
        fn(tensors)
        times.append(time.perf_counter() - start)
    return times


def allreduce_times(args: argparse.Namespace) -> dict:
    """hvd.allreduce (op Average, in a tf.function as the step's) of one float32 tensor per size,
    and of tensors shaped as the model's gradients (Horovod fuses them into one buffer)."""
    from pipeline.network.model import build_model

    hvd, tf, config = _runtime(args.threads, args.cycle_ms, MODELS[args.model])
    rng = np.random.default_rng(0)  # same seed on every rank: same sleeps
    phase_s = args.cycle_ms / 1e3 if args.random_phase else 0.0

    @tf.function
    def allreduce(tensors):
        return [tf.reduce_sum(hvd.allreduce(t, op=hvd.Average)) for t in tensors]

    def run(tensors):
        return [float(x) for x in allreduce(tensors)]  # waits for the result

    by_size = {}
    for size in args.sizes:
        tensor = tf.ones([size // 4], tf.float32)
        by_size[str(size)] = _timed_allreduce(run, [tensor], args.repeats, phase_s, rng)
    grads = [tf.ones(v.shape, tf.float32) for v in build_model(config.model).trainable_variables]
    return {
        "ranks": hvd.size(),
        "controller": "mpi" if hvd.mpi_enabled() else "gloo",
        "cycle_ms": args.cycle_ms,
        "random_phase": args.random_phase,
        "seconds_by_bytes": by_size,
        "gradient_bytes": 4 * sum(int(np.prod(g.shape)) for g in grads),
        "gradient_tensors": len(grads),
        "gradients_s": _timed_allreduce(run, grads, args.repeats, phase_s, rng),
    }


def _child(args: argparse.Namespace) -> None:
    result = step_times(args) if args.child == "step" else allreduce_times(args)
    import horovod.tensorflow as hvd

    if hvd.rank() == 0:
        print(MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Launching the children


def _venv_tool(name: str) -> str:
    """The venv's mpiexec / horovodrun (beside this Python), else whatever PATH has."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def _child_command(kind: str, args: argparse.Namespace, cycle_ms: float, random_phase=False):
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    command += ["--model", args.model, "--batch-size", str(args.batch_size)]
    command += ["--steps", str(args.steps), "--threads", str(args.threads)]
    command += ["--cycle-ms", str(cycle_ms), "--repeats", str(args.repeats)]
    command += ["--sizes", *map(str, args.sizes)]
    return command + (["--random-phase"] if random_phase else [])


def _launcher(ranks: int, controller: str) -> list[str]:
    if ranks == 1:
        return []
    if controller == "mpi":
        return [_venv_tool("mpiexec"), "-n", str(ranks)]
    # Gloo's rendezvous (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, HOROVOD_CONTROLLER and
    # HOROVOD_CPU_OPERATIONS=gloo) is what horovodrun sets up for its ranks.
    host = f"localhost:{ranks}"
    gloo = ["--gloo", "-np", str(ranks), "-H", host, "--start-timeout", "300"]  # slow TF imports
    return [_venv_tool("horovodrun"), *gloo]


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TF_CPP_MIN_LOG_LEVEL": "2"}


def _parse(done: subprocess.CompletedProcess, command: list[str]) -> dict:
    for line in reversed(done.stdout.splitlines()):
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    sys.exit(f"no result from {' '.join(command)} (exit {done.returncode}):\n{done.stderr[-3000:]}")


def launch(kind: str, ranks: int, controller: str, cycle_ms: float, args, random_phase=False):
    """Run one measurement under its launcher; the result rank 0 printed."""
    command = _launcher(ranks, controller) + _child_command(kind, args, cycle_ms, random_phase)
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=_env(args.threads), timeout=3600
    )
    return _parse(done, command)


def launch_side_by_side(args: argparse.Namespace, copies: int = 2) -> dict:
    """`copies` independent 1-rank step measurements at once (no communication between them)."""
    command = _child_command("step", args, args.cycle_ms)
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_env(args.threads),
        )
        for _ in range(copies)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        results.append(
            _parse(subprocess.CompletedProcess(command, proc.returncode, out, err), command)
        )
    return results[0] | {"step_s_per_rank": [r["step_s_per_rank"][0] for r in results]}


# ---------------------------------------------------------------------------------------------
# The model


def summarize_steps(result: dict) -> dict:
    """Mean and sd over every rank's steps (rank 0's for a synchronous multi-rank step)."""
    per_rank = result["step_s_per_rank"]
    pooled = per_rank[0] if result["ranks"] > 1 else [t for times in per_rank for t in times]
    return result | {"mean_s": statistics.fmean(pooled), "sd_s": statistics.stdev(pooled)}


def fit_latency_bandwidth(sizes: list[int], seconds: list[float]) -> dict:
    """alpha, beta of t(2, m) = 2 alpha + m beta by least squares on the relative error (the sizes
    span decades: plain least squares would fit the largest alone)."""
    m, t = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([np.full_like(m, 2.0), m], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    predicted = 2 * alpha + m * beta
    return {
        "alpha_s": float(alpha),
        "beta_s_per_byte": float(beta),
        "bandwidth_bytes_per_s": float(1 / beta) if beta > 0 else math.inf,
        "relative_rms_error": float(np.sqrt(np.mean((predicted / t - 1) ** 2))),
    }


def ring_allreduce_s(p: int, m: float, alpha: float, beta: float) -> float:
    """Ring allreduce of m bytes over p ranks: 2(p-1) messages, 2(p-1)/p of the data each way."""
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * m * beta


def negotiation_s(p: int, alpha: float) -> float:
    """Horovod's per-cycle negotiation across p ranks: a small allreduce (recursive doubling)."""
    return 0.0 if p == 1 else 2 * math.ceil(math.log2(p)) * alpha


def max_of_normals(p: int, points: int = 4096) -> np.ndarray:
    """The maximum of p standard normal draws at `points` evenly spaced quantiles (midpoints):
    its distribution function is Phi(x)^p, so its u-quantile is Phi^-1(u^(1/p))."""
    from scipy.special import ndtri

    u = (np.arange(points) + 0.5) / points
    return ndtri(u ** (1.0 / p))


def step_model(mu: float, sigma: float, p: int, t_proc: float, cycle_s: float) -> dict:
    """Expected synchronous step over p ranks and its terms.

    Each rank computes for mu + sigma z (z standard normal, independent); the step's allreduce is
    enqueued when the slowest rank is done (straggler: sigma E[max of p z]) and starts at the next
    start of Horovod's cycle; the cycle's work (negotiation and allreduce) takes t_proc. Horovod's
    background loop starts a cycle every cycle_s after the previous start, or at once when the
    previous cycle's work took longer, so the period of the step is
        g + cycle_s ceil((t_proc + X - g) / cycle_s),  g = max(cycle_s, t_proc) - cycle_s,
    X the slowest rank's compute; averaged over X this is mu + straggler + t_proc + ~cycle_s / 2
    when sigma >> cycle_s (the cycle term: half a cycle per step), and whole cycles when sigma is
    small. One rank runs no allreduce and no cycle (`make_train_step`, world of one)."""
    if p == 1:
        return {
            "step_s": mu,
            "compute_s": mu,
            "straggler_s": 0.0,
            "allreduce_s": 0.0,
            "cycle_s": 0.0,
        }
    slowest = mu + sigma * max_of_normals(p)
    grid = max(cycle_s, t_proc) - cycle_s
    period = grid + cycle_s * np.ceil((t_proc + slowest - grid) / cycle_s)
    step = float(period.mean())
    straggler = float(slowest.mean()) - mu
    return {
        "step_s": step,
        "compute_s": mu,
        "straggler_s": straggler,
        "allreduce_s": t_proc,
        "cycle_s": step - mu - straggler - t_proc,
    }


def site_step(site: Site, p: int, mu: float, ratio: float, m: float, cycle_s: float) -> dict:
    """The model at a site: its latency and bandwidth, sigma = ratio x mu."""
    beta = 1 / site.bandwidth
    ring = ring_allreduce_s(p, m, site.latency_s, beta)
    t_proc = ring + negotiation_s(p, site.latency_s)
    terms = step_model(mu, ratio * mu, p, t_proc, cycle_s)
    return terms | {
        "latency_term_s": 2 * (p - 1) * site.latency_s + negotiation_s(p, site.latency_s),
        "bandwidth_term_s": ring - 2 * (p - 1) * site.latency_s,
    }


def ratio_for_efficiency(site: Site, p: int, mu: float, m: float, cycle_s: float, target: float):
    """sigma / mu at which the model's efficiency at p nodes is `target` (None if unreachable)."""
    from scipy.optimize import brentq

    def gap(ratio: float) -> float:
        return mu / site_step(site, p, mu, ratio, m, cycle_s)["step_s"] - target

    if gap(0.0) < 0:
        return None  # the network alone is already slower
    return float(brentq(gap, 0.0, 10.0, xtol=1e-6))


# ---------------------------------------------------------------------------------------------
# Run, check, project, report


def measure(args: argparse.Namespace) -> dict:
    """Every measurement of (a)-(c), printed as it arrives."""
    measured: dict = {}
    print(f"(a) step, 1 rank x {args.threads} thread(s), {args.steps} steps ...", flush=True)
    measured["step_1rank"] = summarize_steps(launch("step", 1, "mpi", args.cycle_ms, args))
    print("(a) step, 2 independent 1-rank processes side by side ...", flush=True)
    measured["step_1rank_side_by_side"] = summarize_steps(launch_side_by_side(args))
    measured["allreduce"] = {}
    for controller in ("mpi", "gloo"):
        measured["allreduce"][controller] = {}
        for label, cycle, phase in (
            ("fast", args.fast_cycle_ms, False),
            ("training", args.cycle_ms, True),
        ):
            print(f"(b) allreduce, 2 ranks, {controller}, cycle {cycle} ms ...", flush=True)
            measured["allreduce"][controller][label] = launch(
                "allreduce", 2, controller, cycle, args, phase
            )
    measured["step_2rank"] = {}
    for controller in ("mpi", "gloo"):
        print(f"(c) step, 2 ranks x {args.threads} thread(s), {controller} ...", flush=True)
        result = launch("step", 2, controller, args.cycle_ms, args)
        measured["step_2rank"][controller] = summarize_steps(result)
    return measured


def fits(measured: dict) -> dict:
    out = {}
    for controller, runs in measured["allreduce"].items():
        by_size = runs["fast"]["seconds_by_bytes"]
        sizes = [int(s) for s in by_size]
        out[controller] = fit_latency_bandwidth(
            sizes, [statistics.median(by_size[str(s)]) for s in sizes]
        )
        # What the training's cycle adds to an allreduce entered at a random phase: the model
        # says half a cycle on average.
        slow = runs["training"]["seconds_by_bytes"]
        waits = [statistics.fmean(slow[str(s)]) - statistics.median(by_size[str(s)]) for s in sizes]
        out[controller]["cycle_wait_measured_s"] = statistics.fmean(waits)
        out[controller]["cycle_wait_model_s"] = runs["training"]["cycle_ms"] / 2e3
    return out


def check(measured: dict, fitted: dict, gradient_bytes: int, cycle_ms: float) -> dict:
    """The model's 2-rank step against the measured one, per controller. mu and sigma from the
    side-by-side 1-rank runs (both cores busy, as in the 2-rank run); the same from the 1-rank
    run alone beside it."""
    compute, alone = measured["step_1rank_side_by_side"], measured["step_1rank"]
    out = {}
    for controller, fit in fitted.items():
        t_proc = ring_allreduce_s(2, gradient_bytes, fit["alpha_s"], fit["beta_s_per_byte"])
        terms = step_model(compute["mean_s"], compute["sd_s"], 2, t_proc, cycle_ms / 1e3)
        from_alone = step_model(alone["mean_s"], alone["sd_s"], 2, t_proc, cycle_ms / 1e3)
        real = measured["step_2rank"][controller]
        direct = statistics.median(measured["allreduce"][controller]["fast"]["gradients_s"])
        out[controller] = {
            "inputs": {
                "mu_s": compute["mean_s"],
                "sigma_s": compute["sd_s"],
                "alpha_s": fit["alpha_s"],
                "beta_s_per_byte": fit["beta_s_per_byte"],
                "gradient_bytes": gradient_bytes,
                "cycle_ms": cycle_ms,
            },
            "predicted": terms,
            "gradient_allreduce_measured_s": direct,
            "measured_step_s": real["mean_s"],
            "measured_step_sd_s": real["sd_s"],
            "relative_error": terms["step_s"] / real["mean_s"] - 1,
            "predicted_from_1rank_alone": from_alone,
            "relative_error_from_1rank_alone": from_alone["step_s"] / real["mean_s"] - 1,
        }
    return out


def project(ratio: float, cycle_ms: float, fov_per_s_polaris: float) -> dict:
    """FOV/s and efficiency per node count per site, one rank of batch 4 per node, the paper's
    model (its gradient bytes) at the KNL node's paper-derived rate."""
    m = 4 * weight_count()
    cycle_s = cycle_ms / 1e3
    mu = {"theta": PAPER_BATCH / NODE_FOV_PER_S, "polaris": PAPER_BATCH / fov_per_s_polaris}
    needed = ratio_for_efficiency(
        SITES["theta"], PAPER_NODES, mu["theta"], m, cycle_s, PAPER_EFFICIENCY
    )
    # The same solved in closed form with the straggler sigma sqrt(2 ln p) (the expected
    # maximum's large-p bound) and half a cycle per step.
    theta = site_step(SITES["theta"], PAPER_NODES, mu["theta"], 0.0, m, cycle_s)
    overhead = theta["allreduce_s"] + cycle_s / 2
    bound = (mu["theta"] / PAPER_EFFICIENCY - mu["theta"] - overhead) / (
        mu["theta"] * math.sqrt(2 * math.log(PAPER_NODES))
    )
    rows = []
    for p in [2**k for k in range(11)]:
        row: dict = {"nodes": p}
        for key, site in SITES.items():
            for label, r in (("measured", ratio), ("paper", needed)):
                if r is None or (key == "polaris" and label == "paper"):
                    continue
                terms = site_step(site, p, mu[key], r, m, cycle_s)
                row[f"{key}_{label}"] = terms | {
                    "fov_per_s": p * PAPER_BATCH / terms["step_s"],
                    "efficiency": mu[key] / terms["step_s"],
                    "beyond_machine": p > site.nodes,
                }
        rows.append(row)
    return {
        "gradient_bytes": m,
        "cycle_ms": cycle_ms,
        "node_fov_per_s": {"theta": NODE_FOV_PER_S, "polaris": fov_per_s_polaris},
        "mu_s": mu,
        "sites": {k: asdict(s) for k, s in SITES.items()},
        "paper": {
            "nodes": PAPER_NODES,
            "fov_per_s": PAPER_FOV_PER_S,
            "efficiency": PAPER_EFFICIENCY,
        },
        "sigma_over_mu_measured": ratio,
        "sigma_over_mu_for_paper": needed,
        "sigma_over_mu_for_paper_sqrt2lnp": bound,
        "rows": rows,
    }


def explain(projection: dict) -> str:
    """One sentence: which term makes up the paper's loss at 1,024 Theta nodes, from the model
    with the sigma that reproduces 71 % split into its terms."""
    row = projection["rows"][-1].get("theta_paper")
    if row is None:
        return "The network and cycle terms alone already fall below the paper's efficiency."
    loss = row["step_s"] - row["compute_s"]
    shares = {
        "ring-allreduce latency (and negotiation)": row["latency_term_s"] / loss,
        "allreduce bandwidth": row["bandwidth_term_s"] / loss,
        "Horovod's cycle": row["cycle_s"] / loss,
        "stragglers": row["straggler_s"] / loss,
    }
    largest = max(shares, key=shares.get)
    parts = ", ".join(f"{name} {share:.1%}" for name, share in shares.items())
    ratio, needed = projection["sigma_over_mu_measured"], projection["sigma_over_mu_for_paper"]
    return (
        f"At {PAPER_NODES:,} Theta nodes the gap between the ideal line and the paper's "
        f"{PAPER_EFFICIENCY:.0%} ({loss:.2f} s on a {row['compute_s']:.2f} s step) is "
        f"{largest} in this model ({parts}): it takes per-rank step times varying with "
        f"sigma/mu = {needed:.3f} (measured here: {ratio:.3f}), or another per-step cost the "
        f"model does not have (input pipeline, I/O, jitter of the nodes), to explain it."
    )


def print_report(results: dict) -> None:
    measured, fitted = results["measured"], results["fit"]
    for key in ("step_1rank", "step_1rank_side_by_side"):
        s = measured[key]
        print(
            f"(a) {key}: {s['intra_op_threads']} thread(s), mu {s['mean_s'] * 1e3:.1f} ms, "
            f"sigma {s['sd_s'] * 1e3:.2f} ms (sigma/mu {s['sd_s'] / s['mean_s']:.3f}), "
            f"{len(s['step_s_per_rank'])} x {len(s['step_s_per_rank'][0])} steps"
        )
    runs = measured["allreduce"]
    columns = [(c, label) for c in ("mpi", "gloo") for label in ("fast", "training")]
    print("(b) allreduce, 2 ranks, median ms")
    print(
        f"    {'bytes':>22} | "
        + " | ".join(f"{c} {runs[c][label]['cycle_ms']:>5} ms" for c, label in columns)
    )
    rows = [(f"{int(size):,}", size) for size in runs["mpi"]["fast"]["seconds_by_bytes"]]
    nbytes, count = runs["mpi"]["fast"]["gradient_bytes"], runs["mpi"]["fast"]["gradient_tensors"]
    for name, size in [*rows, (f"gradients {nbytes:,} ({count})", None)]:
        cells = [
            statistics.median(
                runs[c][label]["gradients_s"]
                if size is None
                else runs[c][label]["seconds_by_bytes"][size]
            )
            for c, label in columns
        ]
        print(f"    {name:>22} | " + " | ".join(f"{t * 1e3:12.3f}" for t in cells))
    print(
        "    (the short cycle back to back; the training's entered at a random phase of the cycle)"
    )
    for controller, fit in fitted.items():
        print(
            f"    fit {controller}: alpha {fit['alpha_s'] * 1e6:.1f} us, 1/beta "
            f"{fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, relative rms {fit['relative_rms_error']:.1%}; "
            f"the training's cycle adds {fit['cycle_wait_measured_s'] * 1e3:.1f} ms per allreduce "
            f"(model: half a cycle, {fit['cycle_wait_model_s'] * 1e3:.1f} ms)"
        )
    print("(c) 2-rank step: measured against the model mu + straggler + allreduce + cycle")
    for controller, c in results["check"].items():
        p, i, a = c["predicted"], c["inputs"], c["predicted_from_1rank_alone"]
        print(
            f"    {controller}: measured {c['measured_step_s'] * 1e3:.1f} ms (sd {c['measured_step_sd_s'] * 1e3:.1f}); "
            f"predicted {p['step_s'] * 1e3:.1f} = {p['compute_s'] * 1e3:.1f} + {p['straggler_s'] * 1e3:.2f} "
            f"+ {p['allreduce_s'] * 1e3:.2f} + {p['cycle_s'] * 1e3:.2f} ms; error {c['relative_error']:+.1%} "
            f"(goal within 10 %)"
        )
        print(
            f"      inputs: mu {i['mu_s'] * 1e3:.1f} ms, sigma {i['sigma_s'] * 1e3:.2f} ms (side by side), alpha "
            f"{i['alpha_s'] * 1e6:.1f} us, beta {i['beta_s_per_byte'] * 1e9:.3f} ns/B, m {i['gradient_bytes']:,} B, "
            f"cycle {i['cycle_ms']} ms; the gradients' allreduce measured {c['gradient_allreduce_measured_s'] * 1e3:.2f} ms"
        )
        print(
            f"      with mu, sigma of the 1-rank run alone: predicted {a['step_s'] * 1e3:.1f} ms, "
            f"error {c['relative_error_from_1rank_alone']:+.1%}"
        )
    print_projection(results["projection"])
    print(results["explanation"])


def print_projection(proj: dict) -> None:
    print(
        f"Projection: one rank per node, batch {PAPER_BATCH}, the paper's model ({proj['gradient_bytes']:,} "
        f"gradient bytes), node rate {proj['node_fov_per_s']['theta']:.3f} FOV/s (KNL, from the "
        f"paper), cycle {proj['cycle_ms']} ms; sigma/mu measured here {proj['sigma_over_mu_measured']:.3f}, "
        f"for the paper's 71 % {proj['sigma_over_mu_for_paper'] or float('nan'):.3f} "
        f"(with sigma sqrt(2 ln p): {proj['sigma_over_mu_for_paper_sqrt2lnp']:.3f})"
    )
    print(
        "    nodes | Theta FOV/s  eff | Theta, paper's sigma  eff | Polaris FOV/s  eff | paper Fig. 3"
    )
    for row in proj["rows"]:
        theta, polaris = row["theta_measured"], row["polaris_measured"]
        fit = row.get("theta_paper")
        fitted = f"{fit['fov_per_s']:9.1f} {fit['efficiency']:6.1%}" if fit else " " * 16
        beyond = "*" if polaris["beyond_machine"] else " "
        paper = (
            f"{PAPER_FOV_PER_S:.0f} FOV/s, {PAPER_EFFICIENCY:.0%}"
            if row["nodes"] == PAPER_NODES
            else ""
        )
        print(
            f"    {row['nodes']:>5} | {theta['fov_per_s']:9.1f} {theta['efficiency']:6.1%} | "
            f"{fitted}           | {polaris['fov_per_s']:9.1f} {polaris['efficiency']:6.1%}{beyond} | {paper}"
        )
    print("    * beyond Polaris's 560 nodes (hypothetical)")


def _plot_allreduce(ax, results: dict) -> None:
    """Measured medians (both cycles, and the gradients' allreduce) and the fitted lines."""
    for controller, color in (("mpi", "tab:blue"), ("gloo", "tab:orange")):
        runs, fit = results["measured"]["allreduce"][controller], results["fit"][controller]
        for label, marker in (("fast", "o"), ("training", "x")):
            by_size = runs[label]["seconds_by_bytes"]
            sizes = np.array([int(s) for s in by_size])
            medians = [statistics.median(v) for v in by_size.values()]
            name = f"{controller}, cycle {runs[label]['cycle_ms']} ms"
            ax.loglog(sizes, medians, marker, color=color, label=name)
        gradients = statistics.median(runs["fast"]["gradients_s"])
        ax.loglog([runs["fast"]["gradient_bytes"]], [gradients], "s", mfc="none", color=color,
                  label=f"{controller}, the model's gradients")  # fmt: skip
        grid = np.geomspace(sizes.min(), sizes.max(), 50)
        line = 2 * fit["alpha_s"] + grid * fit["beta_s_per_byte"]
        ax.loglog(grid, line, "-", color=color, label=f"{controller} fit 2 alpha + m beta")
    ax.set(xlabel="message (bytes, float32)", ylabel="allreduce, 2 ranks (s, median)",
           title="Horovod allreduce on this machine")  # fmt: skip
    ax.legend(fontsize=7)


def _plot_projection(ax, proj: dict) -> None:
    """Projected efficiency per site against nodes, the ideal line and the paper's point."""
    nodes = [row["nodes"] for row in proj["rows"]]
    curves = (
        ("theta_measured", "Theta, sigma/mu measured here", "o-"),
        ("theta_paper", "Theta, sigma/mu giving the paper's 71 %", "s-"),
        ("polaris_measured", "Polaris, sigma/mu measured here", "^--"),
    )
    for key, label, style in curves:
        if key in proj["rows"][0]:
            values = [row[key]["efficiency"] for row in proj["rows"]]
            ax.semilogx(nodes, values, style, base=2, label=label, mfc="none")
    ax.axhline(1.0, color="grey", lw=0.8, label="ideal")
    ax.plot([PAPER_NODES], [PAPER_EFFICIENCY], "*", ms=14, color="red", label="Dong et al., Fig. 3")
    ax.axvline(SITES["polaris"].nodes, color="grey", ls=":", lw=0.8, label="Polaris's 560 nodes")
    ax.set(xlabel="nodes (one rank of batch 4 each)", ylabel="efficiency", ylim=(0, 1.05),
           title="Projected strong scaling (published network figures)")  # fmt: skip
    ax.legend(fontsize=7, loc="lower left")


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _plot_allreduce(left, results)
    _plot_projection(right, results["projection"])
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def machine() -> dict:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="paper")
    parser.add_argument(
        "--batch-size", type=int, default=PAPER_BATCH, help="FOVs per rank per step"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per step measurement")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[4096 * 4**k for k in range(7)],
        help="allreduce bytes",
    )
    parser.add_argument("--repeats", type=int, default=50, help="timed allreduces per size")
    parser.add_argument(
        "--cycle-ms",
        type=float,
        default=TrainConfig().horovod_cycle_time_ms,
        help="the training's Horovod cycle",
    )
    parser.add_argument(
        "--fast-cycle-ms", type=float, default=0.1, help="cycle for the latency-bandwidth fit"
    )
    parser.add_argument(
        "--polaris-node-fov-per-s",
        type=float,
        default=NODE_FOV_PER_S,
        help="a Polaris node's rate (default: the KNL node's, to compare networks only)",
    )
    parser.add_argument("--json", default=str(RESULTS / "scaling_model.json"))
    parser.add_argument("--png", default=str(RESULTS / "scaling_model.png"))
    parser.add_argument("--quick", action="store_true", help="tiny everything: a smoke run")
    parser.add_argument("--child", choices=["step", "allreduce"], help=argparse.SUPPRESS)
    parser.add_argument("--random-phase", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and not args.child:
        args.model, args.steps, args.repeats = "small", 8, 8
        args.sizes = [4096 * 4**k for k in range(5)]
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the sd needs two)")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        _child(args)
        return
    model = MODELS[args.model]
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": [sys.executable, *sys.argv],
        "machine": machine(),
        "settings": {
            "model": args.model,
            "model_config": asdict(model),
            "weights": weight_count(model.depth, model.features),
            "batch_size_per_rank": args.batch_size,
            "steps": args.steps,
            "threads_per_rank": args.threads,
            "sizes_bytes": args.sizes,
            "repeats": args.repeats,
            "cycle_ms": args.cycle_ms,
            "fast_cycle_ms": args.fast_cycle_ms,
        },
    }
    print(f"machine: {results['machine']}", flush=True)
    results["measured"] = measure(args)
    results["fit"] = fits(results["measured"])
    gradient_bytes = results["measured"]["allreduce"]["mpi"]["fast"]["gradient_bytes"]
    results["check"] = check(results["measured"], results["fit"], gradient_bytes, args.cycle_ms)
    alone = results["measured"]["step_1rank"]
    ratio = alone["sd_s"] / alone["mean_s"]
    results["projection"] = project(ratio, args.cycle_ms, args.polaris_node_fov_per_s)
    results["explanation"] = explain(results["projection"])
    print_report(results)
    with atomic_path(args.json) as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
