"""Shared fixtures and the capability markers: a test marked `mpi`, `browser` or `shared` is
skipped, with the reason, when this machine lacks the resource instead of failing. No test is skipped for time:
`make test` runs them all (`make test-quick` leaves out those marked `slow` or `mpi`)."""

import importlib.util
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from filelock import FileLock

# Keep TensorFlow's start-up chatter out of test output; one thread pool per test process.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VENV_BIN = Path(sys.executable).parent


def _missing_mpi() -> str | None:
    if shutil.which("mpiexec", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        return "mpiexec not found (the mpich wheel provides it in the venv)"
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed"
    return None


def _missing_browser() -> str | None:
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "headless Chromium/chromedriver not installed (apt-get install chromium chromium-driver)"
    return None


# The team's real FlyEM file beside the repository (../shared/README.md), which configs/paper.toml
# and the flyem configs name: a dry run of them checks it is there.
SHARED_FLYEM = Path(__file__).parents[2] / "shared" / "data" / "flyem_medulla.h5"


def _missing_shared() -> str | None:
    if not SHARED_FLYEM.is_file():
        return f"{SHARED_FLYEM} is not here (the team's shared folder, ../shared)"
    return None


def _expensive(item: pytest.Item) -> bool:
    return "slow" in item.keywords or "mpi" in item.keywords


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The modules with the most slow/mpi tests first: pytest-xdist hands out work in this order,
    # so the long runs start at once and the quick tests fill the end, not one worker alone.
    expensive = Counter(item.module.__name__ for item in items if _expensive(item))
    items.sort(key=lambda item: -expensive[item.module.__name__])
    reasons = {"mpi": _missing_mpi(), "browser": _missing_browser(), "shared": _missing_shared()}
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def training_data(tmp_path_factory):
    """A small synthetic volume with coordinates for the small test model (FOV 9, 17, 17 and
    deltas 2, 4, 4, so the training canvas has radius 6, 12, 12)."""
    from pipeline.data.synthetic import SyntheticConfig, generate
    from pipeline.data.volumes import write_volumes
    from pipeline.preprocess.partitions import (
        build_coordinates,
        compute_partitions,
        save_coordinates,
    )

    folder = tmp_path_factory.mktemp("training_data")
    config = SyntheticConfig(seed=3).with_geometry(shape_zyx=(32, 64, 64))
    raw, labels = generate(config)
    volume = write_volumes(
        folder / "volume.h5", {"raw": raw, "labels": labels}, config.voxel_size_nm
    )
    partitions = compute_partitions(
        labels, (0.1, 0.3, 0.5, 0.7, 0.9), (4, 8, 8), margin_zyx=(6, 12, 12)
    )
    coords = build_coordinates(partitions, samples_per_class=200, seed=0)
    classes = partitions[tuple(coords.T)]
    save_coordinates(folder / "coords.npz", coords, "volume", classes=classes)
    return {
        "raw": f"{volume}:raw",
        "labels": f"{volume}:labels",
        "coordinates": str(folder / "coords.npz"),
        "coords": coords,
        "folder": folder,
    }


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One finished `configs/tiny.toml` run on the local site (2 Horovod ranks), shared by every
    workflow test: tests that change it work on a copy (tests/workflow_runs.copy_run)."""
    from workflow_runs import TINY, workflow

    if _missing_mpi():
        pytest.skip(_missing_mpi())
    # Made once for the whole session, also when pytest-xdist runs it in several processes: the
    # first to get here makes it, the others wait for it in the session's folder (each worker's
    # temporary folder is one inside it).
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    run_dir = shared / "tiny" / "run"
    with FileLock(shared / "tiny.lock"):
        if not (run_dir / "report.md").is_file():
            shutil.rmtree(run_dir, ignore_errors=True)  # a try that failed
            workflow("--site", "local", "--config", str(TINY), "--run-dir", str(run_dir))
    return run_dir


@pytest.fixture
def no_proxy(monkeypatch):
    """Requests to 127.0.0.1 go there, not to a proxy this machine's environment names."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def moto_endpoint() -> str:
    """An S3-compatible server on 127.0.0.1 (moto), for the module's tests. As S3, it lets a
    web page of another origin read a bucket only if the bucket's CORS rules allow it: moto's
    own CORS headers on every answer are off."""
    from moto.moto_server import werkzeug_app
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    with pytest.MonkeyPatch.context() as patch:
        # Read when the server makes its S3 app, at its first request.
        patch.setattr(werkzeug_app, "DISABLE_GLOBAL_CORS", True)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint, no_proxy, monkeypatch) -> str:
    """A new, empty bucket of the S3 stand-in (its name): boto3 (under cloud-files) sends
    `s3://bucket/...` to the endpoint AWS_ENDPOINT_URL_S3 names, with the credentials
    cloud-files takes from the environment (it wants all three)."""
    import uuid

    import boto3

    for key, value in {
        "AWS_ENDPOINT_URL_S3": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    # A bucket of its own: cloud-files keeps its connections and credentials per bucket.
    bucket = f"layers-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def _gcs_download_with_encoding(download):
    """The GCS stand-in's download, answering with the object's Content-Encoding as GCS does
    when the client accepts gzip (google-cloud-storage asks for the stored bytes, cloud-files
    then decompresses by that header); the stand-in leaves it out."""

    def answer(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        params = request.params
        try:
            stored = storage.get_file_obj(params["bucket_name"], params["object_id"])
        except Exception:  # not found: `download` has answered 404
            return
        if stored.get("contentEncoding"):
            response["Content-Encoding"] = stored["contentEncoding"]

    return answer


@pytest.fixture(scope="module")
def gcs_endpoint() -> str:
    """A Google Cloud Storage stand-in on 127.0.0.1 (gcp-storage-emulator, in memory), for the
    module's tests; google-cloud-storage (under cloud-files) goes there when
    STORAGE_EMULATOR_HOST names it."""
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import objects

    with pytest.MonkeyPatch.context() as patch:
        for _, methods in emulator.HANDLERS:
            for method, handler in list(methods.items()):
                if handler is objects.download:
                    patch.setitem(methods, method, _gcs_download_with_encoding(handler))
        server = emulator.create_server("127.0.0.1", 0, in_memory=True)
        server.start()
        try:
            host, port = server._api._httpd.server_address
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def gs_bucket(gcs_endpoint, no_proxy, monkeypatch) -> str:
    """A new, empty bucket of the GCS stand-in (its name), reached as `gs://bucket/...`."""
    import uuid

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    bucket = f"layers-{uuid.uuid4().hex[:12]}"
    storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(bucket)
    return bucket
