"""Stand-in accelerators as TensorFlow lists them on a stand-in node, for tests only
(tests/site_configs/test_sites_run_the_dag.py); the ops still run on the CPU.

Python imports `sitecustomize` as it starts. With this folder on a job's PYTHONPATH and
$FAKE_TF_DEVICES naming a kind and a count ("GPU:4" for four A100, "XPU:12" for Aurora's twelve
tiles), a process that imports TensorFlow finds, once it is imported:

- `tf.config.list_physical_devices(kind)`: that many devices, or those the launcher left it
  ($CUDA_VISIBLE_DEVICES, $ZE_AFFINITY_MASK: "1" leaves one, listed as device 0, as CUDA and Level
  Zero renumber them);
- `tf.config.set_visible_devices` and `tf.config.experimental.set_memory_growth` taking them;
  other kinds' devices (the real CPU) go to TensorFlow's own.

Each such process writes what it saw to $FAKE_TF_RECORDS/<pid>.json as it imports TensorFlow and
whenever it makes a device visible: its MPI rank and Parsl worker, the masking variables, the
devices listed, and the device it made visible (pipeline.network.devices.bind_to_gpu's choice).
"""

import importlib.abc
import importlib.util
import json
import os
import sys

DEVICES_ENV = "FAKE_TF_DEVICES"
RECORDS_ENV = "FAKE_TF_RECORDS"
MASK_ENV = {"GPU": "CUDA_VISIBLE_DEVICES", "XPU": "ZE_AFFINITY_MASK"}


def stand_in_devices(tf, kind: str, count: int) -> None:
    """Wrap tf.config's device calls so that they list and take `count` devices of `kind`."""
    mask = os.environ.get(MASK_ENV[kind], "").strip()
    shown = len(mask.split(",")) if mask else count
    devices = [tf.config.PhysicalDevice(f"/physical_device:{kind}:{i}", kind) for i in range(shown)]
    record = {
        "pid": os.getpid(),
        "rank": os.environ.get("PMI_RANK"),
        "local_rank": os.environ.get("MPI_LOCALRANKID"),
        "parsl_worker": os.environ.get("PARSL_WORKER_RANK"),
        "mask": {name: os.environ.get(name) for name in MASK_ENV.values()},
        "listed": [d.name for d in devices],
    }
    config = tf.config
    real_list = config.list_physical_devices
    real_set_visible = config.set_visible_devices
    real_memory_growth = config.experimental.set_memory_growth

    def list_physical_devices(device_type=None):
        if device_type == kind:
            return list(devices)
        return real_list(device_type) + (list(devices) if device_type is None else [])

    def set_visible_devices(chosen, device_type=None):
        chosen = [chosen] if isinstance(chosen, tf.config.PhysicalDevice) else list(chosen)
        if device_type != kind and not any(d.device_type == kind for d in chosen):
            return real_set_visible(chosen, device_type)
        record["visible"] = [d.name for d in chosen]
        save(record)
        return None

    def set_memory_growth(device, enable):
        if device.device_type != kind:
            return real_memory_growth(device, enable)
        record.setdefault("memory_growth", {})[device.name] = enable
        save(record)
        return None

    config.list_physical_devices = list_physical_devices
    config.set_visible_devices = set_visible_devices
    config.experimental.set_memory_growth = set_memory_growth
    save(record)


def save(record: dict) -> None:
    folder = os.environ[RECORDS_ENV]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{record['pid']}.json")
    with open(path + ".new", "w") as out:
        json.dump(record, out)
    os.replace(path + ".new", path)  # a reader never sees half a record


class AfterTensorFlow(importlib.abc.MetaPathFinder):
    """Finds TensorFlow as the other finders do, and stands the devices in once it is imported."""

    def __init__(self, kind: str, count: int):
        self.kind, self.count = kind, count

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)  # once: the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            stand_in_devices(module, self.kind, self.count)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(DEVICES_ENV):
    _kind, _count = os.environ[DEVICES_ENV].split(":")
    sys.meta_path.insert(0, AfterTensorFlow(_kind, int(_count)))
