"""What a folder output's stamp costs: one walk of the folder (`stamps.output_state`), with each
file's mtime in the digest (issue 31) against names and sizes only (the state before it).

Run by hand, on an otherwise idle machine:

    PATH=.venv/bin:$PATH python bench/folder_state.py [--files 200000] [--repeats 5]

It writes `--files` small files in folders of 1,000 (as an export's chunk folders hold them) under
a temporary folder, then times both kinds of walk in turn, `--repeats` times each (the page cache
warm after the first), and prints the medians and their ratio with the CPU's name.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py

from pipeline.core.stamps import folder_state


def make_files(folder: Path, count: int) -> None:
    for i in range(count):
        sub = folder / f"{i // 1000}"
        if i % 1000 == 0:
            sub.mkdir()
        (sub / f"{i}").write_bytes(b"x" * (i % 97))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_files(folder, args.files)
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for with_mtime in (False, True):
                started = time.perf_counter()
                folder_state(folder, with_mtime=with_mtime)
                seconds[with_mtime].append(time.perf_counter() - started)
    old, new = (statistics.median(seconds[k]) for k in (False, True))
    print(f"{args.files:,} files, {cpu_name()}, median of {args.repeats}:")
    print(f"  names and sizes:        {old:.3f} s ({args.files / old:,.0f} files/s)")
    print(f"  names, sizes, mtimes:   {new:.3f} s ({args.files / new:,.0f} files/s)")
    print(f"  ratio: {new / old:.3f}")


if __name__ == "__main__":
    main()
