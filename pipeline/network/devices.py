"""Where each Horovod rank runs: one rank per GPU, pinned by its local rank; and a check that the
ranks the launcher started are one world.

On a GPU node the site starts as many ranks per node as the node has GPUs (Polaris: 4); each rank
of a node takes a GPU of its own, in the site's order (`SiteSpec.gpu_order`, which the launch line
exports as $FFN_GPU_ORDER), and lets TensorFlow allocate its memory as it goes, so the ranks of a
node do not fight over the first GPU. Without GPUs nothing is bound. The batch per rank stays the
same, so the global batch and the learning rate (pipeline.training.lr_scaling) scale with the ranks.
"""

from collections.abc import Mapping
from typing import Literal, get_args

from pipeline.core.errors import ConfigError, LaunchError

# Which GPU local rank r takes on a node of n GPUs. "local_rank": GPU r. "reverse": GPU n-1-r,
# ALCF's advice for Polaris, whose GPUs are numbered against the order of its NUMA domains, so
# that a rank bound by depth to the first cores gets the GPU beside them
# (set_affinity_gpu_polaris.sh: "assign GPUs in reverse order due to topology").
GpuOrder = Literal["local_rank", "reverse"]
GPU_ORDERS: tuple[str, ...] = get_args(GpuOrder)
# Set by the training's launch line (site_configs.launch.MPILaunch.env), read by every rank.
GPU_ORDER_ENV = "FFN_GPU_ORDER"


def gpu_order(environ: Mapping[str, str]) -> GpuOrder:
    """The order the launch line asked for ($FFN_GPU_ORDER); "local_rank" when it is unset (a
    training started by hand)."""
    order = environ.get(GPU_ORDER_ENV) or "local_rank"
    if order not in GPU_ORDERS:
        raise ConfigError(f"{GPU_ORDER_ENV}={order!r} is not one of {', '.join(GPU_ORDERS)}")
    return order


def gpu_for_rank(local_rank: int, gpus_on_node: int, order: GpuOrder = "local_rank") -> int | None:
    """The GPU (index among the node's visible GPUs) of the rank with this local rank; None
    when the node has none."""
    if gpus_on_node == 0:
        return None
    if not 0 <= local_rank < gpus_on_node:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own: the node shows {gpus_on_node}; "
            "start one rank per GPU (the site's ranks_per_node)"
        )
    return gpus_on_node - 1 - local_rank if order == "reverse" else local_rank


def bind_to_gpu(tf, local_rank: int, order: GpuOrder = "local_rank") -> str:
    """Make this rank's GPU the only one TensorFlow sees (before its first op); returns what was
    done, for the log."""
    gpus = tf.config.list_physical_devices("GPU")
    index = gpu_for_rank(local_rank, len(gpus), order)
    if index is None:
        return "the CPU (no GPU)"
    tf.config.set_visible_devices(gpus[index], "GPU")
    tf.config.experimental.set_memory_growth(gpus[index], True)
    return f"GPU {index} of {len(gpus)}"


def check_world_size(actual: int, expected: int | None) -> None:
    """Ranks started as separate 1-rank jobs (an MPI that Horovod was not built against) each
    see a world of 1 and would train alone without an error: stop them at once."""
    if expected is not None and actual != expected:
        raise LaunchError(
            f"Horovod sees {actual} rank(s) but the launch started {expected}: the ranks are not one "
            "MPI job (is Horovod built against this launcher's MPI? make env MPI=system on an HPC site)"
        )
