"""configs/paper.toml planned on the two sites without a module of their own here (the generic
Slurm site and Theta) at 1, 8 and 128 training nodes, as tests/site_configs/test_aurora.py,
test_polaris.py and test_perlmutter.py plan it on theirs: the dry run prints the plan, or refuses
in one line naming the fix; and Theta's training launch is ALCF's one-rank-per-node aprun line.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from test_dry_run_scripts import PAPER, ROOT

# ALCF's Theta pages (github.com/argonne-lcf/user-guides at 91dabfb^, docs/theta/applications-
# and-libraries/applications/qmcpack.md): one rank per KNL node, bound by depth, with NTHREADS
# hardware threads of HT per core each.
ALCF_THETA_LAUNCH = (
    "aprun -n $COBALT_PARTSIZE -N 1 -cc depth -d $NTHREADS -j $HT $exe $file_prefix.xml"
)


def plan(site: str, nodes: int, tmp_path, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "workflow.py", "--site", site, "--config", str(PAPER), "--dry-run"]
        + ["--run-dir", str(tmp_path / "run"), "--account", "X", "--train-nodes", str(nodes)]
        + list(more),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize(
    "nodes, refused",
    [(1, None), (8, None), (128, "does not fit queue 'debug-cache-quad'")],
)
def test_theta_plans_the_paper_run_with_alcfs_aprun_line_or_names_the_queue(
    nodes, refused, tmp_path
):
    done = plan("theta", nodes, tmp_path)
    assert not (tmp_path / "run").exists()
    if refused:
        (line,) = done.stderr.strip().splitlines()
        assert done.returncode == 2 and refused in line
        assert "queues that fit: default (128-255 nodes, <= 03:00:00)" in line
        assert line.endswith("give another --queue, or --train-nodes that the queue takes")
        done = plan("theta", nodes, tmp_path, "--queue", "default")
        # default takes no job under 128 nodes: the cpu pool's 2-node jobs need a queue too.
        (line,) = done.stderr.strip().splitlines()
        assert line.endswith(
            "queues that fit: debug-cache-quad (1-8 nodes, <= 01:00:00), debug-flat-quad (1-8 "
            "nodes, <= 01:00:00); give another --cpu-queue"
        )
        done = plan(
            "theta", nodes, tmp_path, "--queue", "default", "--cpu-queue", "debug-cache-quad"
        )
    assert done.returncode == 0, done.stderr
    (line,) = re.findall(rf"training on {nodes} node\(s\): (.*)", done.stdout)
    ours = shlex.split(line[line.index("aprun ") :])
    documented = shlex.split(ALCF_THETA_LAUNCH)

    def option(words: list[str], *names: str) -> str:
        (at,) = [i for i, word in enumerate(words) if word in names]
        return words[at + 1]

    assert ours[0] == documented[0] == "aprun"
    assert option(ours, "-n") == str(nodes)  # $COBALT_PARTSIZE: a rank per node
    assert option(ours, "-N") == option(documented, "-N") == "1"
    assert option(ours, "--cc", "-cc") == option(documented, "-cc") == "depth"
    assert option(ours, "-d") == "64" and option(ours, "-j") == "1"  # $NTHREADS, $HT
    assert option(ours, "-e") == "OMP_NUM_THREADS=64"


@pytest.mark.shared  # configs/paper.toml's data
@pytest.mark.parametrize("nodes", [1, 8, 128])
def test_the_slurm_site_plans_the_paper_run_on_any_partition_it_is_not_told_of(nodes, tmp_path):
    """The generic site lists no partitions (its queue_limits are the cluster's to fill in), so
    no size is refused: each plan is printed, its srun line for the nodes asked."""
    done = plan("slurm", nodes, tmp_path, "--queue", "batch")
    assert done.returncode == 0, done.stderr
    (line,) = re.findall(rf"training on {nodes} node\(s\): (.*)", done.stdout)
    assert line.count("srun ") == 1 and f"--nodes {nodes} " in line
