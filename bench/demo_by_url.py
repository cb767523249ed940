"""The demo with its inputs read by URL (issue 59's first goal), without the internet.

Run by hand after `make demo`, from the repository root:

    PATH=.venv/bin:$PATH python bench/demo_by_url.py --run-dir data/runs/demo [--stores http s3]

The finished demo's three staged volumes (training, selection, the volume to segment: what its
synthetic stages made) are written as precomputed layers (image and labels, gzip-compressed
chunks, as other tools write them) to a folder served over HTTP by the export's own data server
(`http`), or to a bucket of moto's S3 server on 127.0.0.1 (`s3`, moto being a test dependency).
For each store a copy of the run is resumed with its `[data]` naming those layers and nothing
else changed: the training and selection parts are copied in by URL, the volume to segment is
read in place by URL. Then its segmentation (the export's layer) and its scores are compared
with the demo's own, voxel for voxel. Prints which stages ran again and a Markdown table; the
copies are kept (`<run-dir>-by-<store>`, replaced when the script runs again).
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.data.volumes import open_volume  # noqa: E402
from pipeline.export.layers import segmentation_spec  # noqa: E402
from pipeline.run.run_layout import RunPaths  # noqa: E402

ROLES = {"train": "train_volume", "select": "select_volume", "eval": "eval_copy"}


def write_layers(base: str, run_dir: Path) -> None:
    """Each staged volume of `run_dir` as two layers under `base` (`<role>_raw`,
    `<role>_labels`), 64^3 chunks, in (x, y, z) order as cloud-volume writes them."""
    from cloudvolume import CloudVolume

    paths = RunPaths(run_dir)
    for role, attribute in ROLES.items():
        with h5py.File(getattr(paths, attribute), "r") as staged:
            voxel_zyx = [float(v) for v in staged["raw"].attrs["voxel_size_nm"]]
            for kind, name in (("raw", "raw"), ("labels", "labels")):
                array = staged[name][...]
                info = CloudVolume.create_new_info(
                    num_channels=1,
                    layer_type="image" if kind == "raw" else "segmentation",
                    data_type=str(array.dtype),
                    encoding="raw",
                    resolution=voxel_zyx[::-1],
                    voxel_offset=[0, 0, 0],
                    volume_size=list(array.shape[::-1]),
                    chunk_size=[64, 64, 64],
                )
                layer = CloudVolume(f"{base}/{role}_{kind}", info=info, progress=False)
                layer.commit_info()
                layer[:, :, :] = array.T


@contextmanager
def http_store(folder: Path):
    """The layers' folder served over HTTP; yields (where to write, the specs' base)."""
    from pipeline.export.viewer import PrecomputedServer, start_data_server

    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's
    folder.mkdir(parents=True)
    PrecomputedServer.request_queue_size = 64  # cloud-files opens 20 connections at once
    server = start_data_server(folder)
    try:
        yield f"file://{folder}", f"precomputed://{server.url}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def s3_store(_folder: Path):
    """A bucket of moto's S3 server on 127.0.0.1; yields (where to write, the specs' base)."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        os.environ.update(
            AWS_ENDPOINT_URL_S3=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench", AWS_SESSION_TOKEN="bench",
            AWS_DEFAULT_REGION="us-east-1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
        )  # fmt: skip
        boto3.client("s3").create_bucket(Bucket="demo")
        yield "s3://demo", "precomputed://s3://demo"
    finally:
        server.stop()


STORES = {"http": http_store, "s3": s3_store}


def resume_by_url(run_dir: Path, store: str) -> dict:
    """A copy of `run_dir` resumed with its inputs in `store`: what ran, its segmentation equal
    to the run's or not, both runs' scores."""
    copy = run_dir.with_name(f"{run_dir.name}-by-{store}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy, symlinks=True)
    config = json.loads((run_dir / "config.json").read_text())
    with ExitStack() as stack:
        write, read = stack.enter_context(STORES[store](copy.with_name(f"{copy.name}-layers")))
        write_layers(write, run_dir)
        for role in ROLES:
            config["data"][f"{role}_raw"] = f"{read}/{role}_raw"
            config["data"][f"{role}_labels"] = f"{read}/{role}_labels"
        settings = copy.with_name(f"{copy.name}.json")
        settings.write_text(json.dumps(config, indent=2))
        started = time.perf_counter()
        resumed = subprocess.run(
            [sys.executable, str(ROOT / "workflow.py"), "--site", "local", "--config",
             str(settings), "--run-dir", str(copy), "--resume"],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        seconds = time.perf_counter() - started
    if resumed.returncode:
        raise SystemExit(f"{store}: the resume failed:\n{resumed.stdout[-3000:]}{resumed.stderr}")
    ran = sorted(
        {line.split(" s ", 1)[1].split()[0].split("[")[0]
         for line in resumed.stdout.splitlines()
         if line.endswith(" finished") and " s " in line}
    )  # fmt: skip
    layers = []
    for run in (run_dir, copy):
        with open_volume(segmentation_spec(RunPaths(run).precomputed)) as layer:
            layers.append(layer[...])
    scores = [json.loads((run / "evaluation.json").read_text())["ffn"] for run in (run_dir, copy)]
    staged = json.loads((copy / "staged" / "eval.json").read_text())
    return {
        "store": store,
        "seconds": round(seconds, 1),
        "stages_run": ran,
        "read_in_place_from": staged["raw"],
        "same_segmentation": bool(np.array_equal(layers[0], layers[1])),
        "objects": int(len(np.unique(layers[1]))),
        "vi": [s["vi"] for s in scores],
        "adapted_rand_error": [s["adapted_rand_error"] for s in scores],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished demo run")
    parser.add_argument("--stores", nargs="+", choices=sorted(STORES), default=["http", "s3"])
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    if not (run_dir / "report.md").is_file():
        raise SystemExit(f"{run_dir}: not a finished run (no report.md)")
    results = [resume_by_url(run_dir, store) for store in args.stores]
    print(
        "| inputs | resume | stages that ran | same segmentation | VI (demo, by URL) | adapted Rand |"
    )
    print("|---|---:|---|---|---|---|")
    for r in results:
        print(
            f"| {r['store']} ({r['read_in_place_from'].split('/eval_raw')[0]}) | {r['seconds']} s"
            f" | {', '.join(r['stages_run'])} | {r['same_segmentation']} ({r['objects']} ids)"
            f" | {r['vi'][0]:.4f}, {r['vi'][1]:.4f}"
            f" | {r['adapted_rand_error'][0]:.4f}, {r['adapted_rand_error'][1]:.4f} |"
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
