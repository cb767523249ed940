"""A stand-in for a node's /sys energy counters (pipeline.core.energy reads the tree that
`FFN_ENERGY_SYSFS` names): the report's energy tests and the sites' whole runs through the
stand-in schedulers read it while their tasks run."""

import os
import threading
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """A counter file changes as the kernel's do: never seen half-written."""
    path.with_name(path.name + ".new").write_text(text)
    os.replace(path.with_name(path.name + ".new"), path)


class StandInNode:
    """A stand-in /sys: one RAPL package (wrapping at 60 J) with its dram, core and psys zones, an
    Intel GPU card (i915) with a per-tile counter; `use` adds joules as a node running work would."""

    WRAP_UJ = 60_000_000

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        powercap = root / "class" / "powercap"
        zones = {"intel-rapl:0": "package-0", "intel-rapl:0:0": "core",
                 "intel-rapl:0:2": "dram", "intel-rapl:1": "psys"}  # fmt: skip
        for zone, name in zones.items():
            (powercap / zone).mkdir(parents=True)
            (powercap / zone / "name").write_text(f"{name}\n")
            (powercap / zone / "energy_uj").write_text("59000000\n")  # 1 J before it wraps
            (powercap / zone / "max_energy_range_uj").write_text(f"{self.WRAP_UJ}\n")
        hwmons = root / "class" / "drm" / "card0" / "device" / "hwmon"
        for hwmon, name in {"hwmon3": "i915", "hwmon4": "i915_gt0"}.items():
            (hwmons / hwmon).mkdir(parents=True)
            (hwmons / hwmon / "name").write_text(f"{name}\n")
            (hwmons / hwmon / "energy1_input").write_text("5000000\n")
        self.counters = {
            "CPU": powercap / "intel-rapl:0" / "energy_uj",
            "DRAM": powercap / "intel-rapl:0:2" / "energy_uj",
            "GPU": hwmons / "hwmon3" / "energy1_input",
        }

    def use(self, **joules: float) -> None:
        with self.lock:
            for kind, added in joules.items():
                path = self.counters[kind]
                value = int(path.read_text()) + round(added * 1e6)
                write_atomically(path, f"{value % self.WRAP_UJ if kind != 'GPU' else value}\n")
