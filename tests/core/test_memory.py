"""A worker's memory: large arrays kept out of the heap, whatever the tasks before freed.

glibc raises its mapping threshold to the size of each mapped block freed (up to 32 MiB), so in
a worker an 8 MiB array that followed a freed 16 MiB one came from the heap, where what earlier
tasks left fragments it. Each case runs in a fresh interpreter: the test process's own
allocator state is the tests' before it."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

# Whether an 8 MiB array made after a 16 MiB one was freed is mapped apart from the heap:
# glibc's mallinfo2 counts mapped bytes in `hblkhd`.
PROBE = """
import ctypes, sys
import numpy as np
from pipeline.core.memory import keep_large_arrays_off_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "kept":
    keep_large_arrays_off_heap()
freed = np.ones(16 << 20, np.uint8)
del freed
before = libc.mallinfo2().hblkhd
array = np.ones(8 << 20, np.uint8)
print(libc.mallinfo2().hblkhd - before >= 8 << 20)
"""


def _glibc_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def _mapped(case: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, case],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],  # the repository, where `pipeline` is imported from
    )
    return result.stdout.strip() == "True"


@pytest.mark.skipif(not _glibc_mallinfo2(), reason="needs glibc 2.33+ (mallinfo2)")
def test_an_array_after_a_larger_one_freed_is_mapped_only_when_kept_off_the_heap():
    assert not _mapped("glibc's own"), "glibc's rising threshold no longer puts it in the heap"
    assert _mapped("kept")
