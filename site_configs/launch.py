"""The launch contract of the training app: `MPILaunch`, how one multi-rank task starts its ranks
on a site; `mpi_launch`, the one a site's settings give (what `SiteSpec.mpi_launch` returns);
which MPI launchers each scheduler can use; and `expanded_launch_line`, the launch line as Parsl's
MPI mode will compose it for a job's nodes (for `--dry-run`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parsl.executors.high_throughput.mpi_prefix_composer import compose_all

from pipeline.core.errors import ConfigError
from pipeline.network.devices import GPU_ORDER_ENV
from site_configs.pools import MPI_LABEL

if TYPE_CHECKING:
    from site_configs.spec import SiteSpec

# Which MPI launchers each scheduler can use. Parsl's MPI mode (MPIExecutor) finds a block's nodes
# from PBS_NODEFILE or SLURM_NODELIST only; Cobalt sites use aprun directly (see cobalt.py).
LAUNCHERS_FOR = {
    "local": ("mpiexec",),
    "pbspro": ("mpiexec",),
    "slurm": ("srun", "mpiexec"),
    "cobalt": ("aprun",),
}
# Fields that `launcher_options` may use, e.g. "--cpu-bind depth --depth={cpus_per_rank}".
LAUNCHER_OPTION_FIELDS = (
    "ranks_per_node",
    "threads_per_rank",
    "cpus_per_rank",
    "hyperthreads_per_core",
    "cores_per_node",
)
# What MPILaunch.prefix holds where Parsl's MPI mode composes the launcher line for the task.
MPI_PREFIX = "$PARSL_MPI_PREFIX"


@dataclass(frozen=True)
class MPILaunch:
    """How the training app starts its ranks on this site. The same code works everywhere:

    launch = site.mpi_launch(num_nodes)
    @bash_app(executors=[launch.executor])
    def train(..., parsl_resource_specification=None): return launch.command("python -m ...")
    train(..., parsl_resource_specification=launch.resource_specification)
    """

    executor: str  # label of the executor to run on ("mpi")
    prefix: str  # put before the program: "$PARSL_MPI_PREFIX" or "aprun -n ... --cc depth"
    resource_specification: dict  # pass as parsl_resource_specification= ({} where unused)
    env: dict  # exported before the launch (OMP_NUM_THREADS, FFN_GPU_ORDER)
    num_nodes: int
    num_ranks: int
    ranks_per_node: int
    threads_per_rank: int  # give the program as its intra-op threads too

    def command(self, program: str) -> str:
        """The full shell line: exports, launcher prefix, program (already shell-quoted)."""
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.env.items())
        return f"{exports}{self.prefix} {program}"


def _task_size(
    site: SiteSpec, num_nodes: int | None, ranks_per_node: int | None
) -> tuple[int, int]:
    """(nodes, ranks per node) of one multi-rank task, checked against the site."""
    nodes = site.nodes_per_mpi_task if num_nodes is None else num_nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"site {site.name!r}: num_nodes must be >= 1, got {nodes!r}")
    per_node = site.ranks_per_node if ranks_per_node is None else ranks_per_node
    if not 1 <= per_node <= site.ranks_per_node:
        raise ConfigError(
            f"site {site.name!r}: ranks_per_node must be in 1..{site.ranks_per_node}, got {per_node}"
        )
    if nodes > site.nodes_per_block:
        raise ConfigError(
            f"site {site.name!r}: a task on {nodes} nodes does not fit in a block of "
            f"{site.nodes_per_block} (a task cannot span blocks); raise nodes_per_block"
        )
    return nodes, per_node


def mpi_launch(
    site: SiteSpec, num_nodes: int | None = None, ranks_per_node: int | None = None
) -> MPILaunch:
    """How to start one multi-rank task on `num_nodes` nodes (default: `nodes_per_mpi_task`)
    with `ranks_per_node` ranks on each (default: the site's; fewer for a study's small
    worlds, e.g. one rank of a node that holds two)."""
    nodes, per_node = _task_size(site, num_nodes, ranks_per_node)
    ranks = nodes * per_node
    options = site.format_launcher_options()
    # The launchers pass the launching shell's environment on to every rank.
    env = {"OMP_NUM_THREADS": str(site.threads_per_rank), GPU_ORDER_ENV: site.gpu_order}
    if site.scheduler == "cobalt":
        # Classic Theta pattern: the worker runs on the MOM node and calls aprun itself; ALPS
        # places the ranks on free nodes of the job, so no node list and no resource spec.
        prefix = f"aprun -n {ranks} -N {per_node} {options}".strip()
        spec: dict[str, int | str] = {}
    else:
        # Parsl's MPI mode composes $PARSL_MPI_PREFIX from this spec and the block's nodes.
        prefix = MPI_PREFIX
        spec = {"num_nodes": nodes, "ranks_per_node": per_node, "num_ranks": ranks}
        if options:
            spec["launcher_options"] = options
    return MPILaunch(
        executor=MPI_LABEL,
        prefix=prefix,
        resource_specification=spec,
        env=env,
        num_nodes=nodes,
        num_ranks=ranks,
        ranks_per_node=per_node,
        threads_per_rank=site.threads_per_rank,
    )


def expanded_launch_line(site: SiteSpec, launch: MPILaunch, command: str) -> str:
    """`command` (a `launch.command(...)` line) as it runs in a job whose nodes are <node0>,
    <node1>, ...: $PARSL_MPI_PREFIX replaced by what Parsl's MPI mode composes from the resource
    specification and the job's nodes. A Cobalt site's aprun line is complete already."""
    if launch.prefix != MPI_PREFIX:
        return command
    hosts = [f"<node{i}>" for i in range(launch.num_nodes)]
    spec = {k: str(v) for k, v in launch.resource_specification.items()}
    composed = compose_all(site.mpi_launcher, spec, hosts)["PARSL_MPI_PREFIX"].strip()
    return command.replace(MPI_PREFIX, composed)
