"""Site configs (site_configs/): what each site's Parsl Config contains, how `--site` finds a
module, and real submissions: on this machine, and through stand-in PBS Pro, Cobalt and Slurm
tools (tests/fake_scheduler/) that run the generated job scripts here, so the submit script, the
launcher line and the worker start-up all run end to end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import parsl
import psutil
import pytest
from parsl import bash_app, python_app
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.jobs.states import JobState
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, PBSProProvider, SlurmProvider

import site_configs
from apps.execute import execute
from apps.plan.dag import checkpoints_within
from apps.plan.describe import describe_dag
from apps.plan.resolved import resolve_plan
from pipeline.core.errors import ConfigError
from pipeline.run.run_layout import RunPaths
from site_configs import (
    CPU_LABEL,
    MPI_LABEL,
    QueueLimit,
    SiteSpec,
    base,
    describe,
    dry_run,
    known_sites,
    load_site,
    parsl_config,
    spec,
    teardown,
)
from site_configs.cobalt import CobaltProvider
from site_configs.launch import expanded_launch_line

FAKE_SCHEDULER = Path(__file__).parents[1] / "fake_scheduler"
VENV = Path(sys.prefix)
TASK_TIMEOUT = 300  # seconds for a task, the block's start-up included (a minute or more on a slow 2-core machine)

# What each site module must build: the "mpi" executor, its provider, the MPI launcher.
EXPECTED = {
    "aurora": (MPIExecutor, PBSProProvider, "mpiexec"),
    "local": (MPIExecutor, LocalProvider, "mpiexec"),
    "perlmutter": (MPIExecutor, SlurmProvider, "srun"),
    "polaris": (MPIExecutor, PBSProProvider, "mpiexec"),
    "slurm": (MPIExecutor, SlurmProvider, "srun"),
    "theta": (HighThroughputExecutor, CobaltProvider, None),  # aprun called by the app itself
}


def submittable(site: SiteSpec, **changes) -> SiteSpec:
    """The site with its "YOUR_..." placeholders filled in, as a user would."""
    filled = {name: f"test_{name}" for name in site.placeholders}
    return dataclasses.replace(site, **{**filled, **changes})


def executors(config) -> dict:
    return {e.label: e for e in config.executors}


# ---- every site's Config, built without a scheduler ----


def test_the_six_sites_are_known():
    assert known_sites() == ["aurora", "local", "perlmutter", "polaris", "slurm", "theta"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_site_config_has_mpi_and_cpu_pools_on_the_sites_provider(name, tmp_path):
    module = load_site(name)
    site = submittable(module.SITE)
    config = module.make_config(tmp_path / "run", site)
    mpi_class, provider_class, mpi_launcher = EXPECTED[name]

    pools = executors(config)
    assert set(pools) == {MPI_LABEL, CPU_LABEL}
    mpi, cpu = pools[MPI_LABEL], pools[CPU_LABEL]
    assert type(mpi) is mpi_class and type(cpu) is HighThroughputExecutor
    assert type(mpi.provider) is provider_class and type(cpu.provider) is provider_class
    # One worker pool per MPI block (MPIExecutor requires it); the pool launches the ranks.
    assert isinstance(mpi.provider.launcher, SimpleLauncher)
    assert type(cpu.provider.launcher).__name__ == dry_run.CPU_LAUNCHER_FOR[site.scheduler]
    if mpi_launcher:
        assert mpi.mpi_launcher == mpi_launcher
        assert mpi.max_workers_per_block == site.mpi_tasks_per_block
    assert mpi.provider.nodes_per_block == site.nodes_per_block
    assert cpu.provider.nodes_per_block == site.cpu_nodes_per_block
    assert mpi.provider.max_blocks == site.max_blocks
    if site.scheduler != "local":
        assert mpi.provider.walltime == cpu.provider.walltime == site.walltime
    # Every job activates the venv before Parsl starts a worker pool.
    for pool in (mpi, cpu):
        assert f"source {VENV}/bin/activate" in pool.provider.worker_init
        assert site.worker_init in pool.provider.worker_init
    # Two malloc arenas in cpu workers (their memory stays bounded), glibc's default in training.
    assert "export MALLOC_ARENA_MAX=2" in cpu.provider.worker_init.splitlines()
    assert "MALLOC_ARENA_MAX" not in mpi.provider.worker_init
    # describe() (for --dry-run) names what was built.
    text = describe(site)
    assert type(mpi.provider).__name__ in text
    assert type(cpu.provider.launcher).__name__ in text
    assert "MALLOC_ARENA_MAX=2" in text


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_site_shares_run_dir_retries_and_monitoring(name, tmp_path):
    module = load_site(name)
    run_dir = tmp_path / "run"
    config = module.make_config(run_dir, submittable(module.SITE))

    assert config.run_dir == str(run_dir.resolve() / "runinfo")
    # Stamps (pipeline.core.stamps) decide what is done, not Parsl's app cache.
    assert config.memoizer is None or not getattr(config.memoizer, "checkpoint_files", None)
    assert config.retries >= 1 and config.retry_handler is parsl_config.retry_cost
    assert config.monitoring.logging_endpoint == f"sqlite:///{run_dir.resolve()}/monitoring.db"
    assert config.monitoring.resource_monitoring_enabled is False  # low overhead by default
    assert config.strategy == "simple"
    assert config.strategy_period == module.SITE.strategy_period
    assert config.initialize_logging.level == logging.INFO  # not Parsl's DEBUG: 29 kB a task


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_pool_of_every_site_is_encrypted_and_ends_with_its_workflow(name, tmp_path):
    """Nobody else gets in: an interchange's ports take only a pool holding the run's CurveZMQ
    certificate (MPIExecutor's default is off), and interchange and pools are the project's,
    which end when their workflow is gone (pipeline/cli/interchange.py, worker_pool.py)."""
    module = load_site(name)
    config = module.make_config(tmp_path / "run", submittable(module.SITE))
    for executor in config.executors:
        assert executor.encrypted, executor.label
        assert executor.interchange_launch_cmd.endswith("/ffn-interchange"), executor.label
        assert executor.launch_cmd.startswith("ffn-worker-pool "), executor.label


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hpc_sites_cap_the_checkpoint_interval_a_lost_node_costs(name):
    """At scale a lost interval costs every node: the batch sites cap the training's seconds
    between checkpoints; a run that asks for less keeps its own; here the run decides."""
    from pipeline.run.run_config import RunConfig

    site = load_site(name).SITE
    config = RunConfig()
    asked = config.train.checkpoint_every_seconds
    capped = checkpoints_within(config, site).train.checkpoint_every_seconds
    if site.scheduler == "local":
        assert site.checkpoint_every_seconds is None and capped == asked
    else:
        assert capped == site.checkpoint_every_seconds == 300.0 < asked
        sooner = dataclasses.replace(config.train, checkpoint_every_seconds=120.0)
        kept = checkpoints_within(dataclasses.replace(config, train=sooner), site)
        assert kept.train.checkpoint_every_seconds == 120.0


@pytest.mark.parametrize("value", [0, -5.0, float("inf"), float("nan"), True, "300"])
def test_a_checkpoint_interval_cap_must_be_positive_seconds(value):
    with pytest.raises(ConfigError, match="checkpoint_every_seconds must be > 0 seconds or None"):
        dataclasses.replace(load_site("local").SITE, checkpoint_every_seconds=value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_run_that_does_not_train_gets_only_the_cpu_pool(name, tmp_path):
    module = load_site(name)
    config = module.make_config(tmp_path / "run", submittable(module.SITE))
    cpu_only = parsl_config.only_executors(config, {CPU_LABEL})

    assert [e.label for e in cpu_only.executors] == [CPU_LABEL]
    assert cpu_only.executors[0] is executors(config)[CPU_LABEL]
    kept = (
        "run_dir",
        "monitoring",
        "retries",
        "retry_handler",
        "strategy_period",
        "initialize_logging",
    )
    for setting in kept:
        assert getattr(cpu_only, setting) is getattr(config, setting)
    with pytest.raises(ConfigError, match="no executor labelled"):
        parsl_config.only_executors(config, {"gpu"})


def test_local_mpi_pool_gets_a_node_file_naming_this_machine(tmp_path):
    from site_configs import local

    config = local.make_config(tmp_path / "run")
    nodefile = (tmp_path / "run").resolve() / "localhost.nodes"
    assert f"export PBS_NODEFILE={nodefile}" in executors(config)[MPI_LABEL].provider.worker_init
    assert nodefile.read_text() == "localhost\n"
    assert "PBS_NODEFILE" not in executors(config)[CPU_LABEL].provider.worker_init


# The local site in a process that may use one CPU of the machine: one task on the CPU pool.
ONE_CPU_RUN = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import parsl
from parsl import python_app
from site_configs import local
from site_configs.base import CPU_LABEL

print(local.SITE.cpu_workers_per_node, flush=True)
parsl.load(local.make_config(sys.argv[1]))
try:
    print(python_app(lambda: "ran", executors=[CPU_LABEL])().result(timeout=60), flush=True)
finally:
    parsl.dfk().cleanup()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to take one away")
def test_local_site_runs_where_the_process_may_use_fewer_cpus_than_the_machine_has(tmp_path):
    """Under taskset, a container's or a batch job's cpuset, one worker per CPU of the machine
    left Parsl's block affinity a worker with no CPU: it failed to start, over and over, and the
    run waited forever (`taskset -c 1 make test` hung). One worker per CPU the process may use."""
    ran = subprocess.run(
        [sys.executable, "-c", ONE_CPU_RUN, str(tmp_path / "run")],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["1", "ran"]


def test_a_pipeline_error_is_not_retried_but_a_lost_worker_is():
    from parsl.executors.high_throughput.errors import WorkerLost

    from pipeline.core.errors import StageFailed, VolumeError

    assert parsl_config.retry_cost(VolumeError("x.h5:raw: NaN"), {}) == float("inf")
    assert parsl_config.retry_cost(
        StageFailed("training exited with code 2", retryable=False), {}
    ) == float("inf")
    assert parsl_config.retry_cost(StageFailed("training exited with code -9"), {}) == 1
    assert parsl_config.retry_cost(WorkerLost(1, "localhost"), {}) == 1


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("train_nodes", [0, 1, 2])
def test_the_nodes_a_training_job_requests_are_the_nodes_it_uses(name, train_nodes, tmp_path):
    from pipeline.run.run_config import RunConfig

    module = load_site(name)
    if name == "local" and train_nodes > 1:
        with pytest.raises(ConfigError, match="train_nodes 2: .*one node"):
            spec.for_run(module.SITE, train_nodes=train_nodes)
        return
    site = submittable(spec.for_run(module.SITE, train_nodes=train_nodes))
    config = RunConfig(train_nodes=train_nodes)
    plan = describe_dag(resolve_plan(config, RunPaths(tmp_path), site))
    used = int(re.search(r"train +\d+ rank\(s\) on (\d+) node", plan)[1])
    assert f"training on {used} node(s)" in plan
    requested = module.make_config(tmp_path / "run", site)
    assert executors(requested)[MPI_LABEL].provider.nodes_per_block == used
    assert used == (train_nodes or module.SITE.nodes_per_block)


@pytest.mark.parametrize("name", ["polaris", "slurm", "theta"])
def test_placeholder_account_is_refused_but_described(name, tmp_path):
    module = load_site(name)
    assert module.SITE.account == "YOUR_ALLOCATION"
    with pytest.raises(ConfigError, match="YOUR_ALLOCATION.*placeholder.*--dry-run"):
        module.make_config(tmp_path / "run")
    assert "YOUR_ALLOCATION  <- placeholder" in describe(module.SITE)  # --dry-run still works


def test_a_site_module_refuses_another_schedulers_site(tmp_path):
    from site_configs import polaris, slurm

    with pytest.raises(ConfigError, match="scheduler 'slurm'"):
        polaris.make_config(tmp_path / "run", submittable(slurm.SITE))


# ---- the launch contract of the training app ----


def test_local_training_launch_uses_parsl_mpi_prefix():
    from site_configs import local

    launch = local.SITE.mpi_launch()
    assert launch.executor == MPI_LABEL
    assert launch.prefix == "$PARSL_MPI_PREFIX"
    assert launch.resource_specification == {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2}
    assert launch.command("python -m pipeline.cli.train") == (
        "export OMP_NUM_THREADS=1; export FFN_GPU_ORDER=local_rank; "
        "$PARSL_MPI_PREFIX python -m pipeline.cli.train"
    )
    # What --dry-run shows is what Parsl's MPI mode will compose for the block's nodes.
    assert "mpiexec -n 2 -ppn 2 -hosts <node0> python -m pipeline.cli.train" in describe(local.SITE)


def test_polaris_training_launch_binds_ranks_by_depth():
    from site_configs import polaris

    launch = polaris.SITE.mpi_launch(2)
    assert launch.num_ranks == 8 and launch.threads_per_rank == 8
    assert launch.resource_specification == {
        "num_nodes": 2,
        "ranks_per_node": 4,
        "num_ranks": 8,
        "launcher_options": "--cpu-bind depth --depth=8",
    }
    assert "mpiexec -n 8 -ppn 4 -hosts <node0>,<node1> --cpu-bind depth --depth=8" in describe(
        polaris.SITE
    )


def test_theta_training_launch_is_a_complete_aprun_line():
    from site_configs import theta

    launch = theta.SITE.mpi_launch(4)
    assert launch.prefix == "aprun -n 4 -N 1 -d 64 -j 1 --cc depth -e OMP_NUM_THREADS=64"
    assert launch.resource_specification == {}  # HTEX without MPI mode takes no MPI keys


def test_a_training_task_cannot_span_blocks():
    from site_configs import slurm

    with pytest.raises(ConfigError, match="cannot span blocks"):
        slurm.SITE.mpi_launch(slurm.SITE.nodes_per_block + 1)


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "polaris",
            "export OMP_NUM_THREADS=8; export FFN_GPU_ORDER=reverse; "
            "mpiexec -n 8 -ppn 4 -hosts <node0>,<node1> --cpu-bind depth --depth=8 python -m x",
        ),
        (
            "slurm",  # PMIx starts the ranks of an OpenMPI-built Horovod as one world
            "export OMP_NUM_THREADS=32; export FFN_GPU_ORDER=local_rank; "
            "srun --ntasks 8 --ntasks-per-node 4 --nodelist <node0>,<node1> --nodes 2 "
            "--cpus-per-task=64 --cpu-bind=cores --mpi=pmix python -m x",
        ),
        (
            "theta",  # complete already: the app calls aprun itself
            "export OMP_NUM_THREADS=64; export FFN_GPU_ORDER=local_rank; "
            "aprun -n 8 -N 1 -d 64 -j 1 --cc depth -e OMP_NUM_THREADS=64 python -m x",
        ),
    ],
)
def test_the_launch_line_shown_is_what_parsl_composes_for_the_jobs_nodes(name, expected):
    site = load_site(name).SITE
    launch = site.mpi_launch()
    assert expanded_launch_line(site, launch, launch.command("python -m x")) == expected


def test_polaris_ranks_take_the_gpus_in_alcfs_reverse_order():
    from pipeline.network.devices import gpu_for_rank, gpu_order
    from site_configs import local, polaris

    exported = polaris.SITE.mpi_launch().env  # what the launch line gives every rank
    assert [gpu_for_rank(rank, 4, gpu_order(exported)) for rank in range(4)] == [3, 2, 1, 0]
    assert gpu_order(local.SITE.mpi_launch().env) == "local_rank"


# ---- queues and walltimes ----

PROD_SIZES = "10-24 nodes, <= 03:00:00; 25-99 nodes, <= 06:00:00; 100-496 nodes, <= 24:00:00"
PROD = f"prod ({PROD_SIZES})"  # a routing queue: the longest walltime grows with the size


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "polaris",
            {"train_nodes": 128},
            "train_nodes 128: site 'polaris': a training job of 128 nodes for 01:00:00 does not "
            "fit queue 'debug' (1-2 nodes, <= 01:00:00); queues that fit: prod (100-496 nodes, "
            "<= 24:00:00); give another --queue, or --train-nodes that the queue takes",
        ),
        (
            "theta",
            {"train_nodes": 128},
            "a training job of 128 nodes for 01:00:00 does not fit queue 'debug-cache-quad' (1-8 "
            "nodes, <= 01:00:00); queues that fit: default (128-255 nodes, <= 03:00:00)",
        ),
        (
            "polaris",  # prod takes no job under 10 nodes: the cpu pool needs a queue of its own
            {"train_nodes": 128, "queue": "prod"},
            f"a cpu job of 1 node for 01:00:00 does not fit queue 'prod' ({PROD_SIZES}); queues "
            "that fit: debug (1-2 nodes, <= 01:00:00), preemptable (1-10 nodes, <= 72:00:00, <= "
            "20 jobs); give another --cpu-queue",  # not debug-scaling, capacity: 4 jobs at once
        ),
        (
            "polaris",
            {"walltime": "02:00:00"},
            "a training job of 2 nodes for 02:00:00 does not fit queue 'debug' (1-2 nodes, <= "
            "01:00:00); queues that fit: preemptable (1-10 nodes, <= 72:00:00, <= 20 jobs), or "
            "with a --cpu-queue of its own: capacity (1-4 nodes, <= 168:00:00, <= 2 jobs); give "
            "a shorter --walltime or another --queue",
        ),
        (
            "polaris",  # prod routes 16 nodes to small: 3 h at most
            {
                "train_nodes": 16,
                "queue": "prod",
                "walltime": "06:00:00",
                "cpu_queue": "preemptable",
            },
            f"a training job of 16 nodes for 06:00:00 does not fit queue 'prod' ({PROD_SIZES}); "
            "queues that fit: none; give a shorter --walltime",
        ),
        (
            "polaris",
            {"cpu_walltime": "02:00:00"},
            "a cpu job of 1 node for 02:00:00 does not fit queue 'debug'",
        ),
    ],
)
def test_a_job_its_queue_does_not_take_is_refused_naming_the_queues_that_would(
    name, changes, message
):
    with pytest.raises(ConfigError) as refused:
        spec.for_run(load_site(name).SITE, **changes)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_run_changes_nodes_queues_and_walltimes_in_one_check(tmp_path):
    """Each change alone is refused (128 nodes in debug, 1-node cpu jobs in prod, 12 h in
    debug); together they fit, and each pool's jobs get their own queue and walltime."""
    from site_configs import polaris

    for alone in ({"train_nodes": 128}, {"queue": "prod"}, {"walltime": "12:00:00"}):
        with pytest.raises(ConfigError, match="does not fit queue"):
            spec.for_run(polaris.SITE, **alone)
    site = spec.for_run(
        polaris.SITE,
        train_nodes=128,
        account="abc123",
        queue="prod",
        walltime="12:00:00",
        cpu_queue="preemptable",
        cpu_walltime="02:00:00",
    )
    pools = executors(polaris.make_config(tmp_path / "run", site))
    mpi, cpu = pools[MPI_LABEL].provider, pools[CPU_LABEL].provider
    assert (mpi.nodes_per_block, mpi.queue, mpi.walltime) == (128, "prod", "12:00:00")
    assert (cpu.nodes_per_block, cpu.queue, cpu.walltime) == (1, "preemptable", "02:00:00")
    assert mpi.account == cpu.account == "abc123"
    text = describe(site)  # --dry-run: both pools' walltimes, and their queues' limits
    assert f"    batch jobs of 12:00:00 in queue {PROD}" in text.splitlines()
    assert (
        "    batch jobs of 02:00:00 in queue preemptable (1-10 nodes, <= 72:00:00, <= 20 jobs)"
        in text
    )


def test_a_queue_the_site_does_not_list_is_not_checked():
    from site_configs import polaris, slurm

    reservation = spec.for_run(polaris.SITE, train_nodes=128, queue="R123456")
    assert reservation.nodes_per_block == 128
    assert "queue R123456 (limits not in the site's queue_limits)" in describe(reservation)
    assert slurm.SITE.queue_limits == ()  # partitions differ per cluster: a user adds theirs
    assert spec.for_run(slurm.SITE, train_nodes=64, walltime="48:00:00").nodes_per_block == 64


def test_dry_run_shows_each_pools_walltime_the_sites_queues_and_no_checkpoint_folder():
    from site_configs import polaris

    text = describe(spec.for_run(polaris.SITE, cpu_walltime="00:20:00"))
    mpi, cpu = text.split('executor "cpu"')
    assert "    batch jobs of 01:00:00 in queue debug (1-2 nodes, <= 01:00:00)" in mpi
    assert "    batch jobs of 00:20:00 in queue debug (1-2 nodes, <= 01:00:00)" in cpu
    assert (
        "  the site's queues: debug (1-2 nodes, <= 01:00:00), debug-scaling (1-10 nodes, "
        f"<= 01:00:00, <= 1 job), {PROD}, preemptable (1-10 nodes, <= 72:00:00, <= 20 jobs), "
        "capacity (1-4 nodes, <= 168:00:00, <= 2 jobs)"
    ) in text.splitlines()
    assert "4 GPU(s) per node, GPU order reverse" in text
    # The Config sets no checkpoint_mode, so Parsl makes no checkpoint folder to point at.
    assert "checkpoint" not in text
    assert "$PARSL_MPI_PREFIX" not in text


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ranks_per_node": 3}, "ranks_per_node 3 > 2 hardware threads"),
        ({"threads_per_rank": 2}, "threads_per_rank 2 > 1"),
        ({"walltime": "2h"}, "walltime '2h' is not HH:MM:SS"),
        ({"mpi_launcher": "srun"}, "does not work with scheduler 'local'"),
        ({"launcher_options": "--bind {cores_per_rank}"}, "unknown field 'cores_per_rank'"),
        ({"nodes_per_block": 2}, "the local scheduler has one node"),
        ({"max_blocks": 0}, "max_blocks must be a whole number >= 1"),
        ({"cpu_workers_per_node": 3}, "cpu_workers_per_node 3 > 2"),
        ({"account": ""}, "account must be a non-empty string"),
        ({"strategy_period": 0}, "strategy_period must be in"),
        ({"parsl_log_level": "VERBOSE"}, "parsl_log_level 'VERBOSE' is not one of DEBUG, INFO"),
        ({"cpu_walltime": "20m"}, "cpu_walltime '20m' is not HH:MM:SS"),
        ({"cpu_queue": " "}, "cpu_queue must be a non-empty string or None"),
        ({"gpu_order": "numa"}, "gpu_order 'numa' is not one of local_rank, reverse"),
        ({"queue_limits": [QueueLimit("q", 1, 2, "01:00:00")]}, "queue_limits must be a tuple"),
    ],
)
def test_site_spec_rejects_inconsistent_settings(changes, message):
    site = SiteSpec(
        name="t", scheduler="local", mpi_launcher="mpiexec", ranks_per_node=2, cores_per_node=2
    )
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(site, **changes)


@pytest.mark.parametrize(
    "limit, message",
    [
        (("", 1, 2, "01:00:00"), "name must be a non-empty string"),
        (("q", 0, 2, "01:00:00"), "node counts must be whole numbers >= 1, got 0"),
        (("q", 3, 2, "01:00:00"), "min_nodes 3 > max_nodes 2"),
        (("q", 1, 2, "1h"), "max_walltime '1h' is not HH:MM:SS"),
    ],
)
def test_queue_limit_rejects_inconsistent_settings(limit, message):
    with pytest.raises(ConfigError, match=message):
        QueueLimit(*limit)


# ---- --site: a name or a path ----


def test_load_site_by_name():
    assert load_site("polaris") is site_configs.polaris


def test_load_site_by_path_to_a_users_module(tmp_path):
    path = tmp_path / "my_laptop.py"
    path.write_text(
        "from dataclasses import replace\n"
        "from site_configs import local\n"
        "SITE = replace(local.SITE, name='my-laptop', cpu_workers_per_node=1)\n"
        "def make_config(run_dir, site=None):\n"
        "    return local.make_config(run_dir, site or SITE)\n"
    )
    module = load_site(str(path))
    assert module.SITE.name == "my-laptop"
    config = module.make_config(tmp_path / "run")
    assert executors(config)[CPU_LABEL].max_workers_per_node == 1


# Every name site_configs.base held before it was split by what each part does (spec, checks,
# queues, launch, pools, parsl_config, teardown, dry_run): a user's site module may import any.
BASE_NAMES = (
    "CLEANUP_AFTER_INTERCHANGE_S",
    "CPU_LABEL",
    "CPU_LAUNCHER_FOR",
    "CPU_WORKER_ENV",
    "HEARTBEATS",
    "INTERCHANGE_CMD",
    "LAUNCHERS_FOR",
    "LAUNCHER_OPTION_FIELDS",
    "MPILaunch",
    "MPI_LABEL",
    "MPI_PREFIX",
    "MpiLauncher",
    "PARSL_LOG_LEVELS",
    "PLACEHOLDER_PREFIX",
    "PROVIDER_FOR",
    "QueueLimit",
    "Scheduler",
    "SiteSpec",
    "build_config",
    "check_scheduler",
    "child_pids",
    "cpu_worker_init",
    "describe",
    "describe_queues",
    "expanded_launch_line",
    "for_run",
    "monitoring_db",
    "only_executors",
    "retry_cost",
    "runinfo_dir",
    "shutdown",
    "stop_failed_start",
    "venv_path",
    "walltime_seconds",
    "worker_init",
)

OLD_STYLE_SITE = """
from parsl.executors import HighThroughputExecutor
from parsl.providers import LocalProvider

from site_configs import base
from site_configs.base import CPU_LABEL, MPI_LABEL, SiteSpec

SITE = SiteSpec(name="old-style", scheduler="local", mpi_launcher="mpiexec")


def make_config(run_dir, site=None):
    site = site or SITE
    base.check_scheduler(site, "local", "old_style")
    site.require_submittable()
    pools = ((MPI_LABEL, base.worker_init), (CPU_LABEL, base.cpu_worker_init))
    return base.build_config(run_dir, site, [
        HighThroughputExecutor(
            label=label,
            interchange_launch_cmd=base.INTERCHANGE_CMD,
            **base.HEARTBEATS,
            provider=LocalProvider(init_blocks=0, min_blocks=0, max_blocks=1, worker_init=init(site)),
        )
        for label, init in pools
    ])
"""


def test_a_site_module_written_against_base_still_works(tmp_path):
    """base re-exports each name it held, the very object its new module holds; a user's site
    module built on base's helpers makes a Config with every site's shared parts."""
    import importlib

    assert sorted(base.__all__) == sorted(BASE_NAMES)
    parts = [
        importlib.import_module(f"site_configs.{name}")
        for name in ("spec", "checks", "queues", "launch", "pools", "parsl_config", "teardown")
    ] + [dry_run]
    for name in BASE_NAMES:
        assert any(getattr(part, name, None) is getattr(base, name) for part in parts), name
    path = tmp_path / "old_style.py"
    path.write_text(OLD_STYLE_SITE)
    module = load_site(str(path))
    run_dir = tmp_path / "run"
    config = module.make_config(run_dir)
    pools = executors(config)
    assert set(pools) == {MPI_LABEL, CPU_LABEL}
    assert config.run_dir == str(run_dir.resolve() / "runinfo")
    assert config.retry_handler is parsl_config.retry_cost
    assert "export MALLOC_ARENA_MAX=2" in pools[CPU_LABEL].provider.worker_init.splitlines()
    assert base.describe(module.SITE) == describe(module.SITE)


def test_load_site_unknown_name_lists_the_known_sites():
    with pytest.raises(
        ConfigError,
        match="unknown site; known sites: aurora, local, perlmutter, polaris, slurm, theta",
    ):
        load_site("summit")


@pytest.mark.parametrize(
    "source, message",
    [
        ("SITE = None\n", "no make_config"),
        ("def make_config(run_dir, site=None): ...\n", "no SITE"),
    ],
)
def test_load_site_module_must_define_site_and_make_config(tmp_path, source, message):
    path = tmp_path / "broken_site.py"
    path.write_text(source)
    with pytest.raises(ConfigError, match=message):
        load_site(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        load_site(str(tmp_path / "missing.py"))


# ---- real submissions ----


class FakeScheduler:
    """One flavour of tests/fake_scheduler on PATH, with its records in `state`."""

    def __init__(self, flavour: str, state: Path, venv: Path):
        self.flavour, self.state, self.venv = flavour, state, venv

    def calls(self, tool: str) -> list[list[str]]:
        path = self.state / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [c["argv"] for c in map(json.loads, lines) if c["tool"] == tool]

    def jobs(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.state.glob("jobs/*.json"))]

    def live_jobs(self) -> list[str]:
        return [j["id"] for j in self.jobs() if session_processes(j["sid"])]

    def job_output(self) -> str:
        """Every job's stdout and stderr, to explain a failed test."""
        parts = []
        for job in self.jobs():
            for key in ("stdout", "stderr"):
                path = Path(job[key])
                text = path.read_text()[-3000:] if path.exists() else "(none)"
                parts.append(f"--- job {job['id']} {key} ---\n{text}")
        return "\n".join(parts)


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def describe_process(proc: psutil.Process) -> str | None:
    """The "pid: command line" of a live process; None for a zombie or one already gone."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"{proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.NoSuchProcess:
        return None


def is_resource_tracker(proc: psutil.Process) -> bool:
    """Python's multiprocessing helper: one per interpreter, started with the first spawned
    queue (monitoring's) and meant to live as long as the interpreter; not a leak."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def leftovers(tmp_path):
    """`leftovers()` lists, after waiting up to 20 s for them to end, the processes the test
    started: children of this process that were not there before (interchanges, monitoring) and
    any process naming the test's tmp dir (worker pools, job scripts, however detached)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def still_running() -> list[str]:
        started = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and not is_resource_tracker(p)
        ]
        naming = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])
        ]
        return sorted({d for p in started + naming if (d := describe_process(p))})

    def wait() -> list[str]:
        deadline = time.time() + 20
        while (left := still_running()) and time.time() < deadline:
            time.sleep(0.25)
        return left

    return wait


def test_a_parsl_start_that_fails_half_way_stops_what_it_started(tmp_path, leftovers, monkeypatch):
    """An executor that cannot start, after the monitoring and both pools' interchanges have: the
    run ends with the error and leaves nothing running (before, they kept it from exiting), but
    a process of the caller's own, started before, keeps running."""
    from parsl.executors import ThreadPoolExecutor

    from apps import execute as execution  # the module `execute` looks executor_labels up in
    from site_configs import local

    class Unstartable(ThreadPoolExecutor):
        def start(self):
            raise RuntimeError("this executor cannot start")

    def with_unstartable(run_dir, site, executors):
        return build_config(run_dir, site, [*executors, Unstartable(label="unstartable")])

    def load_and_look(config):
        try:
            return load(config)
        except RuntimeError:
            running.extend(psutil.Process().children(recursive=True))
            raise

    build_config, load, running = parsl_config.build_config, parsl.load, []
    monkeypatch.setattr(parsl_config, "build_config", with_unstartable)
    monkeypatch.setattr(parsl, "load", load_and_look)
    # A run whose tasks use every pool, the one that cannot start included.
    monkeypatch.setattr(
        execution, "executor_labels", lambda *_: {MPI_LABEL, CPU_LABEL, "unstartable"}
    )
    callers_own = subprocess.Popen(["sleep", "300"])
    try:
        with pytest.raises(RuntimeError, match="cannot start"):
            execute([], {}, local, local.SITE, RunPaths(tmp_path / "run"))
        assert len(running) >= 3  # the interchanges and the monitoring were running when it failed
        assert callers_own.poll() is None  # not Parsl's: spared
        callers_own.kill()
        callers_own.wait()
        assert leftovers() == []  # Parsl's are stopped
    finally:
        callers_own.kill()


@pytest.fixture
def fake_scheduler(tmp_path, monkeypatch):
    """Put one flavour's stand-in tools first on PATH; afterwards kill whatever a failed test
    left running (the test itself checks that nothing was left)."""
    made: list[FakeScheduler] = []

    def use(flavour: str) -> FakeScheduler:
        state = tmp_path / "scheduler"
        tools = str(FAKE_SCHEDULER / flavour)
        monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_SCHED_DIR", str(state))
        monkeypatch.setenv("FAKE_SCHED_PYTHON", sys.executable)
        monkeypatch.setenv("FAKE_REAL_MPIEXEC", str(VENV / "bin" / "mpiexec"))
        # A compute node's default PATH: the site's tools and the system, not the venv.
        monkeypatch.setenv("FAKE_SITE_PATH", f"{tools}{os.pathsep}/usr/local/bin:/usr/bin:/bin")
        # The site's venv for the jobs: ours, with the site's tools first again after activation,
        # as on the real machines, whose venvs hold no mpiexec (ours has the mpich wheel's).
        venv = tmp_path / "site_venv"
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "activate").write_text(
            f"source {VENV}/bin/activate\nexport PATH={tools}{os.pathsep}$PATH\n"
        )
        made.append(FakeScheduler(flavour, state, venv))
        return made[-1]

    yield use
    for scheduler in made:
        for job in scheduler.jobs():
            for proc in session_processes(job["sid"]):
                proc.kill()


@pytest.mark.parametrize(
    "flavour, make_provider",
    [
        ("pbspro", lambda: PBSProProvider(launcher=SimpleLauncher(), queue="debug")),
        ("cobalt", lambda: CobaltProvider(launcher=SimpleLauncher(), queue="debug-cache-quad")),
        ("slurm", lambda: SlurmProvider(launcher=SimpleLauncher(), partition="debug")),
    ],
)
def test_provider_submits_polls_and_cancels_through_the_stand_in_tools(
    flavour, make_provider, tmp_path, fake_scheduler
):
    """The stand-in tools answer in the formats the providers parse (CobaltProvider is ours)."""
    sched = fake_scheduler(flavour)
    provider = make_provider()  # after the PATH change: SlurmProvider probes sacct when built
    provider.script_dir = str(tmp_path)

    sleeper = provider.submit("sleep 60", 1, "sleeper")
    assert [s.state for s in provider.status([sleeper])] == [JobState.RUNNING]
    assert provider.cancel([sleeper]) == [True]
    assert provider.status([sleeper])[0].terminal
    assert sched.live_jobs() == []

    quick = provider.submit("echo done", 1, "quick")
    deadline = time.time() + 10
    while not provider.status([quick])[0].terminal and time.time() < deadline:
        time.sleep(0.2)
    assert provider.status([quick])[0].state == JobState.COMPLETED
    assert "done" in Path(provider.resources[quick]["job_stdout_path"]).read_text()


SUBMIT_TOOL = {"pbspro": "qsub", "cobalt": "qsub", "slurm": "sbatch"}


def submitted_jobs(config, scheduler: FakeScheduler, script_dir: Path) -> dict[str, tuple]:
    """Submit a job of `true` through each pool's provider and cancel it: per pool label, the
    arguments the stand-in qsub/sbatch received and the job script."""
    jobs = {}
    for executor in config.executors:
        provider = executor.provider
        provider.script_dir = str(script_dir)
        provider.cancel([provider.submit("true", 1, executor.label)])
        argv = scheduler.calls(SUBMIT_TOOL[scheduler.flavour])[-1]
        jobs[executor.label] = (argv, Path(argv[-1]).read_text())
    assert scheduler.live_jobs() == []
    return jobs


def asked_walltime(flavour: str, argv: list[str], script: str) -> str:
    """A job's walltime as its scheduler was told it."""
    if flavour == "cobalt":
        return f"{argv[argv.index('-t') + 1]} min"
    if flavour == "slurm":
        minutes = re.search(r"^#SBATCH --time=(\d+)$", script, re.M)[1]
        return f"{minutes} min"
    return re.search(r"^#PBS -l walltime=(\S+)$", script, re.M)[1]


@pytest.mark.parametrize(
    "name, flavour, expected",
    [
        ("polaris", "pbspro", ("00:50:00", "00:20:00")),
        ("theta", "cobalt", ("50 min", "20 min")),
        ("slurm", "slurm", ("50 min", "20 min")),
    ],
)
def test_each_pools_jobs_ask_for_their_own_walltime(
    name, flavour, expected, tmp_path, fake_scheduler
):
    sched = fake_scheduler(flavour)
    module = load_site(name)
    site = spec.for_run(small(module.SITE, sched), walltime="00:50:00", cpu_walltime="00:20:00")
    jobs = submitted_jobs(module.make_config(tmp_path / "run", site), sched, tmp_path)
    assert (
        tuple(asked_walltime(flavour, *jobs[pool]) for pool in (MPI_LABEL, CPU_LABEL)) == expected
    )


def test_polaris_jobs_ask_for_polaris_nodes_one_chunk_per_node(tmp_path, fake_scheduler):
    """As ALCF's Polaris job scripts do: -l select=N:system=polaris, -l place=scatter."""
    from site_configs import polaris

    pbs = fake_scheduler("pbspro")
    jobs = submitted_jobs(
        polaris.make_config(tmp_path / "run", small(polaris.SITE, pbs)), pbs, tmp_path
    )
    for _, script in jobs.values():
        lines = script.splitlines()
        assert "#PBS -l select=1:ncpus=4:ngpus=4:system=polaris" in lines
        assert "#PBS -l place=scatter" in lines
        assert "#PBS -l filesystems=home:eagle" in lines  # the site's own options stay


def test_slurm_jobs_ask_for_the_sites_gpus(tmp_path, fake_scheduler):
    from site_configs import slurm

    sched = fake_scheduler("slurm")
    site = dataclasses.replace(small(slurm.SITE, sched), gpus_per_node=4)
    jobs = submitted_jobs(slurm.make_config(tmp_path / "run", site), sched, tmp_path)
    assert all("#SBATCH --gpus-per-node=4" in script.splitlines() for _, script in jobs.values())
    cpu_only = slurm.make_config(tmp_path / "cpu", small(slurm.SITE, sched))  # none asked for
    assert all(e.provider.gpus_per_node is None for e in cpu_only.executors)


# The apps the submission tests run. Workers import them from this module, so the tests put
# this folder on the workers' PYTHONPATH (WORKER_INIT), as a workflow's apps come from its venv.
WORKER_INIT = f"export PYTHONPATH={Path(__file__).parent}:{Path(__file__).parents[1]}"


@python_app(executors=[CPU_LABEL])
def product(a, b):
    return a * b


@python_app(executors=[CPU_LABEL])
def environment_variable(name):
    import os

    return os.environ.get(name)


@bash_app(executors=[MPI_LABEL])
def ranks(launch, program, parsl_resource_specification=None, stdout=None, stderr=None):
    """Run a Python program as the ranks of one multi-rank task, the way training runs."""
    return launch.command(f"python {program}")


# Each rank reports in one write(), so the ranks' lines cannot interleave.
MPI_RANK_PROGRAM = """import os
e = os.environ
os.write(1, f"rank {e['PMI_RANK']} of {e['PMI_SIZE']} threads {e['OMP_NUM_THREADS']} "
            f"gpus {e['FFN_GPU_ORDER']}\\n".encode())
"""
HOROVOD_PROGRAM = """import os
import horovod.tensorflow as hvd
hvd.init()
os.write(1, f"rank {hvd.rank()} size {hvd.size()}\\n".encode())
"""


def run_ranks(launch, program: str, out: Path):
    """Submit `program` as a multi-rank task; its output goes to out/ranks.out."""
    (out / "ranks.py").write_text(program)
    return ranks(
        launch,
        out / "ranks.py",
        parsl_resource_specification=launch.resource_specification,
        stdout=str(out / "ranks.out"),
        stderr=str(out / "ranks.err"),
    )


def run_two_tasks(config, site: SiteSpec, out: Path, describe_failure) -> list[str]:
    """Load the config, run 6*7 on the "cpu" pool and a 2-rank task on the "mpi" pool through
    the site's launch contract, clean up; returns the ranks' output lines."""
    launch = site.mpi_launch()  # the plan's node count: nodes_per_block / mpi_tasks_per_block
    with parsl.load(config):
        answer = product(6, 7)
        done = run_ranks(launch, MPI_RANK_PROGRAM, out)
        try:
            assert answer.result(timeout=TASK_TIMEOUT) == 42
            assert done.result(timeout=TASK_TIMEOUT) == 0
        except Exception as err:
            raise AssertionError(f"{err!r}\n{describe_failure()}") from err
    return sorted((out / "ranks.out").read_text().splitlines())


def small(site: SiteSpec, scheduler: FakeScheduler) -> SiteSpec:
    """The site shrunk to this 2-core machine (one node, 2 ranks of one thread), using the
    stand-in scheduler's venv."""
    return submittable(
        site,
        nodes_per_block=1,
        cpu_nodes_per_block=1,
        ranks_per_node=2,
        threads_per_rank=1,
        cores_per_node=2,
        hyperthreads_per_core=1,
        cpu_workers_per_node=1,
        cpu_affinity="block",  # a site's list of each worker's CPUs is for its own nodes
        worker_init=WORKER_INIT,  # no module system here
        monitoring=False,  # the local test covers monitoring
        venv=str(scheduler.venv),
    )


@pytest.mark.mpi
def test_polaris_submits_through_pbs_pro(tmp_path, fake_scheduler, leftovers):
    from site_configs import polaris

    pbs = fake_scheduler("pbspro")
    site = small(polaris.SITE, pbs)
    config = polaris.make_config(tmp_path / "run", site)

    lines = run_two_tasks(config, site, tmp_path, pbs.job_output)

    # Every rank sees the site's GPU order, exported by the launch line.
    assert lines == ["rank 0 of 2 threads 1 gpus reverse", "rank 1 of 2 threads 1 gpus reverse"]
    qsubs = pbs.calls("qsub")
    assert len(qsubs) == 2  # one job per pool
    assert all(q[:4] == ["-q", "debug", "-A", "test_account"] for q in qsubs)
    script = Path(qsubs[0][-1]).read_text()
    assert "#PBS -l select=1:ncpus=4:ngpus=4:system=polaris" in script  # the plan's nodes
    assert site.mpi_launch().num_nodes == 1
    assert "#PBS -l filesystems=home:eagle" in script
    # The cpu pool's worker pool went through PALS mpiexec, one per node, bound by depth;
    # the training ranks through $PARSL_MPI_PREFIX with the site's binding options.
    mpiexecs = [" ".join(c) for c in pbs.calls("mpiexec")]
    assert any("--cpu-bind none --depth=64 --ppn 1 -n 1 --hostfile" in c for c in mpiexecs)
    assert any(
        c.startswith("-n 2 -ppn 2 -hosts localhost --cpu-bind depth --depth=1 python ")
        for c in mpiexecs
    )
    assert sorted(q[0] for q in pbs.calls("qdel")) == sorted(j["id"] for j in pbs.jobs())
    assert pbs.live_jobs() == []
    assert leftovers() == []


@pytest.mark.mpi
def test_theta_submits_through_cobalt_with_aprun(tmp_path, fake_scheduler, leftovers):
    from site_configs import theta

    cobalt = fake_scheduler("cobalt")
    site = small(theta.SITE, cobalt)
    config = theta.make_config(tmp_path / "run", site)

    lines = run_two_tasks(config, site, tmp_path, cobalt.job_output)

    assert lines == [
        "rank 0 of 2 threads 1 gpus local_rank",
        "rank 1 of 2 threads 1 gpus local_rank",
    ]
    qsubs = cobalt.calls("qsub")
    assert len(qsubs) == 2
    for argv in qsubs:  # -n: the nodes the plan's training uses
        assert argv[:8] == ["-n", "1", "-t", "60", "-q", "debug-cache-quad", "-A", "test_account"]
        assert os.access(argv[-1], os.X_OK)  # Cobalt runs the script itself
    assert site.mpi_launch().num_nodes == 1
    apruns = [" ".join(c) for c in cobalt.calls("aprun")]
    # The cpu pool's worker pool on the compute node, and the training task's own aprun.
    assert any(c.startswith("-n 1 -N 1 -d 2 -j 1 --cc depth /bin/bash") for c in apruns)
    assert any(
        c.startswith("-n 2 -N 2 -d 1 -j 1 --cc depth -e OMP_NUM_THREADS=1 python") for c in apruns
    )
    assert sorted(q[0] for q in cobalt.calls("qdel")) == sorted(j["id"] for j in cobalt.jobs())
    assert cobalt.live_jobs() == []
    assert leftovers() == []


@pytest.mark.mpi
def test_slurm_submits_through_sbatch_with_srun(tmp_path, fake_scheduler, leftovers):
    from site_configs import slurm

    sched = fake_scheduler("slurm")
    site = small(slurm.SITE, sched)
    config = slurm.make_config(tmp_path / "run", site)

    lines = run_two_tasks(config, site, tmp_path, sched.job_output)

    assert lines == [
        "rank 0 of 2 threads 1 gpus local_rank",
        "rank 1 of 2 threads 1 gpus local_rank",
    ]
    assert len(sched.calls("sbatch")) == 2
    script = Path(sched.calls("sbatch")[0][-1]).read_text()
    assert "#SBATCH --partition=test_queue" in script
    assert "#SBATCH --account=test_account" in script
    assert "#SBATCH --nodes=1" in script and site.mpi_launch().num_nodes == 1  # asked = used
    sruns = [" ".join(c) for c in sched.calls("srun")]
    assert any(c.startswith("--ntasks 1 -l --cpus-per-task=2 --cpu-bind=cores bash") for c in sruns)
    assert any(
        c.startswith(
            "--ntasks 2 --ntasks-per-node 2 --nodelist localhost --nodes 1 "
            "--cpus-per-task=1 --cpu-bind=cores --mpi=pmix python"
        )
        for c in sruns
    )
    assert sorted(c[0] for c in sched.calls("scancel")) == sorted(j["id"] for j in sched.jobs())
    assert sched.live_jobs() == []
    assert leftovers() == []


def test_local_runs_an_app_with_monitoring_and_shutdown_leaves_no_worker(
    tmp_path, leftovers, monkeypatch
):
    from site_configs import local

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)  # the workers get it from the site
    run_dir = tmp_path / "run"
    config = local.make_config(run_dir, dataclasses.replace(local.SITE, worker_init=WORKER_INIT))
    dfk = parsl.load(config)
    try:
        assert product(6, 7).result(timeout=TASK_TIMEOUT) == 42
        assert environment_variable("MALLOC_ARENA_MAX").result(timeout=TASK_TIMEOUT) == "2"
        pools = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])
        ]
        assert pools, "the worker pool should be running"
    finally:
        teardown.shutdown(dfk)  # what apps/execute.py does, after a run or on SIGINT/SIGTERM
    with sqlite3.connect(run_dir / "monitoring.db") as db:
        names = db.execute("select task_func_name from task order by task_id").fetchall()
        assert names == [("product",), ("environment_variable",)]
    # Parsl's log at the site's level, INFO: task states, no DEBUG lines.
    log = (run_dir / "runinfo" / "000" / "parsl.log").read_text()
    assert " INFO: " in log and " DEBUG: " not in log
    # Gone at once: without the cancel, the pool would idle until its heartbeat timed out.
    assert not [p for p in pools if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers() == []


@pytest.mark.mpi
@pytest.mark.slow  # TensorFlow loads in both ranks: about 20-30 s on 2 cores
def test_local_runs_two_horovod_ranks_through_parsl_mpi_prefix(tmp_path, leftovers):
    from site_configs import local

    site = dataclasses.replace(local.SITE, worker_init=WORKER_INIT, monitoring=False)
    launch = site.mpi_launch(1)
    with parsl.load(local.make_config(tmp_path / "run", site)):
        done = run_ranks(launch, HOROVOD_PROGRAM, tmp_path)
        assert done.result(timeout=TASK_TIMEOUT) == 0, (tmp_path / "ranks.err").read_text()[-2000:]

    lines = sorted((tmp_path / "ranks.out").read_text().splitlines())
    assert lines == ["rank 0 size 2", "rank 1 size 2"]
    assert leftovers() == []
