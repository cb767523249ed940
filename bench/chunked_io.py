"""Which library for chunked volumes: zarr, cloud-volume or tensorstore, read the way the
stages read (a block at a time) on this machine.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/chunked_io.py [--shape 256 256 256]
    (tensorstore: PYTHONPATH=DIR, a folder it was `pip install --target`-ed into)

Writes one synthetic uint64 segmentation (the stitched volume's dtype) and its uint8 image as
zarr (64^3 chunks, zstd) and as Neuroglancer precomputed (64^3 chunks; raw image, and
compressed_segmentation as the export writes), then times reading every 128^3 block of each,
per library: zarr (zarr-python 2), cloud-volume (precomputed only) and tensorstore (both
formats; from PYTHONPATH: a folder it was `pip install --target`-ed into, as it is not a
dependency). Reports MB/s of decoded voxels and the installed size of each library's own
packages. Results go to --json.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.data.synthetic import SyntheticConfig, generate

ROOT = Path(__file__).resolve().parents[1]

CHUNK = 64
BLOCK = 128
# Each library's own packages (beyond numpy and what the project has anyway).
PACKAGES = {
    "zarr": ["zarr", "numcodecs", "asciitree", "fasteners", "Deprecated"],
    "cloud-volume": ["cloud-volume", "compressed-segmentation", "fpzip", "zfpc", "zfpy",
                     "DracoPy", "simplejpeg", "pyspng-seunglab", "compresso", "crackle-codec",
                     "fastremap", "google-cloud-storage", "boto3", "botocore", "requests"],
    "tensorstore": ["tensorstore", "ml_dtypes"],
}  # fmt: skip


def _installed_mb(names: list[str]) -> float | None:
    total = 0
    for name in names:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            return None
        total += sum(f.locate().stat().st_size for f in files if f.locate().is_file())
    return total / 1e6


def _blocks(shape):
    for z in range(0, shape[0], BLOCK):
        for y in range(0, shape[1], BLOCK):
            for x in range(0, shape[2], BLOCK):
                yield (slice(z, z + BLOCK), slice(y, y + BLOCK), slice(x, x + BLOCK))


def _time_reads(read, shape, itemsize, repeats: int = 3) -> float:
    """MB/s of decoded voxels reading every block, the best of `repeats` passes (the first pays
    for imports and caches)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        voxels = sum(read(block).size for block in _blocks(shape))
        best = max(best, voxels * itemsize / 1e6 / (time.perf_counter() - start))
    return best


def _write_zarr(folder: Path, raw: np.ndarray, seg: np.ndarray) -> None:
    from pipeline.data.volumes import new_chunked_volume, open_volume

    for name, array in (("raw", raw), ("seg", seg)):
        path = folder / f"{name}.zarr"
        new_chunked_volume(path, name, array.shape, array.dtype, (10, 10, 10), (CHUNK,) * 3)
        with open_volume(f"{path}:{name}", writable=True) as target:
            target[...] = array


def _write_precomputed(folder: Path, raw: np.ndarray, seg: np.ndarray) -> None:
    from cloudvolume import CloudVolume

    for name, array, layer, encoding in (
        ("raw", raw, "image", "raw"),
        ("seg", seg, "segmentation", "compressed_segmentation"),
    ):
        info = CloudVolume.create_new_info(
            1, layer, str(array.dtype), encoding, [10, 10, 10], [0, 0, 0],
            list(array.shape[::-1]), chunk_size=[CHUNK] * 3,
        )  # fmt: skip
        volume = CloudVolume(f"file://{folder / name}", info=info, progress=False)
        volume.commit_info()
        volume[:, :, :] = array.T


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[256, 256, 256])
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/chunked_io.json")
    args = parser.parse_args()
    shape = tuple(args.shape)
    raw, labels = generate(SyntheticConfig(shape_zyx=shape, voxel_size_nm=(10, 10, 10)))
    seg = labels.astype(np.uint64)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "data") as tmp:
        folder = Path(tmp)
        _write_zarr(folder, raw, seg)
        _write_precomputed(folder, raw, seg)

        import zarr

        for name, dtype in (("raw", raw.dtype), ("seg", seg.dtype)):
            array = zarr.open_array(str(folder / f"{name}.zarr" / name), mode="r")
            results.setdefault("zarr", {})[f"{name} zarr"] = _time_reads(
                lambda b, a=array: a[b], shape, dtype.itemsize
            )

        from cloudvolume import CloudVolume

        for name, dtype in (("raw", raw.dtype), ("seg", seg.dtype)):
            cv = CloudVolume(f"file://{folder / name}", progress=False, fill_missing=False)
            results.setdefault("cloud-volume", {})[f"{name} precomputed"] = _time_reads(
                lambda b, v=cv: v[b[2], b[1], b[0]][..., 0].T, shape, dtype.itemsize
            )
        try:
            import tensorstore as ts
        except ImportError:
            print("tensorstore: not importable (PYTHONPATH=DIR), left out", file=sys.stderr)
        else:
            for name, dtype in (("raw", raw.dtype), ("seg", seg.dtype)):
                for driver, path in (("zarr", folder / f"{name}.zarr" / name),
                                     ("neuroglancer_precomputed", folder / name)):  # fmt: skip
                    store = ts.open(
                        {"driver": driver, "kvstore": {"driver": "file", "path": str(path)}},
                        read=True,
                    ).result()
                    if driver == "neuroglancer_precomputed":  # x, y, z, channel
                        read = lambda b, s=store: s[b[2], b[1], b[0], 0].read().result().T  # noqa: E731
                    else:
                        read = lambda b, s=store: s[b].read().result()  # noqa: E731
                    label = f"{name} {'zarr' if driver == 'zarr' else 'precomputed'}"
                    results.setdefault("tensorstore", {})[label] = _time_reads(
                        read, shape, dtype.itemsize
                    )
    rows = {
        lib: {"MB/s": {k: round(v, 1) for k, v in speeds.items()},
              "installed_MB": _installed_mb(PACKAGES[lib])}
        for lib, speeds in results.items()
    }  # fmt: skip
    record = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "shape_zyx": shape,
        "chunk": CHUNK,
        "block": BLOCK,
        "libraries": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.json) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    print("| library | volume read | MB/s | installed MB |\n|---|---|---|---|")
    for lib, row in rows.items():
        for volume_name, speed in row["MB/s"].items():
            print(f"| {lib} | {volume_name} | {speed} | {row['installed_MB']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
