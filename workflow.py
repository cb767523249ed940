"""The FFN workflow's command line: EM volume to a segmentation browsable in Neuroglancer.

    python workflow.py --site local                      # this machine, the synthetic demo
    python workflow.py --site polaris --config run.toml  # the same DAG on an HPC site
    python workflow.py --run-dir R --resume              # go on with R's own settings and site
    python workflow.py --site polaris --dry-run          # print the DAG and the site, submit nothing
    python workflow.py study --config configs/study.toml # the paper's learning-rate/scaling study
    python workflow.py status --run-dir data/runs/demo   # what a run has done, where its logs are
    python workflow.py view --run-dir data/runs/demo     # open the result in Neuroglancer

stage -> preprocess -> train (MPI, N ranks) -> select -> infer x B blocks (parallel) -> stitch
-> [consensus, agglomerate] -> evaluate, export -> report.md. The DAG is planned in apps/plan/,
run in apps/run_workflow.py; this module parses, resolves the run, calls and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import pipeline  # noqa: F401  (oneDNN on before TensorFlow loads)
from apps.plan.step import STAGES
from pipeline.core.errors import FFNError
from pipeline.run.run_layout import RunPaths

COMMANDS = ("run", "study", "status", "view")


def run(args: argparse.Namespace) -> int:
    """`run` and `study`: resolve the run, check it, then describe it (--dry-run) or start it."""
    from apps.plan.resolved import resolve_plan
    from apps.run_setup import check_command, check_shell_safe, resolve_run
    from apps.run_workflow import dry_run, start_run
    from pipeline.data.staging import check_sources
    from site_configs.environment import check_environment, describe_environment, read_environment
    from site_configs.pools import venv_path

    resolved = resolve_run(args)
    plan = resolve_plan(resolved.config, resolved.paths, resolved.spec)
    check_command(args.command, resolved.config)
    check_sources(resolved.config.data, plan.segmenting_fov)  # before a job is submitted
    venv = venv_path(resolved.spec)
    if venv is not None:
        check_shell_safe(venv, "venv")
    environment = read_environment(venv)
    stages = frozenset(args.stages) if args.stages else None
    if args.dry_run:
        return dry_run(args.command, resolved, plan, environment, stages or frozenset(STAGES))
    # A GPU site with a CPU-only TensorFlow is refused here, before a job is asked for.
    warning = check_environment(resolved.spec, environment)
    resolved.spec.require_submittable()  # a placeholder account: refused before the run dir is touched
    notes = [describe_environment(environment), *([warning] if warning else [])]
    return start_run(resolved, plan, stages, args.resume, notes)


def status(args: argparse.Namespace) -> int:
    """What a run has done, from its stamps, monitoring.db and files; starts nothing."""
    from apps.plan.dag import steps_of
    from apps.plan.describe import _progress_of, describe_progress
    from apps.plan.resolved import resolve_plan
    from apps.plan.step import describe_plan, plan_run
    from apps.run_setup import describe_code, load_site_record
    from pipeline.data.staging import reads_in_place
    from pipeline.inference.blocks import block_progress_path
    from pipeline.run.run_config import load_run_config
    from pipeline.run.run_cost import status_line
    from pipeline.run.run_lock import describe_processes, holder, run_processes
    from pipeline.run.run_report import failed_tasks, task_states
    from pipeline.training.train_metrics import last_metrics

    paths = RunPaths(Path(args.run_dir).resolve())
    if not paths.config.is_file() or not paths.site.is_file():
        raise FFNError(f"status: {paths.root} holds no run (no config.json / site.json)")
    config = load_run_config(paths.config)
    paths = replace(paths, eval_in_place=reads_in_place(config.data))
    source, spec = load_site_record(paths.site)
    steps = steps_of(resolve_plan(config, paths, spec))
    print(f"run {config.name} in {paths.root} (site {source})")
    running = holder(paths.root)
    print(f"workflow: {running.describe() if running else 'no workflow has run here'}")
    if working := run_processes(paths.root):
        pids = " ".join(str(p.pid) for p, _ in working)
        left = not (running and running.held)
        print(
            f"processes: {describe_processes(working)} of the run alive on this host"
            + (
                f", left by a workflow that is gone (pids {pids}): --resume ends them"
                if left
                else ""
            )
        )
    print(f"code: {describe_code(paths.root)}")
    print("stamps (what is done and valid now):", *describe_plan(steps, plan_run(steps)), sep="\n")
    for step in [s for s in steps if s.task.stage == "infer"]:
        progress = block_progress_path(step.task.outputs[0])
        if record := _progress_of(progress, {}):  # a block begun and not finished
            when = time.strftime("%H:%M:%S", time.localtime(progress.stat().st_mtime))
            print(f"  at {when}: {describe_progress(step.task.name, record)}")
    db = paths.monitoring_db
    if states := task_states(db):
        counts = {stage: {s: v.count(s) for s in set(v)} for stage, v in states.items()}
        print(
            "last Parsl run (monitoring.db):",
            *(f"  {st:<10} {c}" for st, c in counts.items()),
            sep="\n",
        )
    for app, output, error in failed_tasks(db):
        print(f"  failed: {app} -> {output}: {error}")
    if cost := status_line(paths.root, running=bool(running and running.held)):
        print(cost)
    if (metrics := last_metrics(paths.train_dir / "metrics.csv")) is not None:
        print(
            f"training: step {metrics['step']:.0f}/{config.train.max_steps}, loss {metrics['loss']:.4f}, "
            f"{metrics['fov_per_s']:.1f} FOV/s"
        )
    runs = sorted(paths.runinfo.glob("[0-9][0-9][0-9]"))
    latest = runs[-1] if runs else paths.runinfo
    train_logs = (
        paths.study_cells / "*" / "train.log" if config.study.rank_counts else paths.train_log
    )
    print(f"logs: {train_logs}, {latest / 'parsl.log'}, {latest / 'submit_scripts'}/")
    return 0


def view(args: argparse.Namespace) -> int:
    """`view`: serve the run's export until Ctrl-C; prints the URL to open, a token in it (an
    export published to a bucket: only prints its link). With a merge graph (pairs decided),
    its edges are the segmentation's equivalences: the merged objects, unless --supervoxels."""
    from pipeline.export.viewer import serve_forever
    from pipeline.secondpass.merge_graph import equivalences

    paths = RunPaths(Path(args.run_dir))
    joined = []
    if paths.merge_graph.is_file() and not args.supervoxels:
        joined = equivalences(paths.merge_graph)
        print(f"[view] the merged objects: {len(joined)} edge(s) of {paths.merge_graph} as "
              "equivalences (--supervoxels: the second pass's segments before its merges)")  # fmt: skip
    serve_forever(paths.precomputed, args.port, args.segments, args.viewer_port, joined)
    return 0


def _run_options(parser: argparse.ArgumentParser) -> None:
    """The options of `run` and `study`."""
    add = parser.add_argument
    add(
        "--site",
        help="aurora, local, perlmutter, polaris, slurm, theta, or a path to a site module "
        "(default: local; with --resume the site the run recorded)",
    )
    add(
        "--move-site",
        action="store_true",
        help="with --resume: go on on --site (its current settings) instead of the run's own site",
    )
    add(
        "--accept-site-record",
        action="store_true",
        help="with --resume: take the run's site.json as it is, though another user wrote it or "
        "it changed since the run (its worker_init runs in every job: read it first)",
    )
    add(
        "--config",
        help="TOML of run settings (see configs/) over each section's own defaults "
        "(pipeline/run/run_config.py); relative paths in it are relative to the file; default: the "
        "demo, or with --resume the run's own config.json",
    )
    add("--run-dir", help="default: data/runs/<name from the config>")
    add(
        "--account",
        help="allocation charged by batch jobs (default: $FFN_ACCOUNT, else the site's)",
    )
    add("--queue", help="batch queue or partition (default: $FFN_QUEUE, else the site's)")
    add(
        "--qos",
        help="Slurm only: the QOS of both pools' jobs, sbatch --qos (perlmutter: debug, regular; "
        "default: the site's)",
    )
    add(
        "--constraint",
        help="Slurm only: the node features both pools' jobs need, sbatch --constraint "
        "(perlmutter: gpu, 'gpu&hbm80g'; default: the site's)",
    )
    add("--walltime", metavar="HH:MM:SS", help="walltime of the training's batch jobs")
    add("--cpu-queue", help="batch queue of the single-process tasks' jobs (default: --queue's)")
    add(
        "--cpu-walltime",
        metavar="HH:MM:SS",
        help="walltime of the batch jobs of single-process tasks (inference, export, ...)",
    )
    add(
        "--train-nodes",
        type=int,
        metavar="N",
        help="nodes the training uses, and so the size of its batch job (the config's train_nodes; "
        "default: the site's nodes_per_block)",
    )
    add("--resume", action="store_true", help="reuse what an earlier run in --run-dir finished")
    add("--dry-run", action="store_true", help="print the DAG and site settings; run nothing")
    add(
        "--stages",
        nargs="+",
        choices=STAGES,
        metavar="STAGE",
        help=f"run only these ({', '.join(STAGES)}); the others' outputs must exist from an earlier run",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workflow.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="{run,study,status,view}")
    for name, text in (
        ("run", "run the workflow (the default command)"),
        ("study", "run the paper's learning-rate/scaling study of a [study] config"),
    ):
        _run_options(commands.add_parser(name, help=text, description=text))
    status_text = "what a run has done and is doing, from its stamps, records and logs"
    status_parser = commands.add_parser("status", help=status_text, description=status_text)
    status_parser.add_argument("--run-dir", required=True, help="the run's directory")
    view_text = (
        "serve a run's Neuroglancer layers and open them in a local viewer (published to a "
        "bucket: print a Neuroglancer link to them there)"
    )
    view_parser = commands.add_parser("view", help=view_text, description=view_text)
    view_parser.add_argument("--run-dir", required=True, help="the run's directory")
    view_parser.add_argument("--port", type=int, default=0, help="data server port (0 = any free)")
    view_parser.add_argument(
        "--viewer-port", type=int, default=0, help="Neuroglancer port (0 = any free)"
    )
    view_parser.add_argument(
        "--segments",
        type=int,
        nargs="+",
        metavar="ID",
        help="the segments to show, e.g. a body's pieces from the report (default: the largest)",
    )
    view_parser.add_argument(
        "--supervoxels",
        action="store_true",
        help="with a merge graph (agglomerate/graph.csv): show the second pass's segments before "
        "its merges, each on its own (default: the merged objects, the graph's equivalences)",
    )
    return parser  # fmt: skip


def _with_command(argv: list[str]) -> list[str]:
    """`run` when no command is given (`python workflow.py --site local`)."""
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help")):
        return argv
    return ["run", *argv]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_with_command(sys.argv[1:] if argv is None else list(argv)))
    try:
        if args.command == "status":
            return status(args)
        if args.command == "view":
            return view(args)
        return run(args)
    except FFNError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    # A process Parsl spawned (its monitoring database and routers) runs this file first, as
    # multiprocessing's spawn does with the main script: it ends with its workflow, should the
    # watchdog be gone too (pipeline.core.owner).
    from pipeline.core.owner import watch_owner

    watch_owner()
