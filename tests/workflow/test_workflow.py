"""The whole DAG through Parsl on the local site: what a run leaves, and what the CLI refuses.
How a run resumes after changes and faults: tests/workflow/test_resume.py."""

import json
import re
import sys
import time

import processes
import pytest
from workflow_runs import IMPORT_TRACE, ROOT, TINY, alone_on, imported, workflow

from apps.plan.dag import dag_steps
from apps.plan.describe import (
    _progress_of,
    describe_progress,
    describe_training,
    progress_seen_before,
)
from apps.plan.resolved import RunPlan, resolve_plan
from apps.plan.step import check_stage_inputs, executor_labels, plan_run
from pipeline.run.run_layout import RunPaths


@pytest.mark.mpi
@pytest.mark.slow
class TestLocalRun:
    def test_every_stage_leaves_its_outputs_and_stamps(self, tiny_run):
        for output in (
            "staged/train.h5", "staged/eval.h5", "preprocess/coordinates.npz", "train/train_summary.json",
            "train/curves.png", "selection.json", "precomputed/segmentation/10_10_20", "evaluation.json",
            "precomputed/export.json", "report.md", "monitoring.db", "config.json",
        ):  # fmt: skip
            assert (tiny_run / output).exists(), output
        for stamped in (
            "staged/eval.h5",
            "train/train_summary.json",
            "precomputed/segmentation/10_10_20",
            "precomputed",
        ):
            assert (tiny_run / f"{stamped}.stamp.json").is_file(), stamped
        report = (tiny_run / "report.md").read_text()
        # The run has a labelled training part: its baseline is the watershed a lab would tune.
        assert (
            "| learned watershed (" in report and "| ffn |" in report and "| train | 1 |" in report
        )
        assert "tried on the selection part" in report

    def test_training_ran_two_horovod_ranks(self, tiny_run):
        assert '"world_size": 2' in (tiny_run / "train" / "train_summary.json").read_text()
        # The run trains, so Parsl started the "mpi" pool beside the "cpu" one (their folders).
        assert {p.name for p in (tiny_run / "runinfo" / "000").iterdir()} >= {"mpi", "cpu"}

    def test_resume_without_config_uses_the_runs_own_settings(self, tiny_run):
        saved = (tiny_run / "config.json").read_text()
        with alone_on(tiny_run):
            done = workflow("--run-dir", str(tiny_run), "--resume")
        assert "nothing to do: every task is up to date" in done.stdout  # not the demo's settings
        assert (tiny_run / "config.json").read_text() == saved

    def test_status_says_what_is_done_and_where_the_logs_are(self, tiny_run):
        done = workflow("status", "--run-dir", str(tiny_run))
        assert "infer      4/4 up to date" in done.stdout and "training: step 30/30" in done.stdout
        assert f"{tiny_run}/runinfo/000/parsl.log" in done.stdout

    def test_rerun_without_resume_is_refused(self, tiny_run):
        with alone_on(tiny_run):
            done = processes.run(
                [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(tiny_run)],
                cwd=ROOT, timeout=900,
            )  # fmt: skip
        assert done.returncode == 2 and "add --resume" in done.stderr


def test_dry_run_on_theta_needs_no_scheduler():
    done = workflow("--site", "theta", "--dry-run")
    assert "CobaltProvider" in done.stdout and "aprun" in done.stdout
    assert "infer" in done.stdout and "placeholder" in done.stdout


def test_stages_left_out_must_have_their_outputs(tmp_path):
    done = processes.run(
        [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(tmp_path), "--stages", "train"],
        cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--stages leaves out 'stage', but 'train' needs its output" in done.stderr


def test_stages_left_out_need_only_the_outputs_this_run_plans(tmp_path, monkeypatch):
    """A run with a given model and nothing but a volume to segment stages no training volume:
    --stages stitch asks for the blocks and the staged volume, not for staged/train.h5."""
    import dataclasses

    from pipeline.core.errors import FFNError
    from pipeline.data.staging import DataConfig
    from pipeline.run.run_config import DEMO_MODEL, RunConfig
    from site_configs import local

    monkeypatch.setattr(RunPlan, "eval_shape", property(lambda plan: (64, 128, 128)))
    monkeypatch.setattr(RunPlan, "voxel_size", property(lambda plan: (10.0, 10.0, 10.0)))
    data = DataConfig(eval_raw=f"{tmp_path}/v.h5:raw")
    config = dataclasses.replace(RunConfig(pretrained_model=str(DEMO_MODEL)), data=data)
    steps = dag_steps(resolve_plan(config, RunPaths(tmp_path / "run"), local.SITE))
    stitch = frozenset({"stitch", "export"})
    with pytest.raises(
        FFNError, match="leaves out 'stage', but 'stitch' needs its output .*eval.h5"
    ):
        check_stage_inputs(stitch, steps)
    for step in steps:  # what staging and inference leave behind
        if step.task.stage in ("stage", "infer"):
            for output in step.task.outputs:
                output.parent.mkdir(parents=True, exist_ok=True)
                output.touch()
    assert not (tmp_path / "run" / "staged" / "train.h5").exists()
    check_stage_inputs(stitch, steps)  # no error


def test_resume_of_a_run_dir_that_holds_no_run_is_refused(tmp_path):
    done = workflow(
        "--config", str(TINY), "--run-dir", str(tmp_path / "typo"), "--resume", expect=2
    )
    assert "holds no run (no config.json)" in done.stderr
    assert not (tmp_path / "typo").exists()  # nothing submitted, nothing written


def test_a_config_section_changes_only_the_keys_it_names(tmp_path):
    from pipeline.run.run_config import load_run_config
    from pipeline.training.train_config import TrainConfig

    path = tmp_path / "steps.toml"
    path.write_text("[train]\nmax_steps = 40\n")
    # The paper's FFN, not the demo's, and every other setting at its default.
    assert load_run_config(path).train == TrainConfig(max_steps=40)
    # ... and the run says which model it trains before the first step (the dry run too).
    done = workflow("--config", str(path), "--dry-run")
    assert (
        "model: depth 9, 32 features, FOV 17x33x33 (z, y, x), 472,353 weights; batch 4 per rank"
        in done.stdout
    )


@pytest.mark.parametrize(
    "raw_dtype, voxel_size, labels, message",
    [
        ("uint8", True, "labels", "no dataset 'labels'"),
        ("uint8", True, "", "must look like path.h5:dataset"),
        ("int16", True, "raw", "raw image must be uint8, got int16"),
        (
            "uint8",
            False,
            "raw",
            "no voxel size (looked for the attributes 'voxel_size_nm', 'resolution')",
        ),
    ],
)
def test_dry_run_opens_every_input_before_anything_is_submitted(
    tmp_path, raw_dtype, voxel_size, labels, message
):
    import h5py
    import numpy as np

    volume = tmp_path / "volume.h5"
    with h5py.File(volume, "w") as f:
        f["raw"] = np.zeros((32, 64, 64), raw_dtype)
        if voxel_size:
            f["raw"].attrs["voxel_size_nm"] = (20.0, 10.0, 10.0)
    spec = f"{volume}:{labels}" if labels else str(volume)
    config = tmp_path / "run.toml"
    config.write_text(
        f'[data]\ntrain_raw = "{volume}:raw"\ntrain_labels = "{spec}"\neval_raw = "{volume}:raw"\n'
    )
    done = workflow("--config", str(config), "--dry-run", expect=2)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_account_and_queue_come_from_the_command_line_or_the_environment():
    import os

    env = os.environ | {"FFN_QUEUE": "preemptable"}
    done = processes.run(
        [sys.executable, "workflow.py", "--site", "polaris", "--dry-run", "--account", "abc123"],
        cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    assert "account: abc123" in done.stdout and "queue: preemptable" in done.stdout
    assert "placeholder" not in done.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["workflow.py"],
        ["workflow.py", "run"],
        ["workflow.py", "status"],
        ["-m", "pipeline.cli.train"],
        ["-m", "pipeline.cli.infer"],
        ["-m", "pipeline.cli.export"],
    ],
)
def test_help_imports_neither_tensorflow_nor_parsl(command):
    # What makes --help take seconds is loading TensorFlow or Parsl; asserting on what is imported
    # (not on seconds) holds on a slow machine too.
    done = processes.run(
        [sys.executable, *command, "--help"], cwd=ROOT, env=IMPORT_TRACE, timeout=300
    )
    assert done.returncode == 0 and "usage:" in done.stdout
    modules = imported(done.stderr)
    assert "argparse" in modules  # the trace really lists what was imported
    assert {"tensorflow", "parsl", "horovod", "cloudvolume"}.isdisjoint(modules)


@pytest.mark.parametrize(
    "command, own, not_theirs",
    [
        ("status", ["--run-dir"], ["--site", "--port", "--resume"]),
        ("view", ["--run-dir", "--port", "--viewer-port", "--segments"], ["--site", "--resume"]),
        ("run", ["--site", "--config", "--resume", "--stages"], ["--port", "--segments"]),
        ("study", ["--site", "--config", "--dry-run"], ["--port", "--segments"]),
    ],
)
def test_each_command_helps_with_its_own_options(command, own, not_theirs):
    shown = processes.run(
        [sys.executable, "workflow.py", command, "--help"], cwd=ROOT, timeout=300
    ).stdout
    assert shown.startswith(f"usage: workflow.py {command} ")
    options = set(re.findall(r"^\s+(--[a-z-]+)", shown, re.M))
    assert set(own) <= options and not set(not_theirs) & options, shown


def test_no_command_is_a_run():
    run_help = processes.run(
        [sys.executable, "workflow.py", "run", "--help"], cwd=ROOT, timeout=300
    ).stdout
    # A run's options with no command given, as `python workflow.py --site local` is used.
    given = processes.run(
        [sys.executable, "workflow.py", "--site", "x", "--help"], cwd=ROOT, timeout=300
    )
    assert given.stdout == run_help


def test_a_running_blocks_progress_reads_as_one_line():
    record = {"block": "block_0_0_0", "objects": 12, "fov_evaluations": 3456, "fov_per_s": 1.29,
              "seed_share": 0.4, "segmented_share": 0.62, "eta_s": 1500.0}  # fmt: skip
    assert describe_progress("infer[0]", record) == (
        "infer[0] block_0_0_0: 12 objects, 3,456 FOV evaluations, 1.3 FOV/s, 62% of the voxels "
        "segmented, 40% of the seeds tried, about 25 min left in this seed pass"
    )
    # The first seeds' objects say nothing of the rest (one object can take an hour).
    early = record | {"eta_s": None, "seeds_tried": 2}
    assert describe_progress("infer[0]", early).endswith(
        "tried, too early for a time left (2 seeds tried)"
    )
    # The arithmetic the block runs in ([inference] precision resolved on its machine).
    assert "1.3 FOV/s in mixed_bfloat16, 62%" in describe_progress(
        "infer[0]", record | {"precision": "mixed_bfloat16"}
    )


def test_a_resumed_block_shows_no_progress_until_it_writes_its_own(tmp_path):
    """The record a stopped run left (its counts went on past the last saved state) is not
    shown as the resumed block's; the first record the block writes is."""

    progress = tmp_path / "block_0_0_0.progress.json"
    record = {"block": "block_0_0_0", "objects": 1, "fov_evaluations": 2814, "fov_per_s": 0.6,
              "seed_share": 0.0, "eta_s": None}  # fmt: skip
    progress.write_text(json.dumps(record))
    seen = progress_seen_before([progress, tmp_path / "not_started.progress.json"])
    assert _progress_of(progress, seen) is None
    time.sleep(0.05)  # a new mtime, as the block's next atomic write gives
    progress.write_text(json.dumps(record | {"fov_evaluations": 1887}))
    assert _progress_of(progress, seen)["fov_evaluations"] == 1887


def test_parsl_starts_only_the_pools_of_the_tasks_that_run(tmp_path):
    from pipeline.run.run_config import RunConfig
    from site_configs import CPU_LABEL, MPI_LABEL, local

    steps = dag_steps(resolve_plan(RunConfig(), RunPaths(tmp_path / "run"), local.SITE))
    fresh = plan_run(steps)  # nothing made yet: every task runs, training included
    assert executor_labels(steps, fresh) == {MPI_LABEL, CPU_LABEL}
    # Trained and selected already (a resume, or a given model): no multi-rank task is left.
    before = {"stage", "preprocess", "train", "select"}
    trained = {n: None if n.partition("[")[0] in before else r for n, r in fresh.items()}
    assert executor_labels(steps, trained) == {CPU_LABEL}


def test_the_baseline_is_the_learned_watershed_where_the_run_has_a_labelled_training_part(
    tmp_path, monkeypatch
):
    import dataclasses

    from pipeline.data.staging import DataConfig
    from pipeline.run.run_config import DEMO_MODEL, RunConfig
    from site_configs import local

    def tasks(config: RunConfig) -> dict[str, tuple]:
        steps = dag_steps(resolve_plan(config, RunPaths(tmp_path / "run"), local.SITE))
        return {s.task.name: s.task.inputs for s in steps}

    trained = tasks(RunConfig())
    run = tmp_path / "run" / "staged"
    # Learned on the training part, tuned on the selection part, applied to the scored volume.
    forest = tmp_path / "run" / "baseline" / "boundary_forest.joblib"
    assert trained["evaluate[boundary forest]"] == (run / "train.h5",)
    assert trained["evaluate[learned watershed]"] == (forest, run / "select.h5", run / "eval.h5")
    assert trained["evaluate"][-1] == tmp_path / "run" / "baseline" / "learned_watershed.h5"
    # A given model: its training and selection parts are staged for the baseline alone.
    given = tasks(RunConfig(pretrained_model=str(DEMO_MODEL)))
    assert {"stage[train]", "stage[select]", "evaluate[learned watershed]"} <= set(given)
    assert "train" not in given and "preprocess" not in given
    # No labelled training part (a file to segment, nothing else): the untuned watershed.
    eval_only = DataConfig(eval_raw=f"{tmp_path}/v.h5:raw", eval_labels=f"{tmp_path}/v.h5:labels")
    alone = dataclasses.replace(RunConfig(pretrained_model=str(DEMO_MODEL)), data=eval_only)
    # The shape of a file that need not exist to plan.
    monkeypatch.setattr(RunPlan, "eval_shape", property(lambda plan: (64, 128, 128)))
    monkeypatch.setattr(RunPlan, "voxel_size", property(lambda plan: (10.0, 10.0, 10.0)))
    untuned = tasks(alone)
    assert "evaluate[learned watershed]" not in untuned and "stage[train]" not in untuned


def test_queue_and_walltime_of_each_pool_come_from_the_command_line():
    done = workflow(
        "--site", "polaris", "--dry-run", "--train-nodes", "16", "--queue", "prod",
        "--walltime", "03:00:00", "--cpu-queue", "preemptable", "--cpu-walltime", "02:00:00",
    )  # fmt: skip
    assert "batch jobs of 03:00:00 in queue prod" in done.stdout
    assert "batch jobs of 02:00:00 in queue preemptable" in done.stdout
    # The launch line as it runs in the job, not Parsl's variable.
    assert "$PARSL_MPI_PREFIX" not in done.stdout and "mpiexec -n 64 -ppn 4" in done.stdout


def test_a_job_its_queue_does_not_take_is_refused_naming_the_queues_that_would():
    done = workflow("--site", "polaris", "--dry-run", "--train-nodes", "128", expect=2)
    assert "does not fit queue 'debug'" in done.stderr and "prod" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_dry_run_counts_virtual_ranks_in_the_world_and_its_cost():
    import dataclasses
    import re

    from pipeline.run.run_config import RunConfig

    config = RunConfig()
    four = dataclasses.replace(config, train=dataclasses.replace(config.train, virtual_ranks=4))
    alone, virtual = describe_training(config, 2), describe_training(four, 2)
    assert "x 2 rank(s);" in alone and "x 2 rank(s) x 4 virtual;" in virtual

    def gflop(text: str) -> float:
        return float(re.search(r"about ([\d.]+) GFLOP", text).group(1))

    assert gflop(virtual) == pytest.approx(4 * gflop(alone), rel=0.02)
