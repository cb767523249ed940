"""Node-hours charged and energy per stage (pipeline.run.run_cost, pipeline.core.energy): from a
real tiny run's monitoring.db, from databases with batch jobs, and from stand-in energy counters
(powercap and hwmon trees) that change while a stage runs."""

import json
import sqlite3
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from stand_in_node import StandInNode
from workflow_runs import copy_run

from pipeline.core.energy import SYSFS_VARIABLE, EnergyMeter
from pipeline.core.stamps import holds_stamp, read_stamp, stamp_path
from pipeline.run.run_cost import (
    NO_TASK,
    NODES_SETTING,
    _hours,
    _task_outputs,
    attribute,
    charge,
    status_line,
)
from pipeline.run.run_report import task_states, write_report


def test_the_pools_labels_are_the_site_configs(tmp_path):
    from site_configs.pools import CPU_LABEL, MPI_LABEL
    from site_configs.spec import SiteSpec

    assert set(NODES_SETTING) == {MPI_LABEL, CPU_LABEL}
    assert set(NODES_SETTING.values()) <= {f.name for f in SiteSpec.__dataclass_fields__.values()}


# -- node-hours --


@pytest.mark.mpi
@pytest.mark.slow
def test_the_tiny_runs_node_hours_are_its_blocks_nodes_times_their_time(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path / "run")
    db, spec = run / "monitoring.db", json.loads((run / "site.json").read_text())["spec"]
    with sqlite3.connect(db) as connection:
        rows = connection.execute(
            "SELECT executor_label, MIN(timestamp), MAX(timestamp) FROM block GROUP BY "
            "run_id, executor_label, block_id"
        ).fetchall()
    # The local site: a block's processes start as it is submitted and end when scaled in.
    hours = {
        pool: (datetime.fromisoformat(end) - datetime.fromisoformat(begin)).total_seconds() / 3600
        for pool, begin, end in rows
    }
    assert set(hours) == {"mpi", "cpu"} and spec["nodes_per_block"] == 1
    charged = charge(db, spec)
    assert charged.total == pytest.approx(sum(hours.values()))
    assert sum(charged.stages.values()) == pytest.approx(charged.total)  # idle time included
    assert charged.stages["train"] == pytest.approx(hours["mpi"])  # the mpi block trains only
    assert NO_TASK not in charged.stages
    assert all(charged.stages[stage] > 0 for stage in task_states(db)), charged.stages

    report = write_report(run).read_text()
    assert "## Cost (from monitoring.db: every Parsl run of this run dir)" in report
    assert f"| train | {_hours(charged.stages['train'])} | " in report
    assert f"| total | {_hours(charged.total)} (cpu " in report
    assert ": 1 block(s) of 1 node(s); mpi " in report
    assert "On the local site a node is this machine" in report
    line = status_line(run, running=False)
    assert line.startswith(f"node-hours charged so far: {_hours(charged.total)} (cpu ")
    assert f"train {_hours(charged.stages['train'])}" in line


def parsl_db(path, runs):
    """A database with the columns of Parsl's monitoring that run_cost reads. `runs`: [(run id,
    began, completed, blocks [(pool, block id, [(time, state)])], tries [(app, pool, block id,
    launched, running, returned)])]."""
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE workflow (run_id TEXT, time_began TEXT, time_completed TEXT, rundir TEXT)"
        )
        db.execute(
            "CREATE TABLE block (run_id TEXT, executor_label TEXT, block_id TEXT, job_id TEXT, "
            "timestamp TEXT, status TEXT)"
        )
        db.execute(
            "CREATE TABLE task (task_id INT, run_id TEXT, task_func_name TEXT, task_outputs TEXT)"
        )
        db.execute(
            "CREATE TABLE try (try_id INT, task_id INT, run_id TEXT, block_id TEXT, "
            "task_executor TEXT, task_try_time_launched TEXT, task_try_time_running TEXT, "
            "task_try_time_returned TEXT)"
        )
        db.execute(
            "CREATE TABLE status (task_id INT, run_id TEXT, task_status_name TEXT, timestamp TEXT)"
        )
        for run, began, completed, blocks, tries in runs:
            db.execute("INSERT INTO workflow VALUES (?, ?, ?, ?)", (run, began, completed, "x"))
            for pool, block_id, states in blocks:
                for stamp, state in states:
                    db.execute(
                        "INSERT INTO block VALUES (?, ?, ?, 'job', ?, ?)",
                        (run, pool, block_id, stamp, state),
                    )
            for task_id, (app, pool, block_id, launched, running, returned) in enumerate(tries):
                db.execute("INSERT INTO task VALUES (?, ?, ?, '')", (task_id, run, app))
                db.execute(
                    "INSERT INTO try VALUES (0, ?, ?, ?, ?, ?, ?, ?)",
                    (task_id, run, block_id, pool, launched, running, returned),
                )
                state = "exec_done" if returned else "running"
                db.execute(
                    "INSERT INTO status VALUES (?, ?, ?, ?)",
                    (task_id, run, state, returned or running or launched),
                )
    return path


def test_batch_jobs_are_charged_from_running_to_their_end_at_their_pools_nodes(tmp_path):
    day = "2026-11-26 "
    spec = {"scheduler": "pbspro", "nodes_per_block": 4, "cpu_nodes_per_block": 2}
    db = parsl_db(
        tmp_path / "monitoring.db",
        [
            ("first", day + "09:59", day + "11:20", [
                # 4 nodes for 1 h: its queued 10 minutes are not charged
                ("mpi", "0", [(day + "10:00", "PENDING"), (day + "10:10", "RUNNING"),
                              (day + "11:10", "COMPLETED")]),
                # 2 cpu jobs of 2 nodes for 30 min each, the tries not saying which ran them
                ("cpu", "0", [(day + "10:00", "PENDING"), (day + "10:05", "RUNNING"),
                              (day + "10:35", "SCALED_IN")]),
                ("cpu", "1", [(day + "10:00", "PENDING"), (day + "10:05", "RUNNING"),
                              (day + "10:35", "CANCELLED")]),
                # never ran: nothing charged
                ("cpu", "2", [(day + "10:00", "PENDING"), (day + "10:20", "CANCELLED")]),
            ], [
                ("train", "mpi", None, day + "10:00", None, day + "11:00"),
                ("infer_block", "cpu", None, day + "10:05", None, day + "10:35"),
                ("infer_block", "cpu", None, day + "10:05", None, day + "10:35"),
                # launched before the jobs ran: only its time in them counts
                ("stage_volume", "cpu", None, day + "09:59", None, day + "10:25"),
            ]),
            ("resumed", day + "11:50", None, [  # its workflow still runs, or was killed
                # seen RUNNING at 12:00, though a try ran on it from 11:58
                ("mpi", "0", [(day + "11:55", "PENDING"), (day + "12:00", "RUNNING")]),
            ], [("train", "mpi", "0", day + "11:55", day + "11:58", None)]),
        ],
    )  # fmt: skip
    charged = charge(db, spec, now=datetime.fromisoformat(day + "12:28"))
    # cpu: 2 jobs x 2 nodes x 0.5 h, shared by 60 min of infer tries and 20 min of staging
    assert charged.stages["infer"] == pytest.approx(2 * 2 * 0.5 * 60 / 80)
    assert charged.stages["stage"] == pytest.approx(2 * 2 * 0.5 * 20 / 80)
    assert charged.stages["train"] == pytest.approx(4 * 1 + 4 * 0.5)  # to now: 11:58 to 12:28
    assert charged.pools() == pytest.approx({"mpi": 6.0, "cpu": 2.0})
    assert [b.open for b in charged.blocks if b.run_id == "resumed"] == [True]

    # The workflow gone (no now): the open job counted to the last thing its run recorded.
    assert charge(db, spec).stages["train"] == pytest.approx(4 * 1 + 4 * 2 / 60)
    (tmp_path / "site.json").write_text(json.dumps({"site": "x", "spec": spec}))
    line = status_line(tmp_path, running=True)
    assert line.startswith("node-hours charged so far: ") and "1 block(s) running" in line
    assert ": stage 0.5000, train " in line


def test_a_job_whose_task_ran_between_two_polls_is_charged_from_the_poll_before(tmp_path):
    """Parsl asks a batch scheduler for its blocks' states once a minute: a block whose whole task
    ran between two polls is first seen RUNNING after its task came back (at the next poll, or
    the workflow's last look as it stops, site_configs.teardown). It was running by the poll
    before that: charged from then (or from its submission, if later) to its end."""
    day = "2026-11-26 "
    spec = {"scheduler": "pbspro", "nodes_per_block": 4, "cpu_nodes_per_block": 2}
    db = parsl_db(
        tmp_path / "monitoring.db",
        [
            ("short", day + "10:00", day + "10:10", [
                ("mpi", "0", [(day + "10:00", "PENDING"), (day + "10:05:40", "RUNNING"),
                              (day + "10:07:40", "CANCELLED")]),
                ("cpu", "0", [(day + "10:06:30", "PENDING"), (day + "10:07", "RUNNING"),
                              (day + "10:07:30", "CANCELLED")]),
            ], [
                ("train", "mpi", "0", day + "10:00", None, day + "10:05"),
                ("infer_block", "cpu", "0", day + "10:06:30", None, day + "10:06:50"),
            ]),
        ],
    )  # fmt: skip
    charged = charge(db, spec)
    assert charged.stages["train"] == pytest.approx(4 * 3 / 60)  # 10:04:40 to 10:07:40
    assert charged.stages["infer"] == pytest.approx(2 * 1 / 60)  # 10:06:30 (submitted) to 10:07:30
    assert NO_TASK not in charged.stages


def test_a_job_that_ran_no_task_is_charged_to_no_stage(tmp_path):
    day = "2026-11-26 "
    db = parsl_db(
        tmp_path / "monitoring.db",
        [("only", day + "10:00", day + "11:00", [
            ("cpu", "0", [(day + "10:00", "RUNNING"), (day + "10:30", "FAILED")]),
        ], [])],
    )  # fmt: skip
    charged = charge(db, {"scheduler": "slurm", "cpu_nodes_per_block": 3})
    assert charged.stages == {NO_TASK: pytest.approx(1.5)}


# -- energy --


def test_the_meter_reads_a_stand_in_node_through_its_counters_wrap_arounds(tmp_path, monkeypatch):
    node = StandInNode(tmp_path / "sys")
    monkeypatch.setenv(SYSFS_VARIABLE, str(node.root))
    with EnergyMeter(every=0.01) as meter:
        for _ in range(5):  # 125 J: two wraps of the 60 J package counter in one task
            time.sleep(0.05)
            node.use(CPU=25.0, DRAM=0.5)
        node.use(GPU=7.0)
        time.sleep(0.05)
    record = meter.measured()["energy"]
    assert [name for name, _, _ in record["counters"]] == [
        "rapl:package-0",
        "rapl:package-0/dram",
        "intel-gpu:card0",
    ]  # fmt: skip  (core and psys are inside the package or hold it; the tile is inside the card)
    assert len(record["samples"]) > 5 and "unread" not in record
    joules = attribute([("train", record)])["train"]
    assert joules == pytest.approx({"CPU": 125.0, "DRAM": 2.5, "GPU": 7.0})

    monkeypatch.setenv(SYSFS_VARIABLE, str(tmp_path / "empty"))
    with EnergyMeter() as meter:
        pass
    record = meter.measured()["energy"]
    assert "samples" not in record
    assert record["unread"].startswith(f"RAPL: no intel-rapl zone in {tmp_path}/empty/class")


def test_a_nodes_joules_are_shared_by_the_tasks_running_on_it_at_once():
    def task(host, begin, end, joules, wrap=120.0):
        return {"host": host, "counters": [["rapl:package-0", "CPU", wrap]],
                "samples": [[begin, joules[0]], [end, joules[1]]]}  # fmt: skip

    records = [
        ("infer", task("a", 0.0, 10.0, (0.0, 100.0))),  # 10 J/s on node a
        ("export", task("a", 5.0, 15.0, (50.0, 30.0))),  # 150 J at 15 s: wrapped at 120
        ("export", task("a", 100.0, 110.0, (40.0, 60.0))),  # alone; 15 s to 100 s: no task's
        ("train", task("b", 5.0, 10.0, (7.0, 9.0))),  # another node's counter
    ]
    joules = {stage: by_kind["CPU"] for stage, by_kind in attribute(records).items()}
    assert joules == pytest.approx({"infer": 50 + 25, "export": 25 + 50 + 20, "train": 2})


def test_a_task_whose_readings_share_their_millisecond_keeps_what_they_differ_by():
    """A task quicker than the meter's clock (time.time() rounded to ms, as under load the
    run_once test met): its two readings bear one time, and their difference is still its."""
    counters = [["rapl:package-0", "CPU", 60.0]]
    quick = {"host": "n", "counters": counters, "samples": [[5.0, 10.0], [5.0, 15.0]]}
    assert attribute([("stage", quick)])["stage"]["CPU"] == pytest.approx(5.0)


def test_a_reading_timed_after_a_wrap_but_read_before_it_is_not_a_second_wrap():
    """Two tasks on one node, its counter 1 J short of wrapping at 60 J: task a reads 59.5 J,
    then is held up before it takes the time; task b meanwhile reads 0.5 J after the wrap. By
    time a's reading comes after b's: it lies back below the wrap, it does not wrap again."""
    counters = [["rapl:package-0", "CPU", 60.0]]
    a = {"host": "n", "counters": counters, "samples": [[0.0, 59.0], [2.0, 59.5], [4.0, 1.5]]}
    b = {"host": "n", "counters": counters, "samples": [[1.0, 59.2], [1.5, 0.5], [3.0, 1.0]]}
    joules = attribute([("infer", a), ("infer", b)])
    assert joules["infer"]["CPU"] == pytest.approx(2.5)  # 59.0 J to 61.5 J


@pytest.mark.mpi
@pytest.mark.slow
def test_the_report_gives_each_stage_the_joules_its_nodes_counters_rose_by(
    tiny_run, tmp_path, monkeypatch
):
    """The tiny run's train and infer tasks as if each had read a stand-in node's counters
    (pipeline.core.stamps.run_once's meter): its four blocks at once, using 20 J among them,
    the training 80 J (the package counter wrapping on the way)."""
    run = copy_run(tiny_run, tmp_path / "run")
    node = StandInNode(tmp_path / "sys")
    monkeypatch.setenv(SYSFS_VARIABLE, str(node.root))
    outputs = _task_outputs(run / "monitoring.db", run)
    stages = {stage for stage, _ in outputs.values()}

    def measure(output: Path, work) -> None:
        with EnergyMeter(every=0.01) as meter:
            time.sleep(0.03)
            work()
            time.sleep(0.03)
        assert not holds_stamp(output)
        stamp = read_stamp(output)
        stamp["measured"] |= meter.measured()
        stamp_path(output).write_text(json.dumps(stamp))

    # The other tasks' own readings (this machine's counters, or why they cannot be read)
    # left out: those stages are "not recorded", whatever machine made the tiny run.
    for output, (stage, _) in outputs.items():
        if stage not in ("train", "infer") and (stamp := read_stamp(output)) is not None:
            stamp.get("measured", {}).pop("energy", None)
            if holds_stamp(output):  # an export's record: the stamp is inside it
                output.write_text(json.dumps(json.loads(output.read_text()) | {"stamp": stamp}))
            else:
                stamp_path(output).write_text(json.dumps(stamp))
    [train] = [o for o, (stage, _) in outputs.items() if stage == "train"]
    measure(train, lambda: [node.use(CPU=20.0) or time.sleep(0.03) for _ in range(4)])
    blocks = [o for o, (stage, _) in outputs.items() if stage == "infer"]
    assert len(blocks) == 4
    threads = [
        threading.Thread(target=measure, args=(o, lambda: node.use(CPU=4.0, DRAM=1.0)))
        for o in blocks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    report = write_report(run).read_text()
    cost = report.split("## Cost")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0][2:]: line for line in cost.splitlines() if line.startswith("| ")}
    assert rows["train"].endswith(" | 80.0 J |")
    assert rows["infer"].endswith(" | 20.0 J (CPU 16.0 J, DRAM 4.0 J) |")
    for stage in stages - {"train", "infer"}:
        assert rows[stage].endswith(" | not recorded |"), rows[stage]
    assert rows["total"].endswith(" | 100.0 J |")
    assert "; read: intel-gpu:card0, rapl:package-0, rapl:package-0/dram." in report


def test_run_once_keeps_its_nodes_energy_readings_in_the_stamp(tmp_path, monkeypatch):
    from pipeline.core.stamps import run_once

    node = StandInNode(tmp_path / "sys")
    monkeypatch.setenv(SYSFS_VARIABLE, str(node.root))
    output = tmp_path / "made.txt"

    def work() -> None:
        node.use(CPU=5.0, GPU=2.0)
        output.write_text("made")

    run_once({"task": 1}, [], [output], work)
    record = read_stamp(output)["measured"]["energy"]
    assert attribute([("stage", record)])["stage"] == pytest.approx(
        {"CPU": 5.0, "DRAM": 0.0, "GPU": 2.0}
    )
