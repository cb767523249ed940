"""An export published where the lab's Neuroglancer links point (`[export] destination`).

The tasks make the export in the run dir's folder as ever (pipeline.export.layers); with a
destination other than `file://`, the last task then copies it there: every file the tasks'
records list, the records, and the summary `export.json` last (removed first), so the store
holds a complete export or none. Buckets (`s3://`, `gs://`) are written with cloud-files
(cloud-volume's storage layer), with its credentials; `file:///elsewhere` is copied keeping
mtimes (as `cp -a`), so it is checked and served as the run dir's folder is.

Complete in a bucket (`destination_complete`): its summary there, every record it counts there,
each file those records list there with its recorded size (a bucket keeps no mtime of ours).
"""

import json
import shutil
from pathlib import Path

from pipeline.export.folder_layout import HERE
from pipeline.export.layers import (
    MANIFEST,
    MANIFEST_FORMAT,
    REQUIRED_FILES,
    export_complete,
    recorded_files,
    task_record_path,
)


def published_to(folder: str | Path) -> str:
    """The destination the export in `folder` was published to (`HERE`: none)."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text()).get("destination", HERE)
    except (OSError, ValueError):
        return HERE


def local_path(destination: str) -> Path | None:
    """The folder a `file://` destination names (the run dir's: None); None for a bucket."""
    if destination == HERE or not destination.startswith("file://"):
        return None
    return Path(destination.removeprefix("file://"))


def _record_names(tasks: dict[str, int]) -> list[str]:
    return [
        task_record_path("", kind, k).as_posix()
        for kind, count in tasks.items()
        for k in range(count)
    ]


def publish(folder: str | Path, destination: str) -> None:
    """Copy the finished export in `folder` to `destination`."""
    folder = Path(folder)
    summary = json.loads((folder / MANIFEST).read_text())
    records = _record_names(summary["records"])
    names = sorted(set().union(*(recorded_files(folder / r) for r in records)) | set(records))
    elsewhere = local_path(destination)
    if elsewhere is not None:
        (elsewhere / MANIFEST).unlink(missing_ok=True)
        for name in [*names, MANIFEST]:
            (elsewhere / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / name, elsewhere / name)
        return
    from cloudfiles import CloudFiles

    source, target = CloudFiles(f"file://{folder.resolve()}"), CloudFiles(destination)
    target.delete(MANIFEST)  # not complete until every file is there again
    source.transfer_to(target, paths=names)
    source.transfer_to(target, paths=[MANIFEST])


def destination_complete(destination: str) -> bool:
    """Whether `destination` holds a complete export (`export_complete` for a folder)."""
    elsewhere = local_path(destination)
    if elsewhere is not None:
        return export_complete(elsewhere)
    from cloudfiles import CloudFiles

    store = CloudFiles(destination)
    summary = store.get_json(MANIFEST)
    if not isinstance(summary, dict) or summary.get("format") != MANIFEST_FORMAT:
        return False
    records = store.get_json(_record_names(summary["records"]))
    if not all(isinstance(r, dict) for r in records):
        return False
    sizes = {name: size for r in records for name, (size, _) in r["files"].items()}
    stored = store.size([*sizes, *REQUIRED_FILES])
    return all(stored[n] is not None for n in REQUIRED_FILES) and all(
        stored[n] == size for n, size in sizes.items()
    )
