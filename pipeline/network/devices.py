"""Where each Horovod rank runs: one rank per GPU (an NVIDIA GPU, or a tile of an Intel GPU, which
TensorFlow lists as an "XPU"), pinned by its local rank; and a check that the ranks the launcher
started are one world.

On a GPU node the site starts as many ranks per node as the node has devices (Polaris: 4 A100;
Aurora: 12 tiles, 6 GPUs of 2 tiles each); each rank of a node takes a device of its own, in the
site's order (`SiteSpec.gpu_order`, which the launch line exports as $FFN_GPU_ORDER), and lets
TensorFlow allocate its memory as it goes, so the ranks of a node do not fight over the first
device. Where the launcher shows each rank only its own device ($CUDA_VISIBLE_DEVICES or
$ZE_AFFINITY_MASK naming one), the rank takes the one it sees. Without devices nothing is bound;
a site whose jobs export $FFN_GPU_KIND (Aurora's: "xpu") stops a rank that finds none of that kind
instead of letting it train on the CPU. The batch per rank stays the same, so the global batch and
the learning rate (pipeline.training.lr_scaling) scale with the ranks.
"""

import importlib
import os
from collections.abc import Mapping
from typing import Literal, get_args

from pipeline.core.errors import ConfigError, LaunchError, first_line

# Which GPU local rank r takes on a node of n GPUs. "local_rank": GPU r. "reverse": GPU n-1-r,
# ALCF's advice for Polaris, whose GPUs are numbered against the order of its NUMA domains, so
# that a rank bound by depth to the first cores gets the GPU beside them
# (set_affinity_gpu_polaris.sh: "assign GPUs in reverse order due to topology").
GpuOrder = Literal["local_rank", "reverse"]
GPU_ORDERS: tuple[str, ...] = get_args(GpuOrder)
# Set by the training's launch line (site_configs.launch.MPILaunch.env), read by every rank.
GPU_ORDER_ENV = "FFN_GPU_ORDER"

# What a site's GPUs are (`SiteSpec.gpu_kind`): "cuda", NVIDIA's (TensorFlow's CUDA build lists
# them as "GPU" devices; Horovod allreduces with NCCL), or "xpu", Intel's Data Center GPU Max
# (TensorFlow lists each tile as an "XPU" device through Intel's extension,
# intel_extension_for_tensorflow; Horovod is Intel's, allreducing with oneCCL).
GpuKind = Literal["cuda", "xpu"]
GPU_KINDS: tuple[str, ...] = get_args(GpuKind)
DEVICE_TYPE: dict[str, str] = {"cuda": "GPU", "xpu": "XPU"}  # TensorFlow's device type of each
# Exported by a site's training jobs whose ranks must find devices of this kind (Aurora's: xpu).
GPU_KIND_ENV = "FFN_GPU_KIND"
# Intel's extension for TensorFlow: where it is installed, it is imported before TensorFlow lists
# its devices. ALCF's "TensorFlow on Aurora" (docs.alcf.anl.gov/aurora/data-science/frameworks/
# tensorflow/): "it may also be necessary to load the Intel Extension for TensorFlow"; its
# Horovod example imports it before it lists the XPUs.
XPU_EXTENSION = "intel_extension_for_tensorflow"
# What a launcher sets to show each rank only its own device(s), per TensorFlow device type:
# CUDA's, and Level Zero's (ALCF's gpu_tile_compact.sh sets ZE_AFFINITY_MASK=<gpu>.<tile> for
# each rank: docs.alcf.anl.gov/aurora/running-jobs-aurora/, "Binding MPI ranks to GPUs").
MASK_ENV: dict[str, str] = {"GPU": "CUDA_VISIBLE_DEVICES", "XPU": "ZE_AFFINITY_MASK"}


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


def load_xpu_extension() -> str | None:
    """Import Intel's extension for TensorFlow where it is installed, so that TensorFlow lists
    the tiles as XPU devices. None when it loaded or is not installed (a CUDA or CPU venv); the
    import's error, in one line, when it is installed but does not load (on a node without Intel
    GPUs, as ALCF's page says of Aurora's login nodes)."""
    try:
        importlib.import_module(XPU_EXTENSION)
    except ModuleNotFoundError as missing:
        if missing.name == XPU_EXTENSION:
            return None
        return f"{XPU_EXTENSION} does not load: {first_line(missing)}"
    except Exception as error:  # noqa: BLE001 - whatever the extension raises, said in one line
        return f"{XPU_EXTENSION} does not load: {type(error).__name__}: {first_line(error)}"
    return None


def visible_devices(tf) -> tuple[str, list, str | None]:
    """TensorFlow's device type of this process's accelerators, the devices, and why Intel's
    extension did not load (None: it did, or is not installed): the GPUs, else the XPUs; ("GPU",
    [], ...) with neither. The extension is imported before TensorFlow lists any device."""
    extension_error = load_xpu_extension()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return "GPU", gpus, extension_error
    xpus = tf.config.list_physical_devices("XPU")
    return ("XPU" if xpus else "GPU"), xpus, extension_error


def gpu_kind(environ: Mapping[str, str]) -> GpuKind | None:
    """The kind of device the site's jobs say every rank must find ($FFN_GPU_KIND); None when
    they say nothing (a site that does not export it, a training started by hand)."""
    kind = environ.get(GPU_KIND_ENV) or None
    if kind is not None and kind not in GPU_KINDS:
        raise ConfigError(f"{GPU_KIND_ENV}={kind!r} is not one of {', '.join(GPU_KINDS)}")
    return kind


def _masked_to_one(kind: str, environ: Mapping[str, str]) -> str | None:
    """The device the launcher left this rank ($CUDA_VISIBLE_DEVICES or $ZE_AFFINITY_MASK naming
    exactly one), as the variable's assignment; None when it did not mask them to one."""
    variable = MASK_ENV[kind]
    value = (environ.get(variable) or "").strip()
    if value and "," not in value:
        return f"{variable}={value}"
    return None


def required_devices(tf, who: str, environ: Mapping[str, str] | None = None) -> tuple[str, list]:
    """This process's accelerators (device type, devices), Intel's extension loaded first. A
    process of a site whose jobs export $FFN_GPU_KIND that finds none of that kind stops
    (LaunchError, naming `who`: "local rank 3", "inference") rather than run on the CPU."""
    environ = os.environ if environ is None else environ
    expected = gpu_kind(environ)
    kind, devices, extension_error = visible_devices(tf)
    if expected is not None and (not devices or kind != DEVICE_TYPE[expected]):
        wanted = DEVICE_TYPE[expected]
        if expected == "xpu":
            why = extension_error or (
                f"is {XPU_EXTENSION} installed (the site's TensorFlow module loaded before the "
                "venv, made with make env MPI=system GPU=xpu)?"
            )
        else:
            why = "is this venv's TensorFlow the CUDA build (make env MPI=system GPU=1)?"
        raise LaunchError(
            f"{who}: TensorFlow lists no {wanted} device, but the site's jobs run on {wanted}s "
            f"({GPU_KIND_ENV}={expected}) and it would run on the CPU: {why}"
        )
    return kind, devices


def bind_to_gpu(
    tf, local_rank: int, order: GpuOrder = "local_rank", environ: Mapping[str, str] | None = None
) -> str:
    """Make this rank's device (a GPU, or an XPU tile) the only one TensorFlow sees (before its
    first op); returns which device the rank got, for the log. A rank the launcher showed one
    device only takes that one, whatever its local rank. A rank that finds no device of the kind
    its site's jobs export as $FFN_GPU_KIND stops (LaunchError) rather than train on the CPU."""
    environ = os.environ if environ is None else environ
    kind, devices = required_devices(tf, f"local rank {local_rank}", environ)
    if not devices:
        return "the CPU (no GPU or XPU)"
    masked = _masked_to_one(kind, environ) if len(devices) == 1 else None
    index = 0 if masked else gpu_for_rank(local_rank, len(devices), order)
    tf.config.set_visible_devices(devices[index], kind)
    tf.config.experimental.set_memory_growth(devices[index], True)
    seen = f"{kind} {index} of {len(devices)}"
    return f"{seen} ({masked}, set by the launcher)" if masked else seen


def check_world_size(actual: int, expected: int | None) -> None:
    """Ranks started as separate 1-rank jobs (an MPI that Horovod was not built against) each
    see a world of 1 and would train alone without an error: stop them at once."""
    if expected is not None and actual != expected:
        raise LaunchError(
            f"Horovod sees {actual} rank(s) but the launch started {expected}: the ranks are not one "
            "MPI job (is Horovod built against this launcher's MPI? make env MPI=system on an HPC site)"
        )
