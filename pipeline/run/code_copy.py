"""The code a run's workers import: a copy, in the run dir, of the packages as the run started.

Workers start after the workflow does (a batch job waits in the queue for hours; a lost block is
started again) and import the apps and the pipeline by name, each module when a task first needs
it. From the checkout they would import whatever it holds by then: a `git pull` or an edit while
the run waits or runs gives a worker a module the workflow did not plan with, beside older ones
it already holds (a task fails on a renamed function, or runs a changed one among the old). So
the workflow copies the packages once as it starts, and its workers and training ranks import
from the copy (`worker_exports`); the next run (a resume) copies the checkout as it is then.

The copy is `<run_dir>/code/<digest>/`, the digest of every file copied, so a resume with the
same code reuses it. It is made under a temporary name and renamed: a folder of that name is
complete. Copies of earlier code are removed (one workflow at a time holds a run dir).
"""

import hashlib
import os
import shlex
import shutil
from pathlib import Path

from pipeline.core.atomic import atomic_dir

# The packages workers import (workflow.py runs in the workflow process only).
PACKAGES = ("apps", "pipeline", "site_configs")
CODE_DIR = "code"
_ROOT = Path(__file__).resolve().parents[2]


def code_files(root: Path = _ROOT) -> list[Path]:
    """The packages' Python files under `root`, relative to it, in a stable order."""
    return sorted(
        path.relative_to(root) for package in PACKAGES for path in (root / package).rglob("*.py")
    )


def code_digest(root: Path = _ROOT) -> str:
    """sha256 over every file's relative path and content."""
    digest = hashlib.sha256()
    for relative in code_files(root):
        digest.update(f"{relative}\0".encode())
        digest.update((root / relative).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def copy_name(root: Path = _ROOT) -> str:
    """The name of the copy of the code under `root`."""
    return code_digest(root)[:16]


def last_copy(run_dir: str | os.PathLike) -> Path | None:
    """The copy the run dir's last run imported (None: no run has started workers there)."""
    copies = Path(run_dir).resolve() / CODE_DIR
    made = [path for path in copies.glob("[!.]*") if path.is_dir()]
    return max(made, key=lambda path: path.stat().st_mtime) if made else None


def copy_code(run_dir: str | os.PathLike, root: Path = _ROOT) -> Path:
    """Copy the packages under `root` into the run dir (unless that copy is there); return the
    folder to put on workers' PYTHONPATH. Copies of other code in the run dir are removed."""
    copies = Path(run_dir).resolve() / CODE_DIR
    target = copies / copy_name(root)
    if not target.is_dir():
        with atomic_dir(target) as tmp:
            for relative in code_files(root):
                (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / relative, tmp / relative)
    for other in copies.iterdir():
        if other != target:
            shutil.rmtree(other, ignore_errors=True)
    return target


def worker_exports(code: Path) -> list[str]:
    """Shell lines a worker runs to import `code` first: ahead of the venv's editable install
    (which points at the checkout), and with PYTHONSAFEPATH so `python -m pipeline.cli.train` (a
    training rank) does not put its working directory, often the checkout, ahead of it."""
    return [
        f"export PYTHONPATH={shlex.quote(str(code))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "export PYTHONSAFEPATH=1",
    ]
