"""Viewing an export: the data server (its token, Host check and no listing, CORS, gzip, byte
ranges), the viewer's state and URLs, and, with headless Chromium, that Neuroglancer really
draws the segmentation and its meshes through the token-bearing URLs."""

import gzip
import json
import re
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from browser import chromium, coloured, wait_for
from test_volumes import small_pair, write_sharded_precomputed

from pipeline.cli import viewer as viewer_cli
from pipeline.core.errors import PrecomputedError
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.export import viewer
from pipeline.export.layers import ExportConfig, export_precomputed

SHAPE = (32, 64, 64)
VOXEL = (20.0, 10.0, 10.0)
SCREENSHOT_COPY = "/tmp/viewer_screenshot.png"


@pytest.fixture(scope="module")
def volume():
    return generate(SyntheticConfig(seed=3).with_geometry(shape_zyx=SHAPE, voxel_size_nm=VOXEL))


@pytest.fixture(scope="module")
def precomputed(volume, tmp_path_factory):
    raw, segmentation = volume
    out = tmp_path_factory.mktemp("view") / "precomputed"
    export_precomputed(raw, segmentation, VOXEL, out, ExportConfig(chunk_voxels=32))
    return out


VIEWER_ORIGIN = "http://127.0.0.1:8765"


@pytest.fixture
def served(precomputed):
    """The data server of the small export."""
    server = viewer.start_data_server(precomputed, allowed_origins=[VIEWER_ORIGIN])
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def data_server(served):
    """Its base URL, the token in it."""
    return served.url


def fetch(url, method="GET", origin=VIEWER_ORIGIN, headers=None):
    """(status, headers, body) of one request; HTTP errors are answers too."""
    headers = {"Origin": origin, **(headers or {})}
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def test_data_server_lets_the_viewer_read_across_origins(precomputed, data_server):
    status, headers, body = fetch(f"{data_server}/segmentation/info")
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == VIEWER_ORIGIN and headers["Vary"] == "Origin"
    assert json.loads(body) == json.loads((precomputed / "segmentation" / "info").read_text())
    status, headers, _ = fetch(f"{data_server}/image/info", method="OPTIONS")
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == VIEWER_ORIGIN
    status, headers, _ = fetch(f"{data_server}/image/no-such-chunk")
    assert status == 404
    assert headers["Access-Control-Allow-Origin"] == VIEWER_ORIGIN


def test_data_server_url_holds_a_new_random_token(served, precomputed):
    port = served.server_address[1]
    assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/[\w-]{{43}}", served.url)  # 32 bytes
    assert served.url.endswith("/" + served.token)
    other = viewer.start_data_server(precomputed)
    try:
        assert other.token != served.token
    finally:
        other.shutdown()
        other.server_close()


def test_data_server_refuses_a_request_without_its_token(served, precomputed):
    """Another user of a shared login node reaches 127.0.0.1:PORT too: no data without the token."""
    base, token = f"http://127.0.0.1:{served.server_address[1]}", served.token
    info = (precomputed / "image" / "info").read_bytes()
    for path in (
        "/image/info",
        "/segmentation/info",
        "/",
        f"/{'A' * len(token)}/image/info",  # a wrong token
        f"/{token[:-1]}/image/info",  # a prefix of it
        f"/{token}image/info",  # not a path segment
        f"/x/../{token}/image/info",
        f"/image/info?token={token}",
    ):
        for method in ("GET", "HEAD", "OPTIONS"):
            status, headers, body = fetch(base + path, method)
            assert status == 403, (path, method)
            assert b"@type" not in body and info not in body
            assert "Content-Range" not in headers and "Last-Modified" not in headers
    status, _, body = fetch(f"{base}/{token}/image/info")
    assert (status, body) == (200, info)


@pytest.mark.parametrize(
    "host", ["rebound.example", "rebound.example:{port}", "127.0.0.1:1", "127.0.0.2:{port}", ""]
)
def test_data_server_refuses_a_foreign_host(served, precomputed, host):
    """A DNS-rebinding page (its host name resolved to 127.0.0.1) sends its own name in Host;
    given even the token, it gets nothing."""
    port = served.server_address[1]
    for method in ("GET", "HEAD", "OPTIONS"):
        status, headers, body = fetch(
            f"{served.url}/image/info", method, headers={"Host": host.format(port=port)}
        )
        assert status == 403 and b"@type" not in body, method
        assert "Last-Modified" not in headers
    info = (precomputed / "image" / "info").read_bytes()
    for own in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}"):
        assert fetch(f"{served.url}/image/info", headers={"Host": own})[::2] == (200, info)


def test_data_server_lists_no_folder(served, precomputed):
    chunks = [p.name for p in (precomputed / "image").rglob("*") if p.is_file()]
    # The bare token is no path under /<token>/: refused as any other.
    for folder, refusal in [("", 403)] + [
        (f, 404) for f in ("/", "/image", "/image/", "/segmentation/mesh/", "/image/../")
    ]:
        status, headers, body = fetch(served.url + folder)
        assert status == refusal, folder
        assert "Location" not in headers  # not even a redirect to the listing
        assert b"info" not in body and not any(name.encode() in body for name in chunks)
        assert b"Directory listing" not in body


def test_data_server_lets_no_other_web_page_read_the_volumes(data_server):
    status, headers, _ = fetch(f"{data_server}/segmentation/info", origin="http://evil.example")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers  # the browser blocks it
    status, headers, _ = fetch(
        f"{data_server}/image/info", method="OPTIONS", origin="http://evil.example"
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_data_server_sends_gz_files_under_their_plain_name(volume, tmp_path):
    raw, segmentation = volume
    out = tmp_path / "precomputed"
    export_precomputed(
        raw, segmentation, VOXEL, out, ExportConfig(num_scales=1, gzip=True, sharded=False)
    )
    chunk = next((out / "image" / "10_10_20").iterdir())
    assert chunk.suffix == ".gz"
    server = viewer.start_data_server(out)
    try:
        url = f"{server.url}/image/10_10_20/{chunk.stem}"
        status, headers, body = fetch(url)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == gzip.decompress(chunk.read_bytes())


# Over the 64 KiB a response is copied by: a part of it takes several pieces.
SHARD_BYTES = 200_000


@pytest.fixture
def shard_server(tmp_path):
    """A server of `0.shard`, random bytes as a shard file holds, and `chunk.gz`, their gzip."""
    data = np.random.default_rng(0).bytes(SHARD_BYTES)
    (tmp_path / "0.shard").write_bytes(data)
    (tmp_path / "chunk.gz").write_bytes(gzip.compress(data))
    server = viewer.start_data_server(tmp_path, allowed_origins=[VIEWER_ORIGIN])
    yield server.url
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "header, start, stop",
    [
        ("bytes=1000-70999", 1000, 71000),  # in the middle
        ("bytes=150000-", 150000, SHARD_BYTES),  # to the end
        ("bytes=-500", SHARD_BYTES - 500, SHARD_BYTES),  # the last 500
        ("bytes=199990-999999", 199990, SHARD_BYTES),  # clipped at the end
        ("bytes=-999999", 0, SHARD_BYTES),  # a suffix longer than the file: all of it
        ("Bytes=0-0", 0, 1),  # the unit is case-insensitive
    ],
)
def test_data_server_sends_the_part_a_range_asks_for(shard_server, tmp_path, header, start, stop):
    status, headers, body = fetch(f"{shard_server}/0.shard", headers={"Range": header})
    assert status == 206
    assert headers["Content-Range"] == f"bytes {start}-{stop - 1}/{SHARD_BYTES}"
    assert headers["Content-Length"] == str(stop - start) and headers["Accept-Ranges"] == "bytes"
    assert body == (tmp_path / "0.shard").read_bytes()[start:stop]


@pytest.mark.parametrize(
    "header", [f"bytes={SHARD_BYTES}-", f"bytes={SHARD_BYTES}-{SHARD_BYTES + 9}", "bytes=-0"]
)
def test_data_server_answers_a_range_past_the_end_with_416(shard_server, header):
    for method in ("GET", "HEAD"):
        status, headers, body = fetch(f"{shard_server}/0.shard", method, headers={"Range": header})
        assert status == 416 and body == b""
        assert headers["Content-Range"] == f"bytes */{SHARD_BYTES}"


@pytest.mark.parametrize(
    "headers",
    [
        {"Range": "bytes=5-2"},  # last before first
        {"Range": "bytes=abc-"},
        {"Range": "bytes=-"},
        {"Range": "bytes 0-9"},
        {"Range": "items=0-9"},  # another unit
        {"Range": "bytes=0-9, 20-29"},  # several ranges
        # A conditional range: this server cannot prove the client's part current.
        {"Range": "bytes=0-9", "If-Range": "Mon, 01 Jan 2024 00:00:00 GMT"},
    ],
)
def test_data_server_sends_the_whole_file_for_a_range_it_ignores(shard_server, tmp_path, headers):
    status, response, body = fetch(f"{shard_server}/0.shard", headers=headers)
    assert status == 200 and "Content-Range" not in response
    assert response["Accept-Ranges"] == "bytes"
    assert body == (tmp_path / "0.shard").read_bytes()


def test_data_server_answers_head_like_get_without_a_body(shard_server):
    status, headers, body = fetch(f"{shard_server}/0.shard", "HEAD", headers={"Range": "bytes=-10"})
    assert (status, body) == (206, b"")
    assert headers["Content-Range"] == f"bytes {SHARD_BYTES - 10}-{SHARD_BYTES - 1}/{SHARD_BYTES}"
    assert headers["Content-Length"] == "10"
    status, headers, body = fetch(f"{shard_server}/0.shard", "HEAD")
    assert (status, body) == (200, b"")
    assert headers["Content-Length"] == str(SHARD_BYTES) and headers["Accept-Ranges"] == "bytes"


def test_data_server_ranges_a_gz_file_over_its_gzip_bytes(shard_server, tmp_path):
    """The response is the gzip stream (Content-Encoding), so a range is of its bytes."""
    encoded = (tmp_path / "chunk.gz").read_bytes()
    status, headers, body = fetch(f"{shard_server}/chunk", headers={"Range": "bytes=10-99"})
    assert status == 206 and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Range"] == f"bytes 10-99/{len(encoded)}"
    assert body == encoded[10:100]
    status, headers, body = fetch(f"{shard_server}/chunk", headers={"Range": "bytes=-2000000"})
    assert status == 206 and gzip.decompress(body) == (tmp_path / "0.shard").read_bytes()


def test_data_server_answers_a_current_copy_with_304(shard_server):
    _, headers, _ = fetch(f"{shard_server}/0.shard")
    since = {"If-Modified-Since": headers["Last-Modified"], "Range": "bytes=0-9"}
    status, _, body = fetch(f"{shard_server}/0.shard", headers=since)
    assert (status, body) == (304, b"")
    since["If-Modified-Since"] = "Mon, 01 Jan 2001 00:00:00 GMT"
    assert fetch(f"{shard_server}/0.shard", headers=since)[0] == 206


def test_data_server_lets_the_viewer_read_parts_across_origins(shard_server):
    preflight = {"Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "range"}
    status, headers, _ = fetch(f"{shard_server}/0.shard", "OPTIONS", headers=preflight)
    assert status == 204
    allowed = [h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")]
    assert "range" in allowed
    _, headers, _ = fetch(f"{shard_server}/0.shard", headers={"Range": "bytes=-10"})
    exposed = {h.strip() for h in headers["Access-Control-Expose-Headers"].split(",")}
    assert {"Content-Range", "Content-Length", "Accept-Ranges"} <= exposed
    _, headers, _ = fetch(
        f"{shard_server}/0.shard", origin="http://evil.example", headers={"Range": "bytes=-10"}
    )
    assert "Access-Control-Expose-Headers" not in headers


def test_cloud_volume_reads_a_sharded_segmentation_over_http(tmp_path):
    """Shard files are read in parts (the shard index, a minishard index, a chunk): a server
    that sent whole files for them would give a reader garbage."""
    from cloudvolume import CloudVolume

    _, labels = small_pair(shape=(8, 12, 16))
    write_sharded_precomputed(tmp_path / "segmentation", labels, VOXEL, "segmentation")
    server = viewer.start_data_server(tmp_path)
    try:
        url = f"precomputed://{server.url}/segmentation"
        volume = CloudVolume(url, progress=False)
        assert volume.image.is_sharded(0)
        # (x, y, z, channel) from the voxel offset (7, 5, 3).
        np.testing.assert_array_equal(volume[:, :, :][..., 0].T, labels)
        np.testing.assert_array_equal(volume[12:20, 6:15, 4:9][..., 0].T, labels[1:6, 1:10, 5:13])
    finally:
        server.shutdown()
        server.server_close()


def test_viewer_shows_both_layers_from_the_data_server(precomputed):
    with viewer.start_viewer(precomputed) as handle:
        assert handle.url.startswith("http://127.0.0.1:")
        state = handle.viewer.state
        assert state.layers["image"].source[0].url == f"precomputed://{handle.data_url}/image"
        segments = state.layers["segmentation"].segments
        assert 0 < len(segments) <= viewer.DEFAULT_SEGMENT_COUNT
        assert list(state.dimensions.names) == ["x", "y", "z"]
        assert list(state.position) == [32, 32, 16]
        page = urllib.parse.urlsplit(handle.url)
        status, headers, _ = fetch(
            f"{handle.data_url}/segmentation/mesh/info", origin=f"http://{page.netloc}"
        )
        assert status == 200 and headers["Access-Control-Allow-Origin"] == f"http://{page.netloc}"
        # Another local web app (a notebook server, say) is another origin.
        _, headers, _ = fetch(f"{handle.data_url}/image/info", origin="http://127.0.0.1:1")
        assert "Access-Control-Allow-Origin" not in headers
    with viewer.start_viewer(precomputed, segments=[1, 2]) as handle:
        assert sorted(handle.viewer.state.layers["segmentation"].segments) == [1, 2]


def test_viewer_urls_hold_tokens(precomputed):
    """Both servers answer only through their tokens: the data server's in the layers' URLs,
    Neuroglancer's (the viewer's) in the URL to open."""
    with viewer.start_viewer(precomputed) as handle:
        page = urllib.parse.urlsplit(handle.url)
        origin = f"http://{page.netloc}"
        data = urllib.parse.urlsplit(handle.data_url)
        token = handle.server.token
        assert data.path == f"/{token}" and len(token) >= 43
        layers = handle.viewer.state.layers
        for name in ("image", "segmentation"):
            assert layers[name].source[0].url == f"precomputed://{handle.data_url}/{name}"
        bare = f"http://{data.netloc}"
        status, headers, body = fetch(f"{bare}/segmentation/mesh/info", origin=origin)
        assert status == 403 and b"@type" not in body
        assert fetch(f"{handle.data_url}/segmentation/mesh/info", origin=origin)[0] == 200
        # Neuroglancer's server: the client page under the viewer's token only.
        viewer_token = handle.viewer.token
        assert re.fullmatch(rf"/v/{viewer_token}/", page.path) and len(viewer_token) >= 40
        assert fetch(handle.url, origin=origin)[0] == 200
        wrong = "0" * len(viewer_token)
        for path in (f"/v/{wrong}/", f"/events/{wrong}", "/", "/v/"):
            status, _, body = fetch(f"{origin}{path}", origin=origin)
            assert status == 404 and token.encode() not in body, path
        first = token
    with viewer.start_viewer(precomputed) as handle:
        assert handle.server.token != first


def test_serve_forever_prints_the_urls_to_open(precomputed, monkeypatch, capsys):
    """The printed URLs, tokens in them, are the ones that work."""
    answers = []

    class Interrupted:  # serve_forever's wait: read the printed URLs, then Ctrl-C
        def wait(self):
            out = capsys.readouterr().out
            page = re.search(r"Neuroglancer: (\S+)", out).group(1)
            data = re.search(r"data: (\S+)", out).group(1)
            origin = "http://" + urllib.parse.urlsplit(page).netloc
            answers.append((page, data))
            answers.append(fetch(page, origin=origin)[0])
            answers.append(fetch(f"{data}/image/info", origin=origin)[::2])
            raise KeyboardInterrupt

    monkeypatch.setattr(
        viewer, "threading", SimpleNamespace(Event=Interrupted, Thread=threading.Thread)
    )
    viewer.serve_forever(precomputed)
    (page, data), page_status, (data_status, info) = answers
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v/[0-9a-f]{40}/", page)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/[\w-]{43}", data)
    assert page_status == 200
    assert (data_status, info) == (200, (precomputed / "image" / "info").read_bytes())
    assert "[view] stopped" in capsys.readouterr().out


def test_viewer_refuses_incomplete_exports_and_unknown_segments(precomputed, tmp_path):
    with pytest.raises(PrecomputedError, match="not a complete export"):
        viewer.start_viewer(tmp_path)
    with pytest.raises(PrecomputedError, match="no segment 999999"):
        viewer.start_viewer(precomputed, segments=[1, 999999])


def test_workflow_view_shows_the_segments_asked_for(precomputed, tmp_path, monkeypatch, capsys):
    """`workflow.py view --segments`: the ids the report names (a body's pieces) selected."""
    import workflow

    run = tmp_path / "run"
    run.mkdir()
    (run / "precomputed").symlink_to(precomputed)
    shown = []

    def serve_once(folder, port, segments, viewer_port, equivalences):  # without the forever
        with viewer.start_viewer(folder, port, segments, viewer_port, equivalences) as handle:
            shown.append(sorted(handle.viewer.state.layers["segmentation"].segments))

    monkeypatch.setattr(viewer, "serve_forever", serve_once)
    assert workflow.main(["view", "--run-dir", str(run), "--segments", "2", "1"]) == 0
    assert shown == [[1, 2]]
    assert workflow.main(["view", "--run-dir", str(run), "--segments", "999999"]) == 2
    assert "no segment 999999" in capsys.readouterr().err


def test_workflow_view_shows_the_merge_graph_as_equivalences(precomputed, tmp_path, monkeypatch):
    """A run with a merge graph (agglomerate/graph.csv, as a proofreader left it): `view` shows
    its edges as the segmentation's equivalences, each group one object; `--supervoxels` shows
    the segments each on its own. The state is read from the file each time: an edge deleted
    is gone from the next view."""
    import workflow

    run = tmp_path / "run"
    (run / "agglomerate").mkdir(parents=True)
    (run / "precomputed").symlink_to(precomputed)
    graph = run / "agglomerate" / "graph.csv"
    header = "a,b,jaccard,recovered_a,recovered_b,fov_evaluations\n"
    graph.write_text(header + "1,2,0.8,0.95,0.97,32\n2,3,0.7,0.91,0.93,30\n5,4,,,,\n")
    states = []

    def serve_once(folder, port, segments, viewer_port, equivalences):
        with viewer.start_viewer(folder, port, segments, viewer_port, equivalences) as handle:
            states.append(handle.viewer.state.layers["segmentation"].to_json())

    monkeypatch.setattr(viewer, "serve_forever", serve_once)
    assert workflow.main(["view", "--run-dir", str(run), "--segments", "1", "4"]) == 0
    assert sorted(map(sorted, states[-1]["equivalences"])) == [[1, 2, 3], [4, 5]]
    assert workflow.main(["view", "--run-dir", str(run), "--supervoxels"]) == 0
    assert "equivalences" not in states[-1]
    graph.write_text(header + "1,2,0.8,0.95,0.97,32\n")  # two merges undone by hand
    assert workflow.main(["view", "--run-dir", str(run)]) == 0
    assert states[-1]["equivalences"] == [[1, 2]]


def test_a_published_exports_link_carries_the_equivalences(volume):
    """The state a bucket's link holds (`remote_link` builds it with `_fill`)."""
    state = viewer.neuroglancer.ViewerState()
    scale = {"resolution": [10, 10, 20], "size": [64, 64, 32]}
    viewer._fill(state, "s3://bucket/export", [1], scale, False, [[1, 2], [7, 9]])
    assert state.layers["segmentation"].to_json()["equivalences"] == [[1, 2], [7, 9]]
    viewer._fill(state, "s3://bucket/export", [1], scale, False)
    assert "equivalences" not in state.layers["segmentation"].to_json()


def test_cli_reports_an_incomplete_export(tmp_path, capsys):
    assert viewer_cli.main(["--precomputed", str(tmp_path)]) == 2
    assert "not a complete export" in capsys.readouterr().err


@pytest.mark.browser
def test_headless_chromium_renders_the_segmentation_and_its_meshes(precomputed, tmp_path):
    with viewer.start_viewer(precomputed) as handle:
        # Through the tokens only: the viewer's in the URL opened, the data server's in the
        # layers' URLs (a request without it would be refused).
        assert f"/{handle.server.token}/" in handle.viewer.state.layers["image"].source[0].url
        driver = chromium(tmp_path / "chromium-profile")
        try:
            driver.get(handle.url)

            def coloured_in(half):
                png = driver.get_screenshot_as_png()
                return png if coloured(png, half) else None

            # Default view: the 2-D panel (left) overlays segment colours on the EM image.
            png = wait_for(lambda: coloured_in("left"), 180)
            screenshot = tmp_path / "viewer.png"
            screenshot.write_bytes(png or driver.get_screenshot_as_png())
            shutil.copyfile(screenshot, SCREENSHOT_COPY)
            assert png, f"no segmentation in the 2-D panel after 60 s (see {screenshot})"
            # Without the slices the 3-D panel (right) can only be coloured by the meshes.
            with handle.viewer.txn() as state:
                state.show_slices = False
            meshes = wait_for(lambda: coloured_in("right"), 180)
            if not meshes:
                (tmp_path / "meshes.png").write_bytes(driver.get_screenshot_as_png())
            assert meshes, f"no meshes in the 3-D panel after 180 s (see {tmp_path / 'meshes.png'})"
        finally:
            driver.quit()
