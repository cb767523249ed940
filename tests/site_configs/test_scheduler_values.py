"""An account or queue that is not a plain scheduler word never reaches a shell: Parsl's batch
providers run the submit command through one (`qsub ... -q QUEUE -A ACCOUNT`), so an account of
`abc;touch${IFS}FILE;echo` ran `touch FILE` on submit. Refused however it is given: the site
module, --account/--queue/--cpu-queue, $FFN_ACCOUNT/$FFN_QUEUE, or a run's site.json."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from workflow_runs import workflow

from pipeline.core.errors import ConfigError
from site_configs import polaris, slurm

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_before_issue55.tar.gz"


def injection(tmp_path: Path) -> tuple[str, Path]:
    planted = tmp_path / "planted"
    return f"abc;touch${{IFS}}{planted};echo", planted


@pytest.mark.parametrize("name", ["account", "queue", "cpu_queue"])
@pytest.mark.parametrize("site", [polaris.SITE, slurm.SITE], ids=["pbs", "slurm"])
def test_a_site_refuses_a_value_a_shell_would_split(site, name, tmp_path):
    value, _ = injection(tmp_path)
    with pytest.raises(ConfigError, match=f"{name} .* is not a scheduler name"):
        dataclasses.replace(site, **{name: value})
    for bad in ("two words", "a'b", "$(id)", "x`id`", "q\nx", "-A"):
        with pytest.raises(ConfigError, match="is not a scheduler name"):
            dataclasses.replace(site, **{name: bad})


def test_plain_scheduler_names_are_taken():
    site = dataclasses.replace(
        polaris.SITE, account="FFN_project-2.a", queue="debug-scaling", cpu_queue="prod@polaris-pbs"
    )
    assert (site.account, site.queue, site.cpu_queue) == (
        "FFN_project-2.a", "debug-scaling", "prod@polaris-pbs",
    )  # fmt: skip


def test_a_walltime_is_only_hh_mm_ss():
    for bad in ("01:00:00\n", "01:00:00;id", "1:00"):
        with pytest.raises(ConfigError, match="is not HH:MM:SS"):
            dataclasses.replace(polaris.SITE, walltime=bad)


@pytest.mark.parametrize(
    "given",
    [
        lambda value: (["--account", value], {}),
        lambda value: (["--queue", value], {}),
        lambda value: (["--cpu-queue", value], {}),
        lambda value: ([], {"FFN_ACCOUNT": value}),
        lambda value: ([], {"FFN_QUEUE": value}),
    ],
    ids=["--account", "--queue", "--cpu-queue", "FFN_ACCOUNT", "FFN_QUEUE"],
)
def test_the_command_line_and_the_environment_are_refused_before_a_dry_run(given, tmp_path):
    value, planted = injection(tmp_path)
    args, env = given(value)
    done = workflow(
        "--site", "polaris", "--run-dir", str(tmp_path / "run"), "--dry-run", *args,
        env=os.environ | env, expect=2, timeout=300,
    )  # fmt: skip
    assert done.stderr.startswith("error: ") and "not a scheduler name" in done.stderr
    assert not planted.exists() and not (tmp_path / "run").exists()


def test_a_site_json_holding_one_is_refused_on_resume(tmp_path):
    subprocess.run(["tar", "-xzf", str(FIXTURE), "-C", str(tmp_path)], check=True)
    run_dir = tmp_path / "tiny-run"
    record = json.loads((run_dir / "site.json").read_text())
    value, planted = injection(tmp_path)
    record["spec"]["account"] = value
    (run_dir / "site.json").write_text(json.dumps(record))
    for command in (["--resume", "--dry-run"], ["--resume"], ["status"]):
        args = [*command[:1], "--run-dir", str(run_dir), *command[1:]]
        done = workflow(*args, expect=2, timeout=300)
        assert "account 'abc;touch${IFS}" in done.stderr and "not a scheduler name" in done.stderr
    assert not planted.exists()
