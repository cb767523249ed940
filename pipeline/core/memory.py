"""What a task's process holds in memory: its peak and current resident memory, and memory handed back
between the parts of a task."""

import contextlib
import ctypes
import gc
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # h5py is imported where a staged volume is read
    pass


def reset_peak_memory() -> None:
    """Start this process's peak resident memory (Linux's VmHWM) afresh from what it holds now,
    so that a worker that runs many tasks reports each one's own peak (Linux 4.0+; elsewhere
    the peak stays the process's lifetime one). Earlier tasks' garbage (reference cycles) is
    collected and memory the C allocator kept is handed back first: not this task's. What
    survives the collection is the worker's own (imported modules, their caches) and is frozen,
    so the next task's collection does not walk it again: a full walk of a worker that has
    imported cloud-volume and igneous took 80 ms, once per task. Arrays of `MMAP_THRESHOLD`
    bytes or more are kept out of the heap from here on (`keep_large_arrays_off_heap`)."""
    keep_large_arrays_off_heap()
    release_memory(freeze=True)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


# glibc maps an allocation this large or larger on its own, and unmaps it when freed. glibc's own
# threshold starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: in
# a worker that had run export region tasks, arrays of 4-32 MiB then came from a heap fragmented
# by them, and a skeleton task's peak rose with every region task before it (171 to 189 MiB
# above its start after 4; BENCHMARKS.md, "Skeleton tasks from 256³ to 1024³"). Set, it stays:
# 4 MiB kept the rise flat, glibc's 32 MiB ceiling did not.
MMAP_THRESHOLD = 4 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def keep_large_arrays_off_heap() -> None:
    """Allocations of `MMAP_THRESHOLD` bytes or more mapped apart from the heap in this process
    (glibc's `mallopt`; nothing elsewhere), so that memory a task frees goes back to the
    system and what a task needs does not depend on the tasks the worker ran before."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_memory(freeze: bool = False) -> None:
    """Collect garbage (reference cycles), then hand back to the system what the C allocator
    kept of freed memory (glibc's `malloc_trim`): between two parts of a task, the second then
    grows from what the first left in use, not from its fragmented heap (an export region task
    meshing after writing its scales peaked 60 MB higher without). `freeze`: what survives the
    collection is not walked again by later ones."""
    gc.collect()
    if freeze:
        gc.freeze()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory_mib() -> float | None:
    """This process's peak resident memory since it started or since `reset_peak_memory`, in
    MiB (None where /proc is missing)."""
    return _status_mib("VmHWM:")


def resident_memory_mib() -> float | None:
    """This process's resident memory now, in MiB (None where /proc is missing)."""
    return _status_mib("VmRSS:")


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None
