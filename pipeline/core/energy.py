"""The energy counters of the node a task runs on, read while it runs (issue 57, point 6).

`EnergyMeter` reads every counter of the node readable here when a task begins, every
`SAMPLE_SECONDS` while it runs (a thread) and when it ends; `pipeline.core.stamps.run_once`
keeps the readings in the task's stamp (`measured["energy"]`, beside the peak memory that
`pipeline.core.memory` measures: so it is in core, which run_once may import) and the report
(`pipeline.run.run_cost`) turns the readings of all the tasks of a node into each stage's joules.
Finding the counters takes once per worker process ~0.1 s, a task's readings ~50 µs where there
are none.

The counters, all of the whole node and cumulative, read as joules:

- CPU: RAPL through the kernel's powercap files, `/sys/class/powercap/intel-rapl:N/energy_uj`
  (the zones named package-N) and their `dram` sub-zones; the same files on AMD (the rapl
  driver). The core and uncore sub-zones are parts of their package's, and psys (the platform,
  on client machines) holds the packages: both are left out, else counted twice. A counter wraps
  at its zone's `max_energy_range_uj` (262 kJ on most: above 10 min at 400 W, so a task's
  readings, one a minute, see every wrap). Since Linux 5.10 `energy_uj` is readable by root
  only (CVE-2020-8694), so on most clusters a user's tasks cannot read it.
- NVIDIA GPUs: NVML's `nvmlDeviceGetTotalEnergyConsumption` (mJ since the driver loaded, Volta
  and later) through `pynvml`, the module of NVIDIA's own `nvidia-ml-py`, imported only where it
  is installed: it is not in the default venv (`pip install nvidia-ml-py` in a GPU site's).
- Intel GPUs (Aurora's Data Center GPU Max): the i915 or xe driver's hwmon counter,
  `/sys/class/drm/cardN/device/hwmon/hwmonM/energy1_input` (µJ, the card's), which Level Zero
  Sysman (`zesPowerGetEnergyCounter`) and xpu-smi also read. i915's per-tile hwmons
  (`i915_gtN`) are parts of the card's, left out.

No energy library: zeus (ml.energy), the well-kept one that reads these, requires nvidia-ml-py
and amdsmi on every machine, and reads the same files and NVML calls as the few lines below.

`FFN_ENERGY_SYSFS` names a stand-in for `/sys` (the tests' powercap trees whose counters change
while a stage runs); it reaches the workers as every variable of the workflow's environment does.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYSFS_VARIABLE = "FFN_ENERGY_SYSFS"
SAMPLE_SECONDS = 60.0  # between a running task's readings: well within a RAPL counter's wrap
INTEL_GPU_DRIVERS = ("i915", "xe")  # hwmon names of the card-level counters


@dataclass(frozen=True)
class Counter:
    """One cumulative energy counter of the node."""

    name: str  # "rapl:package-0", "rapl:package-0/dram", "nvml:0", "intel-gpu:card0"
    kind: str  # "CPU", "DRAM", "GPU"
    wrap: float | None  # joules at which it starts again from 0; None: it does not wrap
    read: Callable[[], float]  # its value now, in joules


def _read_number(path: Path) -> int:
    return int(path.read_text().strip())


def _file_counter(name: str, kind: str, path: Path, wrap: float | None) -> Counter:
    return Counter(name, kind, wrap, lambda: _read_number(path) / 1e6)  # µJ


@dataclass
class Found:
    """What one kind of counter gave: its counters, and why others were not read: `absent`
    (nothing of the kind on the node: said only where no counter at all is read) or `denied`
    (there, but not readable: always said, the node's energy is short of it)."""

    counters: list[Counter]
    absent: str = ""
    denied: str = ""


def _rapl(sysfs: Path) -> Found:
    powercap = sysfs / "class" / "powercap"
    zones = sorted(powercap.glob("intel-rapl:*"))
    if not zones:
        return Found([], absent=f"RAPL: no intel-rapl zone in {powercap}")
    counters, denied = [], []
    for zone in zones:
        try:
            name = (zone / "name").read_text().strip()
        except OSError:
            continue
        parent = zone.name.count(":") == 2  # intel-rapl:N:M, a sub-zone of intel-rapl:N
        if (name.startswith("package") and not parent) or (name == "dram" and parent):
            package = zone.parent / zone.name.rsplit(":", 1)[0] if parent else None
            label = f"rapl:{_zone_name(package)}/{name}" if package else f"rapl:{name}"
            try:
                _read_number(zone / "energy_uj")
                wrap = _read_number(zone / "max_energy_range_uj") / 1e6
            except PermissionError:
                denied.append(f"{zone / 'energy_uj'} readable by root only")
                continue
            except (OSError, ValueError) as exc:
                denied.append(f"{zone / 'energy_uj'}: {exc}")
                continue
            kind = "DRAM" if name == "dram" else "CPU"
            counters.append(_file_counter(label, kind, zone / "energy_uj", wrap))
    if not counters and not denied:
        return Found([], absent=f"RAPL: no package zone in {powercap}")
    return Found(counters, denied=("RAPL: " + "; ".join(denied)) if denied else "")


def _zone_name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return zone.name


def _intel_gpus(sysfs: Path) -> Found:
    drm = sysfs / "class" / "drm"
    counters, denied, seen = [], [], set()
    for hwmon in sorted(drm.glob("card[0-9]*/device/hwmon/hwmon*")):
        energy = hwmon / "energy1_input"
        if hwmon.resolve() in seen or not energy.exists():
            continue
        seen.add(hwmon.resolve())
        if _zone_name(hwmon) not in INTEL_GPU_DRIVERS:
            continue
        card = hwmon.parent.parent.parent.name
        try:
            _read_number(energy)
        except (OSError, ValueError) as exc:
            denied.append(f"{energy}: {exc}")
            continue
        counters.append(_file_counter(f"intel-gpu:{card}", "GPU", energy, None))  # 64-bit µJ
    if not counters and not denied:
        return Found([], absent=f"Intel GPU: no i915/xe energy counter in {drm}")
    return Found(counters, denied=("Intel GPU: " + "; ".join(denied)) if denied else "")


def _nvml() -> Found:
    try:
        import pynvml  # nvidia-ml-py, installed on GPU sites only
    except ImportError:
        return Found([], absent="NVML: nvidia-ml-py not installed")
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:  # no driver: no NVIDIA GPU here
        return Found([], absent=f"NVML: {exc}")
    if not handles:
        return Found([], absent="NVML: no NVIDIA GPU")
    counters, denied = [], []
    for index, handle in enumerate(handles):
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError as exc:  # before Volta: not supported
            denied.append(f"GPU {index}: {exc}")
            continue
        read = functools.partial(_nvml_joules, pynvml, handle)
        counters.append(Counter(f"nvml:{index}", "GPU", None, read))  # 64-bit mJ
    return Found(counters, denied=("NVML: " + "; ".join(denied)) if denied else "")


def _nvml_joules(pynvml, handle) -> float:
    return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # mJ


def sysfs_root() -> Path:
    """`/sys`, or the stand-in `FFN_ENERGY_SYSFS` names."""
    return Path(os.environ.get(SYSFS_VARIABLE) or "/sys")


@functools.lru_cache(maxsize=8)
def node_counters(sysfs: Path | None = None) -> tuple[tuple[Counter, ...], str]:
    """The node's readable energy counters, and why others cannot be read here ("" when
    nothing the node has is left unread): found once per process (a worker runs many tasks)."""
    sysfs = sysfs or sysfs_root()
    found = [_rapl(sysfs), _nvml(), _intel_gpus(sysfs)]
    counters = tuple(c for f in found for c in f.counters)
    why = [f.denied for f in found if f.denied]
    if not counters:
        why = [f.absent for f in found if f.absent] + why
    return counters, "; ".join(why)


class EnergyMeter:
    """The node's energy counters while a task runs, as `with EnergyMeter() as meter: work()`,
    then `meter.measured()`: {"energy": {"host", "counters": [[name, kind, wrap J]],
    "samples": [[time, joules of each counter (None: not read)], ...], "unread": why}}, the
    first sample as the task began, the last as it ended, one every `every` s between."""

    def __init__(self, sysfs: Path | None = None, every: float = SAMPLE_SECONDS):
        try:
            self.counters, self.unread = node_counters(sysfs or sysfs_root())
        except Exception as exc:  # noqa: BLE001 (a task's result never depends on its meter)
            self.counters, self.unread = (), f"energy counters: {exc!r}"
        self.every = every
        self.samples: list[list] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        values = []
        for counter in self.counters:
            try:
                values.append(round(counter.read(), 6))
            except Exception:  # noqa: BLE001 (a counter gone: OSError, ValueError, NVMLError)
                values.append(None)
        self.samples.append([round(time.time(), 3), *values])

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> EnergyMeter:
        self._sample()
        if self.counters:
            self._thread = threading.Thread(target=self._run, name="energy-meter", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def measured(self) -> dict:
        """What the stamp's `measured` takes: the readings, or why there are none."""
        record: dict = {"host": socket.gethostname()}
        if self.counters:
            record["counters"] = [[c.name, c.kind, c.wrap] for c in self.counters]
            record["samples"] = self.samples
        if self.unread:
            record["unread"] = self.unread
        return {"energy": record}
