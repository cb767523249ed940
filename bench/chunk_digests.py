"""What `[data] chunk_digests` costs: staging a zarr volume in place with and without a crc32 of
each chunk recorded, and reading the staged volume with and without each chunk checked against
it (issue 56, "Chunk integrity").

Run by hand, on an otherwise idle machine:

    PATH=.venv/bin:$PATH python bench/chunk_digests.py [--edge 256] [--chunk 64] [--repeats 5]

It writes an edge³ uint8 image of noise (which Blosc stores as plain copies, as it does EM: the
most bytes per chunk) in chunk³ chunks under a temporary folder, then, `--repeats` times in turn,
stages it in place without and with digests (`staging.stage_in_place`) and reads the staged
volume whole in 128³ bricks (as inference blocks and staging copies read) without and with
them. Also the crc32 of every chunk's bytes alone, and the length check alone. The page cache is
warm (the files were just written): the figures are the CPU's cost, not the disk's. Prints the
medians with the CPU's name and writes them to bench/results/chunk_digests.json.
"""

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from machine import cpu_name, write_result  # bench/machine.py

from pipeline.data.staging import read_staged, stage_in_place
from pipeline.data.volumes import new_chunked_volume, open_volume, read_bricks
from pipeline.data.zarr_volumes import chunk_size_problem, open_zarr


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def read_all(spec: str, edge: int) -> None:
    for _ in read_bricks(spec, (slice(0, edge),) * 3, 128):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edge", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    edge = args.edge
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = f"{folder / 'raw.zarr'}:raw"
        new_chunked_volume(
            folder / "raw.zarr", "raw", (edge,) * 3, np.uint8, (8, 8, 8), (args.chunk,) * 3
        )
        image = np.random.default_rng(0).integers(0, 256, (edge,) * 3, dtype=np.uint8)
        with open_volume(spec, writable=True) as array:
            array[...] = image
        chunk_files = sorted((folder / "raw.zarr" / "raw").glob("*.*.*"))
        stored = sum(p.stat().st_size for p in chunk_files)
        contents = [p.read_bytes() for p in chunk_files]
        array = open_zarr(folder / "raw.zarr", "raw")
        times: dict[str, list[float]] = {
            k: [] for k in ("stage", "stage_digests", "read", "read_digests", "crc32", "length")
        }
        for i in range(args.repeats):
            for digests in (False, True):
                record = folder / f"eval-{i}-{digests}.json"
                key = "stage_digests" if digests else "stage"
                times[key].append(
                    timed(lambda r=record, d=digests: stage_in_place(r, spec, chunk_digests=d))
                )
                staged = read_staged(record).raw
                assert ("#chunk_digests=" in staged) == digests
                key = "read_digests" if digests else "read"
                times[key].append(timed(lambda s=staged: read_all(s, edge)))
            times["crc32"].append(timed(lambda: [zlib.crc32(c) for c in contents]))
            times["length"].append(timed(lambda: [chunk_size_problem(c, array) for c in contents]))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "cpu": cpu_name(),
        "edge": edge,
        "chunk": args.chunk,
        "chunks": len(contents),
        "stored_bytes": stored,
        "repeats": args.repeats,
        "median_seconds": median,
        "all_seconds": times,
    }
    write_result(Path(__file__).parent / "results" / "chunk_digests.json", result)
    mb = edge**3 / 1e6
    print(
        f"{edge}³ uint8 in {args.chunk}³ chunks ({len(contents)} files, {stored:,} bytes), {cpu_name()}, median of {args.repeats}:"
    )
    print(f"  stage in place, no digests:   {median['stage'] * 1e3:8.1f} ms")
    print(f"  stage in place, digests:      {median['stage_digests'] * 1e3:8.1f} ms")
    print(
        f"  read whole, no digests:       {median['read'] * 1e3:8.1f} ms ({mb / median['read']:,.0f} MB/s)"
    )
    print(
        f"  read whole, digests checked:  {median['read_digests'] * 1e3:8.1f} ms ({mb / median['read_digests']:,.0f} MB/s)"
    )
    print(
        f"  crc32 of every chunk alone:   {median['crc32'] * 1e3:8.1f} ms ({mb / median['crc32']:,.0f} MB/s)"
    )
    print(f"  length check of every chunk:  {median['length'] * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
