"""Every batch site runs the workflow's DAG end to end through its stand-in scheduler (issue 57):
aurora and polaris through the stand-in PBS Pro, perlmutter and slurm through the stand-in Slurm,
theta through the stand-in Cobalt (tests/fake_scheduler). Each test runs the real command,
`python workflow.py --site <a site module written here> --config ... --run-dir ...`, and checks
that the run finished with its report and scores, that the jobs went through the scheduler and
none is left running, that the site's own `worker_init` ran (its module loads through the
stand-in `module`), that each training rank took its own accelerator in the site's order and
each cpu worker its own, and that the report charges each stage node-hours and the joules of the
node's energy counters.

The site module is the site's own SiteSpec with only what this 2-core machine forces changed
(test_site_configs.small: one node, 2 ranks of one thread, 2 cores; here 2 cpu workers and one
cpu block at a time) and what a user fills in (the account; module loads where the site holds a
placeholder or none).

The stand-in nodes (tests/fake_scheduler/fakesched.py's $FAKE_NODE_ENV):
- TensorFlow lists the site's accelerators (tests/fake_scheduler/devices/sitecustomize.py): 4
  GPUs on polaris and perlmutter, 12 XPU tiles on aurora, none on slurm (a CPU cluster) and theta
  (KNL); the ops run on the CPU;
- a stand-in /sys (tests/stand_in_node.py) whose counters rise while the run runs.

The run: configs/tiny.toml's whole DAG, every stage of a default run and its tasks (stage,
preprocess, train 30 steps on 2 Horovod ranks, select of 2 checkpoints, infer in 4 blocks,
stitch, evaluate, export), with the evaluation's watershed baseline untuned ([watershed] learned =
false): learning its boundary forest took a quarter of the tiny run's time. (10 steps of training
would save little, and its model segments nothing: the export then has nothing to show.) A run
takes 40-60 s alone on 2 cores, 50-95 s two at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
from pathlib import Path

import pytest
from stand_in_node import StandInNode
from test_site_configs import (  # noqa: F401  (fixtures: fake_scheduler, leftovers)
    FAKE_SCHEDULER,
    SUBMIT_TOOL,
    fake_scheduler,
    leftovers,
    small,
)
from workflow_runs import tiny_variant, workflow

from site_configs import load_site

DEVICES_STAND_IN = FAKE_SCHEDULER / "devices"  # its sitecustomize.py
MASK_ENV = {"GPU": "CUDA_VISIBLE_DEVICES", "XPU": "ZE_AFFINITY_MASK"}
STAGES = {"stage", "preprocess", "train", "select", "infer", "stitch", "evaluate", "export"}
RUN_TIMEOUT = 900  # seconds for one site's run, 15 times what it takes here


@dataclasses.dataclass(frozen=True)
class Site:
    flavour: str  # the stand-in scheduler
    module_calls: tuple[str, ...]  # what each job's worker_init asks `module`
    devices: str | None = None  # what TensorFlow lists on a node: "GPU:4"
    ranks_take: tuple[str, ...] = ()  # the device ranks 0 and 1 make visible
    worker_init: str | None = None  # the module loads a user gives a site that holds none


# The loads perlmutter's comment names for its placeholder (WarpX's Perlmutter GPU profile).
PERLMUTTER_LOADS = "gpu PrgEnv-gnu cray-mpich cudatoolkit craype-accel-nvidia80 cray-python"

SITES = {
    "aurora": Site(
        "pbspro",
        ("load tensorflow", "load mpich/opt/develop-git.6037a7a"),
        devices="XPU:12",
        ranks_take=("XPU:0", "XPU:1"),  # local rank r on tile r
    ),
    "polaris": Site(
        "pbspro",
        ("use /soft/modulefiles", "load conda", "load cray-mpich"),
        devices="GPU:4",
        ranks_take=("GPU:3", "GPU:2"),  # ALCF's reverse order
    ),
    "perlmutter": Site(
        "slurm",
        (f"load {PERLMUTTER_LOADS}",),
        devices="GPU:4",
        ranks_take=("GPU:0", "GPU:1"),
        worker_init=f"module load {PERLMUTTER_LOADS}",
    ),
    "slurm": Site(
        "slurm",
        ("load python openmpi",),
        worker_init="module load python openmpi",  # the example of the site's comment
    ),
    "theta": Site("cobalt", ("load miniconda-3",)),
}

SITE_MODULE = '''"""Site {name} on this 2-core machine, through the stand-in scheduler."""

import dataclasses

from site_configs import {name} as own

SITE = dataclasses.replace(
    own.SITE,
{changes}
)


def make_config(run_dir, site=None):
    return own.make_config(run_dir, site or SITE)
'''


def site_module(name: str, site: Site, scheduler, folder: Path) -> Path:
    """A site module as a user writes one for `--site path.py`: the site's SiteSpec with the
    changes small() makes for this machine and the stand-in's venv, but the site's own
    worker_init (or the user's module loads) and monitoring (the report's node-hours)."""
    own = load_site(name).SITE
    here = dataclasses.replace(
        small(own, scheduler),
        cpu_workers_per_node=2,  # two workers, each with its own accelerator
        cpu_max_blocks=1,  # one node here: a second block's workers would share its 2 cores
        worker_init=site.worker_init or own.worker_init,
        monitoring=own.monitoring,
    )
    changes = {
        f.name: getattr(here, f.name)
        for f in dataclasses.fields(own)
        if getattr(here, f.name) != getattr(own, f.name)
    }
    path = folder / f"{name}_here.py"
    settings = "".join(f"    {setting}={value!r},\n" for setting, value in changes.items())
    path.write_text(SITE_MODULE.format(name=name, changes=settings.rstrip("\n")))
    return path


def node_environment(site: Site, node: StandInNode, records: Path) -> dict[str, str]:
    """What every job on the stand-in nodes starts with: their /sys and, on a GPU site, the
    accelerators TensorFlow lists."""
    env = {
        "FFN_ENERGY_SYSFS": str(node.root),
        "PYTHONPATH": str(DEVICES_STAND_IN),
        "FAKE_TF_RECORDS": str(records),
    }
    return env | ({"FAKE_TF_DEVICES": site.devices} if site.devices else {})


@contextlib.contextmanager
def node_at_work(node: StandInNode, every: float = 0.2):
    """The node's counters rising while the block runs (CPU 0.2 W, DRAM 0.05 W, GPU 0.1 W: the
    60 J package counter wraps after 5 s, then every 5 minutes, so a task's first and last readings
    are never a wrap apart); yields {"joules": added so far}."""
    added = {"joules": 0.0}
    stop = threading.Event()

    def work() -> None:
        while not stop.wait(every):
            node.use(CPU=0.2 * every, DRAM=0.05 * every, GPU=0.1 * every)
            added["joules"] += 0.35 * every

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield added
    finally:
        stop.set()
        thread.join()


def device_records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def cost_table(report: str) -> dict[str, tuple[str, str]]:
    """The report's cost rows: stage -> (node-hours, energy)."""
    section = report.split("## Cost")[1].split("\n## ")[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: (cells[1], cells[2]) for cells in rows[1:] if len(cells) == 3}


JOULES = re.compile(r"([\d.,]+) (J|kJ)\b")  # an energy cell read: "12.3 J (CPU 9.0 J, ...)"


def joules(cell: str) -> float:
    number, unit = JOULES.match(cell).groups()
    return float(number.replace(",", "")) * (1e3 if unit == "kJ" else 1)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return tiny_variant(
        tmp_path_factory.mktemp("config"),
        "sites",
        {"[export]": "[watershed]\nlearned = false\n\n[export]"},
    )


@pytest.mark.mpi
@pytest.mark.slow  # a whole run through the stand-in's jobs: about a minute on 2 cores
@pytest.mark.parametrize("name", sorted(SITES))
def test_the_tiny_dag_runs_end_to_end_through_the_sites_stand_in_scheduler(
    name,
    config,
    tmp_path,
    fake_scheduler,  # noqa: F811
    leftovers,  # noqa: F811
    monkeypatch,
):
    site = SITES[name]
    scheduler = fake_scheduler(site.flavour)
    node, records = StandInNode(tmp_path / "sys"), tmp_path / "devices"
    monkeypatch.setenv("FAKE_NODE_ENV", json.dumps(node_environment(site, node, records)))
    run_dir = tmp_path / "run"
    command = ["--site", str(site_module(name, site, scheduler, tmp_path))]
    command += ["--config", str(config), "--run-dir", str(run_dir)]

    with node_at_work(node) as added:
        try:
            workflow(*command, timeout=RUN_TIMEOUT)
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{scheduler.job_output()}") from None

    # The run finished, through the stand-in's jobs, and left nothing running.
    assert (run_dir / "evaluation.json").is_file()
    report = (run_dir / "report.md").read_text()
    jobs = scheduler.calls(SUBMIT_TOOL[site.flavour])
    pools = {re.search(r"/parsl\.(\w+)\.block-\d+\.", argv[-1])[1] for argv in jobs}
    assert pools == {"cpu", "mpi"}  # the job scripts Parsl wrote, one per block
    assert scheduler.live_jobs() == []
    assert leftovers() == []

    # Each job ran the site's worker_init, module loads included.
    module_calls = [" ".join(argv) for argv in scheduler.calls("module")]
    assert sorted(module_calls) == sorted(site.module_calls * len(jobs))

    # Each training rank took its own accelerator, in the site's order; each cpu worker its own.
    train_log = (run_dir / "train" / "train.log").read_text()
    seen = device_records(records)
    if site.devices:
        kind, count = site.devices.split(":")
        ranks = {r["rank"]: r for r in seen if "visible" in r}
        assert {rank: r["visible"] for rank, r in ranks.items()} == {
            str(rank): [f"/physical_device:{device}"] for rank, device in enumerate(site.ranks_take)
        }
        assert all(r["memory_growth"] == {r["visible"][0]: True} for r in ranks.values())
        rank_0 = site.ranks_take[0].replace(":", " ")
        assert f"[train] 2 rank(s); rank 0 on {rank_0} of {count}" in train_log
        workers = [r for r in seen if "visible" not in r]  # the inference and selection tasks'
        assert workers, seen
        for worker in workers:  # Parsl gives worker i accelerator i (available_accelerators)
            assert worker["mask"][MASK_ENV[kind]] == worker["parsl_worker"], worker
            assert worker["listed"] == [f"/physical_device:{kind}:0"]  # its one, alone
    else:
        assert seen == []
        assert "[train] 2 rank(s); rank 0 on the CPU (no GPU or XPU)" in train_log

    # The report charges every stage node-hours, and joules of the node's counters.
    costs = cost_table(report)
    assert set(costs) == STAGES | {"total"}, costs
    assert all(hours != "-" for hours, _ in costs.values()), costs
    assert float(costs["train"][0]) > 0
    assert "1 block(s) of 1 node(s)" in costs["total"][0]
    assert all(JOULES.match(energy) for _, energy in costs.values()), costs  # read, every stage
    assert joules(costs["train"][1]) > 0 and "(CPU " in costs["train"][1]
    assert 0 < joules(costs["total"][1]) <= added["joules"] + 0.1  # the cells are rounded
    assert "read: intel-gpu:card0, rapl:package-0, rapl:package-0/dram." in report
