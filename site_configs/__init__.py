"""Where the workflow runs: one small module per site, each making a Parsl Config from a `SiteSpec`.

    local       this machine: LocalProvider, MPIExecutor + the venv's MPICH mpiexec
    aurora      ALCF Aurora: PBSProProvider, MPIExecutor + mpiexec, a rank per XPU tile
    perlmutter  NERSC Perlmutter GPU nodes: SlurmProvider (-C gpu, --qos), MPIExecutor + srun
    polaris     ALCF Polaris: PBSProProvider, MPIExecutor + PALS mpiexec
    slurm       a Slurm cluster (PMIx by default): SlurmProvider, MPIExecutor + srun
    theta       ALCF Theta (retired; SC'19 setup): CobaltProvider (cobalt.py), HTEX + aprun

What the sites share, one module per job: `spec` (SiteSpec, for_run), `checks` (what a SiteSpec
is checked for when built), `queues` (QueueLimit), `affinity` (the cpu pool's workers' CPUs),
`launch` (MPILaunch, the training's launch
line), `pools` (executor labels, worker start-up), `parsl_config` (build_config), `teardown`
(shutdown) and `dry_run` (describe); `base` re-exports them all for site modules written against it.

`--site` takes one of these names or the path of a user's own module (`load_site`). A site module
has `SITE` (a `SiteSpec`) and `make_config(run_dir, site=None) -> parsl.config.Config`; copy one
of the modules above to start. `make_config` refuses (ConfigError) while `account` or `queue`
still hold a "YOUR_..." placeholder; `describe(site)` works regardless (for `--dry-run`). A site
lists its queues' limits (`SiteSpec.queue_limits`, `QueueLimit`): a SiteSpec whose training or
cpu jobs (nodes, walltime, how many at once) its queue does not take is refused when built,
naming the queues that would; `spec.for_run(site, train_nodes=, account=, queue=, walltime=, cpu_queue=, cpu_walltime=)`
applies a run's changes together, in one check.

Every Config has the same two executors, so apps can name them on any site:

    "mpi" (MPI_LABEL)  multi-rank tasks: Horovod training
    "cpu" (CPU_LABEL)  single-process tasks: staging, preprocessing, inference blocks, evaluation

and the same shared parts (parsl_config.build_config): Parsl's run dir `<run_dir>/runinfo`, retries with
`retry_cost` (a pipeline error is not retried), and monitoring into
`sqlite:///<run_dir>/monitoring.db`. What is done is decided by stamps (pipeline.core.stamps), not by
Parsl's app cache; `teardown.shutdown(dfk)` cancels the blocks so no worker outlives the workflow.
The workflow loads only the executors its tasks to run use (`parsl_config.only_executors`): a run that
does not train starts no "mpi" interchange.

The launcher contract for the training app, the same code on every site:

    site = module.SITE                      # or spec.for_run(module.SITE, account=...)
    launch = site.mpi_launch(num_nodes)     # default: nodes_per_block / mpi_tasks_per_block

    @bash_app(executors=[launch.executor])  # "mpi"
    def train(args, parsl_resource_specification=None, stdout=None, stderr=None):
        return launch.command(f"python -m pipeline.cli.train {args} "
                              f"--intra-op-threads {launch.threads_per_rank}")

    train(args, parsl_resource_specification=launch.resource_specification)

`launch.command(program)` exports OMP_NUM_THREADS and FFN_GPU_ORDER (`SiteSpec.gpu_order`, which
GPU each rank of a node takes: pipeline.network.devices) and puts `launch.prefix` in front of the program:
`$PARSL_MPI_PREFIX` on local, polaris and slurm (Parsl's MPI mode composes it from the resource
specification `{num_nodes, ranks_per_node, num_ranks[, launcher_options]}` and the block's nodes:
`mpiexec -n 2 -ppn 2 -hosts localhost` locally, `srun --ntasks ...` on Slurm), and on theta a
complete `aprun -n <ranks> -N <ranks/node> -d .. -j .. --cc depth ...` with an empty resource
specification (HTEX without MPI mode accepts no MPI keys). A task cannot span blocks, so
`num_nodes <= nodes_per_block` (ConfigError otherwise).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

from pipeline.core.errors import ConfigError
from site_configs.dry_run import describe
from site_configs.launch import MPILaunch
from site_configs.pools import CPU_LABEL, MPI_LABEL
from site_configs.queues import QueueLimit
from site_configs.spec import SiteSpec

__all__ = [
    "CPU_LABEL",
    "MPI_LABEL",
    "MPILaunch",
    "QueueLimit",
    "SiteSpec",
    "describe",
    "known_sites",
    "load_site",
]

# Modules of this package that are building blocks, not sites.
_NOT_SITES = {
    "affinity",
    "base",
    "checks",
    "cobalt",
    "dry_run",
    "environment",
    "launch",
    "parsl_config",
    "pools",
    "queues",
    "spec",
    "teardown",
}


def known_sites() -> list[str]:
    """Names `--site` accepts besides a path."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules([str(Path(__file__).parent)])
        if not m.ispkg and m.name not in _NOT_SITES and not m.name.startswith("_")
    )


def load_site(name_or_path: str) -> ModuleType:
    """The site module for `--site`: `site_configs.<name>`, or a user's `.py` file given by path.

    The module must define `make_config(run_dir, site=None)` and `SITE`, a `SiteSpec`."""
    text = str(name_or_path)
    looks_like_path = text.endswith(".py") or "/" in text or "\\" in text
    if looks_like_path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(f"--site {text}: no such file")
        module_name = f"site_configs._user_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"--site {text}: cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules[module_name]
            raise
    elif text in known_sites():
        module = importlib.import_module(f"{__name__}.{text}")
    else:
        raise ConfigError(
            f"--site {text}: unknown site; known sites: {', '.join(known_sites())} "
            "(or give the path of a .py file that defines SITE and make_config)"
        )
    if not callable(getattr(module, "make_config", None)):
        raise ConfigError(f"--site {text}: the module has no make_config(run_dir, site=None)")
    if not isinstance(getattr(module, "SITE", None), SiteSpec):
        raise ConfigError(f"--site {text}: the module has no SITE = SiteSpec(...)")
    return module
