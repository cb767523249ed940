"""Device binding and the world-size check (pipeline.network.devices): the logic a GPU node relies on,
tested here without one, with a stand-in for TensorFlow's device API: NVIDIA GPUs as TensorFlow's
CUDA build lists them ("GPU"), and the tiles of Aurora's Intel GPUs as Intel's extension for
TensorFlow lists them ("XPU"; ALCF's "TensorFlow on Aurora" shows XPU:0 ... XPU:11 on a node)."""

import sys
from types import SimpleNamespace

import pytest

from pipeline.core.errors import ConfigError, LaunchError
from pipeline.network.devices import (
    XPU_EXTENSION,
    bind_to_gpu,
    check_world_size,
    gpu_for_rank,
    gpu_kind,
    gpu_order,
)
from pipeline.network.model import ModelConfig, build_model


class FakeDevices:
    """tf.config's device calls, recording what a rank made visible. `xpus` are listed only once
    Intel's extension is imported when `needs_extension` (as ALCF says it may be on Aurora)."""

    def __init__(self, gpus: int = 0, xpus: int = 0, needs_extension: bool = False):
        self.gpus = [f"GPU:{i}" for i in range(gpus)]
        self.xpus = [f"XPU:{i}" for i in range(xpus)]
        self.needs_extension = needs_extension
        self.visible, self.growth, self.listed = None, [], []
        self.experimental = SimpleNamespace(
            set_memory_growth=lambda device, on: self.growth.append(device)
        )

    def list_physical_devices(self, kind):
        self.listed.append((kind, XPU_EXTENSION in sys.modules))
        if kind == "GPU":
            return self.gpus
        if kind == "XPU" and (XPU_EXTENSION in sys.modules or not self.needs_extension):
            return self.xpus
        return []

    def set_visible_devices(self, device, kind):
        self.visible = (device, kind)


def bind(devices: FakeDevices, local_rank: int, order="local_rank", **environ: str) -> str:
    """bind_to_gpu on the stand-in, with exactly `environ` as the rank's environment."""
    return bind_to_gpu(SimpleNamespace(config=devices), local_rank, order, environ)


@pytest.fixture
def stand_in_extension(tmp_path, monkeypatch):
    """Install a stand-in intel_extension_for_tensorflow whose import runs `body`."""

    def install(body: str = "") -> None:
        package = tmp_path / XPU_EXTENSION
        package.mkdir()
        (package / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))

    monkeypatch.delitem(sys.modules, XPU_EXTENSION, raising=False)
    yield install
    sys.modules.pop(XPU_EXTENSION, None)


# ---- NVIDIA GPUs ----


@pytest.mark.parametrize("local_rank", range(4))
def test_four_ranks_of_a_polaris_node_take_one_a100_each(local_rank):
    devices = FakeDevices(gpus=4)
    assert bind(devices, local_rank) == f"GPU {local_rank} of 4"
    assert devices.visible == (f"GPU:{local_rank}", "GPU")
    assert devices.growth == [f"GPU:{local_rank}"]


@pytest.mark.parametrize("local_rank", range(4))
def test_in_reverse_order_local_rank_0_takes_the_last_gpu(local_rank):
    """ALCF's order for Polaris (set_affinity_gpu_polaris.sh): GPU 3 - local rank."""
    devices = FakeDevices(gpus=4)
    gpu = 3 - local_rank
    assert bind(devices, local_rank, "reverse") == f"GPU {gpu} of 4"
    assert devices.visible == (f"GPU:{gpu}", "GPU") and devices.growth == [f"GPU:{gpu}"]


def test_the_order_comes_from_the_launch_lines_environment():
    assert gpu_order({"FFN_GPU_ORDER": "reverse"}) == "reverse"
    assert gpu_order({}) == "local_rank"  # a training started by hand
    with pytest.raises(ConfigError, match="FFN_GPU_ORDER='numa' is not one of local_rank, reverse"):
        gpu_order({"FFN_GPU_ORDER": "numa"})


def test_without_gpus_nothing_is_bound():
    devices = FakeDevices()
    assert bind(devices, 1) == "the CPU (no GPU or XPU)"
    assert devices.visible is None and gpu_for_rank(3, 0) is None


def test_more_ranks_than_gpus_on_a_node_is_refused():
    with pytest.raises(ConfigError, match="local rank 4 has no GPU of its own: the node shows 4"):
        gpu_for_rank(4, 4)


def test_a_rank_the_launcher_showed_one_gpu_takes_it_whatever_its_local_rank():
    devices = FakeDevices(gpus=1)
    got = bind(devices, 3, CUDA_VISIBLE_DEVICES="3")
    assert got == "GPU 0 of 1 (CUDA_VISIBLE_DEVICES=3, set by the launcher)"
    assert devices.visible == ("GPU:0", "GPU")
    with pytest.raises(ConfigError, match="local rank 3 has no GPU of its own"):
        bind(FakeDevices(gpus=1), 3)  # one GPU, and no launcher chose it for this rank


# ---- Aurora: 6 Intel GPUs x 2 tiles, each tile an XPU device ----


@pytest.mark.parametrize("local_rank", range(12))
def test_twelve_ranks_of_an_aurora_node_take_one_tile_each(local_rank):
    """As ALCF's Horovod example does: set_visible_devices(xpus[hvd.local_rank()], 'XPU')."""
    devices = FakeDevices(xpus=12)
    assert bind(devices, local_rank, FFN_GPU_KIND="xpu") == f"XPU {local_rank} of 12"
    assert devices.visible == (f"XPU:{local_rank}", "XPU")
    assert devices.growth == [f"XPU:{local_rank}"]


def test_a_rank_the_launcher_masked_to_one_tile_takes_it():
    """ALCF's gpu_tile_compact.sh: ZE_AFFINITY_MASK=<gpu>.<tile> per rank, so each sees one XPU."""
    devices = FakeDevices(xpus=1)
    got = bind(devices, 5, ZE_AFFINITY_MASK="2.1", FFN_GPU_KIND="xpu")
    assert got == "XPU 0 of 1 (ZE_AFFINITY_MASK=2.1, set by the launcher)"
    assert devices.visible == ("XPU:0", "XPU") and devices.growth == ["XPU:0"]


def test_intels_extension_is_imported_before_tensorflow_lists_a_device(stand_in_extension):
    stand_in_extension()
    devices = FakeDevices(xpus=12, needs_extension=True)
    assert bind(devices, 7) == "XPU 7 of 12"
    assert devices.listed and all(loaded for _, loaded in devices.listed)


def test_a_rank_of_an_xpu_site_that_finds_no_xpu_stops_instead_of_training_on_the_cpu():
    with pytest.raises(LaunchError) as error:
        bind(FakeDevices(xpus=12, needs_extension=True), 2, FFN_GPU_KIND="xpu")  # no extension
    message = str(error.value)
    assert message.startswith("local rank 2: TensorFlow lists no XPU device, but the site's jobs")
    assert "FFN_GPU_KIND=xpu" in message and "make env MPI=system GPU=xpu" in message
    assert "\n" not in message
    with pytest.raises(LaunchError, match="lists no XPU device"):
        bind(FakeDevices(gpus=4), 0, FFN_GPU_KIND="xpu")  # a CUDA venv on an XPU site
    with pytest.raises(LaunchError, match="lists no GPU device.*GPU=1"):
        bind(FakeDevices(xpus=12), 0, FFN_GPU_KIND="cuda")


SMALL = ModelConfig(fov_shape_zyx=(9, 9, 9), deltas_zyx=(2, 2, 2), depth=1, features=4)


def test_the_network_is_not_built_on_the_cpu_where_the_sites_jobs_require_xpus(monkeypatch):
    """An inference worker of an XPU site (its jobs export FFN_GPU_KIND=xpu) whose TensorFlow
    lists no XPU, as this machine's: the network is refused before its first variable, in one
    line, rather than segment on the CPU."""
    monkeypatch.setenv("FFN_GPU_KIND", "xpu")
    with pytest.raises(LaunchError) as error:
        build_model(SMALL)
    assert str(error.value).startswith("the network: TensorFlow lists no XPU device")
    monkeypatch.delenv("FFN_GPU_KIND")
    assert build_model(SMALL)  # the CPU


def test_an_extension_that_does_not_load_is_named_in_the_ranks_one_line(stand_in_extension):
    stand_in_extension("raise RuntimeError('no XPU device found\\nsecond line')")
    with pytest.raises(LaunchError) as error:
        bind(FakeDevices(xpus=12, needs_extension=True), 0, FFN_GPU_KIND="xpu")
    assert str(error.value).endswith(
        "intel_extension_for_tensorflow does not load: RuntimeError: no XPU device found"
    )
    # A site that does not ask for XPUs: the rank goes on, on what TensorFlow lists.
    assert bind(FakeDevices(xpus=12, needs_extension=True), 0) == "the CPU (no GPU or XPU)"


def test_the_kind_comes_from_the_sites_jobs_environment():
    assert gpu_kind({"FFN_GPU_KIND": "xpu"}) == "xpu"
    assert gpu_kind({}) is None  # a site that does not say: nothing is required
    with pytest.raises(ConfigError, match="FFN_GPU_KIND='rocm' is not one of cuda, xpu"):
        gpu_kind({"FFN_GPU_KIND": "rocm"})


def test_ranks_started_as_separate_jobs_are_stopped():
    check_world_size(8, 8)
    check_world_size(1, None)  # nothing to compare with (started by hand)
    with pytest.raises(LaunchError, match="Horovod sees 1 rank.*the launch started 8"):
        check_world_size(1, 8)
