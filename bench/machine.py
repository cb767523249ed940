"""What the benchmarks say of the machine they ran on (speeds differ between sessions' CPUs),
and how they keep what they measured."""

import json
import platform
from pathlib import Path

from pipeline.core.atomic import atomic_path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(path: Path, result: dict) -> Path:
    """`result` as JSON at `path` (numpy numbers as floats), written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1, default=float) + "\n")
    return path
