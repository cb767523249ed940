"""`describe(site)`: what a site's Config would do, in a few lines, for `--dry-run`, without a
scheduler or a submission: each pool's executor, provider, launcher, jobs and queues, the
training's launch line as it will run, the worker start-up and the monitoring database.

`block_scripts(site_module, site, run_dir)` (printed by `describe_block_scripts`): for one block
of each pool, the batch script its provider writes and the command line it submits it with (on
the local site, the shell script LocalProvider runs and how), made by the site's `make_config`,
Parsl's executor and the provider's own `submit`, with a stand-in that records the submit command
instead of running it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import unittest.mock
from dataclasses import dataclass
from pathlib import Path

from parsl.providers.cluster_provider import ClusterProvider

from pipeline.core.errors import ConfigError
from site_configs.launch import expanded_launch_line
from site_configs.pools import CPU_LABEL, CPU_WORKER_ENV, MPI_LABEL, worker_init
from site_configs.queues import describe_queues, queue_sizes
from site_configs.spec import SiteSpec

# The provider and the launcher of the "cpu" pool each scheduler's module uses
# (tests/site_configs/test_site_configs.py checks these against the built configs).
PROVIDER_FOR = {
    "local": "LocalProvider",
    "pbspro": "PBSProProvider",
    "cobalt": "CobaltProvider",
    "slurm": "SlurmProvider",
}
CPU_LAUNCHER_FOR = {
    "local": "SingleNodeLauncher",
    "pbspro": "MpiExecLauncher",
    "cobalt": "AprunLauncher",
    "slurm": "SrunLauncher",
}


def _describe_jobs(site: SiteSpec, queue: str | None, walltime: str) -> str:
    """Where one pool's jobs go: "batch jobs of 01:00:00 in queue debug (1-2 nodes, ...)"."""
    if queue is None:
        where = "the scheduler's default queue"
    else:
        sizes = queue_sizes(site.limits_of(queue)) or "limits not in the site's queue_limits"
        where = f"queue {queue} ({sizes})"
    return f"    batch jobs of {walltime} in {where}"


def describe(site: SiteSpec, run_dir: str | Path | None = None) -> str:
    """A few lines saying what the site's Config would do, without a scheduler or a submission."""
    provider = PROVIDER_FOR[site.scheduler]
    batch = site.scheduler != "local"
    lines = [f"site {site.name}: {provider}"]
    if batch:
        lines += _describe_account_and_queues(site)
    lines += _describe_mpi_pool(site, provider, batch)
    lines += _describe_cpu_pool(site, provider, batch)
    lines += [
        "  worker_init:",
        *[f"    {x}" for x in worker_init(site).splitlines()],
    ]
    if batch and site.scheduler_options.strip():
        lines += [
            "  scheduler_options:",
            *[f"    {x}" for x in site.scheduler_options.splitlines()],
        ]
    where = Path(run_dir).resolve() if run_dir is not None else Path("<run_dir>")
    lines.append(
        "  monitoring: " + (f"sqlite:///{where / 'monitoring.db'}" if site.monitoring else "off")
    )
    return "\n".join(lines)


def _describe_account_and_queues(site: SiteSpec) -> list[str]:
    """A batch site's account and queue (a placeholder flagged), and the queues it lists."""
    lines = []
    for name in ("account", "queue"):
        value = getattr(site, name)
        note = "  <- placeholder: set it before submitting" if name in site.placeholders else ""
        lines.append(f"  {name}: {value if value is not None else '(scheduler default)'}{note}")
    if site.queue_limits:
        lines.append(f"  the site's queues: {describe_queues(site.queue_limits)}")
    return lines


def _describe_mpi_pool(site: SiteSpec, provider: str, batch: bool) -> list[str]:
    """The "mpi" pool: its executor, blocks, jobs, GPUs and the training's launch line."""
    launch = site.mpi_launch()
    if site.scheduler == "cobalt":
        mpi_exec = (
            f"HighThroughputExecutor, {site.mpi_tasks_per_block} worker(s) on the job's MOM node "
            f"that call aprun ({provider}, SimpleLauncher)"
        )
    else:
        mpi_exec = (
            f"MPIExecutor(mpi_launcher={site.mpi_launcher!r}, "
            f"max_workers_per_block={site.mpi_tasks_per_block}) ({provider}, SimpleLauncher)"
        )
    line = expanded_launch_line(site, launch, launch.command("python -m pipeline.cli.train ..."))
    lines = [
        f'  executor "{MPI_LABEL}": {mpi_exec}',
        f"    {site.nodes_per_block} node(s) per block, up to {site.max_blocks} block(s); "
        f"{site.ranks_per_node} rank(s) per node x {site.threads_per_rank} thread(s), "
        f"{site.cpus_per_rank} hardware thread(s) per rank",
    ]
    if batch:
        lines.append(_describe_jobs(site, site.queue, site.walltime))
    if site.gpus_per_node:
        lines.append(f"    {site.gpus_per_node} GPU(s) per node, GPU order {site.gpu_order}")
    lines.append(f"    training on {launch.num_nodes} node(s): {line}")
    if launch.resource_specification:
        lines.append(f"    parsl_resource_specification={launch.resource_specification}")
    return lines


def _describe_cpu_pool(site: SiteSpec, provider: str, batch: bool) -> list[str]:
    """The "cpu" pool: its executor, blocks, workers, their environment and jobs."""
    lines = [
        f'  executor "{CPU_LABEL}": HighThroughputExecutor ({provider}, '
        f"{CPU_LAUNCHER_FOR[site.scheduler]})",
        f"    {site.cpu_nodes_per_block} node(s) per block, up to {site.cpu_max_blocks} "
        f"block(s), {site.cpu_workers_per_node} worker(s) per node x "
        f"{site.cpu_threads_per_worker} thread(s), "
        + " ".join(f"{k}={v}" for k, v in CPU_WORKER_ENV.items()),
    ]
    if batch:
        lines.append(_describe_jobs(site, site.cpu_job_queue, site.cpu_job_walltime))
    return lines


# ---- the batch script and the submit command of one block of each pool ----

# What the scripts show in place of the values a run has only once Parsl has started: Parsl's
# run number (runinfo/000, 001, ...: the next free one when the run starts), the port the pool's
# interchange opens for its worker pools, and the time.time() a provider puts in a job's name.
RUN_NUMBER = "<NNN>"
WORKER_PORT = "<worker_port>"
SUBMIT_TIME = "<time>"
PLACEHOLDERS = (
    f"{RUN_NUMBER}: Parsl's run number (runinfo/000, 001, ...), {WORKER_PORT}: the port the "
    f"pool's interchange opens, {SUBMIT_TIME}: when the block is submitted"
)
BLOCK_ID = "0"  # the first block of a pool; the next ones differ only in this number
# What Parsl and the providers are given in their place: words a shell takes as they are, so the
# commands are quoted as a run's are (CobaltProvider's shlex.join would quote "<NNN>").
_TOKENS = {"FFNDRYRUNNUMBER": RUN_NUMBER, "FFNDRYRUNWORKERPORT": WORKER_PORT}
_TOKEN_OF = {shown: token for token, shown in _TOKENS.items()}


@dataclass(frozen=True)
class BlockScript:
    """One block of one pool as its provider would submit it: the script it writes (`script`,
    at `script_path`; LocalProvider's is a shell script it runs itself) and the command line it
    runs to submit it (`submit`), with `PLACEHOLDERS` in place of what only a started run has."""

    label: str  # the executor's: "mpi", "cpu"
    provider: str  # its provider's class name
    script_path: str
    script: str
    submit: str


class _Submitted(Exception):
    """Raised in place of running a provider's command: the command it was about to run."""

    def __init__(self, command: str):
        super().__init__(command)
        self.command = command


def _stand_in_runner(command: str, *args, **kwargs):
    """Each provider's command runner (`execute_wait`) while a block is rendered: nothing runs."""
    raise _Submitted(command)


def _not_run(self, command: str, *args, **kwargs) -> tuple[int, str, str]:
    """A batch provider's command runner while its Config is built: nothing runs, it failed."""
    return 1, "", f"not run by the dry run: {command}"


def _as_given(site: SiteSpec) -> SiteSpec:
    """`site` as given, "YOUR_..." placeholders and all: its Config is built to be shown, never
    submitted (what a run would refuse, the dry run says beside it). Of `site`'s own class (a
    user's SiteSpec may have more fields), whose `require_submittable` passes."""
    shown = type(f"{type(site).__name__}AsGiven", (type(site),), {"require_submittable": _passes})
    return shown(**{f.name: getattr(site, f.name) for f in dataclasses.fields(site)})


def _passes(self) -> None:
    pass


def block_scripts(site_module, site: SiteSpec, run_dir: str | Path) -> list[BlockScript]:
    """The batch script and submit command of one block of each pool of `site`, made by the same
    code that submits them in a run: the site module's `make_config` builds the executors, Parsl's
    HighThroughputExecutor composes the worker pool's command (`initialize_scaling`) and launches
    a block (`_launch_block`), and the provider's own `submit` writes the script and composes its
    submit command, which a stand-in for the provider's command runner records instead of running.

    Nothing is written to `run_dir`, nothing is submitted and no scheduler command runs: the
    Config is built in a temporary folder (the code copy and the runinfo/ a run would make
    there), whose path is then shown as `run_dir`'s. Parsl's run number, the interchange's port
    and the submit time are shown as `PLACEHOLDERS`. A pool without a provider (it runs in the
    workflow process) is left out; one of another executor than HighThroughputExecutor (or
    MPIExecutor, one) is refused (ConfigError)."""
    run_dir = Path(run_dir).resolve()
    as_given = _as_given(site)
    with tempfile.TemporaryDirectory(prefix="ffn-dry-run-") as tmp:
        stand_in = Path(tmp).resolve() / "run"
        # Nothing asked of the scheduler either: SlurmProvider probes `sacct` when it is built.
        with unittest.mock.patch.object(ClusterProvider, "execute_wait", _not_run):
            config = site_module.make_config(stand_in, as_given)
        # As Parsl's DataFlowKernel does before it starts the executors (dflow.py: make_rundir,
        # add_executors), with the run's number not yet known.
        parsl_run_dir = Path(config.run_dir) / _TOKEN_OF[RUN_NUMBER]
        script_dir = parsl_run_dir / "submit_scripts"
        script_dir.mkdir(parents=True)
        blocks = []
        for executor in config.executors:
            if getattr(executor, "provider", None) is None:
                continue
            blocks.append(_block_script(executor, config, parsl_run_dir, script_dir))
        return [_as_shown(block, str(stand_in), str(run_dir)) for block in blocks]


def _block_script(executor, config, parsl_run_dir: Path, script_dir: Path) -> BlockScript:
    """Render block `BLOCK_ID` of `executor` through Parsl's and its provider's own code."""
    from parsl import curvezmq
    from parsl.executors import HighThroughputExecutor

    if not isinstance(executor, HighThroughputExecutor):
        raise ConfigError(
            f'executor "{executor.label}" is a {type(executor).__name__}: only a '
            "HighThroughputExecutor's (or MPIExecutor's) blocks are shown"
        )
    executor.run_dir = str(parsl_run_dir)
    executor.log_config = config.initialize_logging
    executor.provider.script_dir = str(script_dir)
    # What HighThroughputExecutor.start sets before it composes the pools' command: the
    # certificates of an encrypted pool, the pickled logging settings, the interchange's port.
    if getattr(executor, "encrypted", False) and executor.cert_dir is None:
        executor.cert_dir = curvezmq.create_certificates(executor.logdir)
    if getattr(executor, "log_config", None):
        executor.logconf_path = os.path.join(executor.logdir, "log_config", "log_config.pkl")
    executor.worker_port = _TOKEN_OF[WORKER_PORT]
    executor.initialize_scaling()  # formats launch_cmd (HighThroughputExecutor)

    provider = executor.provider
    before = set(script_dir.iterdir())
    runner_module = sys.modules[type(provider).__module__]
    with contextlib.ExitStack() as stack:
        # ClusterProvider's submit runs `self.execute_wait(...)`; LocalProvider's, the function
        # its module imported from parsl.utils.
        stack.enter_context(
            unittest.mock.patch.object(provider, "execute_wait", _stand_in_runner, create=True)
        )
        if hasattr(runner_module, "execute_wait"):
            stack.enter_context(
                unittest.mock.patch.object(runner_module, "execute_wait", _stand_in_runner)
            )
        try:
            executor._launch_block(BLOCK_ID)
        except _Submitted as submitted:
            command = submitted.command
        else:
            raise ConfigError(f'executor "{executor.label}": its provider ran no command')
    written = sorted(set(script_dir.iterdir()) - before)
    script = next((p for p in written if str(p) in command), written[0] if written else None)
    if script is None:
        raise ConfigError(f'executor "{executor.label}": its provider wrote no script')
    return BlockScript(
        label=executor.label,
        provider=type(provider).__name__,
        script_path=str(script),
        script=script.read_text(),
        submit=command,
    )


def _as_shown(block: BlockScript, stand_in: str, run_dir: str) -> BlockScript:
    """`block` with the run dir for the temporary one, and `PLACEHOLDERS` for the tokens and the
    job's submit time."""
    name = re.escape(f"parsl.{block.label}.block-{BLOCK_ID}.")
    stamp = re.search(name + r"(\d+(?:\.\d+)?)", Path(block.script_path).name)

    def shown(text: str) -> str:
        text = text.replace(stand_in, run_dir)
        for token, placeholder in _TOKENS.items():
            text = text.replace(token, placeholder)
        return text.replace(stamp[1], SUBMIT_TIME) if stamp else text

    return dataclasses.replace(
        block,
        script_path=shown(block.script_path),
        script=shown(block.script),
        submit=shown(block.submit),
    )


def describe_block_scripts(site_module, site: SiteSpec, run_dir: str | Path) -> str:
    """For the dry run: each pool's batch script (each of its lines after "    | ") and its submit
    command (after "    $ "); on the local site, the shell script LocalProvider runs and how."""
    try:
        blocks = block_scripts(site_module, site, run_dir)
    except Exception as exc:  # a site module that cannot build its Config: the run would fail
        return f"batch jobs: not shown: {type(exc).__name__}: {exc}"
    local = site.scheduler == "local"
    lines = [
        "batch jobs: one block of each pool as the site's providers would write and submit it "
        "(nothing is submitted; a run starts a pool only when its tasks use it)",
        f"  {PLACEHOLDERS}; -a: this machine's addresses",
    ]
    for block in blocks:
        head = f'  executor "{block.label}", block {BLOCK_ID}: '
        if local:
            lines.append(
                head + f"no batch script: {block.provider} writes this shell script, "
                f"{block.script_path}"
            )
        else:
            lines.append(head + f"{block.provider} writes the batch script {block.script_path}")
        # Every line as written, trailing blanks and the last empty lines too.
        lines += [f"    | {line}" if line else "    |" for line in block.script.splitlines()]
        lines.append("  and runs it on this machine with" if local else "  and submits it with")
        lines.append(f"    $ {block.submit}")
    return "\n".join(lines)
