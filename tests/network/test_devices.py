"""Device binding and the world-size check (pipeline.network.devices): the logic a GPU node relies on,
tested here without one, with a stand-in for TensorFlow's device API."""

from types import SimpleNamespace

import pytest

from pipeline.core.errors import ConfigError, LaunchError
from pipeline.network.devices import bind_to_gpu, check_world_size, gpu_for_rank, gpu_order


class FakeDevices:
    """tf.config's device calls, recording what a rank made visible."""

    def __init__(self, gpus: int):
        self.gpus = [f"GPU:{i}" for i in range(gpus)]
        self.visible, self.growth = None, []
        self.experimental = SimpleNamespace(
            set_memory_growth=lambda gpu, on: self.growth.append(gpu)
        )

    def list_physical_devices(self, kind):
        return self.gpus if kind == "GPU" else []

    def set_visible_devices(self, device, kind):
        self.visible = device


@pytest.mark.parametrize("local_rank", range(4))
def test_four_ranks_of_a_polaris_node_take_one_a100_each(local_rank):
    devices = FakeDevices(gpus=4)
    assert bind_to_gpu(SimpleNamespace(config=devices), local_rank) == f"GPU {local_rank} of 4"
    assert devices.visible == f"GPU:{local_rank}" and devices.growth == [f"GPU:{local_rank}"]


@pytest.mark.parametrize("local_rank", range(4))
def test_in_reverse_order_local_rank_0_takes_the_last_gpu(local_rank):
    """ALCF's order for Polaris (set_affinity_gpu_polaris.sh): GPU 3 - local rank."""
    devices = FakeDevices(gpus=4)
    gpu = 3 - local_rank
    assert bind_to_gpu(SimpleNamespace(config=devices), local_rank, "reverse") == f"GPU {gpu} of 4"
    assert devices.visible == f"GPU:{gpu}" and devices.growth == [f"GPU:{gpu}"]


def test_the_order_comes_from_the_launch_lines_environment():
    assert gpu_order({"FFN_GPU_ORDER": "reverse"}) == "reverse"
    assert gpu_order({}) == "local_rank"  # a training started by hand
    with pytest.raises(ConfigError, match="FFN_GPU_ORDER='numa' is not one of local_rank, reverse"):
        gpu_order({"FFN_GPU_ORDER": "numa"})


def test_without_gpus_nothing_is_bound():
    devices = FakeDevices(gpus=0)
    assert bind_to_gpu(SimpleNamespace(config=devices), 1) == "the CPU (no GPU)"
    assert devices.visible is None and gpu_for_rank(3, 0) is None


def test_more_ranks_than_gpus_on_a_node_is_refused():
    with pytest.raises(ConfigError, match="local rank 4 has no GPU of its own: the node shows 4"):
        gpu_for_rank(4, 4)


def test_ranks_started_as_separate_jobs_are_stopped():
    check_world_size(8, 8)
    check_world_size(1, None)  # nothing to compare with (started by hand)
    with pytest.raises(LaunchError, match="Horovod sees 1 rank.*the launch started 8"):
        check_world_size(1, 8)
