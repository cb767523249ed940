"""A site whose machine is gone says so in its dry run, in one line (issue 57, point 4): Theta,
which the project's first design names, still describes and plans a run."""

import sys

import processes
import pytest
from workflow_runs import ROOT, TINY

from site_configs import theta

PAPER = ROOT / "configs" / "paper.toml"


def dry_run(site: str, config, tmp_path) -> str:
    command = [
        "workflow.py", "--site", site, "--config", str(config),
        "--run-dir", str(tmp_path / "run"), "--dry-run",
    ]  # fmt: skip
    done = processes.run([sys.executable, *command], cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.shared  # configs/paper.toml's data
def test_the_theta_dry_run_says_in_one_line_that_theta_retired_at_the_end_of_2023(tmp_path):
    assert "\n" not in theta.RETIRED and "end of 2023" in theta.RETIRED
    for config in (TINY, PAPER):
        out = dry_run("theta", config, tmp_path)
        lines = [line for line in out.splitlines() if "retired" in line]
        assert lines == [f"  {theta.RETIRED}"], out
        assert "site theta: CobaltProvider" in out  # the site is described as before
        assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_a_site_whose_machine_runs_prints_no_such_line(tmp_path):
    out = dry_run("local", TINY, tmp_path)
    assert "retired" not in out, out
