"""A resume you can trust: a changed setting or input re-runs exactly what depends on it, a missing
output is rebuilt, a lost worker costs a retry, and a stopped workflow leaves no worker behind.

Every scenario starts from a copy of one finished `configs/tiny.toml` run (the `tiny_run` fixture),
injects the real change or fault, resumes, and checks both what ran (the plan the workflow
prints, and the tasks Parsl's monitoring database recorded for that resume) and that the result
equals the one of a fresh run with the same settings and inputs.
"""

import json
import os
import shutil
import signal
import sys
import time

import numpy as np
import processes
import psutil
import pytest
from faults import zero_bytes
from workflow_runs import (
    IMPORT_TRACE,
    ROOT,
    TINY,
    alone_on,
    copy_run,
    imported,
    parsl_runs,
    segmentation,
    tiny_variant,
    tries,
    workflow,
)

from pipeline.core.owner import PERIOD
from pipeline.export.layers import export_complete
from pipeline.run.run_report import STAGE_OF_APP, task_states

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
# A sharded export's (the default): its region tasks mesh, no meshing task of their own.
EXPORT_APPS = {app for app, stage in STAGE_OF_APP.items() if stage == "export"} - {"export_meshes"}


def resume(run_dir, config, *extra: str) -> str:
    return workflow("--config", str(config), "--run-dir", str(run_dir), "--resume", *extra).stdout


def ran(run_dir) -> set[str]:
    """The stages the last Parsl run of `run_dir` executed."""
    return set(task_states(run_dir / "monitoring.db"))


def evaluation(run_dir) -> dict:
    """The scores of evaluation.json (not its timings)."""
    scores = json.loads((run_dir / "evaluation.json").read_text())
    return {method: values for method, values in scores.items() if isinstance(values, dict)}


def assert_same_result(run_dir, fresh) -> None:
    np.testing.assert_array_equal(segmentation(run_dir), segmentation(fresh))
    assert evaluation(run_dir) == evaluation(fresh)
    assert (
        json.loads((run_dir / "selection.json").read_text())["step"]
        == json.loads((fresh / "selection.json").read_text())["step"]
    )


def test_resuming_a_finished_run_starts_nothing_and_says_so(tiny_run):
    runs = parsl_runs(tiny_run)
    with alone_on(tiny_run):
        done = workflow(
            "--config", str(TINY), "--run-dir", str(tiny_run), "--resume", env=IMPORT_TRACE
        )
    assert "nothing to do: every task is up to date" in done.stdout
    assert "infer      4/4 up to date" in done.stdout
    assert parsl_runs(tiny_run) == runs  # no Parsl run, no worker: the stamps decided
    # Nor a model: deciding from the stamps loads no TensorFlow (seconds on any machine).
    assert "tensorflow" not in imported(done.stderr)


class TestChangedSettings:
    """One copy of the run, resumed three times: an inference setting, back to the first
    settings, and more training steps."""

    @pytest.fixture(scope="class")
    def legs(self, tiny_run, tmp_path_factory):
        folder = tmp_path_factory.mktemp("settings")
        run_dir = copy_run(tiny_run, folder / "run")
        configs = {
            "inference": tiny_variant(
                folder, "min_size", {"min_segment_size = 20": "min_segment_size = 2000"}
            ),
            "back": TINY,
            "training": tiny_variant(folder, "steps", {"max_steps = 30": "max_steps = 40"}),
        }
        legs = {}
        for name, config in configs.items():
            out = resume(run_dir, config)
            legs[name] = {
                "out": out,
                "ran": ran(run_dir),
                "segmentation": segmentation(run_dir),
                "evaluation": evaluation(run_dir),
            }
        legs["run_dir"] = run_dir
        return legs

    def test_an_inference_setting_reruns_inference_and_what_follows_it(self, legs, tiny_run):
        leg = legs["inference"]
        assert "settings changed: inference.min_segment_size 20 -> 2000" in leg["out"]
        assert leg["ran"] == {"infer", "stitch", "evaluate", "export"}
        # Segments under 2000 voxels are gone: the new setting really reached the blocks.
        assert len(np.unique(leg["segmentation"])) < len(np.unique(segmentation(tiny_run)))

    def test_the_first_settings_again_give_the_fresh_runs_result(self, legs, tiny_run):
        leg = legs["back"]
        assert "inference.min_segment_size 2000 -> 20" in leg["out"]
        assert leg["ran"] == {"infer", "stitch", "evaluate", "export"}
        np.testing.assert_array_equal(leg["segmentation"], segmentation(tiny_run))
        assert leg["evaluation"] == evaluation(tiny_run)

    def test_more_training_steps_go_on_from_the_last_checkpoint(self, legs):
        leg = legs["training"]
        assert "settings changed: train.max_steps 30 -> 40" in leg["out"]
        assert leg["ran"] == {"train", "select", "infer", "stitch", "evaluate", "export"}
        log = (legs["run_dir"] / "train" / "train.log").read_text()
        assert "ckpt-30 at step 30" in log


class TestChangedInputFile:
    """A run on the user's own files: the same voxels in a new file re-stage but train nothing
    again; a rewritten file re-runs what reads it."""

    @pytest.fixture(scope="class")
    def legs(self, tiny_run, tmp_path_factory):
        folder = tmp_path_factory.mktemp("files")
        train_file, select_file, eval_file = (
            folder / f"{n}.h5" for n in ("train", "select", "eval")
        )
        shutil.copyfile(tiny_run / "staged" / "train.h5", train_file)
        shutil.copyfile(tiny_run / "staged" / "select.h5", select_file)
        shutil.copyfile(tiny_run / "staged" / "train.h5", eval_file)  # the wrong volume, at first
        files = "[data]\n" + "".join(
            f'{role}_raw = "{path}:raw"\n{role}_labels = "{path}:labels"\n'
            for role, path in (("train", train_file), ("select", select_file), ("eval", eval_file))
        )
        config = tiny_variant(
            folder, "files", {"[data]\nsynthetic_shape_zyx = [32, 64, 64]\n": files}
        )
        run_dir = copy_run(tiny_run, folder / "run")
        legs = {"first": resume(run_dir, config)}
        legs["first_ran"] = ran(run_dir)
        time.sleep(0.01)  # a new mtime even on coarse clocks
        shutil.copyfile(tiny_run / "staged" / "eval.h5", eval_file)  # the user rewrites the file
        legs["rewritten"] = resume(run_dir, config)
        legs["rewritten_ran"] = ran(run_dir)
        legs["run_dir"] = run_dir
        return legs

    def test_the_same_voxels_from_a_file_train_nothing_again(self, legs):
        out = legs["first"]
        assert "stage[train]: settings changed" in out and "stage[eval]:" in out
        # Planned after the re-staging, then found up to date: the staged voxels are the same.
        assert "train      0/1 up to date; runs: after preprocess, stage" in out
        assert (
            "preprocess finished (found up to date)" in out
            and "train finished (found up to date)" in out
        )
        assert (legs["run_dir"] / "train" / "train.log").read_text().count("[train] done") == 1
        assert {"stage", "select", "infer"} <= legs["first_ran"]

    def test_a_rewritten_input_file_reruns_what_reads_it(self, legs, tiny_run):
        out = legs["rewritten"]
        assert "stage      2/3 up to date; runs: stage[eval]: input changed: " in out
        assert "train      1/1 up to date" in out and "select     1/1 up to date" in out
        assert legs["rewritten_ran"] == {"stage", "infer", "stitch", "evaluate", "export"}
        assert_same_result(legs["run_dir"], tiny_run)


class TestLostOutputAndWorker:
    """One block's result and the segmentation deleted; while the block is segmented again,
    its worker process is killed."""

    @pytest.fixture(scope="class")
    def resumed(self, tiny_run, tmp_path_factory):
        run_dir = copy_run(tiny_run, tmp_path_factory.mktemp("lost") / "run")
        (block,) = sorted((run_dir / "inference" / "blocks").glob("block_0_0_0.npz"))
        block.unlink()
        shutil.rmtree(run_dir / "precomputed")  # the stitched segmentation and its export
        lines, killed = [], None
        with processes.started(
            [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir), "--resume"],
            cwd=ROOT,
        ) as process:  # fmt: skip
            for line in process.stdout:
                lines.append(line)
                if "infer[0] started" in line:
                    killed = kill_worker_reading(run_dir, "staged/eval.h5")
            process.wait(timeout=600)
        return {
            "run_dir": run_dir,
            "out": "".join(lines),
            "rc": process.returncode,
            "killed": killed,
        }

    def test_a_deleted_output_is_rebuilt_and_nothing_else(self, resumed, tiny_run):
        assert resumed["rc"] == 0, resumed["out"][-3000:]
        out = resumed["out"]
        assert (
            "infer      3/4 up to date; runs: infer[0]: output missing: blocks/block_0_0_0.npz"
            in out
        )
        # 4 pairs tasks (only block 0's reads it), the join, one part (all of the tiny volume), the last
        assert "stitch     3/7 up to date; runs: stitch[pairs 0]: after infer;" in out
        assert ran(resumed["run_dir"]) == {"infer", "stitch", "evaluate", "export"}
        np.testing.assert_array_equal(segmentation(resumed["run_dir"]), segmentation(tiny_run))

    def test_a_killed_worker_costs_a_retry_not_the_run(self, resumed, tiny_run):
        assert resumed["killed"], "no worker process was found to kill"
        assert resumed["rc"] == 0, resumed["out"][-3000:]
        assert tries(resumed["run_dir"])["infer_block"] == 2  # the lost try, then the one that ran
        np.testing.assert_array_equal(segmentation(resumed["run_dir"]), segmentation(tiny_run))


def test_a_lost_shard_of_the_segmentation_is_written_again_and_nothing_else(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, tmp_path / "run")
    full_resolution = run_dir / "precomputed" / "segmentation" / "10_10_20"
    (lost,) = full_resolution.glob("*.shard")  # the tiny volume is one region: one shard
    lost.unlink()
    out = resume(run_dir, TINY)
    # 4 pairs tasks, the join, a relabel task (one part), the last: only the last runs.
    assert "stitch     6/7 up to date; runs: stitch: output changed since it was made" in out
    # Of the stitching, only its last task ran (and what reads the segmentation after it).
    assert set(tries(run_dir)) == {"finish_stitch", "count_region", "evaluate", *EXPORT_APPS}
    summary = json.loads((run_dir / "inference" / "stitch.json").read_text())
    assert summary["repaired_parts"] and lost.is_file()
    np.testing.assert_array_equal(segmentation(run_dir), segmentation(tiny_run))


def test_lost_truncated_and_zeroed_files_of_the_export_are_written_again(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, tmp_path / "run")
    folder = run_dir / "precomputed"
    lost = sorted((folder / "segmentation").glob("*_*_*/*.shard"))[-1]  # the coarsest scale's
    fragment = next((folder / "segmentation" / "mesh").glob("*.frags"))  # a meshing task's
    image = sorted((folder / "image").glob("*_*_*/*.shard"))[0]
    sizes, pixels = (lost.stat().st_size, fragment.stat().st_size), image.read_bytes()
    lost.unlink()
    fragment.write_bytes(fragment.read_bytes()[: sizes[1] // 2])
    zero_bytes(image, 0, 100)  # its size kept (issue 31)
    assert image.stat().st_size == len(pixels) and image.read_bytes() != pixels
    assert not export_complete(folder)
    out = resume(run_dir, TINY)
    # begin, a region (it meshes too), the mesh plan, a merge, the skeletons' task, plan and
    # merge, the last: only the last runs.
    assert "export     7/8 up to date; runs: export: output changed since it was made" in out
    assert set(tries(run_dir)) == {"finish_export"}  # it repairs: the other tasks kept
    assert (lost.stat().st_size, fragment.stat().st_size) == sizes and export_complete(folder)
    assert image.read_bytes() == pixels
    assert json.loads((folder / "export.json").read_text())["repaired"] == [
        "region 0:32, 0:64, 0:64",
        "mesh plan",
        "mesh merge 0",
        "skeleton 0",  # it reads the region written again
        "skeleton plan",
        "skeleton merge 0",
    ]
    # The repaired tasks' records were put back as their tasks made them: nothing runs again.
    again = resume(run_dir, TINY)
    assert "export     8/8 up to date" in again, again


def kill_worker_reading(run_dir, path: str, timeout: float = 300) -> int | None:
    """SIGKILL the worker process of the run's "cpu" pool that has `path` open (the block it is
    segmenting); returns its pid, or None if none did within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pool in psutil.process_iter(["cmdline"]):
            command = " ".join(pool.info["cmdline"] or [])
            if "process_worker_pool" not in command or f"{run_dir}/runinfo" not in command:
                continue
            for worker in pool.children():
                try:
                    if any(f.path.endswith(path) for f in worker.open_files()):
                        worker.kill()
                        return worker.pid
                except psutil.Error:
                    continue
        time.sleep(0.1)
    return None


def processes_of(run_dir, session: int) -> list[str]:
    """Processes naming the run dir (worker pools, ranks) or in the workflow's session."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            ours = str(run_dir) in " ".join(p.info["cmdline"] or []) or os.getsid(p.pid) == session
        except (psutil.Error, ProcessLookupError):
            continue
        if ours and p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(" ".join(p.info["cmdline"] or [])[:120])
    return found


def test_ctrl_c_stops_every_worker_and_a_resume_goes_on(tiny_run, tmp_path):
    run_dir = tmp_path / "stopped"
    command = [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir)]
    with processes.started(command, cwd=ROOT) as process:
        deadline = time.monotonic() + 600
        while process.poll() is None and time.monotonic() < deadline:
            if len(ranks(run_dir)) == 2:  # both Horovod ranks started (the tiny training is short)
                break
            time.sleep(0.2)
        assert len(ranks(run_dir)) == 2, "the ranks should be training"
        # A terminal's Ctrl-C: SIGINT to the whole foreground process group, Parsl's interchanges
        # and monitoring processes included (they died of it, and Parsl's cleanup then hung).
        os.killpg(process.pid, signal.SIGINT)
        out, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "stopped by SIGINT" in out
    assert "cleanup had not ended" not in out  # the interchanges lived: Parsl's own cleanup ran
    time.sleep(1)
    assert processes_of(run_dir, process.pid) == []  # no worker, no rank left computing

    # The training volume's staging is done (its ranks ran); the others' may still have been
    # running beside the training on a loaded machine. What was done stays done.
    staged = len(list((run_dir / "staged").glob("*.stamp.json")))
    assert staged >= 1
    out = resume(run_dir, TINY)
    assert f"stage      {staged}/3 up to date" in out and "train      0/1 up to date" in out
    assert_same_result(run_dir, tiny_run)


def test_sigterm_to_the_whole_process_group_stops_every_worker(tmp_path):
    """As `timeout` or a batch system stops a job: SIGTERM to every process of the group at once.
    The interchanges die before the workflow's handler stops them, and Parsl's cleanup, which
    waits for their answer, would wait forever. A block the provider started as the signal came
    (after it, so outside its reach; seen once on a loaded machine) stops by itself: its worker
    pool watches the workflow (pipeline.core.owner.PERIOD)."""
    run_dir = tmp_path / "terminated"
    command = [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir)]
    with processes.started(command, cwd=ROOT) as process:
        seen = []
        for line in process.stdout:  # until the first task starts: Parsl is up
            seen.append(line)
            if line.rstrip().endswith(" started"):
                break
        assert seen[-1].rstrip().endswith(" started"), "".join(seen)[-3000:]
        os.killpg(process.pid, signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and "cleanup had not ended" in out
    took = processes.wait_until(lambda: not processes_of(run_dir, process.pid), PERIOD + 5)
    assert took <= PERIOD + 5, processes_of(run_dir, process.pid)


def ranks(run_dir) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        command = " ".join(p.info["cmdline"] or [])
        if "pipeline.cli.train" in command and str(run_dir) in command and "mpiexec" not in command:
            found.append(p)
    return found
