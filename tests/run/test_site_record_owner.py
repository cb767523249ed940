"""A run dir's site.json is code: its worker_init runs in every job of a resumed run. A resume
shows it, and one written by another user is refused until the user takes a site module's own
settings (--move-site)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from workflow_runs import copy_run, workflow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_before_issue55.tar.gz"


@pytest.fixture
def received_run(tmp_path) -> Path:
    """A finished run as it arrives from someone else: its site.json with a worker_init of theirs."""
    subprocess.run(["tar", "-xzf", str(FIXTURE), "-C", str(tmp_path)], check=True)
    run_dir = tmp_path / "tiny-run"
    record = json.loads((run_dir / "site.json").read_text())
    record["spec"]["worker_init"] = f"touch {tmp_path / 'ran'}"
    (run_dir / "site.json").write_text(json.dumps(record))
    return run_dir


def test_a_resume_shows_the_recorded_worker_init(received_run):
    done = workflow("--run-dir", str(received_run), "--resume", "--dry-run", timeout=300)
    assert f"worker_init from site.json: 'touch {received_run.parent / 'ran'}'" in done.stdout


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_site_json_of_another_user_is_refused_until_move_site(received_run):
    os.chown(received_run / "site.json", 4242, 4242)
    for extra in (["--dry-run"], []):
        done = workflow("--run-dir", str(received_run), "--resume", *extra, expect=2, timeout=300)
        assert done.stderr.startswith(f"error: --resume: {received_run / 'site.json'} was written")
        assert "runs as code on resume" in done.stderr and "--move-site" in done.stderr
    assert not (received_run.parent / "ran").exists()
    moved = workflow(
        "--run-dir", str(received_run), "--resume", "--move-site", "--site", "local", "--dry-run",
        timeout=300,
    )  # fmt: skip
    assert "worker_init from site.json" not in moved.stdout


def test_a_site_json_changed_since_the_run_is_refused_until_accepted(tiny_run, tmp_path):
    """The run keeps the digest of the site.json it wrote (runinfo/site.json.sha256): a
    worker_init put in afterwards does not run on --resume until the user takes it."""
    run_dir = copy_run(tiny_run, tmp_path / "run")
    ran = tmp_path / "ran"
    record = json.loads((run_dir / "site.json").read_text())
    record["spec"]["worker_init"] = f"touch {ran}"
    (run_dir / "site.json").write_text(json.dumps(record))
    for extra in (["--dry-run"], []):
        done = workflow("--run-dir", str(run_dir), "--resume", *extra, expect=2, timeout=300)
        assert done.stderr.startswith(
            f"error: --resume: {run_dir / 'site.json'} changed since the run wrote it"
        ), done.stderr
        assert f"worker_init now: 'touch {ran}'" in done.stderr
        assert "--accept-site-record" in done.stderr and "--move-site" in done.stderr
    assert not ran.exists()
    # Taken as it is: the resume runs with it (every task up to date, so no worker starts) and
    # records it as the run's, so the next resume takes it without asking.
    taken = workflow("--run-dir", str(run_dir), "--resume", "--accept-site-record", timeout=600)
    assert f"worker_init from site.json: 'touch {ran}'" in taken.stdout
    workflow("--run-dir", str(run_dir), "--resume", "--dry-run", timeout=300)
