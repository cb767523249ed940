"""Running `workflow.py` from tests: the command, a run's outputs, copies and variants of runs."""

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import processes
from filelock import FileLock

from pipeline.data.volumes import open_volume
from pipeline.export.layers import segmentation_spec

ROOT = Path(__file__).parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def workflow(
    *args: str, timeout: float = 1700, expect: int = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    done = processes.run([sys.executable, "workflow.py", *args], cwd=ROOT, timeout=timeout, env=env)
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@contextlib.contextmanager
def alone_on(shared_run: Path):
    """Hold conftest's shared run (`tiny_run`) while a workflow runs on it: tests in another
    pytest-xdist process may run one on it at the same time, and a run dir refuses a second
    workflow (its lock). The lock is the one its maker held."""
    with FileLock(shared_run.parent.parent / "tiny.lock"):
        yield


# Python lists every module it imports on stderr ("import time: ... | name") with this set.
IMPORT_TRACE = os.environ | {"PYTHONPROFILEIMPORTTIME": "1"}


def imported(stderr: str) -> set[str]:
    """The top-level packages a process run with IMPORT_TRACE imported."""
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def tiny_variant(folder: Path, name: str, replacements: dict[str, str]) -> Path:
    """configs/tiny.toml with some of its lines replaced (each key must be found)."""
    text = TINY.read_text()
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of a finished run (mtimes kept, as a user's `cp -a`), to change without touching it."""
    shutil.copytree(run_dir, to, symlinks=True)
    return to


def segmentation(run_dir: Path) -> np.ndarray:
    with open_volume(segmentation_spec(run_dir / "precomputed")) as array:
        return array[...]


def tries(run_dir: Path) -> dict[str, int]:
    """Tries of each app in the last Parsl run of `run_dir`, from monitoring.db (app name: count)."""
    with sqlite3.connect(run_dir / "monitoring.db") as db:
        (run,) = db.execute(
            "SELECT run_id FROM workflow ORDER BY time_began DESC LIMIT 1"
        ).fetchone()
        rows = db.execute(
            "SELECT t.task_func_name, COUNT(*) FROM try y JOIN task t "
            "ON t.task_id = y.task_id AND t.run_id = y.run_id WHERE y.run_id = ? GROUP BY t.task_func_name",
            (run,),
        )
        return dict(rows.fetchall())


def parsl_runs(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "monitoring.db") as db:
        return db.execute("SELECT COUNT(*) FROM workflow").fetchone()[0]


def tasks_of(run_dir: Path) -> list:
    """The run's tasks as the workflow plans them (apps.plan), from its saved config and site."""
    from apps.plan.dag import steps_of
    from apps.plan.resolved import resolve_plan
    from apps.run_setup import load_site_record
    from pipeline.data.staging import reads_in_place
    from pipeline.run.run_config import load_run_config
    from pipeline.run.run_layout import RunPaths

    config = load_run_config(run_dir / "config.json")
    paths = RunPaths(run_dir, reads_in_place(config.data))
    _, site = load_site_record(paths.site)
    return [step.task for step in steps_of(resolve_plan(config, paths, site))]


def stamp_files(tasks) -> dict[str, tuple[int, int]]:
    """Per task, its stamp file's inode and mtime: a task that runs writes it anew."""
    from pipeline.core.stamps import STAMP_SUFFIX, holds_stamp

    states = {}
    for task in tasks:
        output = task.outputs[0]
        held = output if holds_stamp(output) else output.with_name(output.name + STAMP_SUFFIX)
        stat = os.stat(held)
        states[task.name] = (stat.st_ino, stat.st_mtime_ns)
    return states
