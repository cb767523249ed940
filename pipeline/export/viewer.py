"""Serve an export folder (`pipeline.export.layers`) over HTTP and open it in a local Neuroglancer viewer.

Two servers, both on 127.0.0.1 only, and both behind a random token in their URLs, as a
Jupyter server is: 127.0.0.1 is open to every user of a shared login node, so the port alone
must not give the data away.
  * the data server, a small `http.server` subclass: the export folder, read-only, under
    `/<token>/` only (`secrets.token_urlsafe`, new for each server; any other path gets a 403
    and no data), to a request whose `Host` is `127.0.0.1:PORT` or `localhost:PORT` only (else
    403: a DNS-rebinding page reaches 127.0.0.1 under its own host name, and sends that), with
    no folder listing (404), and with CORS headers for the Neuroglancer client's origin only
    (no other web page open in the browser may read the volumes). The layers' URLs Neuroglancer
    gets carry the token as a path prefix, which every client of a precomputed URL keeps (a
    query parameter need not be). A `*.gz` file written with `ExportConfig(gzip=True)` is
    served under its plain name with `Content-Encoding: gzip`, as Neuroglancer asks for the
    plain name; a single byte range (`Range: bytes=a-b`) is served as a 206 part, as
    Neuroglancer reads a sharded layer's shard files in parts;
  * the `neuroglancer` package's server: the Neuroglancer client (bundled, so it works offline)
    and the viewer state. Its every path holds a token (the viewer's, 40 random hex digits:
    `/v/<token>/` for the client, `/events/<token>`, `/state/<token>`, ... for the state, which
    names the data server's token), anything else is a 404; it does not check `Host` (a
    DNS-rebinding page cannot guess the token, so it still reads nothing).

The URL printed (`serve_forever`) carries the viewer's token: it is the one to open, and a key
to the data, so keep it to yourself (out of a log file others can read).

To view from another machine (an HPC login node), fix both ports and tunnel them:
`ssh -L 8000:127.0.0.1:8000 -L 8001:127.0.0.1:8001 host` (the same port numbers on both ends:
the data server answers the viewer's origin and a `Host` that include its port), then open the
printed URL on your computer.

CLI: `python -m pipeline.cli.viewer --precomputed DIR [--port 8000] [--viewer-port 8001]`.
"""

import datetime
import email.utils
import hmac
import http.server
import json
import os
import re
import secrets
import threading
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from pathlib import Path
from typing import BinaryIO

import neuroglancer

from pipeline.core.errors import PrecomputedError
from pipeline.export.destination import destination_complete, local_path, published_to
from pipeline.export.folder_layout import HERE
from pipeline.export.layers import IMAGE_LAYER, PROPERTIES_DIR, SEGMENTATION_LAYER, export_complete

BIND_ADDRESS = "127.0.0.1"
# The host names a browser on this machine (or at the near end of a tunnel) reaches it by.
LOCAL_HOSTS = ("127.0.0.1", "localhost")
# Segments shown when none are asked for: the largest ones, few enough for a quick 3-D view.
DEFAULT_SEGMENT_COUNT = 20
# Screen pixels the volume's width spans in the 2-D panel, and the 3-D panel's view height in
# volume widths: the whole volume in view, a little margin around it.
SLICE_FIT_PIXELS = 400
PROJECTION_FIT = 2.5
# The 3-D panel looks at the volume obliquely (a unit quaternion), so depth shows.
PROJECTION_ORIENTATION = (0.3, -0.25, -0.05, 0.92)
# The page a published export's link opens (`remote_link`): Neuroglancer's public one, which
# reads the store itself.
NEUROGLANCER_PAGE = "https://neuroglancer-demo.appspot.com"
# One byte range, `first-last`, `first-` or the suffix `-length` (RFC 9110 14.1.2).
BYTE_RANGE = re.compile(r"bytes=(\d*)-(\d*)", re.IGNORECASE)


def requested_bytes(header: str | None, size: int) -> range | None:
    """The bytes of a `size`-byte file that a `Range` header asks for, clipped to the file: empty
    when none of them exist (416). None to send the whole file: no header, or one this server
    ignores, as RFC 9110 lets it: malformed, another unit, several ranges."""
    match = BYTE_RANGE.fullmatch(header.strip()) if header else None
    if match is None:
        return None
    first, last = match.groups()
    if not first:  # the last `last` bytes
        return range(max(size - int(last), 0), size) if last else None
    if last and int(last) < int(first):
        return None  # an invalid range, ignored
    stop = min(int(last) + 1, size) if last else size
    return range(min(int(first), size), stop)


class _FilePart:
    """The bytes `part` of an open file, for `do_GET` to copy in pieces (`shutil.copyfileobj`
    reads 64 KiB at a time), so a part of a multi-GB shard is never held in memory whole."""

    def __init__(self, file: BinaryIO, part: range) -> None:
        file.seek(part.start)
        self._file, self._left = file, len(part)

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(self._left if size < 0 else min(size, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()


class PrecomputedServer(http.server.ThreadingHTTPServer):
    """The data server: its files are under `/<token>/` (`url`), for a `Host` naming this
    machine's loopback and port, readable across origins from `allowed_origins` only."""

    token: str
    allowed_origins: frozenset[str]

    @property
    def url(self) -> str:
        """The base URL of the served folder, token included: `{url}/image` is a layer."""
        return f"http://{BIND_ADDRESS}:{self.server_address[1]}/{self.token}"

    @property
    def allowed_hosts(self) -> frozenset[str]:
        return frozenset(f"{host}:{self.server_address[1]}" for host in LOCAL_HOSTS)


class PrecomputedRequestHandler(http.server.SimpleHTTPRequestHandler):
    """Static files, whole or one byte range of them; `name` falls back to `name.gz` sent
    gzip-encoded, a range then being of the gzip bytes (RFC 9110: of the encoded representation).
    A request is answered only if its `Host` is in `server.allowed_hosts` and its path starts
    with `/<server.token>/` (then served as the rest of the path); a folder is not listed.
    Cross-origin reads are allowed only to the origins in `server.allowed_origins` (the
    viewer's): any other web page open in the user's browser must not read the volumes."""

    server: PrecomputedServer

    def _admitted(self) -> bool:
        """Whether the request names this server's host and token; strips the token from
        `self.path`. If not, sends a 403 (no data) and returns False."""
        host = (self.headers.get("Host") or "").strip().lower()
        if host not in self.server.allowed_hosts:
            # A DNS-rebinding page reaches 127.0.0.1 under its own host name.
            self.send_error(HTTPStatus.FORBIDDEN, "host not allowed")
            return False
        prefix = f"/{self.server.token}/".encode()
        given = self.path[: len(prefix)].encode("latin-1", "replace")
        if not hmac.compare_digest(given, prefix):  # in constant time: no guessing it by bytes
            self.send_error(HTTPStatus.FORBIDDEN, "no token: open the URL the viewer printed")
            return False
        self.path = self.path[len(prefix) - 1 :]
        return True

    def _allowed_origin(self) -> str | None:
        origin = self.headers.get("Origin")
        return origin if origin in self.server.allowed_origins else None

    def end_headers(self) -> None:
        if origin := self._allowed_origin():
            self.send_header("Access-Control-Allow-Origin", origin)
            # How a part of a shard is placed and sized: a page sees these only if exposed.
            self.send_header(
                "Access-Control-Expose-Headers", "Content-Range, Content-Length, Accept-Ranges"
            )
        self.send_header("Vary", "Origin")
        super().end_headers()

    def do_OPTIONS(self) -> None:  # a CORS preflight
        if not self._admitted():
            return
        if self._allowed_origin() is None:
            self.send_error(403, "origin not allowed")
            return
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        # Range is not safelisted for every value (a suffix range is not): named for browsers
        # that predate the wildcard, kept for any other header a client sends.
        self.send_header("Access-Control-Allow-Headers", "Range, *")
        self.end_headers()

    def send_head(self) -> BinaryIO | _FilePart | None:  # GET and HEAD
        if not self._admitted():
            return None
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            return self._send_file(path, self.guess_type(path))
        gzipped = path + ".gz"
        if not os.path.exists(path) and os.path.isfile(gzipped):
            return self._send_file(gzipped, "application/octet-stream", encoding="gzip")
        # A folder too: its listing would show what the export holds, and no client needs it.
        self.send_error(HTTPStatus.NOT_FOUND, "File not found")
        return None

    def list_directory(self, path: str) -> None:
        """Never a listing (`send_head` does not ask for one; this in case a caller would)."""
        self.send_error(HTTPStatus.NOT_FOUND, "File not found")

    def _send_file(
        self, path: str, content_type: str, encoding: str | None = None
    ) -> _FilePart | None:
        """Send the head of a response with the file at `path`; the body to copy, if any."""
        file = open(path, "rb")
        try:
            part = self._send_file_head(os.fstat(file.fileno()), content_type, encoding)
        except BaseException:
            file.close()
            raise
        if not part:
            file.close()
            return None
        return _FilePart(file, part)

    def _send_file_head(
        self, stat: os.stat_result, content_type: str, encoding: str | None
    ) -> range:
        """The status and headers for a file of `stat`: 304 if the client's copy is current, the
        whole file (200), the part a `Range` asks (206), or 416 when none of it exists. Returns
        the bytes of the file the body holds."""
        if self._not_modified(stat.st_mtime):
            self.send_response(HTTPStatus.NOT_MODIFIED)
            self.end_headers()
            return range(0)
        size = stat.st_size
        part = self._requested_part(size)
        if part is None:
            self.send_response(HTTPStatus.OK)
            part = range(size)
        elif part:
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {part.start}-{part.stop - 1}/{size}")
        else:
            self._send_unsatisfiable(size)
            return part
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(part)))
        self.send_header("Last-Modified", self.date_time_string(stat.st_mtime))
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        return part

    def _send_unsatisfiable(self, size: int) -> None:
        """416, with the file's size for the client to ask again within it."""
        self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
        self.send_header("Content-Range", f"bytes */{size}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _requested_part(self, size: int) -> range | None:
        """The part of a `size`-byte file the request's `Range` asks for (see `requested_bytes`)."""
        # A conditional range (If-Range) gets the whole file: with no ETag and modification
        # times to the second, this server cannot prove the client's part current.
        if "If-Range" in self.headers:
            return None
        return requested_bytes(self.headers.get("Range"), size)

    def _not_modified(self, mtime: float) -> bool:
        """Whether If-Modified-Since dates the client's copy at or after `mtime`, as the standard
        handler checks it (ignored beside If-None-Match, as no ETag here can match it)."""
        if "If-None-Match" in self.headers or "If-Modified-Since" not in self.headers:
            return False
        try:
            since = email.utils.parsedate_to_datetime(self.headers["If-Modified-Since"])
        except (TypeError, ValueError, IndexError, OverflowError):
            return False  # a malformed date is ignored
        if since.tzinfo is None:
            since = since.replace(tzinfo=datetime.UTC)
        return int(mtime) <= since.timestamp()

    def log_message(self, format: str, *args: object) -> None:
        """Silent: a viewer fetches hundreds of chunks, one log line each would bury the URL."""


def start_data_server(
    folder: str | Path, port: int = 0, allowed_origins: Iterable[str] = ()
) -> PrecomputedServer:
    """Serve `folder` on 127.0.0.1:`port` (0: any free port) from a background thread, under
    the server's `url` (a new random token in it), readable across origins only from
    `allowed_origins` (e.g. `viewer_origins(url)`)."""
    handler = partial(PrecomputedRequestHandler, directory=str(folder))
    try:
        server = PrecomputedServer((BIND_ADDRESS, port), handler)
    except OSError as exc:
        raise PrecomputedError(f"cannot serve on {BIND_ADDRESS}:{port} ({exc.strerror})") from None
    server.token = secrets.token_urlsafe(32)
    server.allowed_origins = frozenset(allowed_origins)
    threading.Thread(target=server.serve_forever, name="precomputed-http", daemon=True).start()
    return server


@dataclass
class ViewerHandle:
    """A running viewer: open `url` in a browser (its token in it); `data_url` is the export's
    base URL (its token in it); `close()` stops both servers."""

    url: str
    data_url: str
    viewer: neuroglancer.Viewer
    server: PrecomputedServer = field(repr=False)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        # The neuroglancer package has one server per process; stopping it ends this viewer.
        neuroglancer.stop()

    def __enter__(self) -> "ViewerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _largest_segments(folder: Path, count: int) -> list[int]:
    """The `count` largest segments, by the voxel counts the export recorded."""
    return _largest(_read_json(folder / SEGMENTATION_LAYER / PROPERTIES_DIR / "info"), count)


def _largest(properties: dict, count: int) -> list[int]:
    """The `count` largest segments of a segment properties `info`, by their voxel counts."""
    inline = properties["inline"]
    voxels = next(p["values"] for p in inline["properties"] if p["id"] == "voxels")
    ranked = sorted(zip(voxels, inline["ids"], strict=True), reverse=True)
    return [int(i) for _, i in ranked[:count]]


def _check_segments(folder: Path, segments: Sequence[int]) -> list[int]:
    known = set(_read_json(folder / SEGMENTATION_LAYER / PROPERTIES_DIR / "info")["inline"]["ids"])
    missing = [int(s) for s in segments if str(int(s)) not in known]
    if missing:
        raise PrecomputedError(f"{folder}: no segment {', '.join(map(str, missing))} in the export")
    return [int(s) for s in segments]


def start_viewer(
    precomputed_dir: str | Path,
    port: int = 0,
    segments: Sequence[int] | None = None,
    viewer_port: int = 0,
    equivalences: Sequence[Sequence[int]] = (),
) -> ViewerHandle:
    """Serve an export on `port` and open a Neuroglancer viewer of it on `viewer_port` (0: any
    free port); shows `segments`, by default the largest few, in the 2-D and 3-D panels, and
    each group of `equivalences` (a merge graph's edges) as one object."""
    folder = Path(precomputed_dir)
    if not export_complete(folder):
        raise PrecomputedError(
            f"{folder}: not a complete export (write one with python -m pipeline.cli.export)"
        )
    segments = (
        _largest_segments(folder, DEFAULT_SEGMENT_COUNT)
        if segments is None
        else _check_segments(folder, segments)
    )
    full_resolution = _read_json(folder / IMAGE_LAYER / "info")["scales"][0]
    skeletons = "skeletons" in _read_json(folder / SEGMENTATION_LAYER / "info")
    neuroglancer.set_server_bind_address(BIND_ADDRESS, bind_port=viewer_port)
    viewer = neuroglancer.Viewer()  # starts Neuroglancer's server: its page may read the data
    try:
        url = viewer.get_viewer_url()
        server = start_data_server(folder, port, viewer_origins(url))
    except BaseException:
        neuroglancer.stop()
        raise
    handle = ViewerHandle(url, server.url, viewer, server)
    try:
        with viewer.txn() as state:
            _fill(state, handle.data_url, segments, full_resolution, skeletons, equivalences)
    except BaseException:
        handle.close()
        raise
    return handle


def _fill(
    state: neuroglancer.ViewerState,
    data_url: str,
    segments: list[int],
    scale: dict,
    skeletons: bool,
    equivalences: Sequence[Sequence[int]] = (),
) -> None:
    """Both layers from `data_url`, `segments` selected, the whole volume in view; with
    `skeletons`, the segmentation's skeletons named among its sources (Neuroglancer finds them
    through the segmentation's `info`, and draws them with its segments); `equivalences`, groups
    of segment ids Neuroglancer shows (and selects) as one object."""
    # Precomputed sizes are (x, y, z), and so are Neuroglancer's coordinates.
    resolution_xyz, size_xyz = scale["resolution"], scale["size"]
    state.dimensions = neuroglancer.CoordinateSpace(
        names=["x", "y", "z"], units="nm", scales=resolution_xyz
    )
    state.position = [s / 2 for s in size_xyz]
    state.layers[IMAGE_LAYER] = neuroglancer.ImageLayer(
        source=f"precomputed://{data_url}/{IMAGE_LAYER}"
    )
    source = neuroglancer.LayerDataSource(
        url=f"precomputed://{data_url}/{SEGMENTATION_LAYER}",
        subsources={"skeletons": True} if skeletons else {},  # Neuroglancer's name
    )
    # No equivalences, no key: the state of an export without a merge graph is as before.
    joined = {"equivalences": [list(map(int, e)) for e in equivalences]} if equivalences else {}
    state.layers[SEGMENTATION_LAYER] = neuroglancer.SegmentationLayer(
        source=source, segments=segments, **joined
    )
    state.layout = "xy-3d"
    # Zoom in units of the finest voxel (the scales above); fit the volume's x-y extent.
    extent = max(n * r for n, r in zip(size_xyz[:2], resolution_xyz[:2], strict=True))
    finest = min(resolution_xyz)
    state.cross_section_scale = extent / finest / SLICE_FIT_PIXELS
    state.projection_scale = PROJECTION_FIT * extent / finest
    state.projection_orientation = PROJECTION_ORIENTATION


def viewer_origins(viewer_url: str) -> set[str]:
    """The origins a browser sends for the viewer at `viewer_url` (127.0.0.1 is also localhost)."""
    parts = urllib.parse.urlsplit(viewer_url)
    origins = {f"{parts.scheme}://{parts.netloc}"}
    if parts.hostname in ("127.0.0.1", "localhost"):
        origins |= {f"{parts.scheme}://{host}:{parts.port}" for host in ("127.0.0.1", "localhost")}
    return origins


def browser_url(destination: str) -> str:
    """The URL a browser reads the bucket `destination` by. Neuroglancer takes `s3://` to mean
    AWS's own host, so an S3-compatible store elsewhere (its endpoint in AWS_ENDPOINT_URL_S3 or
    AWS_ENDPOINT_URL, where boto3 under cloud-files finds it) is named over HTTP instead, by
    path: `http://host:port/bucket/path`, as is one that names its endpoint itself
    (cloud-files' `s3://http://host:port/bucket/path`). AWS (no endpoint set) and `gs://`:
    unchanged."""
    scheme, _, path = destination.partition("://")
    if scheme == "s3" and path.startswith(("http://", "https://")):
        return path
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if scheme != "s3" or not endpoint:
        return destination
    return f"{endpoint.rstrip('/')}/{path}"


def remote_link(
    destination: str,
    segments: Sequence[int] | None = None,
    equivalences: Sequence[Sequence[int]] = (),
) -> str:
    """A Neuroglancer URL of the export published to bucket `destination`: its layers'
    sources `precomputed://<destination>/...` (`browser_url`), read by the browser from the
    store itself (no server here); `segments`, by default the largest few, shown;
    `equivalences` as one object each (in the URL's state)."""
    if not destination_complete(destination):
        raise PrecomputedError(f"{destination}: not a complete export")
    from cloudfiles import CloudFiles

    store = CloudFiles(destination)
    properties, image, layer = store.get_json(
        [f"{SEGMENTATION_LAYER}/{PROPERTIES_DIR}/info", f"{IMAGE_LAYER}/info",
         f"{SEGMENTATION_LAYER}/info"]
    )  # fmt: skip
    shown = _largest(properties, DEFAULT_SEGMENT_COUNT) if segments is None else list(segments)
    state = neuroglancer.ViewerState()
    data_url = browser_url(destination)
    _fill(state, data_url, shown, image["scales"][0], "skeletons" in layer, equivalences)
    return neuroglancer.to_url(state, prefix=NEUROGLANCER_PAGE)


def serve_forever(
    precomputed_dir: str | Path,
    port: int = 0,
    segments: Sequence[int] | None = None,
    viewer_port: int = 0,
    equivalences: Sequence[Sequence[int]] = (),
) -> None:
    """Start the viewer, print its URL and serve until interrupted (Ctrl-C). An export
    published to a bucket (pipeline.export.destination): print its link, serve nothing; to a
    folder elsewhere: serve that folder. `equivalences`: as `start_viewer`'s."""
    destination = published_to(precomputed_dir)
    if destination != HERE and local_path(destination) is None:
        print(f"[view] Neuroglancer: {remote_link(destination, segments, equivalences)}")
        print(f"[view] data: {destination} (read by the browser with its own access to it)")
        return
    precomputed_dir = local_path(destination) or precomputed_dir
    with start_viewer(precomputed_dir, port, segments, viewer_port, equivalences) as handle:
        print(f"[view] Neuroglancer: {handle.url}")
        print(f"[view] data: {handle.data_url} (serving {precomputed_dir}; Ctrl-C stops)")
        print("[view] both URLs hold a token: anyone who has them can read the export")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("[view] stopped")
