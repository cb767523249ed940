"""The dry run's batch jobs (site_configs.dry_run.block_scripts): for one block of each pool, the
script the site's provider writes and the command it submits it with, as a run would. Checked in
what `workflow.py --dry-run` prints for configs/paper.toml on polaris (PBS Pro), slurm and theta
(Cobalt), and against what the same providers send to the stand-in schedulers
(tests/fake_scheduler/) when Parsl, loaded for real, launches a block of each pool.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import parsl
import psutil
import pytest

from pipeline.run.run_config import load_run_config
from site_configs import CPU_LABEL, MPI_LABEL, load_site
from site_configs.dry_run import RUN_NUMBER, SUBMIT_TIME, WORKER_PORT
from site_configs.pools import POOL_LAUNCH_CMD, venv_path
from site_configs.spec import for_run

ROOT = Path(__file__).parents[2]
PAPER = ROOT / "configs" / "paper.toml"
FAKE_SCHEDULER = ROOT / "tests" / "fake_scheduler"
POOL_PROGRAM = POOL_LAUNCH_CMD.split()[0]  # ffn-worker-pool (process_worker_pool.py uninstalled)
SUBMIT_TOOL = {"pbspro": "qsub", "cobalt": "qsub", "slurm": "sbatch"}


@dataclass(frozen=True)
class Shown:
    """One pool's block as the dry run prints it."""

    script_path: str
    script: str
    submit: str

    @property
    def lines(self) -> list[str]:
        return self.script.splitlines()


SHOWN_BLOCK = re.compile(
    r'^  executor "(?P<label>\w+)", block 0: .*? (?P<path>\S+)\n'
    r"(?P<script>(?:    \|(?: .*)?\n)+)"
    r"  and (?:submits it with|runs it on this machine with)\n"
    r"    \$ (?P<submit>.*)$",
    re.M,
)


def shown_blocks(out: str) -> dict[str, Shown]:
    """The batch jobs the dry run printed: per pool, the script's path, its text (the lines after
    "    | ") and the submit command (after "    $ ")."""
    assert "\nbatch jobs: " in out, f"the dry run shows no batch script:\n{out[-2000:]}"
    section = out.split("\nbatch jobs: ", 1)[1]
    blocks = {}
    for match in SHOWN_BLOCK.finditer(section):
        lines = [line[6:] for line in match["script"].splitlines()]
        blocks[match["label"]] = Shown(match["path"], "\n".join(lines) + "\n", match["submit"])
    assert set(blocks) == {MPI_LABEL, CPU_LABEL}, section
    return blocks


def dry_run(site: str, run_dir: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "workflow.py", "--site", site, "--config", str(PAPER)]
        + ["--run-dir", str(run_dir), "--dry-run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def pool_command(block: Shown, run_dir: Path, label: str) -> str:
    """The worker pool's command line in the script, with the values only a run has shown as
    placeholders."""
    (line,) = [x for x in block.lines if x.startswith(f"{POOL_PROGRAM} ")]
    logdir = f"{run_dir}/runinfo/{RUN_NUMBER}/{label}"
    for part in (f"--port={WORKER_PORT}", "--block_id=0", f"--logdir={logdir}"):
        assert part in line.split(), line
    assert f"--cert_dir {logdir}/certificates" in line  # the pool is encrypted
    return line


def worker_init_lines(site, label: str, run_dir: Path) -> list[str]:
    """The lines every job runs before its pool: the site's, the venv, the run's code copy."""
    lines = [*site.worker_init.splitlines(), f"source {venv_path(site)}/bin/activate"]
    return lines + (["export MALLOC_ARENA_MAX=2"] if label == CPU_LABEL else [])


# ---- what the dry run prints ----


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize("name", ["polaris", "slurm", "theta"])
def test_the_dry_run_prints_each_pools_batch_script_and_submit_command(name, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--account", "X"] + (["--queue", "debug"] if name == "slurm" else [])
    blocks = shown_blocks(dry_run(name, run_dir, *args))
    assert not run_dir.exists()  # the dry run writes nothing there (its Config is built aside)

    config = load_run_config(PAPER)
    queue = "debug" if name == "slurm" else None
    site = for_run(load_site(name).SITE, train_nodes=config.train_nodes, account="X", queue=queue)
    nodes = {MPI_LABEL: site.nodes_per_block, CPU_LABEL: site.cpu_nodes_per_block}
    hours, minutes, _ = map(int, site.walltime.split(":"))
    assert site.walltime == site.cpu_job_walltime
    for label, block in blocks.items():
        lines = block.lines
        job = f"parsl.{label}.block-0.{SUBMIT_TIME}"
        scripts = f"{run_dir}/runinfo/{RUN_NUMBER}/submit_scripts"
        assert block.script_path == f"{scripts}/{job}" + (".submit" if name == "theta" else "")
        # The scheduler's lines: walltime, nodes (account and queue where the script holds them).
        if name == "polaris":
            assert f"#PBS -l walltime={site.walltime}" in lines
            select = f"#PBS -l select={nodes[label]}:ncpus={2 * site.cores_per_node}:ngpus=4"
            assert f"{select}:system=polaris" in lines
            assert "#PBS -l place=scatter" in lines and "#PBS -l filesystems=home:eagle" in lines
            assert f"#PBS -N {job}" in lines
        elif name == "slurm":
            for line in [f"--nodes={nodes[label]}", f"--time={60 * hours + minutes}"]:
                assert f"#SBATCH {line}" in lines
            for line in ["--partition=debug", "--account=X", "--exclusive", f"--job-name={job}"]:
                assert f"#SBATCH {line}" in lines
        else:
            assert "#COBALT --attrs filesystems=home,grand" in lines
        # Then the site's worker_init, the venv, the run's copy of the code, and the pool.
        init = worker_init_lines(site, label, run_dir)
        assert [x for x in lines if x in init] == init
        exports = [x for x in lines if x.startswith("export PYTHONPATH=")]
        assert len(exports) == 1 and exports[0].startswith(f"export PYTHONPATH={run_dir}/code/")
        command = pool_command(block, run_dir, label)
        assert lines.index(exports[0]) < lines.index(command)
        # The submit command: the site's queue, account, nodes and walltime where they go on it.
        if name == "polaris":
            expected = ["qsub", "-q", site.queue, "-A", "X", block.script_path]
        elif name == "slurm":
            expected = ["sbatch", block.script_path]
        else:
            prefix = block.script_path.removesuffix(".submit")
            expected = ["qsub", "-n", str(nodes[label]), "-t", str(60 * hours + minutes)]
            expected += ["-q", site.queue, "-A", "X", "-O", prefix, block.script_path]
        assert shlex.split(block.submit) == expected
    # The cpu pool's launcher starts a pool on each node of its job; the mpi pool's (Simple), one.
    launchers = {"polaris": "mpiexec --cpu-bind", "slurm": "srun --ntasks", "theta": "aprun -n"}
    assert any(x.startswith(launchers[name]) for x in blocks[CPU_LABEL].lines)
    assert not any(x.startswith(launchers[name]) for x in blocks[MPI_LABEL].lines)


@pytest.mark.shared  # configs/paper.toml's data
def test_the_local_dry_run_shows_the_shell_script_localprovider_runs(tmp_path):
    out = dry_run("local", tmp_path / "run")
    blocks = shown_blocks(out)
    assert out.count("no batch script: LocalProvider writes this shell script") == 2
    for label, block in blocks.items():
        assert not any(line.startswith("#PBS") for line in block.lines)
        pool_command(block, tmp_path / "run", label)
        # LocalProvider runs the script in the background on this machine and reads its pid.
        assert block.submit.startswith("/bin/bash -c 'echo - >")
        assert f"bash {block.script_path} 1>{block.script_path}.out" in block.submit
    assert not (tmp_path / "run").exists()


# ---- what the providers submit to the stand-in schedulers ----

SITE_MODULE = """import dataclasses
from site_configs import {name} as site

# The site as the test's dry run and its submission both use it; no monitoring processes.
SITE = dataclasses.replace(site.SITE, account="X", queue={queue!r}, monitoring=False)
make_config = site.make_config
"""


def stand_in_scheduler(flavour: str, state: Path, monkeypatch) -> None:
    """One flavour of tests/fake_scheduler first on PATH (as test_site_configs.fake_scheduler)."""
    tools = str(FAKE_SCHEDULER / flavour)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCHED_DIR", str(state))
    monkeypatch.setenv("FAKE_SCHED_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_REAL_MPIEXEC", str(Path(sys.prefix) / "bin" / "mpiexec"))
    monkeypatch.setenv("FAKE_SITE_PATH", f"{tools}{os.pathsep}/usr/local/bin:/usr/bin:/bin")


def submitted(state: Path, tool: str) -> list[list[str]]:
    calls = [json.loads(x) for x in (state / "calls.jsonl").read_text().splitlines()]
    return [c["argv"] for c in calls if c["tool"] == tool]


def end_jobs(state: Path) -> None:
    """Kill whatever a job of the stand-in scheduler still runs (its session)."""
    for path in state.glob("jobs/*.json"):
        sid = json.loads(path.read_text())["sid"]
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == sid:
                    proc.kill()
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                continue


def comparable(text: str) -> str:
    """A script without what differs between two processes that build the same Config: the
    digest of the code copy (another edit of the checkout in between) and the order of the
    interchange's addresses (a set)."""
    text = re.sub(r"/code/[0-9a-f]{16}\b", "/code/<digest>", text)
    return re.sub(r" -a (\S+) ", lambda m: f" -a {','.join(sorted(m[1].split(',')))} ", text)


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize(
    "name, flavour, queue",
    [("polaris", "pbspro", "debug"), ("slurm", "slurm", "debug"), ("theta", "cobalt", None)],
)
def test_the_printed_script_and_command_are_what_the_provider_submits(
    name, flavour, queue, tmp_path, monkeypatch
):
    """A block of each pool launched by Parsl itself (loaded, its interchanges started, the
    block launched as its scaling does) goes to the stand-in scheduler with the script and the
    command line the dry run printed, the run's number, port and submit time filled in."""
    state, run_dir, site_file = tmp_path / "scheduler", tmp_path / "run", tmp_path / "site.py"
    site_file.write_text(SITE_MODULE.format(name=name, queue=queue or load_site(name).SITE.queue))
    stand_in_scheduler(flavour, state, monkeypatch)
    shown = shown_blocks(dry_run(str(site_file), run_dir))
    assert not state.exists()  # the dry run ran no scheduler command (not even Slurm's sacct)

    module = load_site(str(site_file))
    site = for_run(module.SITE, train_nodes=load_run_config(PAPER).train_nodes)
    try:
        with parsl.load(module.make_config(run_dir, site)) as dfk:
            for executor in dfk.executors.values():
                if executor.label not in shown:
                    continue  # Parsl's own "_parsl_internal" thread pool
                block = shown[executor.label]
                (job,) = executor.scale_out_facade(1)  # block 0, as Parsl's scaling launches it
                argv = submitted(state, SUBMIT_TOOL[flavour])[-1]
                executor.provider.cancel([executor.blocks_to_job_id[job]])
                script = Path(argv[-1])
                name = re.escape(f"parsl.{executor.label}.block-0.")
                stamp = re.search(name + r"(\d+\.\d+)", script.name)[1]

                def filled(text: str, executor=executor, stamp=stamp) -> str:
                    text = text.replace(RUN_NUMBER, Path(dfk.run_dir).name)
                    text = text.replace(WORKER_PORT, str(executor.worker_port))
                    return text.replace(SUBMIT_TIME, stamp)

                assert filled(block.script_path) == str(script)
                assert comparable(filled(block.script)) == comparable(script.read_text())
                assert shlex.split(filled(block.submit)) == [SUBMIT_TOOL[flavour], *argv]
    finally:
        end_jobs(state)
