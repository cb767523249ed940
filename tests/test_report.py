"""What the run report reads from Parsl's monitoring database."""

import sqlite3

from pipeline.report import stage_wall_times


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


def test_every_app_the_workflow_plans_belongs_to_a_stage_of_the_report():
    """A task whose app has no stage would be left out of the report's stage times."""
    import dataclasses

    import workflow as cli
    from pipeline.agglomeration import AgglomerationConfig
    from pipeline.report import STAGE_OF_APP
    from pipeline.run_config import RunConfig
    from site_configs import local

    second_pass = AgglomerationConfig(enabled=True, consensus=True)
    config = dataclasses.replace(RunConfig(), agglomeration=second_pass)
    steps = cli.dag_steps(
        config, cli.RunPaths(cli.ROOT / "data" / "runs" / "plan-only"), local.SITE
    )
    for step in steps:
        app = step.app.rpartition(".")[2]
        assert STAGE_OF_APP.get(app) == step.task.stage, step.task.name
