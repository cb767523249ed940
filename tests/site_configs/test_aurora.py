"""`--site aurora` (site_configs/aurora.py) against ALCF's Aurora documentation, held here as the
pages print it, each with its source: the launch line a dry run prints for configs/paper.toml on
1, 8 and 128 nodes, the queues, the jobs' PBS lines and environment, the cpu pool's tiles; jobs
submitted through the stand-in PBS Pro (tests/fake_scheduler/) whose ranks each bind their own
XPU tile of a stand-in device list; the environment check of the XPU flavour; and the set-up's
GPU=xpu flavour (tools/setup_env.sh) with stand-in Pythons of a TensorFlow module.

The pages are docs.alcf.anl.gov's, whose source is github.com/argonne-lcf/user-guides (the file
named beside each), as read at its commit 7d04a3f91d5eaf6d731be6d267617c2e5cbe722e (2026-08-19).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import parsl
import pytest
from parsl.launchers import MpiExecLauncher
from test_environment import record, stand_in, stand_in_mpich
from test_environment import setup as setup_env
from test_site_configs import (  # noqa: F401 - fake_scheduler and leftovers are fixtures
    TASK_TIMEOUT,
    fake_scheduler,
    leftovers,
    ranks,
    small,
    submitted_jobs,
)

from pipeline.core.errors import ConfigError
from site_configs import CPU_LABEL, MPI_LABEL, aurora, known_sites, load_site, spec
from site_configs.environment import (
    EnvironmentRecord,
    check_environment,
    describe_environment,
    main,
    read_environment,
    write_environment,
)
from site_configs.launch import expanded_launch_line

ROOT = Path(__file__).parents[2]
PAPER = ROOT / "configs" / "paper.toml"

# ---- what ALCF's pages say, as they say it ----

# docs.alcf.anl.gov/aurora/data-science/frameworks/tensorflow/, "A simple job script"
# (docs/aurora/data-science/frameworks/tensorflow.md): the rank count, the binding, the launch.
TF_JOB_SCRIPT_LAUNCH = r"""
NNODES=`wc -l < $PBS_NODEFILE`
NRANKS_PER_NODE=12
let NRANKS=${NNODES}*${NRANKS_PER_NODE}
export CPU_BIND="verbose,list:2-8:10-16:18-24:26-32:34-40:42-48:54-60:62-68:70-76:78-84:86-92:94-100"
HOROVOD_THREAD_AFFINITY="4,12,20,28,36,44,56,64,72,80,88,96"
CCL_WORKER_AFFINITY="1,9,17,25,33,41,53,61,69,77,85,93"
mpiexec -np ${NRANKS} -ppn ${NRANKS_PER_NODE} \
--cpu-bind ${CPU_BIND} \
python path/to/application.py
"""
# The same script's environment ("This is a fix for running over 16 nodes", "CCL setup",
# "JOB LAUNCH"), every export line of it.
TF_JOB_SCRIPT_EXPORTS = r"""
export FI_CXI_DEFAULT_CQ_SIZE=131072
export FI_CXI_OFLOW_BUF_SIZE=8388608
export FI_CXI_CQ_FILL_PERCENT=20
export FI_LOG_LEVEL=warn
export FI_LOG_PROV=cxi
export MPIR_CVAR_ENABLE_GPU=0
export ITEX_FP32_MATH_MODE=TF32
export FI_CXI_DEFAULT_CQ_SIZE=131072
export FI_CXI_OVFLOW_BUF_SIZE=8388608
export FI_CXI_CQ_FILL_PERCENT=20
export FI_LOG_LEVEL=warn
export FI_LOG_PROV=cxi
export CCL_KVS_GET_TIMEOUT=600
export LD_LIBRARY_PATH=$CCL_ROOT/lib:$LD_LIBRARY_PATH
export CPATH=$CCL_ROOT/include:$CPATH
export LIBRARY_PATH=$CCL_ROOT/lib:$LIBRARY_PATH
export CCL_PROCESS_LAUNCHER=pmix
export CCL_ATL_TRANSPORT=mpi
export CCL_ALLREDUCE=topo
export CCL_ALLREDUCE_SCALEOUT=rabenseifner  # currently best allreduce algorithm at large scale
export CCL_BCAST=double_tree # currently best bcast algorithm at large scale
export CCL_KVS_MODE=mpi
export CCL_CONFIGURATION_PATH=""
export CCL_CONFIGURATION=cpu_gpu_dpcpp
export CCL_KVS_CONNECTION_TIMEOUT=600
export CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD=1024
export CCL_KVS_USE_MPI_RANKS=1
export CCL_LOG_LEVEL="WARN"
"""
# What the site leaves out of it, and why (site_configs/aurora.py, TRAINING_ENV): TF32 changes the
# arithmetic; CPATH and LIBRARY_PATH are for compiling; FI_CXI_OVFLOW_BUF_SIZE is the script's
# second spelling of FI_CXI_OFLOW_BUF_SIZE.
LEFT_OUT = {"ITEX_FP32_MATH_MODE", "CPATH", "LIBRARY_PATH", "FI_CXI_OVFLOW_BUF_SIZE"}
# docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/, "Minimal set"
# (docs/aurora/data-science/frameworks/oneCCL.md), which the TensorFlow page includes.
CCL_MINIMAL_SET = """
export CCL_PROCESS_LAUNCHER=pmix
export CCL_ATL_TRANSPORT=mpi
export FI_MR_CACHE_MONITOR=userfaultfd
export CCL_KVS_MODE=mpi
"""
# docs.alcf.anl.gov/aurora/workflows/parsl/ (docs/aurora/workflows/parsl.md), the PARSL_MPI_PREFIX
# of MPIExecutor: "PARSL_MPI_PREFIX will resolve to `mpiexec -n num_ranks -ppn ranks_per_node
# -hosts NODE001,NODE002`".
PARSL_MPI_PREFIX = "mpiexec -n num_ranks -ppn ranks_per_node -hosts NODE001,NODE002"
# The same page, "Parsl Config for a Large Ensemble of Single Tile tasks": the HTEX settings.
PARSL_SINGLE_TILE = r"""
            cpu_affinity="list:1-8,105-112:9-16,113-120:17-24,121-128:25-32,129-136:33-40,137-144:41-48,145-152:53-60,157-164:61-68,165-172:69-76,173-180:77-84,181-188:85-92,189-196:93-100,197-204",
            max_workers_per_node=12,
                scheduler_options="#PBS -l filesystems=home:flare",
                launcher=MpiExecLauncher(bind_cmd="--cpu-bind", overrides="--ppn 1"),
                select_options="",
                cpus_per_node=208,
"""
# docs.alcf.anl.gov/aurora/running-jobs-aurora/ (docs/aurora/running-jobs-aurora.md), "Queues".
QUEUE_TABLES = """
| debug          | 1        | 2          | 5 min    | 1 hr             | 64 nodes (non-exclusive);  <br/> Max 1 job running/accruing/queued **per-user**                 |
| debug-scaling  | 2        | 256        | 5 min    | 1 hr             | Max 1 job running/accruing/queued **per-user**                                                  |
| capacity       | 1        | 16         | 5 min    | 7 days (168 hrs) | Max of 512 nodes across all jobs. Max 5 jobs queued or running, 2 jobs running per user.      |
| small           | 256      | 1024       | 5 min    | 12 hrs   |
| medium          | 1025     | 1999       | 5 min    | 18 hrs   |
| large           | 2000     | 10,624[^1] | 5 min    | 24 hrs   |
"""
PROD_ROUTES_TO = ("small", "medium", "large")  # "`prod` is the routing queue and routes your job"
# The same page, "Recommended PBSPro options" (those the provider does not write itself).
RECOMMENDED_PBS = ["#PBS -k doe", "#PBS -l place=scatter"]
# The same page, "MPI rank and thread binding to cores and GPUs": the node.
NODE = "a total of 104 physical cores and 208 logical processors on the CPUs per Aurora node"
TILES = "for a total of 6 GPUs and 12 GPU tiles on the GPUs per Aurora node"


def hours(text: str) -> str:
    """A table's "1 hr", "12 hrs", "7 days (168 hrs)" as HH:MM:SS."""
    count = int(re.findall(r"(\d+) hrs?", text)[-1])
    return f"{count:02d}:00:00"


def documented_queues() -> dict[str, tuple[int, int, str]]:
    queues = {}
    for row in QUEUE_TABLES.strip().splitlines():
        name, low, high, _, longest = (cell.strip() for cell in row.strip("|").split("|")[:5])
        high = re.sub(r"\[\^\d\]", "", high).replace(",", "")
        queues[name] = (int(low), int(high), hours(longest))
    return queues


def documented_launch(nodes: int) -> list[str]:
    """The TensorFlow job script's mpiexec line for a job of `nodes` nodes, its variables as bash
    expands them (an mpiexec that prints its arguments, one per line)."""
    script = TF_JOB_SCRIPT_LAUNCH.replace("NNODES=`wc -l < $PBS_NODEFILE`", f"NNODES={nodes}")
    printing = "mpiexec() { printf '%s\\n' mpiexec \"$@\"; }\n" + script
    done = subprocess.run(["bash", "-c", printing], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def documented_exports(text: str) -> dict[str, str]:
    exports = {}
    for line in text.strip().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        exports[name] = shlex.split(value, comments=True)[0] if value.strip('"') else ""
    return exports


def training_job_exports(run_dir: Path) -> dict[str, str]:
    """What the training's batch jobs export, from the Config the site builds."""
    config = aurora.make_config(run_dir, dataclasses.replace(aurora.SITE, account="X"))
    init = {e.label: e.provider.worker_init for e in config.executors}[MPI_LABEL]
    exports = {}
    for line in init.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = shlex.split(value)[0] if "$" not in value and value else value
    return exports


def test_aurora_is_a_known_site():
    assert "aurora" in known_sites() and load_site("aurora") is aurora


def test_the_node_is_alcfs_twelve_tiles_and_104_cores():
    assert (aurora.CORES_PER_NODE, aurora.HARDWARE_THREADS_PER_NODE) == (104, 208) and "104" in NODE
    assert (aurora.GPUS_PER_NODE, aurora.TILES_PER_NODE) == (6, 12) and "12 GPU tiles" in TILES
    site = aurora.SITE
    assert site.ranks_per_node == site.gpus_per_node == 12 and site.gpu_kind == "xpu"


# ---- the launch line: the dry run of configs/paper.toml on 1, 8 and 128 nodes ----


def dry_run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "workflow.py", "--site", "aurora", "--config", str(PAPER)]
    command += ["--run-dir", str(tmp_path / "run"), "--dry-run", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def printed_launch(out: str, nodes: int) -> list[str]:
    """The argv of the training launch the dry run prints, from mpiexec to the program."""
    (line,) = [x for x in out.splitlines() if f"training on {nodes} node(s): " in x]
    words = shlex.split(line.split(": ", 1)[1])
    return words[words.index("mpiexec") :]


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize("nodes, queue", [(1, None), (8, "debug-scaling"), (128, "debug-scaling")])
def test_the_printed_launch_line_is_alcfs_tensorflow_job_script_line(nodes, queue, tmp_path):
    queue_args = ["--queue", queue] if queue else []
    done = dry_run("--train-nodes", str(nodes), *queue_args, tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ours = printed_launch(done.stdout, nodes)
    documented = documented_launch(nodes)
    # ALCF's line, as bash gives it to mpiexec for this many nodes:
    assert documented[:7] == ["mpiexec", "-np", str(12 * nodes), "-ppn", "12", "--cpu-bind"] + [
        aurora.CPU_BIND
    ]
    # Ours: Parsl's MPI prefix (its page: `mpiexec -n <ranks> -ppn <per node> -hosts <nodes>`)
    # with the script's binding, then our program where the script has its own.
    hosts = ",".join(f"<node{i}>" for i in range(nodes))
    prefix = PARSL_MPI_PREFIX.replace("num_ranks", str(12 * nodes)).replace("ranks_per_node", "12")
    assert ours[:7] == prefix.replace("NODE001,NODE002", hosts).split()
    assert ours[7:9] == documented[5:7]  # --cpu-bind verbose,list:2-8:...:94-100
    assert ours[9].endswith("python") and ours[10:12] == ["-m", "pipeline.cli.train"]
    # -np (the script) and -n (Parsl): both the rank count of Aurora's mpiexec, as the pages use it.
    assert ours[ours.index("-n") + 1] == documented[documented.index("-np") + 1]
    assert f"training on {nodes} node(s): export OMP_NUM_THREADS=7; " in done.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("nodes", [8, 128])
def test_more_nodes_than_debug_takes_is_refused_in_one_line_naming_the_queues(nodes, tmp_path):
    done = dry_run("--train-nodes", str(nodes), tmp_path=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"a training job of {nodes} nodes for 01:00:00 does not fit queue 'debug'" in line
    assert (
        "debug-scaling (2-256 nodes, <= 01:00:00, <= 1 job)" in line and "another --queue" in line
    )
    assert not (tmp_path / "run").exists()


def test_the_launch_line_is_what_parsl_composes_for_the_jobs_nodes():
    launch = aurora.SITE.mpi_launch()
    assert expanded_launch_line(aurora.SITE, launch, launch.command("python -m x")) == (
        "export OMP_NUM_THREADS=7; export FFN_GPU_ORDER=local_rank; mpiexec -n 12 -ppn 12 "
        f"-hosts <node0> --cpu-bind {aurora.CPU_BIND} python -m x"
    )


def test_the_binding_leaves_out_the_cores_alcf_reserves_and_keeps_each_rank_on_its_socket():
    """Cores 0 and 52 (threads 104, 156) are the system's since March 31, 2025; ranks 0-5 on socket 0
    (cores 0-51, GPUs 0-2: tiles 0-5), ranks 6-11 on socket 1 (52-103, tiles 6-11); each rank's
    Horovod thread among its cores, its oneCCL worker on a core of its socket outside them."""
    ranges = aurora.CPU_BIND.removeprefix("verbose,list:").split(":")
    cores = [set(range(int(a), int(b) + 1)) for a, b in (r.split("-") for r in ranges)]
    horovod = [int(c) for c in aurora.HOROVOD_THREAD_AFFINITY.split(",")]
    ccl = [int(c) for c in aurora.CCL_WORKER_AFFINITY.split(",")]
    assert len(cores) == len(horovod) == len(ccl) == 12
    for rank, own in enumerate(cores):
        socket = range(0, 52) if rank < 6 else range(52, 104)
        assert own <= set(socket) - {0, 52} and len(own) == aurora.SITE.threads_per_rank
        assert horovod[rank] in own and ccl[rank] in set(socket) - own - {0, 52}
    worker_threads = re.findall(r"\d+", aurora.WORKER_AFFINITY)
    assert not {0, 52, 104, 156} & {int(t) for t in worker_threads}


# ---- the jobs: PBS lines, queues, environment ----


def test_the_queues_are_alcfs_table():
    documented = documented_queues()
    ours = {(q.name, q.min_nodes, q.max_nodes, q.max_walltime) for q in aurora.QUEUES}
    expected = {(name, *documented[name]) for name in ("debug", "debug-scaling", "capacity")}
    expected |= {("prod", *documented[name]) for name in PROD_ROUTES_TO}
    assert ours == expected


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"train_nodes": 1, "queue": "debug-scaling"}, "does not fit queue 'debug-scaling' (2-256"),
        ({"train_nodes": 128, "queue": "prod"}, "does not fit queue 'prod' (256-1024 nodes"),
        ({"train_nodes": 2, "walltime": "02:00:00"}, "queues that fit: capacity (1-16 nodes"),
        ({"train_nodes": 300, "queue": "prod", "walltime": "13:00:00"}, "a shorter --walltime"),
        ({"cpu_walltime": "169:00:00"}, "a cpu job of 1 node for 169:00:00 does not fit queue"),
    ],
)
def test_nothing_is_submitted_that_an_aurora_queue_cannot_run(changes, message):
    with pytest.raises(ConfigError) as refused:
        spec.for_run(aurora.SITE, **changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_runs_that_the_queues_take():
    for changes in (
        {"train_nodes": 2},
        {"train_nodes": 128, "queue": "debug-scaling"},
        {"train_nodes": 16, "queue": "capacity", "walltime": "48:00:00"},
        {"train_nodes": 512, "queue": "prod", "walltime": "12:00:00"},
    ):
        site = spec.for_run(aurora.SITE, **changes)
        assert site.cpu_job_queue == "capacity"  # the cpu pool's 1-node jobs: debug holds 1 job


def test_the_training_jobs_export_alcfs_tensorflow_and_oneccl_settings(tmp_path):
    ours = training_job_exports(tmp_path / "run")
    documented = documented_exports(TF_JOB_SCRIPT_EXPORTS) | documented_exports(CCL_MINIMAL_SET)
    for name in ("HOROVOD_THREAD_AFFINITY", "CCL_WORKER_AFFINITY"):  # assigned, not exported
        documented[name] = re.search(rf'^{name}="(.*)"$', TF_JOB_SCRIPT_LAUNCH, re.M)[1]
    kept = {k: v for k, v in documented.items() if k not in LEFT_OUT}
    assert {k: ours.get(k) for k in kept} == kept
    assert ours["FFN_GPU_KIND"] == "xpu"  # every rank must find its XPU
    assert ours["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    assert not LEFT_OUT & set(ours)


def test_the_jobs_load_the_tensorflow_module_before_the_venv(tmp_path):
    config = aurora.make_config(tmp_path / "run", dataclasses.replace(aurora.SITE, account="X"))
    for executor in config.executors:
        lines = executor.provider.worker_init.splitlines()
        assert lines[:4] == [
            "module load tensorflow",  # [tf] "Provided installation"
            "module load mpich/opt/develop-git.6037a7a",
            "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
            "export TMPDIR=/tmp",  # [parsl] "Known Issues"
        ]
        assert lines[4].startswith("source ") and lines[4].endswith("/bin/activate")


def test_the_cpu_pool_gives_each_of_12_workers_a_tile_and_alcfs_cores(tmp_path):
    config = aurora.make_config(tmp_path / "run", dataclasses.replace(aurora.SITE, account="X"))
    cpu = {e.label: e for e in config.executors}[CPU_LABEL]
    documented = dict(re.findall(r"(\w+)=(.+?),?$", PARSL_SINGLE_TILE.strip(), re.M))
    assert cpu.cpu_affinity == documented["cpu_affinity"].strip('"')
    assert cpu.max_workers_per_node == int(documented["max_workers_per_node"]) == 12
    assert cpu.available_accelerators == [str(t) for t in range(12)]  # one tile each (FLAT)
    provider = cpu.provider
    assert provider.cpus_per_node == int(documented["cpus_per_node"])
    assert provider.select_options == documented["select_options"].strip('"')
    assert isinstance(provider.launcher, MpiExecLauncher)
    assert provider.launcher.bind_cmd == "--cpu-bind" and provider.launcher.overrides == "--ppn 1"
    assert f'scheduler_options="{aurora.SITE.scheduler_options}"' in PARSL_SINGLE_TILE


def test_the_jobs_ask_for_aurora_nodes_as_alcf_recommends(tmp_path, fake_scheduler):  # noqa: F811
    pbs = fake_scheduler("pbspro")
    site = small(aurora.SITE, pbs)
    jobs = submitted_jobs(aurora.make_config(tmp_path / "run", site), pbs, tmp_path)
    for label, (argv, script) in jobs.items():
        lines = script.splitlines()
        assert "#PBS -l select=1:ncpus=208" in lines  # [parsl]: cpus_per_node=208
        assert set(RECOMMENDED_PBS) <= set(lines)
        assert "#PBS -l filesystems=home:flare" in lines
        queue = {MPI_LABEL: "debug", CPU_LABEL: "capacity"}[label]
        assert argv[:4] == ["-q", queue, "-A", "test_account"]
    mpi_script = jobs[MPI_LABEL][1].splitlines()
    assert f"export CCL_WORKER_AFFINITY={aurora.CCL_WORKER_AFFINITY}" in mpi_script
    # Both pools' processes that run the network must find an XPU (inference on the cpu pool).
    for label in (MPI_LABEL, CPU_LABEL):
        assert "export FFN_GPU_KIND=xpu" in jobs[label][1].splitlines()


# Each rank binds its device as the training does (pipeline.network.devices.bind_to_gpu), in a
# stand-in TensorFlow that lists a node's 12 tiles; it reports in one write().
XPU_RANK_PROGRAM = """import os
from types import SimpleNamespace
from pipeline.network.devices import bind_to_gpu, gpu_order
class Config:
    experimental = SimpleNamespace(set_memory_growth=lambda device, on: None)
    def list_physical_devices(self, kind):
        return [f"XPU:{i}" for i in range(12)] if kind == "XPU" else []
    def set_visible_devices(self, device, kind):
        self.visible = device
config = Config()
e = os.environ
got = bind_to_gpu(SimpleNamespace(config=config), int(e["MPI_LOCALRANKID"]), gpu_order(e))
os.write(1, f"rank {e['PMI_RANK']}: {got}, visible {config.visible}, "
            f"ccl {e['CCL_WORKER_AFFINITY'].split(',')[int(e['MPI_LOCALRANKID'])]}\\n".encode())
"""


@pytest.mark.mpi
def test_each_rank_of_an_aurora_job_binds_its_own_tile(tmp_path, fake_scheduler, leftovers):  # noqa: F811
    """Through the stand-in PBS Pro and PALS mpiexec: the training job's exports reach the ranks
    ($FFN_GPU_KIND, the oneCCL settings), and each rank takes its own XPU."""
    pbs = fake_scheduler("pbspro")
    site = small(aurora.SITE, pbs)
    launch = site.mpi_launch()
    (tmp_path / "ranks.py").write_text(XPU_RANK_PROGRAM)
    with parsl.load(aurora.make_config(tmp_path / "run", site)):
        done = ranks(
            launch,
            tmp_path / "ranks.py",
            parsl_resource_specification=launch.resource_specification,
            stdout=str(tmp_path / "ranks.out"),
            stderr=str(tmp_path / "ranks.err"),
        )
        try:
            assert done.result(timeout=TASK_TIMEOUT) == 0
        except Exception as err:
            raise AssertionError(f"{err!r}\n{pbs.job_output()}") from err
    lines = sorted((tmp_path / "ranks.out").read_text().splitlines())
    assert lines == [
        "rank 0: XPU 0 of 12, visible XPU:0, ccl 1",
        "rank 1: XPU 1 of 12, visible XPU:1, ccl 9",
    ]
    mpiexecs = [" ".join(c) for c in pbs.calls("mpiexec")]
    assert any(
        c.startswith(f"-n 2 -ppn 2 -hosts localhost --cpu-bind {aurora.CPU_BIND} ")
        for c in mpiexecs
    )
    assert pbs.live_jobs() == []
    assert leftovers() == []


# ---- the venv: the XPU flavour recorded, described and checked ----


def xpu_record(
    venv: Path, extension: str | None = "2.15.0.2", ccl: bool = True
) -> EnvironmentRecord:
    """What `make env MPI=system GPU=xpu` records over Aurora's TensorFlow module."""
    return dataclasses.replace(
        record(venv, gpu=True),
        tensorflow_package="tensorflow",
        tensorflow_cuda_build=False,
        cuda_version=None,
        mpi="MPICH 4.3.0",
        horovod_version="0.28.1.5",
        horovod_operations=("CCL", "MPI", "Gloo") if ccl else ("MPI", "Gloo"),
        xpu_extension_version=extension,
    )


def test_aurora_refuses_a_venv_without_intels_extension_in_one_line(tmp_path):
    for venv in (
        record(tmp_path),
        record(tmp_path, gpu=True, nccl=True),
        xpu_record(tmp_path, None),
    ):
        with pytest.raises(ConfigError) as refused:
            check_environment(aurora.SITE, venv)
        message = str(refused.value)
        assert message.startswith("site 'aurora' has 12 Intel GPU tile(s) (XPU) per node, but in")
        assert "has no Intel extension (intel_extension_for_tensorflow)" in message
        assert "make env MPI=system GPU=xpu" in message and "module load tensorflow" in message
        assert "\n" not in message


def test_aurora_refuses_a_horovod_without_oneccl_and_takes_the_xpu_venv(tmp_path):
    with pytest.raises(ConfigError, match="Horovod 0.28.1.5 has no oneCCL"):
        check_environment(aurora.SITE, xpu_record(tmp_path, ccl=False))
    assert check_environment(aurora.SITE, xpu_record(tmp_path)) is None
    unrecorded = check_environment(aurora.SITE, None)
    assert unrecorded.startswith("warning: site 'aurora' wants XPUs")


def test_a_cuda_site_refuses_the_xpu_venv(tmp_path):
    from site_configs import polaris

    with pytest.raises(ConfigError, match="site 'polaris' has 4 GPU.*is not a CUDA build: it has "):
        check_environment(polaris.SITE, xpu_record(tmp_path))


def test_an_unknown_gpu_kind_is_refused(tmp_path):
    site = dataclasses.replace(aurora.SITE, gpu_kind="rocm")
    with pytest.raises(ConfigError, match="gpu_kind 'rocm' is not one of cuda, xpu"):
        check_environment(site, xpu_record(tmp_path))


def test_the_xpu_record_reads_back_and_an_older_record_still_reads(tmp_path):
    write_environment(xpu_record(tmp_path))
    assert read_environment(tmp_path) == xpu_record(tmp_path)
    assert "TensorFlow 2.15.1 (XPU: Intel's extension 2.15.0.2)" in describe_environment(
        xpu_record(tmp_path)
    )
    older = tmp_path / "older"
    older.mkdir()
    write_environment(record(older))
    path = older / "ffn-environment.json"
    path.write_text(re.sub(r',\s*"xpu_extension_version": null', "", path.read_text()))
    assert "xpu_extension_version" not in path.read_text()
    assert read_environment(older) == record(older)  # written before the field: None


CHECK_BUILD = """Horovod v0.28.1.5:

Available Frameworks:
    [X] TensorFlow
    [ ] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [{ccl}] CCL
    [X] MPI
    [X] Gloo
"""  # the format of horovodrun --check-build in intel/intel-optimization-for-horovod
# (horovod/runner/launch.py, check_build)


@pytest.mark.parametrize("ccl, extension", [(True, "2.15.0.2"), (False, "2.15.0.2"), (True, None)])
def test_the_set_up_records_the_xpu_flavour_or_refuses_it_in_one_line(
    ccl, extension, tmp_path, monkeypatch, capsys
):
    from site_configs import environment

    monkeypatch.setattr(
        environment, "_tensorflow_build", lambda: ("tensorflow", "2.15.1", False, None)
    )
    monkeypatch.setattr(environment, "_xpu_extension_version", lambda: extension)
    monkeypatch.setattr(
        sys, "stdin", __import__("io").StringIO(CHECK_BUILD.format(ccl="X" if ccl else " "))
    )
    args = ["--write", str(tmp_path), "--mpi-flavour", "system", "--gpu", "xpu"]
    args += [
        "--mpi",
        "MPICH 4.3.0",
        "--mpi-wrapper",
        "/opt/mpich/bin/mpicxx",
        "--mpi-id",
        "1a2b3c4d",
    ]
    done = main(args)
    if ccl and extension:
        assert done == 0
        written = read_environment(tmp_path)
        assert written.xpu_extension_version == "2.15.0.2" and written.gpu
        assert "CCL" in written.horovod_operations
    else:
        assert done == 1 and read_environment(tmp_path) is None
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("[setup] GPU=xpu, but the venv's Python has ")


# ---- the set-up's GPU=xpu flavour: a venv over the TensorFlow module's Python ----

MODULE_PACKAGES = {  # top-level package: (distribution, version), as the module's Python holds them
    "tensorflow": ("tensorflow", "2.15.1"),
    "intel_extension_for_tensorflow": ("intel_extension_for_tensorflow", "2.15.0.2"),
    "horovod": ("intel_optimization_for_horovod", "0.28.1.5"),
}


def stand_in_module_python(folder: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A `python3` on PATH as a TensorFlow module's: this machine's Python 3.11, with stand-in
    packages (empty, with their distributions' metadata) on its path."""
    site_packages = folder / "site-packages"
    for top, (dist, version) in MODULE_PACKAGES.items():
        if top in leave_out:
            continue
        (site_packages / top).mkdir(parents=True)
        (site_packages / top / "__init__.py").write_text("")
        info = site_packages / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{top}\n")
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site_packages} exec /usr/bin/python3.11 -s "$@"\n')
    python.chmod(0o755)
    return bin_dir


needs_python311 = pytest.mark.skipif(
    not Path("/usr/bin/python3.11").is_file(), reason="no /usr/bin/python3.11 to stand in"
)


@needs_python311
def test_gpu_xpu_makes_the_venv_over_the_modules_python_and_builds_nothing(tmp_path):
    module = stand_in_module_python(tmp_path / "module")
    mpich = stand_in_mpich(tmp_path / "mpich", "4.3.0")
    venv = tmp_path / "venv"
    done = setup_env(venv, module, mpich, GPU="xpu", DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "flavour MPI=system GPU=xpu (the venv's: none yet, a new venv)" in out
    assert f"the venv over {module}/python3 (Python 3.11, --system-site-packages)" in out
    assert (
        "from the module: TensorFlow: tensorflow 2.15.1; Intel's extension: "
        "intel_extension_for_tensorflow 2.15.0.2; Horovod: intel_optimization_for_horovod 0.28.1.5"
    ) in out
    assert "install ffn-workflow[test]" in out and "tensorflow-cpu" not in out
    assert "mpich==" not in out and "build horovod" not in out and "wheel cache" not in out
    assert f"MPI from PATH: MPICH 4.3.0 ({mpich}/mpicxx)" in out
    assert not venv.exists()


@needs_python311
@pytest.mark.parametrize(
    "leave_out, expected",
    [
        (
            ("intel_extension_for_tensorflow",),
            "has no Intel extension (intel_extension_for_tensorflow), so it lists no XPU",
        ),
        (("horovod",), "has no Horovod (Intel's, with oneCCL)"),
        (("tensorflow",), "has no TensorFlow; load the site's TensorFlow module first"),
    ],
)
def test_gpu_xpu_without_the_modules_packages_is_refused_in_one_line(leave_out, expected, tmp_path):
    module = stand_in_module_python(tmp_path / "module", leave_out)
    mpich = stand_in_mpich(tmp_path / "mpich", "4.3.0")
    done = setup_env(tmp_path / "venv", module, mpich, GPU="xpu", DRY_RUN="1")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("[setup] GPU=xpu: ") and expected in line


def test_gpu_xpu_without_the_module_loaded_is_refused_in_one_line(tmp_path):
    """PATH holds only the system's python3 (no TensorFlow), or one of another Python."""
    other = stand_in(tmp_path / "other", "python3", "python=3.10\ntensorflow=tensorflow 2.15.1")
    mpich = stand_in_mpich(tmp_path / "mpich", "4.3.0")
    done = setup_env(tmp_path / "venv", other.parent, mpich, GPU="xpu", DRY_RUN="1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"[setup] GPU=xpu: {other} is Python 3.10; the project needs 3.11 (pyproject.toml): load "
        "the site's TensorFlow module of Python 3.11, or give PYTHON="
    ]


def test_gpu_xpu_goes_with_the_sites_mpi_and_sticks_to_the_venv(tmp_path):
    module = stand_in(
        tmp_path / "module",
        "python3",
        "\n".join(
            ["python=3.11"]
            + [
                f"{k}={d} {v}"
                for k, (d, v) in zip(
                    ("tensorflow", "extension", "horovod"), MODULE_PACKAGES.values(), strict=True
                )
            ]
        ),
    ).parent
    mpich = stand_in_mpich(tmp_path / "mpich", "4.3.0")
    wheel = setup_env(tmp_path / "venv", module, mpich, GPU="xpu", MPI="wheel", DRY_RUN="1")
    assert wheel.returncode == 2
    assert "GPU=xpu: the TensorFlow module's Horovod speaks the site's MPI" in wheel.stderr
    venv = tmp_path / "made"
    venv.mkdir()
    (venv / ".setup-flavour").write_text("MPI=system GPU=xpu\n")
    kept = setup_env(venv, module, mpich, DRY_RUN="1")  # a later `make env`: the venv's flavour
    assert kept.returncode == 0, kept.stderr
    assert "flavour MPI=system GPU=xpu (the venv's: MPI=system GPU=xpu)" in kept.stdout
    other = setup_env(venv, module, mpich, GPU="1", DRY_RUN="1")
    assert other.returncode == 2 and "was made with MPI=system GPU=xpu, not MPI=system GPU=1" in (
        other.stderr
    )
