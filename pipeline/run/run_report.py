"""The run report (`report.md`) and what the monitoring database says about earlier runs.

Per-stage wall times come from Parsl's monitoring database (`monitoring.db`: tables `workflow`,
`task`, `status`; the stage of each app, `STAGE_OF_APP`: pipeline.run.monitoring_db);
node-hours charged and energy per stage from its `block` and `try` tables, the run's
`site.json` and the tasks' stamps (pipeline.run.run_cost); training speed from
`train/metrics.csv`; scores from `evaluation.json`.
"""

import json
import re
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.core.stamps import read_stamp
from pipeline.run.monitoring_db import STAGE_OF_APP
from pipeline.run.monitoring_db import query as _query
from pipeline.run.run_cost import cost_lines
from pipeline.run.run_layout import LAYOUT, RunPaths

# evaluation.json's keys -> the report's rows.
METHOD_NAMES = {
    "ffn_first_pass": "ffn, first pass only",
    "ffn_consensus": "ffn + consensus (before agglomeration)",
    "learned_watershed": "learned watershed (forest of the training part, tuned on the selection part)",
    "watershed": "watershed (edge distance, untuned)",
}


def _truth_in_pieces_lines(pieces: dict | None) -> list[str]:
    """The part of every row's VI split that the scored part's ground truth itself costs."""
    if not pieces or not pieces["bodies_in_pieces"]:
        return []
    return [
        "", f"Of every row's VI split, {pieces['vi_split']:.3f} the scored part's own ground truth "
        f"costs: {pieces['bodies_in_pieces']} of its {pieces['bodies']} bodies lie in pieces there "
        "(joined outside it), which no segmentation of connected segments joins without merging.",
    ]  # fmt: skip


def _forest_origin(paths: RunPaths) -> str:
    """Where the fill's forest came from: the run's training part, or the file it was given."""
    given = (_read_json(paths.config) or {}).get("boundary_forest")
    return (
        f"of the forest another run learned (`{given}`)"
        if given
        else "learned on the training part"
    )


def _largest_errors_lines(errors: dict | None) -> list[str]:
    """The bodies split most and the segments that merge most: where to proofread first."""
    if not errors or not (errors["split"] or errors["merge"]):
        return []

    def named(i: int) -> str:
        return str(i) if i else "unsegmented"

    lines = ["", "## Where FFN errs most", "",
             "The ground-truth bodies that add most to VI split, and the segments that add most to "
             "VI merge (segment ids as in the export: select them in Neuroglancer):", ""]  # fmt: skip
    columns = {"split": ("body", "segments"), "merge": ("segment", "bodies")}
    for side, (what, other) in columns.items():
        if errors[side]:
            header = f"| {what} | voxels | VI {side} (bits) | its largest {other} (voxels) |"
            lines += [header, "|---|---|---|---|"]
            for row in errors[side]:
                largest = ", ".join(f"{named(i)} ({v:,})" for i, v in row["largest"])
                lines.append(
                    f"| {named(row['id'])} | {row['voxels']:,} | {row['bits']:.3f} | {largest} |"
                )
            lines.append("")
    return lines[:-1]


def _run_id(db: Path, run: int) -> str | None:
    """The id of one Parsl run in the database, in the order they began (-1 = the last)."""
    runs = [r[0] for r in _query(db, "SELECT run_id FROM workflow ORDER BY time_began")]
    return runs[run] if runs else None


def task_states(db: str | Path, run: int = -1) -> dict[str, list[str]]:
    """Final state of each app's tasks in one run (-1 = the last), e.g. {"train": ["exec_done"]}."""
    db = Path(db)
    if (run_id := _run_id(db, run)) is None:
        return {}
    rows = _query(
        db,
        "SELECT t.task_func_name, s.task_status_name FROM task t JOIN status s "
        "ON s.task_id = t.task_id AND s.run_id = t.run_id WHERE t.run_id = ? "
        "AND s.timestamp = (SELECT MAX(timestamp) FROM status WHERE task_id = t.task_id AND run_id = t.run_id)",
        (run_id,),
    )
    states: dict[str, list[str]] = {}
    for app, state in rows:
        states.setdefault(STAGE_OF_APP.get(app, app), []).append(state)
    return states


def failed_tasks(db: str | Path, run: int = -1) -> list[tuple[str, str, str]]:
    """(app, its first output, the error of its last try) of each task that failed in one run
    (-1 = the last): what `status` shows when the workflow's own output is gone."""
    db = Path(db)
    if (run_id := _run_id(db, run)) is None:
        return []
    rows = _query(
        db,
        "SELECT t.task_func_name, t.task_outputs, y.task_fail_history FROM task t JOIN try y "
        "ON y.task_id = t.task_id AND y.run_id = t.run_id WHERE t.run_id = ? "
        "AND y.try_id = (SELECT MAX(try_id) FROM try WHERE task_id = t.task_id AND run_id = t.run_id) "
        "AND (SELECT task_status_name FROM status s WHERE s.task_id = t.task_id AND s.run_id = t.run_id "
        "ORDER BY s.timestamp DESC LIMIT 1) = 'failed' ORDER BY t.task_id",
        (run_id,),
    )
    failed = []
    for app, outputs, history in rows:
        # Parsl records the outputs as the repr of its File objects, the errors comma-joined.
        output = re.search(r"url=(\S+)", outputs or "")
        error = (history or "").strip() or "no error recorded"
        failed.append((app, output.group(1) if output else "?", error[-500:]))
    return failed


def stage_wall_times(db: str | Path) -> dict[str, float]:
    """Seconds from the first task of a stage starting to its last one returning, in the latest
    run that executed the stage (a resumed run takes the earlier times of what it skipped)."""
    rows = _query(
        Path(db),
        # A try's 'running' time is recorded only where workers report it; 'launched' always is.
        "SELECT t.task_func_name, t.run_id, MIN(COALESCE(y.task_try_time_running, y.task_try_time_launched)), "
        "MAX(y.task_try_time_returned) FROM task t JOIN try y ON y.task_id = t.task_id AND y.run_id = t.run_id "
        "JOIN workflow w ON w.run_id = t.run_id WHERE EXISTS (SELECT 1 FROM status s WHERE s.task_id = t.task_id "
        "AND s.run_id = t.run_id AND s.task_status_name = 'exec_done') "
        "GROUP BY t.task_func_name, t.run_id ORDER BY w.time_began",
    )
    from datetime import datetime

    spans: dict[str, tuple[str, datetime, datetime]] = {}  # stage: (run, first start, last end)
    for app, run, began, ended in rows:  # runs in the order they began: later ones replace
        if not began or not ended:
            continue
        stage = STAGE_OF_APP.get(app, app)
        began, ended = datetime.fromisoformat(began), datetime.fromisoformat(ended)
        if stage in spans and spans[stage][0] == run:  # a stage of several apps spans them all
            began, ended = min(began, spans[stage][1]), max(ended, spans[stage][2])
        spans[stage] = (run, began, ended)
    return {stage: (ended - began).total_seconds() for stage, (_, began, ended) in spans.items()}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _world(train: dict) -> str:
    """The world a training ran as: its ranks, and how many of them were virtual."""
    virtual = train.get("virtual_ranks", 1)
    split = f" ({train['real_ranks']} real x {virtual} virtual)" if virtual > 1 else ""
    stretches = train.get("worlds", [])
    changes = "".join(
        f", {size} from step {start}" for start, size in stretches[1:]
    )  # a run that went on at another world size
    was = f" ({stretches[0][1]} rank(s) at first{changes})" if changes else ""
    return f"{train['world_size']} rank(s){split}{was}"


def _study_lines(paths: RunPaths) -> list[str]:
    """A study's answers and the link to its report (pipeline.study.study_report)."""
    results = _read_json(paths.study_results)
    if not results:
        return []
    answers = [f"- {s['setting']}: {s['answer']}" for s in results["settings"]]
    return [
        "",
        "## Study",
        "",
        *answers,
        "",
        f"Figures and tables: [{LAYOUT['study_report']}]({LAYOUT['study_report']}).",
    ]


def _stage_lines(paths: RunPaths) -> list[str]:
    """Each stage's tasks in the latest Parsl run and its wall time, from the monitoring database."""
    times = stage_wall_times(paths.monitoring_db)
    states = task_states(paths.monitoring_db)
    lines = [
        f"## Stages (from {LAYOUT['monitoring_db']}: the run that last executed each)",
        "",
        "| stage | tasks in the latest Parsl run | wall time |",
        "|---|---|---|",
    ]
    for stage in dict.fromkeys(STAGE_OF_APP.values()):  # stitching is four apps, one stage
        if stage in states or stage in times:
            tasks = len(states[stage]) if stage in states else "- (up to date)"
            wall = f"{times[stage]:.1f} s" if stage in times else "-"
            lines.append(f"| {stage} | {tasks} | {wall} |")
    return lines


def _training_lines(paths: RunPaths) -> list[str]:
    """How long the training ran, on which world, from which weights, and how well it did."""
    train = _read_json(paths.train_summary)
    if not train:
        return []
    inputs = (_read_json(paths.train_config) or {}).get("inputs", {})
    start = (
        f"from the weights of `{inputs['init_from']}`"
        if inputs.get("init_from")
        else "from scratch"
    )
    return [
        "", "## Training", "",
        f"{train['step']} steps {start} on {_world(train)}, {train['fov_per_s']:.1f} FOV/s "
        f"in the last interval; final loss {train['loss']:.3f}, voxel F1 {train['f1']:.3f}, "
        f"accuracy {train['accuracy']:.3f}.",
        "", f"![training curves]({LAYOUT['train_curves']})",
    ]  # fmt: skip


def _selection_lines(paths: RunPaths) -> list[str]:
    selection = _read_json(paths.selection)
    return ["", f"Selected checkpoint: `{selection.get('checkpoint')}`."] if selection else []


def _inference_lines(stitched: dict) -> list[str]:
    """The first pass's blocks, speed and objects (`stitched`: the stitching's summary)."""
    if not (stitched and "inference" in stitched):  # older runs' stitch.json listed every block
        return []
    blocks, total = stitched["stitch"]["blocks"], stitched["inference"]
    seen = total.get("fovs_seen_enough")
    skipped = f" ({seen} more the floods had seen were not evaluated)" if seen else ""
    return [
        "", "## Inference", "",
        f"{blocks} block(s), {total['seconds'] / blocks:.1f} s per block, "
        f"{total['voxels_per_second']:,.0f} voxels/s per task; {total['fov_evaluations']} FOV "
        f"evaluations{skipped}; {stitched['stitch']['objects']} objects after stitching.",
    ]  # fmt: skip


def _consensus_lines(paths: RunPaths) -> list[str]:
    """The consensus's second inference pass and the segments both passes agree on."""
    again = _read_json(paths.second_stitch_summary)
    if not (again and paths.consensus_summary.is_file()):
        return []
    return [
        "", "## Consensus (FFN's second pass)", "",
        f"A second inference pass, seeds in the other order: {again['inference']['fov_evaluations']} "
        f"FOV evaluations; the voxels both passes put together are kept together "
        f"({_read_json(paths.consensus_summary)['segments']} segments).",
    ]  # fmt: skip


def _pairs_decided(agglomerated: dict) -> bool:
    """Whether the agglomeration decided its pairs (older runs' summaries: always)."""
    return agglomerated.get("pairs_decided", True)


def _agglomeration_lines(agglomerated: dict, stitched: dict) -> list[str]:
    """The pairs the agglomeration tested and merged, and its network calls against the first
    pass's (`stitched`: the stitching's summary)."""
    if not (agglomerated and _pairs_decided(agglomerated)):
        return []
    first = (stitched.get("inference") or {}).get("fov_evaluations")
    share = f" ({agglomerated['fov_evaluations'] / first:.0%} of the first pass's)" if first else ""
    screened = agglomerated.get("screened_pairs")
    membrane = f" ({screened} not filled: membrane across their contact)" if screened else ""
    return [
        "", "## Agglomeration (FFN's second pass)", "",
        f"{agglomerated['pairs']} touching pairs tested{membrane}, {agglomerated['merged_pairs']} merged "
        f"({agglomerated['merged_segments']} segments into {agglomerated['merged_objects']} objects); "
        f"{agglomerated['fov_evaluations']} FOV evaluations{share}.",
    ]  # fmt: skip


def _graph_lines(paths: RunPaths) -> list[str]:
    """Where the merges are, with pairs decided: the graph over the exported supervoxels."""
    graph = _read_json(paths.merged_summary)
    if not graph:
        return []
    return [
        "", f"The export holds the segments before these merges (supervoxels); the merges are "
        f"the graph `{paths.merge_graph.relative_to(paths.root)}` ({graph['edges']} edges, "
        f"to edit by hand: docs/second-pass.md), its {graph['merged_objects']} merged objects "
        f"in `{paths.merged.relative_to(paths.root)}`, which is scored; `view` shows them as "
        "equivalences (`--supervoxels`: without).",
    ]  # fmt: skip


def _fill_lines(agglomerated: dict, paths: RunPaths) -> list[str]:
    """How the voxels the fills left unsegmented were filled, and what was dropped first."""
    if not agglomerated.get("filled_unsegmented"):
        return []
    lines = [
        "", "## Fill of the unsegmented voxels", "",
        "Every voxel the fills left unsegmented joined the segment whose basin it lies in, "
        f"flooding a boundary map {_forest_origin(paths)}.",
    ]  # fmt: skip
    if agglomerated.get("fill_min_size"):
        lines[-1] += (
            f" First, {agglomerated['dropped_objects']} objects under "
            f"{agglomerated['fill_min_size']} voxels were dropped, their voxels filled alike."
        )
    return lines


def _method_names(agglomerated: dict, paths: RunPaths) -> dict[str, str]:
    """The quality table's row names: FFN's named after the steps its segmentation went through."""
    second = {"consensus": paths.consensus_summary, "agglomeration": paths.agglomerate_summary}
    steps = [step for step, summary in second.items() if summary.is_file()]
    steps = [s for s in steps if s != "agglomeration" or _pairs_decided(agglomerated)]
    steps += ["fill"] if agglomerated.get("filled_unsegmented") else []
    return METHOD_NAMES | ({"ffn": " + ".join(["ffn", *steps])} if steps else {})


def _erl_cells(scores: dict) -> str:
    """A row's ERL (nm) and its merges and splits along the skeletons; dashes where it has none
    (the baseline off, or an evaluation made before ERL)."""
    if "erl_nm" not in scores:
        return "| — | — | — |"
    return f"| {scores['erl_nm']:,.0f} | {scores['erl_merges']} | {scores['erl_splits']} |"


def _skeleton_lines(skeletons: dict | None) -> list[str]:
    """What ERL is measured along, and the most a row can score."""
    if not skeletons:
        return []
    return [
        "", f"ERL: the expected run length along the ground truth's skeletons ({skeletons['bodies']} "
        f"bodies, {skeletons['length_nm'] / 1000:,.1f} µm of skeleton; kimimaro), as funlib.evaluate "
        "defines it (pipeline/evaluation/erl.py); higher is better, at most the ground truth's own, "
        f"{skeletons['erl_nm']:,.0f} nm. Merges: segments holding nodes of two or more skeletons; "
        "splits: skeleton edges whose nodes lie in two segments.",
    ]  # fmt: skip


def _quality_lines(evaluation: dict, agglomerated: dict, paths: RunPaths) -> list[str]:
    """The scores of every method evaluated, a row each."""
    if not evaluation:
        return []
    lines = [
        "",
        "## Segmentation quality (lower is better; ERL higher)",
        "",
        "| method | VI split | VI merge | VI | adapted Rand error | objects split | segments merged "
        "| ERL (nm) | skeleton merges | skeleton splits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = _method_names(agglomerated, paths)
    for method, scores in evaluation.items():
        if isinstance(scores, dict) and "vi" in scores:
            lines.append(
                f"| {names.get(method, method)} | {scores['vi_split']:.3f} | {scores['vi_merge']:.3f} | {scores['vi']:.3f} "
                f"| {scores['adapted_rand_error']:.3f} | {scores['split_objects']} | {scores['merged_segments']} "
                + _erl_cells(scores)
            )
    return lines + _skeleton_lines(evaluation.get("skeletons"))


def _learned_watershed_lines(paths: RunPaths, evaluation: dict) -> list[str]:
    """The learned watershed's tuned parameters and the time it took to learn, tune, segment."""
    learned = _read_json(paths.learned_baseline_record)
    if not (learned and "learned_watershed" in evaluation):
        return []
    params = ", ".join(f"{k} {v}" for k, v in learned["params"].items())
    seconds = learned["seconds"]
    # The forest is a task of its own (the fill takes it too): its stamp holds its time.
    forest = read_stamp(paths.boundary_forest) or {}
    learn = forest.get("measured", {}).get("seconds")
    learnt = f"{learn:.0f} s to learn the forest, " if learn is not None else ""
    return [
        "", f"The learned watershed: {params} (the best of {len(learned['tuning_trials'])} "
        f"tried on the selection part); {learnt}{seconds['tune']:.0f} s to tune, "
        f"{seconds['segment']:.0f} s to segment.",
    ]  # fmt: skip


def _viewer_lines(run_dir: Path, paths: RunPaths, errors: dict) -> list[str]:
    """How to open the export in Neuroglancer, and the body split most among its segments."""
    if not paths.precomputed.is_dir():
        return []
    lines = ["", f"Neuroglancer: `python workflow.py view --run-dir {run_dir}`"]
    split = errors.get("split")
    pieces = [str(i) for i, _ in split[0]["largest"] if i] if split else []
    if pieces:
        lines[-1] += (
            f"; the body split most, its largest segments: `python workflow.py view --run-dir "
            f"{run_dir} --segments {' '.join(pieces)}`"
        )
    return lines


def write_report(run_dir: str | Path) -> Path:
    """report.md: stage times, node-hours and energy, training speed and quality, FFN against the watershed baseline."""
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    lines = [f"# FFN run report: {run_dir.name}", ""]
    lines += _stage_lines(paths)
    lines += cost_lines(paths)
    lines += _study_lines(paths)
    lines += _training_lines(paths)
    lines += _selection_lines(paths)
    stitched = _read_json(paths.stitch_summary)
    lines += _inference_lines(stitched)
    lines += _consensus_lines(paths)
    agglomerated = _read_json(paths.agglomerate_summary)
    lines += _agglomeration_lines(agglomerated, stitched)
    lines += _graph_lines(paths)
    lines += _fill_lines(agglomerated, paths)
    evaluation = _read_json(paths.evaluation)
    lines += _quality_lines(evaluation, agglomerated, paths)
    lines += _truth_in_pieces_lines(evaluation.get("truth_in_pieces") if evaluation else None)
    lines += _learned_watershed_lines(paths, evaluation)
    errors = (evaluation or {}).get("largest_errors") or {}
    lines += _largest_errors_lines(errors)
    lines += _viewer_lines(run_dir, paths, errors)
    with atomic_path(paths.report) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    return paths.report
