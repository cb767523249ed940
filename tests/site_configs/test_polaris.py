"""Polaris as ALCF sets it up now (site_configs/polaris.py): the cpu pool's workers placed as
ALCF's Parsl page places them, each with the threads the dry run says (read from the batch script
the dry run renders), and each on the cores nearest its own A100; the queues' job counts, so that
no plan submits more jobs than a queue holds.

The documented lines are quoted from ALCF's pages (github.com/argonne-lcf/user-guides, the source
of docs.alcf.anl.gov), as read on 2026-11-29.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys

import parsl
import pytest
from parsl import python_app
from parsl.launchers import MpiExecLauncher
from test_dry_run_scripts import PAPER, ROOT, dry_run, pool_command, shown_blocks
from test_site_configs import (  # noqa: F401  (fixtures)
    TASK_TIMEOUT,
    fake_scheduler,
    leftovers,
    small,
)

from pipeline.core.errors import ConfigError
from pipeline.network.devices import gpu_for_rank
from site_configs import CPU_LABEL, polaris
from site_configs.spec import for_run

# docs.alcf.anl.gov/polaris/workflows/parsl/ (docs/polaris/workflows/parsl.md), "Using Parsl on
# Polaris", the configuration "that will run one task per GPU":
ALCF_PARSL_CONFIG = r"""
    "available_accelerators": 4, # Each Polaris node has 4 GPUs, setting this ensures one worker per GPU
                available_accelerators=user_opts["available_accelerators"],
                max_workers_per_node=user_opts["available_accelerators"],
                # This give optimal binding of threads to GPUs on a Polaris node
                cpu_affinity="list:24-31,56-63:16-23,48-55:8-15,40-47:0-7,32-39",
                prefetch_capacity=0,
                    launcher=MpiExecLauncher(bind_cmd="--cpu-bind", overrides="--depth=64 --ppn 1"),
                    select_options="ngpus=4",
"""
# The same page, "Known Issues": "include in the `worker_init` for cases using the
# `PBSProProvider` ... this environment variable setting: `export TMPDIR=/tmp`".
KNOWN_ISSUE_LINE = "export TMPDIR=/tmp"
# docs.alcf.anl.gov/polaris/running-jobs/ (docs/polaris/running-jobs/index.md), "Queues": the
# queues' job counts a submission may not pass.
ALCF_QUEUE_NOTES = {
    "debug-scaling": "max 1 job running/accruing/queued **per-user**",
    "preemptable": "Max 20 jobs running/accruing/queued **per-project**",
    "capacity": "Max 2 jobs queued or running, 1 jobs running per user.",
}
# docs.alcf.anl.gov/polaris/running-jobs/using-gpus/ (docs/polaris/running-jobs/using-gpus.md):
# the launch of one rank per GPU, the GPU each rank takes, and the CPUs nearest each GPU ("the
# application is spawning MPI ranks 0-7 on CPUs 24-31 and using GPU 0. This mapping is based on
# output from the `nvidia-smi topo -m` command and pairs CPUs with the closest GPU").
ALCF_GPU_LAUNCH = (
    "mpiexec -n ${NTOTRANKS} --ppn ${NRANKS_PER_NODE} --depth=${NDEPTH} --cpu-bind depth "
    "./set_affinity_gpu_polaris.sh ./hello_affinity"
)
ALCF_RANK_GPU = "gpu=$((${num_gpus} - 1 - ${PMI_LOCAL_RANK} % ${num_gpus}))"
ALCF_GPU_CPUS = """
export CUDA_VISIBLE_DEVICES=0
mpiexec -n 8 --ppn 8 --cpu-bind list:24:25:26:27:28:29:30:31 ./hello_affinity &
export CUDA_VISIBLE_DEVICES=1
mpiexec -n 8 --ppn 8 --cpu-bind list:16:17:18:19:20:21:22:23 ./hello_affinity &
export CUDA_VISIBLE_DEVICES=2
mpiexec -n 8 --ppn 8 --cpu-bind list:8:9:10:11:12:13:14:15 ./hello_affinity &
export CUDA_VISIBLE_DEVICES=3
mpiexec -n 8 --ppn 8 --cpu-bind list:0:1:2:3:4:5:6:7 ./hello_affinity &
"""
CORES = 32  # "32 CPU cores, each core has 2 threads": logical CPU c + 32 is core c's second thread


def gpu_cores() -> dict[int, set[int]]:
    """The cores nearest each GPU, from ALCF_GPU_CPUS."""
    pairs = re.findall(r"CUDA_VISIBLE_DEVICES=(\d)\n.*--cpu-bind list:([\d:]+) ", ALCF_GPU_CPUS)
    return {int(gpu): {int(c) for c in cpus.split(":")} for gpu, cpus in pairs}


def documented(name: str) -> str:
    (value,) = re.findall(rf"\b{name}=(.+?),?$", ALCF_PARSL_CONFIG, re.M)
    return value


def test_the_cpu_pool_is_alcfs_one_worker_per_gpu_configuration(tmp_path):
    site = dataclasses.replace(polaris.SITE, account="X")
    cpu = {e.label: e for e in polaris.make_config(tmp_path / "run", site).executors}[CPU_LABEL]
    assert cpu.cpu_affinity == documented("cpu_affinity").strip('"')
    assert cpu.available_accelerators == ["0", "1", "2", "3"]  # Parsl's names for 4 GPUs
    assert cpu.max_workers_per_node == 4 and cpu.prefetch_capacity == 0
    launcher = cpu.provider.launcher
    assert isinstance(launcher, MpiExecLauncher)
    assert launcher.bind_cmd == "--cpu-bind" and launcher.overrides == "--depth=64 --ppn 1"
    assert f'overrides="{launcher.overrides}"' in documented("launcher")
    assert cpu.provider.select_options.startswith("ngpus=4")
    assert KNOWN_ISSUE_LINE in site.worker_init.split("; ")


def parsl_worker_cpus(affinity: str, visible: list[int], workers: int) -> list[list[int]]:
    """Each worker's CPUs as Parsl's process_worker_pool.py sets them (its OMP_NUM_THREADS is
    their count), written out again here rather than read from the site's code."""
    if affinity.startswith("list:"):
        lists = []
        for part in affinity.split(":")[1:]:
            cpus = []
            for piece in part.split(","):
                first, _, last = piece.partition("-")
                cpus += range(int(first), int(last or first) + 1)
            lists.append(cpus)
        return lists
    per = len(visible) // workers
    return [visible[per * w : per * (w + 1)] for w in range(workers)]


@pytest.mark.shared  # configs/paper.toml's data
def test_each_worker_gets_the_threads_the_dry_run_says_on_its_gpus_cores(tmp_path):
    run_dir = tmp_path / "run"
    out = dry_run("polaris", run_dir, "--account", "X")
    (said,) = re.findall(r"(\d+) worker\(s\) per node x (\d+) thread\(s\)", out)
    workers, threads = map(int, said)
    script = shown_blocks(out)[CPU_LABEL]
    # The pool's launch in the rendered script: PALS mpiexec leaves it unbound (--cpu-bind none,
    # MpiExecLauncher's), one per node, reserving the node's 64 hardware threads.
    (launch,) = [x for x in script.lines if x.startswith("mpiexec ")]
    assert launch.startswith("mpiexec --cpu-bind none --depth=64 --ppn 1 -n $WORKERCOUNT ")
    visible = list(range(64))
    pool = shlex.split(pool_command(script, run_dir, CPU_LABEL))
    affinity = pool[pool.index("--cpu-affinity") + 1]
    accelerators = pool[pool.index("--available-accelerators") + 1 :][:workers]
    assert accelerators == ["0", "1", "2", "3"]
    cpus = parsl_worker_cpus(affinity, visible, workers)
    assert [len(mine) for mine in cpus] == [threads] * workers == [16] * 4
    assert sorted(sum(cpus, [])) == visible  # every hardware thread once
    nearest = gpu_cores()
    for worker, mine in enumerate(cpus):  # worker w has GPU w (CUDA_VISIBLE_DEVICES=w)
        assert {cpu % CORES for cpu in mine} == nearest[worker]
        assert {cpu - CORES for cpu in mine if cpu >= CORES} == nearest[worker]  # second threads


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize(
    "nodes, queues",
    [
        (1, []),
        (8, ["--queue", "debug-scaling", "--cpu-queue", "debug"]),
        (128, ["--queue", "prod", "--cpu-queue", "debug"]),
    ],
)
def test_the_training_launch_is_alcfs_one_rank_per_gpu_launch(nodes, queues, tmp_path):
    out = dry_run(
        "polaris", tmp_path / "run", "--account", "X", "--train-nodes", str(nodes), *queues
    )
    (line,) = re.findall(rf"training on {nodes} node\(s\): (.*)", out)
    launch = shlex.split(line[line.index("mpiexec ") :])
    documented = shlex.split(ALCF_GPU_LAUNCH)
    # The same launcher and binding; ours names the hosts (Parsl's MPIExecutor, for the nodes of
    # the task) and runs python where ALCF's runs the GPU script, then the program.
    assert launch[0] == documented[0] == "mpiexec"
    assert (
        launch[launch.index("--cpu-bind") + 1]
        == documented[documented.index("--cpu-bind") + 1]
        == "depth"
    )
    assert int(launch[launch.index("-n") + 1]) == 4 * nodes  # NTOTRANKS
    assert int(launch[launch.index("-ppn") + 1]) == 4  # NRANKS_PER_NODE: one per A100
    assert "--depth=8" in launch  # NDEPTH: 32 cores / 4 ranks
    assert launch[launch.index("-hosts") + 1].count(",") == nodes - 1
    # Rank r takes the GPU ALCF's script gives it, and its depth-8 cores are that GPU's nearest.
    nearest = gpu_cores()
    for rank in range(4):
        # The script's shell arithmetic, which Python's reads alike.
        arithmetic = ALCF_RANK_GPU.removeprefix("gpu=$((").removesuffix("))")
        alcf_gpu = eval(
            arithmetic.replace("${num_gpus}", "4").replace("${PMI_LOCAL_RANK}", str(rank))
        )
        assert gpu_for_rank(rank, 4, "reverse") == alcf_gpu
        assert set(range(8 * rank, 8 * rank + 8)) == nearest[alcf_gpu]


# ---- the queues' job counts ----


def test_the_queues_job_counts_are_alcfs():
    held = {q.name: q.max_jobs for q in polaris.QUEUES if q.max_jobs is not None}
    counts = {
        name: int(re.search(r"[Mm]ax (\d+) jobs?", note)[1])
        for name, note in ALCF_QUEUE_NOTES.items()
    }
    assert held == counts == {"debug-scaling": 1, "preemptable": 20, "capacity": 2}


def workflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "workflow.py", "--site", "polaris", "--config", str(PAPER)]
        + ["--account", "X", "--dry-run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.shared  # configs/paper.toml's data
def test_a_plan_a_queue_cannot_hold_is_refused_in_one_line_naming_the_queues_that_can(tmp_path):
    # debug-scaling takes 8 nodes but one job per user: the training's, not the cpu pool's 4 too.
    done = workflow(
        "--run-dir", str(tmp_path / "run"), "--train-nodes", "8", "--queue", "debug-scaling"
    )
    assert done.returncode != 0 and not (tmp_path / "run").exists()
    (line,) = done.stderr.strip().splitlines()
    assert line.endswith(
        "queue 'debug-scaling' holds at most 1 job queued or running and the plan may have 5 "
        "there (training 1, cpu 4); give --cpu-queue one that holds 4 jobs of the cpu pool: "
        "debug (1-2 nodes, <= 01:00:00), preemptable (1-10 nodes, <= 72:00:00, <= 20 jobs)"
    ), line
    # As it says: the cpu pool's jobs in debug.
    fits = workflow(
        "--run-dir",
        str(tmp_path / "run"),
        "--train-nodes",
        "8",
        "--queue",
        "debug-scaling",
        "--cpu-queue",
        "debug",
    )
    assert fits.returncode == 0, fits.stderr


@pytest.mark.parametrize(
    "changes, message",
    [
        # capacity holds 2 jobs queued or running: not the cpu pool's 4.
        (
            {"cpu_queue": "capacity"},
            "queue 'capacity' holds at most 2 jobs queued or running and the plan may have 4 "
            "there; give another --cpu-queue: debug (1-2 nodes, <= 01:00:00), preemptable",
        ),
        # A training of 10 nodes goes to prod, which takes no 1-node job: the queues named for the
        # cpu pool are those that take 1-node jobs and hold its 4.
        (
            {"train_nodes": 10, "queue": "prod"},
            "queues that fit: debug (1-2 nodes, <= 01:00:00), preemptable (1-10 nodes, <= "
            "72:00:00, <= 20 jobs); give another --cpu-queue",
        ),
    ],
)
def test_nothing_is_submitted_that_a_polaris_queue_cannot_hold(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        for_run(polaris.SITE, **changes)


def test_plans_the_queues_hold():
    for changes in (
        {},  # debug: both pools
        {"train_nodes": 8, "queue": "debug-scaling", "cpu_queue": "debug"},
        {"train_nodes": 10, "queue": "prod", "cpu_queue": "preemptable"},
        {"train_nodes": 128, "queue": "prod", "cpu_queue": "debug"},
    ):
        assert for_run(polaris.SITE, **changes)


# ---- through the stand-in PBS Pro: each worker on its GPU and its CPUs ----


@python_app(executors=[CPU_LABEL])
def worker_placement(seconds: float):
    """Where a cpu worker runs: its GPU, CPUs and threads (held a while, so that two such tasks
    run on two workers)."""
    import os
    import time

    time.sleep(seconds)
    return (
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        sorted(os.sched_getaffinity(0)),
        os.environ.get("OMP_NUM_THREADS"),
    )


def test_through_the_stand_in_pbs_each_worker_takes_its_gpu_and_the_cpus_paired_with_it(
    tmp_path,
    fake_scheduler,  # noqa: F811
    leftovers,  # noqa: F811
):
    here = sorted(os.sched_getaffinity(0))
    if len(here) < 2:
        pytest.skip("one CPU here: two workers cannot each have their own")
    pbs = fake_scheduler("pbspro")
    # Two workers a node, as Polaris pairs them: worker 0 (GPU 0) on the last CPU, worker 1 on
    # the first, the order of ALCF's list.
    paired = f"list:{here[1]}:{here[0]}"
    site = dataclasses.replace(
        small(polaris.SITE, pbs), cpu_workers_per_node=2, gpus_per_node=2, cpu_affinity=paired
    )
    with parsl.load(polaris.make_config(tmp_path / "run", site)):
        tasks = [worker_placement(3.0) for _ in range(2)]
        try:
            placed = sorted(task.result(timeout=TASK_TIMEOUT) for task in tasks)
        except Exception as err:
            raise AssertionError(f"{err!r}\n{pbs.job_output()}") from err
    assert placed == [("0", [here[1]], "1"), ("1", [here[0]], "1")]
    assert site.cpu_threads_per_worker == 1
    assert pbs.live_jobs() == [] and leftovers() == []
