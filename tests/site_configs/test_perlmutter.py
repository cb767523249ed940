"""`--site perlmutter` (NERSC Perlmutter's GPU nodes) and `--qos`/`--constraint` on any Slurm site
(issue 57, point 3): the dry run of configs/paper.toml on 1, 8 and 128 nodes, the job scripts'
`#SBATCH` lines and the training's `srun` line against NERSC's documented ones (held here with
their sources), the QOS limits, values a shell would split, a non-Slurm site refusing a QOS, and a
tiny DAG through the stand-in Slurm (tests/fake_scheduler/slurm) on the Perlmutter description.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path

import parsl
import pytest
from parsl import bash_app, python_app
from test_site_configs import (  # noqa: F401  (fixtures: fake_scheduler, leftovers)
    TASK_TIMEOUT,
    fake_scheduler,
    leftovers,
    product,
    small,
)
from workflow_runs import ROOT, workflow

import workflow as workflow_cli
from apps.run_setup import load_site_record, resolve_run, save_site_record
from pipeline.core.errors import ConfigError
from site_configs import CPU_LABEL, MPI_LABEL, load_site, perlmutter, polaris, slurm, theta
from site_configs.launch import expanded_launch_line
from site_configs.spec import SiteSpec, for_run

PAPER = ROOT / "configs" / "paper.toml"

# ---- what NERSC documents, with where it says so ----

# NERSC, "Running Jobs on Perlmutter's GPU nodes" (https://docs.nersc.gov/systems/perlmutter/running-jobs/,
# read in a 2021 copy of its source): the job options of its example scripts ("4 nodes, 16 tasks,
# 16 GPUs"), and what Parsl's SlurmProvider writes for each (the long form of the same option).
GPU_PAGE = "https://docs.nersc.gov/systems/perlmutter/running-jobs/"
DOCUMENTED_SBATCH = {
    "#SBATCH -C gpu": "#SBATCH --constraint=gpu",  # "this constraint directive is required"
    "#SBATCH -q regular": "#SBATCH --qos=regular",  # "you can submit with the regular queue"
    "#SBATCH -A <account>": "#SBATCH --account=<account>",  # "#SBATCH -A <project>"
}
# The same page's srun line for 8 nodes, 32 tasks, one GPU each ("To run a job across 8 GPU nodes
# using 32 tasks total, with each task bound to one GPU"), without its -C gpu (a job's option,
# given by the script) and its --gpu-bind=map_gpu:0,1,2,3 (see DOCUMENTED_GPU_BIND):
DOCUMENTED_SRUN_8_NODES = "srun -N 8 -n 32 -c 32 --cpu-bind=cores --gpus-per-task=1"
# The page's examples "all GPUs visible to all tasks" give --gpus-per-task=1 alone; Slurm's
# --gpus-per-task "will implicitly set --gpu-bind=per_task:<gpus_per_task>, but that can be
# overridden with an explicit --gpu-bind specification" (https://slurm.schedmd.com/srun.html),
# and WarpX's Perlmutter GPU script keeps every GPU visible with `#SBATCH --gpu-bind=none`
# (github.com/BLAST-WarpX/warpx, Tools/machines/perlmutter-nersc/perlmutter_gpu.sbatch). Each rank
# then takes its own (pipeline.network.devices.bind_to_gpu), which needs all four visible.
DOCUMENTED_GPU_BIND = "--gpu-bind=none"
# "each GPU node has 4 GPUs and 64 physical cores with 2 hardware threads" (the GPU page);
# "1 AMD EPYC 7763 CPUs and 4 NVIDIA A100 GPUs" (https://docs.nersc.gov/beginner-guide/nodetypesfig).
GPUS_PER_NODE, CORES_PER_NODE, THREADS_PER_CORE = 4, 64, 2
# 'The "debug" QOS is the default QOS on Perlmutter' (https://docs.nersc.gov/jobs/policy/).
DEFAULT_QOS = "debug"


def srun_options(line: str) -> dict[str, str]:
    """An srun command's options, each by its long name (-N 8 and --nodes=8 alike)."""
    long = {"-N": "--nodes", "-n": "--ntasks", "-c": "--cpus-per-task", "-G": "--gpus"}
    words = shlex.split(line)
    assert words[0] == "srun", line
    options, i = {}, 1
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if not eq:
            i += 1
            value = words[i]
        options[long.get(name, name)] = value
        i += 1
    return options


def submittable(**changes) -> SiteSpec:
    """Perlmutter as a user sets it: an account and module loads in place of the placeholders."""
    return dataclasses.replace(
        for_run(perlmutter.SITE, account="m1234_g", **changes), worker_init="module load gpu"
    )


def scripts_written(config, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Per pool, the job script its SlurmProvider writes for one block, and the command it would
    submit it with: the provider's own submit (Parsl's template), its command runner replaced."""
    written = {}
    for executor in config.executors:
        provider, commands = executor.provider, []

        def runner(command, *args, commands=commands, **kwargs):
            commands.append(command)
            return 0, "Submitted batch job 42", ""

        provider.script_dir = str(tmp_path)
        provider.execute_wait = runner
        assert provider.submit("true", 1, executor.label) == "42"
        (command,) = commands
        script = Path(command.split()[-1])
        written[executor.label] = (script.read_text().splitlines(), command)
    return written


# ---- the site ----


def test_perlmutter_is_a_known_site_of_nerscs_gpu_nodes():
    site = load_site("perlmutter").SITE
    assert (site.scheduler, site.mpi_launcher) == ("slurm", "srun")
    assert (site.gpus_per_node, site.cores_per_node) == (GPUS_PER_NODE, CORES_PER_NODE)
    assert site.hyperthreads_per_core == THREADS_PER_CORE
    assert site.ranks_per_node == site.gpus_per_node  # one training rank per A100
    assert (site.qos, site.constraint, site.queue) == (DEFAULT_QOS, "gpu", None)
    assert "YOUR_" in site.account and "_g" in perlmutter.ACCOUNT_NOTE  # NERSC's GPU accounts


@pytest.mark.parametrize("nodes", [1, 8, 128])
def test_the_training_srun_line_holds_nerscs_documented_options(nodes):
    site = for_run(perlmutter.SITE, train_nodes=nodes, qos="regular")
    launch = site.mpi_launch()
    line = expanded_launch_line(site, launch, launch.command("python -m x"))
    exports, srun = line.split("srun ", 1)
    assert exports == "export OMP_NUM_THREADS=16; export FFN_GPU_ORDER=local_rank; "
    ours = srun_options("srun " + srun.removesuffix(" python -m x"))
    documented = srun_options(DOCUMENTED_SRUN_8_NODES)
    # The page's options for 8 nodes, with this run's node and task counts.
    documented |= {"--nodes": str(nodes), "--ntasks": str(4 * nodes)}
    assert {k: ours[k] for k in documented} == documented
    assert ours["--ntasks-per-node"] == "4"
    assert ours["--gpu-bind"] == DOCUMENTED_GPU_BIND.split("=")[1]
    # Slurm's default MPI plugin starts Cray MPICH's ranks: no --mpi, and no PMIx.
    assert "--mpi" not in ours and "pmix" not in line
    assert set(ours) == {*documented, "--ntasks-per-node", "--nodelist", "--gpu-bind"}


def test_each_rank_takes_its_own_gpu_of_four_visible():
    """--gpu-bind=none shows every rank its node's four A100, and the rank binds to the one of its
    local rank (with Slurm's implicit per-task binding each would see one GPU, and ranks 1-3 none
    of their own: bind_to_gpu refuses them)."""
    from pipeline.network.devices import gpu_for_rank, gpu_order

    env = perlmutter.SITE.mpi_launch().env
    assert [gpu_for_rank(r, GPUS_PER_NODE, gpu_order(env)) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="no GPU of its own"):
        gpu_for_rank(1, 1, gpu_order(env))


@pytest.mark.parametrize("qos", ["regular", "debug"])
def test_the_job_scripts_hold_nerscs_documented_sbatch_lines(qos, tmp_path):
    site = submittable(train_nodes=8, qos=qos)
    scripts = scripts_written(perlmutter.make_config(tmp_path / "run", site), tmp_path)
    for label, nodes in ((MPI_LABEL, 8), (CPU_LABEL, 1)):
        lines, command = scripts[label]
        for short, long in DOCUMENTED_SBATCH.items():
            long = long.replace("<account>", "m1234_g").replace("regular", qos)
            assert long in lines, (short, lines)
        for line in (f"--nodes={nodes}", "--time=30", "--gpus-per-node=4", "--exclusive"):
            assert f"#SBATCH {line}" in lines
        assert not [x for x in lines if x.startswith("#SBATCH --partition")]  # the QOS chooses
        assert command == f"sbatch {command.split()[-1]}"
    # The cpu pool: one worker pool per node with all its hardware threads and its four A100,
    # which HighThroughputExecutor hands out one per worker.
    (srun,) = [x for x in scripts[CPU_LABEL][0] if x.startswith("srun ")]
    assert srun.startswith(
        "srun --ntasks 1 -l --cpus-per-task=128 --cpu-bind=cores --gpus-per-task=4 "
    )
    cpu = next(
        e for e in perlmutter.make_config(tmp_path / "r2", site).executors if e.label == CPU_LABEL
    )
    assert cpu.available_accelerators == ["0", "1", "2", "3"] and cpu.max_workers_per_node == 4


def test_the_site_refuses_to_submit_with_its_placeholders(tmp_path):
    with pytest.raises(
        ConfigError, match="account='YOUR_PROJECT'.*worker_init='YOUR_MODULE_LOADS'"
    ):
        perlmutter.make_config(tmp_path / "run")
    with pytest.raises(ConfigError, match="worker_init='YOUR_MODULE_LOADS'"):
        perlmutter.make_config(tmp_path / "run", for_run(perlmutter.SITE, account="m1234_g"))


def test_a_partition_is_refused_naming_qos(tmp_path):
    with pytest.raises(ConfigError, match="queue 'regular' is one of the site's QOSes .*--qos"):
        for_run(perlmutter.SITE, queue="regular")
    site = dataclasses.replace(submittable(), queue="gpu_ss11")  # a partition it does not list
    with pytest.raises(ConfigError, match="'gpu_ss11' would be a Slurm partition.*--qos"):
        perlmutter.make_config(tmp_path / "run", site)


# ---- QOS limits: nothing is submitted that its QOS cannot run ----


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"train_nodes": 128},  # debug, the default QOS
            "train_nodes 128: site 'perlmutter': a training job of 128 nodes for 00:30:00 does "
            "not fit QOS 'debug' (1-8 nodes, <= 00:30:00); QOSes that fit: regular (1-1794 "
            "nodes, <= 48:00:00); give another --qos, or --train-nodes that the QOS takes",
        ),
        (
            {"walltime": "02:00:00"},
            "walltime 02:00:00: site 'perlmutter': a training job of 2 nodes for 02:00:00 does "
            "not fit QOS 'debug' (1-8 nodes, <= 00:30:00); QOSes that fit: regular (1-1794 "
            "nodes, <= 48:00:00); give a shorter --walltime or another --qos",
        ),
        (
            {"qos": "regular", "cpu_walltime": "49:00:00"},
            "cpu_walltime 49:00:00, qos regular: site 'perlmutter': a cpu job of 1 node for "
            "49:00:00 does not fit QOS 'regular' (1-1794 nodes, <= 48:00:00); QOSes that fit: "
            "none; give a shorter --cpu-walltime or another --qos",
        ),
    ],
)
def test_a_job_its_qos_does_not_take_is_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError) as refused:
        for_run(perlmutter.SITE, **changes)
    assert str(refused.value) == message


def test_a_qos_the_site_does_not_list_is_not_checked():
    site = for_run(perlmutter.SITE, train_nodes=128, qos="premium")
    assert (site.nodes_per_block, site.qos) == (128, "premium")


# ---- the dry run of the paper's config ----


def dry_run(*args: str, run_dir: Path, expect: int = 0):
    return workflow(
        "--site", "perlmutter", "--config", str(PAPER), "--run-dir", str(run_dir),
        "--account", "m1234_g", "--dry-run", *args, expect=expect, timeout=600,
    )  # fmt: skip


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize("nodes", [1, 8, 128])
def test_the_paper_dry_run_on_regular_prints_the_documented_launch(nodes, tmp_path):
    out = dry_run("--train-nodes", str(nodes), "--qos", "regular", run_dir=tmp_path / "run").stdout
    assert not (tmp_path / "run").exists()
    (line,) = [x for x in out.splitlines() if x.strip().startswith(f"training on {nodes} node")]
    srun = "srun " + line.split(" srun ", 1)[1].split(" python ", 1)[0]
    options = srun_options(srun)
    assert (options["--nodes"], options["--ntasks"]) == (str(nodes), str(4 * nodes))
    for name, value in srun_options(DOCUMENTED_SRUN_8_NODES).items():
        assert name in ("--nodes", "--ntasks") or options[name] == value
    assert options["--gpu-bind"] == "none" and "--mpi" not in options
    # The batch scripts it prints (site_configs.dry_run.describe_block_scripts), one per pool.
    printed = [x[6:] for x in out.splitlines() if x.startswith("    | ")]
    for long in DOCUMENTED_SBATCH.values():
        assert printed.count(long.replace("<account>", "m1234_g")) == 2, long
    assert printed.count(f"#SBATCH --nodes={nodes}") == 1 + (nodes == 1)


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize("nodes, refused", [(1, False), (8, False), (128, True)])
def test_the_paper_dry_run_on_debug_fits_or_refuses_in_one_line(nodes, refused, tmp_path):
    run_dir = tmp_path / "run"
    done = dry_run(
        "--train-nodes", str(nodes), "--qos", "debug", run_dir=run_dir, expect=2 * refused
    )
    if refused:
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
        assert "does not fit QOS 'debug' (1-8 nodes" in done.stderr
        assert "QOSes that fit: regular" in done.stderr and "give another --qos" in done.stderr
    assert not run_dir.exists()


# ---- --qos and --constraint on any Slurm site ----


def test_qos_and_constraint_from_the_command_line_reach_the_spec(tmp_path):
    argv = [
        "--site", "perlmutter", "--config", str(PAPER), "--run-dir", str(tmp_path / "run"),
        "--account", "m1234_g", "--qos", "regular", "--constraint", "gpu&hbm80g",
    ]  # fmt: skip
    args = workflow_cli._parser().parse_args(workflow_cli._with_command(argv))
    spec = resolve_run(args).spec
    assert (spec.qos, spec.constraint, spec.account) == ("regular", "gpu&hbm80g", "m1234_g")


@pytest.mark.parametrize("module", [perlmutter, slurm], ids=["perlmutter", "slurm"])
def test_qos_and_constraint_reach_both_pools_providers(module, tmp_path):
    site = dataclasses.replace(
        for_run(module.SITE, account="a1", qos="premium", constraint="gpu&hbm80g"),
        worker_init="",
        queue=None if module is perlmutter else "p1",
    )
    config = module.make_config(tmp_path / "run", site)
    for executor in config.executors:
        assert (executor.provider.qos, executor.provider.constraint) == ("premium", "gpu&hbm80g")
    for lines, _ in scripts_written(config, tmp_path).values():
        assert "#SBATCH --qos=premium" in lines and "#SBATCH --constraint=gpu&hbm80g" in lines


def test_the_generic_slurm_site_asks_for_no_qos_or_constraint_unless_given(tmp_path):
    site = dataclasses.replace(slurm.SITE, account="a1", queue="p1", worker_init="")
    for lines, _ in scripts_written(slurm.make_config(tmp_path / "run", site), tmp_path).values():
        assert not [x for x in lines if x.startswith(("#SBATCH --qos", "#SBATCH --constraint"))]


def test_the_site_record_keeps_qos_and_constraint(tmp_path):
    site = for_run(perlmutter.SITE, account="m1234_g", qos="regular", constraint="gpu&hbm80g")
    save_site_record(tmp_path / "site.json", "perlmutter", site)
    source, recorded = load_site_record(tmp_path / "site.json")
    assert (source, recorded) == ("perlmutter", site)
    assert (recorded.qos, recorded.constraint) == ("regular", "gpu&hbm80g")


# ---- values a shell or a script would run, and schedulers that take no QOS ----


def injection(tmp_path: Path) -> tuple[str, Path]:
    planted = tmp_path / "planted"
    return f"abc;touch${{IFS}}{planted}", planted


@pytest.mark.parametrize("name", ["qos", "constraint"])
@pytest.mark.parametrize("site", [perlmutter.SITE, slurm.SITE], ids=["perlmutter", "slurm"])
def test_an_injected_qos_or_constraint_is_refused(site, name, tmp_path):
    value, _ = injection(tmp_path)
    with pytest.raises(ConfigError, match=f"{name} .* is not a scheduler name"):
        dataclasses.replace(site, **{name: value})
    for bad in ("two words", "gpu\n#SBATCH --x", "$(id)", "gpu&", "&gpu", "a'b", "-q"):
        with pytest.raises(ConfigError, match="is not a scheduler name"):
            dataclasses.replace(site, **{name: bad})


@pytest.mark.parametrize("option", ["--qos", "--constraint"])
def test_an_injected_value_on_the_command_line_is_refused_before_the_dry_run(option, tmp_path):
    value, planted = injection(tmp_path)
    done = dry_run(option, value, run_dir=tmp_path / "run", expect=2)
    assert done.stderr.startswith("error: ") and "not a scheduler name" in done.stderr
    assert not planted.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("site", [polaris.SITE, theta.SITE], ids=["pbspro", "cobalt"])
@pytest.mark.parametrize("name", ["qos", "constraint"])
def test_a_site_of_another_scheduler_refuses_qos_and_constraint(site, name):
    with pytest.raises(ConfigError, match=f"{name} 'regular' is Slurm's.*leave out --{name}"):
        dataclasses.replace(site, **{name: "regular"})


def test_polaris_refuses_qos_on_the_command_line_in_one_line(tmp_path):
    done = workflow(
        "--site", "polaris", "--run-dir", str(tmp_path / "run"), "--account", "X",
        "--qos", "regular", "--dry-run", expect=2, timeout=600,
    )  # fmt: skip
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert "qos 'regular' is Slurm's" in done.stderr and "leave out --qos" in done.stderr


# ---- the generic Slurm site: PMIx by default, and when to change it ----


def test_the_generic_slurm_site_keeps_pmix_and_says_when_to_change_it():
    assert "--mpi=pmix" in slurm.SITE.launcher_options
    doc = slurm.__doc__
    assert "Perlmutter CPU nodes" not in doc and "defaults for NERSC" not in doc
    assert "--mpi=cray_shasta" in doc and "--site perlmutter" in doc and "srun --mpi=list" in doc


# ---- a tiny DAG through the stand-in Slurm, on the Perlmutter description ----

GPU_RANK_PROGRAM = """import os
e = os.environ
os.write(1, f"rank {e['PMI_RANK']} of {e['PMI_SIZE']} gpus {e['FFN_GPU_ORDER']}\\n".encode())
"""


@bash_app(executors=[MPI_LABEL])
def ranks_after(
    launch, program, inputs=(), parsl_resource_specification=None, stdout=None, stderr=None
):
    """The ranks of one multi-rank task, started once `inputs` are done, as training is."""
    return launch.command(f"python {program}")


@python_app(executors=[CPU_LABEL])
def worker_gpu(inputs=()):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.mpi
@pytest.mark.slow  # three tasks one after another through the stand-in's jobs: 40-60 s on 2 cores
def test_a_tiny_dag_runs_through_the_stand_in_slurm_on_perlmutter(
    tmp_path,
    fake_scheduler,  # noqa: F811  (the fixtures imported from test_site_configs)
    leftovers,  # noqa: F811
):
    sched = fake_scheduler("slurm")
    site = for_run(small(perlmutter.SITE, sched), qos="regular")
    config = perlmutter.make_config(tmp_path / "run", site)
    launch = site.mpi_launch()
    (tmp_path / "ranks.py").write_text(GPU_RANK_PROGRAM)
    with parsl.load(config):
        answer = product(6, 7)  # cpu pool
        ranks = ranks_after(  # mpi pool, after it
            launch, tmp_path / "ranks.py", inputs=[answer],
            parsl_resource_specification=launch.resource_specification,
            stdout=str(tmp_path / "ranks.out"), stderr=str(tmp_path / "ranks.err"),
        )  # fmt: skip
        gpu = worker_gpu(inputs=[ranks])  # cpu pool again, after the ranks
        try:
            assert answer.result(timeout=TASK_TIMEOUT) == 42
            assert ranks.result(timeout=TASK_TIMEOUT) == 0
            assert gpu.result(timeout=TASK_TIMEOUT) == "0"  # the worker's own A100
        except Exception as err:
            raise AssertionError(f"{err!r}\n{sched.job_output()}") from err
    lines = sorted((tmp_path / "ranks.out").read_text().splitlines())
    assert lines == ["rank 0 of 2 gpus local_rank", "rank 1 of 2 gpus local_rank"]
    sbatches = sched.calls("sbatch")
    assert len(sbatches) == 2  # one job per pool
    for argv in sbatches:
        lines = Path(argv[-1]).read_text().splitlines()
        for line in (
            "--qos=regular",
            "--constraint=gpu",
            "--account=test_account",
            "--gpus-per-node=4",
        ):
            assert f"#SBATCH {line}" in lines
    sruns = [" ".join(c) for c in sched.calls("srun")]
    assert any(
        c.startswith("--ntasks 1 -l --cpus-per-task=2 --cpu-bind=cores --gpus-per-task=4 bash")
        for c in sruns
    ), sruns
    assert any(
        re.match(
            r"--ntasks 2 --ntasks-per-node 2 --nodelist localhost --nodes 1 -c 1 "
            r"--cpu-bind=cores --gpus-per-task=1 --gpu-bind=none python ",
            c,
        )
        for c in sruns
    ), sruns
    assert sorted(c[0] for c in sched.calls("scancel")) == sorted(j["id"] for j in sched.jobs())
    assert sched.live_jobs() == [] and leftovers() == []
    assert os.environ.get("FAKE_SCHED_DIR")  # the stand-in was the one on PATH
