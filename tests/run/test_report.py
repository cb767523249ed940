"""What the run report reads from Parsl's monitoring database."""

import json
import sqlite3

from apps.plan.dag import dag_steps
from apps.plan.resolved import resolve_plan
from apps.plan.study import study_steps
from apps.run_setup import ROOT
from pipeline.run.run_layout import RunPaths
from pipeline.run.run_report import stage_wall_times, write_report


def monitoring_db(path, runs):
    """A database with the tables and columns of Parsl's monitoring that the report reads:
    `runs` is [(run id, began, [(app, launched, returned), ...]), ...]."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE workflow (run_id TEXT, time_began TEXT)")
        db.execute("CREATE TABLE task (task_id INT, run_id TEXT, task_func_name TEXT)")
        db.execute(
            "CREATE TABLE try (task_id INT, run_id TEXT, task_try_time_launched TEXT, "
            "task_try_time_running TEXT, task_try_time_returned TEXT)"
        )
        db.execute("CREATE TABLE status (task_id INT, run_id TEXT, task_status_name TEXT)")
        for run, began, tasks in runs:
            db.execute("INSERT INTO workflow VALUES (?, ?)", (run, began))
            for task_id, (app, launched, returned) in enumerate(tasks):
                db.execute("INSERT INTO task VALUES (?, ?, ?)", (task_id, run, app))
                db.execute(
                    "INSERT INTO try VALUES (?, ?, ?, NULL, ?)", (task_id, run, launched, returned)
                )
                db.execute("INSERT INTO status VALUES (?, ?, 'exec_done')", (task_id, run))
    return path


def test_a_stage_of_several_apps_spans_them_all_in_the_latest_run_that_ran_it(tmp_path):
    day = "2026-11-26 10:00:"
    db = monitoring_db(
        tmp_path / "monitoring.db",
        [
            ("first", day + "00", [
                ("begin_export", day + "01", day + "02"),
                ("export_region", day + "02", day + "20.5"),
                ("export_meshes", day + "02", day + "30"),
                ("finish_export", day + "30", day + "31"),
                ("infer_block", day + "00", day + "01"),
            ]),
            ("resumed", day + "40", [("infer_block", day + "41", day + "45")]),
        ],
    )  # fmt: skip
    times = stage_wall_times(db)
    assert times["export"] == 30.0  # begin_export's start to finish_export's end, not one app's
    assert times["infer"] == 4.0  # the resumed run ran it again


def test_the_report_says_how_many_of_a_trainings_ranks_were_virtual(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    summary = {"step": 20, "world_size": 8, "real_ranks": 2, "virtual_ranks": 4, "fov_per_s": 3.0,
               "loss": 0.5, "f1": 0.7, "accuracy": 0.8}  # fmt: skip
    (train / "train_summary.json").write_text(json.dumps(summary))
    report = write_report(tmp_path).read_text()
    assert "20 steps from scratch on 8 rank(s) (2 real x 4 virtual)" in report


def test_the_report_says_where_a_training_went_on_at_another_world_size(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    summary = {"step": 300, "world_size": 2, "real_ranks": 2, "virtual_ranks": 1, "fov_per_s": 3.0,
               "loss": 0.5, "f1": 0.7, "accuracy": 0.8, "worlds": [[0, 1], [150, 2]]}  # fmt: skip
    (train / "train_summary.json").write_text(json.dumps(summary))
    report = write_report(tmp_path).read_text()
    assert "300 steps from scratch on 2 rank(s) (1 rank(s) at first, 2 from step 150)" in report


def test_the_report_counts_the_fovs_not_evaluated_and_the_pairs_not_filled(tmp_path):
    """`min_unseen_share` and `max_contact_boundary` save FOV evaluations: the report says how
    many, beside those made."""
    (tmp_path / "inference").mkdir()
    (tmp_path / "agglomerate").mkdir()
    inference = {"seconds": 10.0, "voxels_per_second": 100.0, "fov_evaluations": 1601,
                 "fovs_seen_enough": 2514}  # fmt: skip
    stitched = {"stitch": {"blocks": 1, "objects": 60}, "inference": inference}
    (tmp_path / "inference/stitch.json").write_text(json.dumps(stitched))
    second = {"pairs": 121, "screened_pairs": 95, "merged_pairs": 2, "merged_segments": 3,
              "merged_objects": 1, "fov_evaluations": 125, "pairs_decided": True}  # fmt: skip
    (tmp_path / "agglomerate/agglomerate.json").write_text(json.dumps(second))
    report = write_report(tmp_path).read_text()
    assert "1601 FOV evaluations (2514 more the floods had seen were not evaluated)" in report
    assert "121 touching pairs tested (95 not filled: membrane across their contact)" in report


def test_every_app_the_workflow_plans_belongs_to_a_stage_of_the_report():
    """A task whose app has no stage would be left out of the report's stage times."""
    import dataclasses

    from test_parts import LABELS, RAW

    from pipeline.data.staging import DataConfig
    from pipeline.run.run_config import RunConfig
    from pipeline.run.run_report import STAGE_OF_APP
    from pipeline.secondpass.agglomeration import AgglomerationConfig
    from pipeline.study.study_grid import StudyConfig
    from site_configs import local

    second_pass = AgglomerationConfig(enabled=True, consensus=True, fill_unsegmented=True)
    config = dataclasses.replace(RunConfig(), agglomeration=second_pass)
    paths = RunPaths(ROOT / "data" / "runs" / "plan-only")
    a_study = dataclasses.replace(RunConfig(), study=StudyConfig(rank_counts=(1, 4)))
    steps = dag_steps(resolve_plan(config, paths, local.SITE)) + study_steps(
        resolve_plan(a_study, paths, local.SITE)
    )
    given_forest = dataclasses.replace(  # no training part: the fill's forest another run's
        config,
        data=DataConfig(eval_raw=RAW, eval_labels=LABELS),
        pretrained_model=str(ROOT / "models" / "demo-synthetic"),
        boundary_forest=str(paths.root / "forest.joblib"),
    )
    steps += dag_steps(resolve_plan(given_forest, paths, local.SITE))
    for step in steps:
        app = step.app_name.rpartition(".")[2]
        assert STAGE_OF_APP.get(app) == step.task.stage, step.task.name


def test_the_report_names_the_bodies_split_most_and_the_segments_that_merge_most(tmp_path):
    scores = {"vi_split": 0.6, "vi_merge": 0.3, "vi": 0.9, "adapted_rand_error": 0.04,
              "split_objects": 8, "merged_segments": 3}  # fmt: skip
    errors = {
        "split": [
            {"id": 135478, "voxels": 50198, "bits": 0.194, "largest": [[69, 10187], [0, 900]]}
        ],
        "merge": [{"id": 14, "voxels": 475926, "bits": 0.063, "largest": [[114488, 469440]]}],
    }
    (tmp_path / "evaluation.json").write_text(json.dumps({"ffn": scores, "largest_errors": errors}))
    report = write_report(tmp_path).read_text()
    assert "## Where FFN errs most" in report
    assert "| 135478 | 50,198 | 0.194 | 69 (10,187), unsegmented (900) |" in report
    assert "| 14 | 475,926 | 0.063 | 114488 (469,440) |" in report
    (tmp_path / "precomputed").mkdir()  # exported: the command that shows the body's pieces
    report = write_report(tmp_path).read_text()
    assert f"view --run-dir {tmp_path} --segments 69`" in report
    nothing = {"split": [], "merge": []}
    (tmp_path / "evaluation.json").write_text(
        json.dumps({"ffn": scores, "largest_errors": nothing})
    )
    assert "errs most" not in write_report(tmp_path).read_text()


def test_the_report_says_how_much_split_the_scored_parts_own_truth_costs(tmp_path):
    scores = {"vi_split": 0.6, "vi_merge": 0.3, "vi": 0.9, "adapted_rand_error": 0.04,
              "split_objects": 8, "merged_segments": 3}  # fmt: skip
    pieces = {"vi_split": 0.098, "bodies": 48, "bodies_in_pieces": 9}
    (tmp_path / "evaluation.json").write_text(
        json.dumps({"ffn": scores, "truth_in_pieces": pieces})
    )
    report = write_report(tmp_path).read_text()
    assert (
        "Of every row's VI split, 0.098 the scored part's own ground truth costs: 9 of its 48"
        in report
    )
    assert report.count("| 0.600 |") == 1  # one row: the truth's pieces are not a method


def test_the_quality_table_shows_each_rows_erl_and_what_it_is_measured_along(tmp_path):
    scores = {"vi_split": 0.6, "vi_merge": 0.3, "vi": 0.9, "adapted_rand_error": 0.04,
              "split_objects": 8, "merged_segments": 3}  # fmt: skip
    erl = {"erl_nm": 1234.5, "erl_merges": 2, "erl_splits": 17}
    skeletons = {"bodies": 48, "nodes": 9000, "length_nm": 81234.0, "erl_nm": 4321.0}
    evaluation = {"ffn": scores | erl, "learned_watershed": scores, "skeletons": skeletons}
    (tmp_path / "evaluation.json").write_text(json.dumps(evaluation))
    report = write_report(tmp_path).read_text()
    assert "| ERL (nm) | skeleton merges | skeleton splits |" in report
    assert "| 0.040 | 8 | 3 | 1,234 | 2 | 17 |" in report
    # A row without ERL (an evaluation made before it): dashes, not a failed report.
    assert "| 0.040 | 8 | 3 | — | — | — |" in report
    assert "(48 bodies, 81.2 µm of skeleton; kimimaro)" in report
    assert "at most the ground truth's own, 4,321 nm" in report
    assert report.count("| 0.600 |") == 2  # the skeletons are not a row
