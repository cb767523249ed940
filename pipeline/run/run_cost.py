"""What a run cost, per stage: the node-hours charged for its batch jobs and the energy its nodes
used (issue 57, point 6); the report's "Cost" section and the line `status` prints.

Node-hours charged (`charge`): each block (a batch job; on the local site a pool of local
processes) is charged its nodes x the time it ran, from Parsl's monitoring database
(`monitoring.db`, table `block`), over every Parsl run of the run dir (a resumed or retried
run costs again): from the first time Parsl saw it RUNNING, or the first time a try of its pool
had run if that is earlier (Parsl records a block's state at its polls, once a minute on a batch
scheduler), to the first end it saw (CANCELLED, COMPLETED, FAILED, TIMEOUT, MISSING, SCALED_IN).
A block that returned a try before Parsl saw it running (its whole work between two polls) is
charged from a poll before that, or its submission if later: when the try began is not recorded.
Its time queued is not charged; a local block's processes start as it is submitted, so it
counts from then.
Its nodes are the pool's nodes per block in the run's `site.json` (`nodes_per_block` for the
"mpi" pool, `cpu_nodes_per_block` for the "cpu" pool). A block whose end was never recorded
(the workflow was killed: its watchdog cancels it within seconds) is counted to the last thing
its Parsl run recorded, or to `now` while its workflow runs.

A block's node-hours go to the stages of the tasks it ran, in proportion to the time each of its
tasks ran in it (their tries' start to end, cut to the block's life), its idle time (starting,
waiting for the next stage's tasks, `max_idletime` before it is given back) included: so the
stages' node-hours add up to what was charged. An "mpi" block runs training only and goes
whole to it. Where the database does not say which block ran a try (Parsl records it only with
resource monitoring on), the blocks of one pool in one Parsl run are shared together the same
way. A block that ran no task at all is charged to no stage ("blocks that ran no task").

On the local site a node is this machine, and its two pools' blocks run on it at the same
time: the node-hours are what the same blocks would be charged as batch jobs on a cluster.

Energy (`energy_by_stage`): each task's stamp holds the energy counters of the node it ran on,
read as it began, every minute and as it ended (pipeline.core.energy, from the stamp's
`measured["energy"]`). A node's counters count every task running on it at once, so the
readings of all the tasks of a node are put on one time line, and the joules between two
consecutive readings are shared equally by the tasks running on that node then (joules while
none runs are no stage's). Only the node the task's worker runs on is read: a training's other
nodes are not. A stamp is its task's last successful try's: failed tries' joules are not counted.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections import Counter as Tally
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from pipeline.core.stamps import read_stamp
from pipeline.run.monitoring_db import STAGE_OF_APP
from pipeline.run.monitoring_db import query as _query
from pipeline.run.run_layout import RunPaths

# The pools' executor labels (site_configs.pools.MPI_LABEL, CPU_LABEL) -> the site setting that
# gives their nodes per block.
NODES_SETTING = {"mpi": "nodes_per_block", "cpu": "cpu_nodes_per_block"}
# parsl.jobs.states.TERMINAL_STATES: a block that reached one is no longer charged.
ENDED = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "MISSING", "SCALED_IN"}
# How often Parsl asks a batch scheduler for its blocks' states (the status_polling_interval of
# PBSProProvider, SlurmProvider and site_configs.cobalt.CobaltProvider): a block was not running
# at the poll before the one that first saw it RUNNING.
POLL = timedelta(seconds=60)
NO_TASK = "blocks that ran no task"


@dataclass(frozen=True)
class Block:
    """One batch job (Parsl block) of one pool in one Parsl run."""

    run_id: str
    executor: str
    block_id: str
    nodes: int
    start: datetime | None  # first seen RUNNING; None: never seen running (charged nothing)
    end: datetime | None
    open: bool = False  # no end recorded: counted to its run's end, or to `now`

    @property
    def node_hours(self) -> float:
        if self.start is None or self.end is None:
            return 0.0
        return self.nodes * max(0.0, (self.end - self.start).total_seconds()) / 3600


@dataclass
class Charge:
    """The node-hours charged, by stage (NO_TASK: blocks that ran no task)."""

    stages: dict[str, float] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(b.node_hours for b in self.blocks)

    def pools(self) -> dict[str, float]:
        by_pool: dict[str, float] = defaultdict(float)
        for block in self.blocks:
            by_pool[block.executor] += block.node_hours
        return dict(by_pool)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def nodes_per_block(spec: dict) -> dict[str, int]:
    """Nodes of one block of each pool, from a run's `site.json` spec (1 where it says none)."""
    return {label: int(spec.get(setting) or 1) for label, setting in NODES_SETTING.items()}


def blocks(db: Path, spec: dict, now: datetime | None = None) -> list[Block]:
    """Every block of every Parsl run in `db`, with the time it was charged for. `now`: the
    last run's workflow still runs, so its open blocks are counted to now."""
    runs = _query(db, "SELECT run_id, time_completed FROM workflow ORDER BY time_began")
    completed = {run: _time(done) for run, done in runs}
    last_run = runs[-1][0] if runs else None
    recorded = defaultdict(list)  # run: the times it recorded anything
    for sql in (
        "SELECT run_id, MAX(timestamp) FROM block GROUP BY run_id",
        "SELECT run_id, MAX(timestamp) FROM status GROUP BY run_id",
    ):
        for run, latest in _query(db, sql):
            if latest:
                recorded[run].append(_time(latest))
    nodes = nodes_per_block(spec)
    history = defaultdict(list)
    for run, executor, block_id, stamp, state in _query(
        db,
        "SELECT run_id, executor_label, block_id, timestamp, status FROM block ORDER BY timestamp",
    ):
        history[run, executor, block_id].append((_time(stamp), state))
    # The first time a try of a pool ran, and returned: a block of it was running by then, though
    # Parsl may see it RUNNING only at its next poll of the blocks (5 s on on the local site, whose
    # tiny run finished its staging before its cpu block was seen running; POLL on a batch one).
    first_try = {
        (run, executor, block_id): (_time(ran), _time(returned))
        for run, executor, block_id, ran, returned in _query(
            db,
            "SELECT run_id, task_executor, block_id, MIN(task_try_time_running), "
            "MIN(task_try_time_returned) FROM try GROUP BY run_id, task_executor, block_id",
        )
    }
    local = spec.get("scheduler") == "local"
    found = []
    for (run, executor, block_id), states in history.items():
        start = next((t for t, state in states if state == "RUNNING"), None)
        if start is not None:
            submitted = states[0][0]
            if local:  # a local block's processes start as it is submitted
                start = submitted
            ran, returned = first_try.get((run, executor, block_id)) or first_try.get(
                (run, executor, None), (None, None)
            )
            if ran and submitted <= ran < start:
                start = ran
            if returned and submitted <= returned < start:  # it worked between two polls
                start = max(submitted, start - POLL)
        end = next((t for t, s in states if start and t >= start and s in ENDED), None)
        still = start is not None and end is None
        if still:
            if completed.get(run):
                end = completed[run]
            elif now is not None and run == last_run:
                end = now
            else:
                end = max(recorded[run], default=start)
        found.append(
            Block(run, executor, str(block_id), nodes.get(executor, 1), start, end, open=still)
        )
    return found


def charge(db: str | Path, spec: dict, now: datetime | None = None) -> Charge:
    """The node-hours charged, split among the stages (the module's docstring says how)."""
    db = Path(db)
    found = blocks(db, spec, now)
    tries = _query(
        db,
        "SELECT t.run_id, t.task_func_name, y.task_executor, y.block_id, "
        "COALESCE(y.task_try_time_running, y.task_try_time_launched), y.task_try_time_returned "
        "FROM task t JOIN try y ON y.task_id = t.task_id AND y.run_id = t.run_id",
    )
    # Pools whose tries do not say their block: their blocks are shared together.
    pooled = {(run, executor) for run, _, executor, block_id, _, _ in tries if block_id is None}

    def group(run: str, executor: str, block_id: str | None) -> tuple:
        return (run, executor, None if (run, executor) in pooled else str(block_id))

    groups: dict[tuple, list[Block]] = defaultdict(list)
    for block in found:
        if block.start is not None:
            groups[group(block.run_id, block.executor, block.block_id)].append(block)
    busy: dict[tuple, Tally] = defaultdict(Tally)  # group: stage -> seconds of its tries
    spans = {
        key: (min(b.start for b in members), max(b.end for b in members))
        for key, members in groups.items()
    }
    for run, app, executor, block_id, began, returned in tries:
        key = group(run, executor, block_id)
        if key not in spans or began is None:
            continue
        low, high = spans[key]
        ended = _time(returned) or high  # a try still running (or lost) ran to the block's end
        seconds = (min(ended, high) - max(_time(began), low)).total_seconds()
        if seconds > 0:
            busy[key][STAGE_OF_APP.get(app, app)] += seconds
    result = Charge(blocks=found)
    stages: dict[str, float] = defaultdict(float)
    for key, members in groups.items():
        hours = sum(b.node_hours for b in members)
        seconds = sum(busy[key].values())
        if not seconds:
            stages[NO_TASK] += hours
            continue
        for stage, share in busy[key].items():
            stages[stage] += hours * share / seconds
    result.stages = dict(stages)
    return result


# -- energy --


def _task_outputs(db: Path, root: Path) -> dict[Path, tuple[str, str]]:
    """Each task's first output (in this run dir, wherever the run was made) -> (stage, pool),
    the latest Parsl run's where several ran it."""
    runs = {
        run: Path(rundir).parent.parent  # rundir: the run's runinfo/NNN
        for run, rundir in _query(db, "SELECT run_id, rundir FROM workflow")
    }
    rows = _query(
        db,
        "SELECT t.run_id, t.task_func_name, t.task_outputs, "
        "(SELECT y.task_executor FROM try y WHERE y.task_id = t.task_id AND y.run_id = t.run_id "
        "ORDER BY y.try_id DESC LIMIT 1) FROM task t JOIN workflow w ON w.run_id = t.run_id "
        "ORDER BY w.time_began, t.task_id",
    )
    outputs = {}
    for run, app, recorded, executor in rows:
        # Parsl records the outputs as the repr of its File objects (run_report.failed_tasks).
        match = re.search(r"url=(\S+)", recorded or "")
        if not match:
            continue
        path = Path(match.group(1))
        made_in = runs.get(run)
        if made_in is not None and path.is_relative_to(made_in):
            path = root / path.relative_to(made_in)  # a run dir moved or copied since
        outputs[path] = (STAGE_OF_APP.get(app, app), executor or "")
    return outputs


@dataclass
class Energy:
    """Joules by stage and kind of counter; which tasks had their node's counters read."""

    joules: dict[str, dict[str, float]] = field(default_factory=dict)  # stage: kind: J
    read: Tally = field(default_factory=Tally)  # stage: tasks whose node's counters were read
    recorded: Tally = field(default_factory=Tally)  # stage: tasks with an energy record at all
    tasks: Tally = field(default_factory=Tally)  # stage: tasks
    unread: dict[str, set] = field(default_factory=dict)  # why a node could not be read: hosts
    counters: set = field(default_factory=set)  # the counters read, by name
    pools: dict[str, set] = field(default_factory=dict)  # stage: the pools its tasks ran on


def _in_counting_order(
    timeline: list[tuple[float, float, int]], wrap: float
) -> list[tuple[float, float, int]]:
    """A counter's readings (time, joules, task), wraps undone, in the order the counter rose.
    Tasks read one counter at once: a reading's time and value are taken a moment apart, so two
    readings close in time may be out of order by time; by value they are not (a counter only
    rises). Each reading is unwrapped to within half the range of the one before it by time: a
    drop of more than that is a wrap, and a reading taken just before a wrap but timed after one
    taken just after it goes back below the wrap rather than make a second one."""
    unwrapped, last = [], None
    for time, value, task in sorted(timeline):
        if last is not None and wrap:
            value += round((last - value) / wrap) * wrap
        last = value
        unwrapped.append((time, value, task))
    return sorted(unwrapped, key=lambda reading: (reading[1], reading[0]))


def attribute(records: list[tuple[str, dict]]) -> dict[str, dict[str, float]]:
    """Joules by stage and kind of counter, from (stage, a task's energy record) pairs: the
    joules between consecutive readings of one node's counter (any task's), shared equally by
    the tasks running on that node between them."""
    joules: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    timelines = defaultdict(list)  # (host, counter): [(time, joules, task)]
    kinds, wraps, spans = {}, {}, {}
    for task, (stage, record) in enumerate(records):
        samples = record.get("samples") or []
        if not samples:
            continue
        spans[task] = (stage, samples[0][0], samples[-1][0])
        for index, (name, kind, wrap) in enumerate(record.get("counters", [])):
            key = (record.get("host", "?"), name)
            kinds[key], wraps[key] = kind, wrap
            timelines[key] += [
                (s[0], s[1 + index], task) for s in samples if s[1 + index] is not None
            ]
    for key, timeline in timelines.items():
        timeline = _in_counting_order(timeline, wraps[key])
        tasks = {task for _, _, task in timeline}
        begins = sorted((spans[t][1], t) for t in tasks)
        ends: list[tuple[float, int]] = []  # heap of the running tasks' ends
        running: Tally = Tally()  # stage: tasks of it running
        nxt = 0
        for (t0, v0, _), (t1, v1, _) in zip(timeline, timeline[1:], strict=False):
            while nxt < len(begins) and begins[nxt][0] <= t0:
                task = begins[nxt][1]
                heapq.heappush(ends, (spans[task][2], task))
                running[spans[task][0]] += 1
                nxt += 1
            # Ended before t1: not running through the readings' interval. (A task whose two
            # readings share their millisecond ended at t0 = t1 and still gets what they differ by.)
            while ends and ends[0][0] < t1:
                _, task = heapq.heappop(ends)
                running[spans[task][0]] -= 1
            count, delta = sum(running.values()), v1 - v0
            if count > 0 and math.isfinite(delta):
                for stage, n in running.items():
                    if n > 0:
                        joules[stage][kinds[key]] += delta * n / count
    return {stage: dict(by_kind) for stage, by_kind in joules.items()}


def energy_by_stage(paths: RunPaths) -> Energy:
    """The energy of each stage's tasks, from the readings in their stamps."""
    energy = Energy()
    records = []
    for output, (stage, pool) in _task_outputs(paths.monitoring_db, paths.root).items():
        energy.tasks[stage] += 1
        energy.pools.setdefault(stage, set()).add(pool)
        record = ((read_stamp(output) or {}).get("measured") or {}).get("energy")
        if not isinstance(record, dict):
            continue
        energy.recorded[stage] += 1
        if record.get("unread"):
            energy.unread.setdefault(record["unread"], set()).add(record.get("host", "?"))
        if record.get("samples") and record.get("counters"):
            energy.read[stage] += 1
            energy.counters |= {name for name, _, _ in record["counters"]}
            records.append((stage, record))
    energy.joules = attribute(records)
    return energy


# -- what the report and `status` print --


def _hours(hours: float) -> str:
    if 0 < hours < 0.00005:
        return "<0.0001"
    return f"{hours:.4f}" if hours < 1 else f"{hours:,.2f}"


def _joules(joules: float) -> str:
    if joules >= 3.6e6:
        return f"{joules / 3.6e6:,.2f} kWh"
    return f"{joules / 1e3:.2f} kJ" if joules >= 1e3 else f"{joules:.1f} J"


def _energy_cell(energy: Energy, stage: str) -> str:
    if not energy.recorded[stage]:
        return "not recorded"
    if not energy.read[stage]:
        return "not readable here"
    by_kind = {k: j for k, j in energy.joules.get(stage, {}).items() if j > 0}
    text = _joules(sum(by_kind.values()))
    if len(by_kind) > 1:
        text += " (" + ", ".join(f"{k} {_joules(j)}" for k, j in sorted(by_kind.items())) + ")"
    if energy.read[stage] < energy.tasks[stage]:
        text += f" ({energy.read[stage]} of {energy.tasks[stage]} tasks read)"
    return text


def _spec(paths: RunPaths) -> dict:
    try:
        record = json.loads(paths.site.read_text())
    except (OSError, ValueError):
        return {}
    return record.get("spec", record)  # runs before the site module was recorded: the spec alone


def cost_lines(paths: RunPaths) -> list[str]:
    """The report's "Cost" section: node-hours charged and energy, per stage."""
    spec = _spec(paths)
    charged = charge(paths.monitoring_db, spec)
    if not charged.blocks:
        return []
    energy = energy_by_stage(paths)
    order = list(dict.fromkeys([*STAGE_OF_APP.values(), *charged.stages, *energy.tasks]))
    lines = [
        "",
        f"## Cost (from {paths.monitoring_db.name}: every Parsl run of this run dir)",
        "",
        "| stage | node-hours charged | energy |",
        "|---|---|---|",
    ]
    for stage in order:
        if stage in charged.stages or energy.tasks[stage]:
            hours = charged.stages.get(stage)
            cell = _hours(hours) if hours is not None else "-"
            lines.append(f"| {stage} | {cell} | {_energy_cell(energy, stage)} |")
    if NO_TASK in charged.stages:
        lines.append(f"| ({NO_TASK}) | {_hours(charged.stages[NO_TASK])} | |")
    per_block = nodes_per_block(spec)
    pools = "; ".join(
        f"{pool} {_hours(hours)}: {_count(charged, pool)} block(s) of {per_block.get(pool, 1)} "
        "node(s)"
        for pool, hours in sorted(charged.pools().items())
    )
    if not any(energy.recorded.values()):
        total = "not recorded"
    elif not energy.read:
        total = "not readable here"
    else:
        total = _joules(sum(sum(k.values()) for k in energy.joules.values()))
    lines.append(f"| total | {_hours(charged.total)} ({pools}) | {total} |")
    lines += [
        "",
        "Node-hours: each block (batch job) charged its nodes x the time it ran, shared among the "
        "stages of the tasks it ran by their time in it, its idle time included "
        "(`pipeline.run.run_cost`).",
    ]
    if spec.get("scheduler") == "local":
        lines[-1] += (
            " On the local site a node is this machine and both pools' blocks run on it at once: "
            "this is what the same blocks would be charged as batch jobs."
        )
    lines += ["", _energy_note(energy, spec)]
    return lines


def _count(charged: Charge, pool: str) -> int:
    """The blocks of a pool that ran (were charged)."""
    return sum(b.executor == pool and b.start is not None for b in charged.blocks)


def _energy_note(energy: Energy, spec: dict) -> str:
    note = (
        "Energy: the counters of the node each task ran on (RAPL for CPUs and DRAM, NVML for "
        "NVIDIA GPUs, the i915/xe counter of Intel GPUs: `pipeline.core.energy`), shared equally "
        "by the tasks running on a node at once"
    )
    if energy.counters:
        note += f"; read: {', '.join(sorted(energy.counters))}"
    if int(spec.get("nodes_per_block") or 1) > 1 and any("mpi" in p for p in energy.pools.values()):
        note += f"; of a training's {spec['nodes_per_block']} nodes only its first is read"
    note += "."
    for why, hosts in sorted(energy.unread.items()):
        note += f" Not readable on {', '.join(sorted(hosts))}: {why}."
    if not any(energy.recorded.values()):
        note += " This run's tasks recorded no energy readings (their stamps have none)."
    return note


def status_line(run_dir: str | Path, running: bool) -> str | None:
    """`status`'s line: the node-hours charged so far (to now while the workflow runs)."""
    paths = RunPaths(Path(run_dir))
    charged = charge(paths.monitoring_db, _spec(paths), datetime.now() if running else None)
    if not charged.blocks:
        return None
    open_blocks = sum(b.open for b in charged.blocks)
    pools = ", ".join(f"{p} {_hours(h)}" for p, h in sorted(charged.pools().items()))
    order = list(dict.fromkeys([*STAGE_OF_APP.values(), *charged.stages]))
    stages = ", ".join(
        f"{s} {_hours(charged.stages[s])}" for s in order if charged.stages.get(s, 0) > 0
    )
    still = f", {open_blocks} block(s) running" if running and open_blocks else ""
    return f"node-hours charged so far: {_hours(charged.total)} ({pools}{still}): {stages}"
