"""What a run goes on with, resolved once from the command line: its settings, paths and site
(site.json, `--resume`, `--move-site`, the allocation given), checked before anything starts."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import re
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from apps.plan.dag import checkpoints_within
from apps.plan.study import study_site
from pipeline.core import config_io
from pipeline.core.errors import BoundaryForestError, ConfigError, FFNError
from pipeline.run.code_copy import CODE_DIR, copy_name, last_copy
from pipeline.run.run_layout import RunPaths

if TYPE_CHECKING:
    from pipeline.run.run_config import RunConfig
    from site_configs.spec import SiteSpec

ROOT = Path(__file__).resolve().parents[1]


def _site_source(name_or_path: str) -> str:
    """How a run records its site: a known site's name, or a user module's absolute path (a
    resume from another directory must find the same module)."""
    from site_configs import known_sites

    if name_or_path in known_sites():
        return name_or_path
    return str(Path(name_or_path).expanduser().resolve())


def save_site_record(path: Path, source: str, spec: SiteSpec) -> None:
    """site.json: the site module the run uses and its resolved settings (account, queue, job
    sizes): what `--resume` and `status` go on with."""
    from pipeline.core.atomic import atomic_path

    text = json.dumps({"site": source, "spec": config_io.to_dict(spec)}, indent=2) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    digest = _site_digest_path(path)
    digest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(digest) as tmp:
        tmp.write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def _site_digest_path(site_record: Path) -> Path:
    return RunPaths(site_record.parent).site_digest


def load_site_record(path: Path) -> tuple[str, SiteSpec]:
    """(site module, settings) a run recorded. Runs made before the module was recorded saved the
    settings alone: their site is the known site of that name."""
    from site_configs import known_sites
    from site_configs.spec import SiteSpec

    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FFNError(f"{path}: the run's site record cannot be read ({exc})") from None
    if "spec" not in record:
        record = {"site": record.get("name", ""), "spec": record}
        if record["site"] not in known_sites():
            raise FFNError(
                f"{path} does not say which site module made the run (site {record['site']!r}); "
                "give it with --site and --move-site"
            )
    return record["site"], config_io.from_dict(SiteSpec, record["spec"], str(path))


def _allocation(args: argparse.Namespace, recorded: bool) -> dict[str, str]:
    """--account, --queue, --walltime, --cpu-queue, --cpu-walltime, --qos, --constraint as given;
    for a site not recorded by the run also $FFN_ACCOUNT/$FFN_QUEUE (a resumed run keeps what it
    recorded over the environment's). Checked with the site's settings (site_configs.checks): a
    QOS or constraint on a site whose scheduler is not Slurm is refused."""
    names = ("account", "queue", "walltime", "cpu_queue", "cpu_walltime", "qos", "constraint")
    changes = {name: value for name in names if (value := getattr(args, name, None))}
    if not recorded:
        for name in ("account", "queue"):
            if name not in changes and (value := os.environ.get(f"FFN_{name.upper()}")):
                changes[name] = value
    return changes


def choose_site(args: argparse.Namespace, paths: RunPaths) -> tuple[str, SiteSpec | None]:
    """The site module a run uses and, when it goes on with what it recorded, its settings.

    A new run: --site (default local). A resume: the site in the run's site.json with its
    settings; another --site only with --move-site, which takes that module's current settings
    (a batch run must never move to the login node because --site was left out)."""
    if args.move_site and not args.resume:
        raise FFNError("--move-site goes with --resume: it moves an earlier run to another site")
    if args.accept_site_record and not args.resume:
        raise FFNError("--accept-site-record goes with --resume: it takes a run's site.json")
    if not args.resume:
        return args.site or "local", None
    if not paths.site.is_file():
        if args.site is None:
            raise FFNError(
                f"--resume: {paths.site} is missing, so the run's site is not known; give --site"
            )
        return args.site, None
    source, spec = load_site_record(paths.site)
    if args.move_site:
        return args.site or source, None
    if not args.accept_site_record:
        check_own_site_record(paths.site, spec)
        check_site_record_unchanged(paths.site, spec)
    if args.site is not None and _site_source(args.site) != source:
        raise FFNError(
            f"--resume: the run in {paths.root} was made on site {source}; it resumes there "
            f"(leave out --site), or add --move-site to go on on {args.site}"
        )
    return source, spec


def check_own_site_record(path: Path, spec: SiteSpec) -> None:
    """A run's site.json is code that runs on --resume (its worker_init and launch settings reach
    the job scripts): one written by another user is not taken as it is."""
    owner = path.stat().st_uid
    if owner == os.getuid():
        return
    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = f"uid {owner}"
    raise FFNError(
        f"--resume: {path} was written by {name}, not you, and runs as code on resume (its "
        f"worker_init: {spec.worker_init!r}); read it, then take it as it is: --resume "
        "--accept-site-record, or go on with your site module's own settings: --resume "
        "--move-site --site SITE"
    )


def check_site_record_unchanged(path: Path, spec: SiteSpec) -> None:
    """A site.json changed since the run wrote it (by hand, by someone else, a run dir received
    with another's) is not taken as it is: its worker_init runs in every job. A run made before
    the digest was kept has none to compare with."""
    try:
        recorded = _site_digest_path(path).read_text().strip()
    except FileNotFoundError:
        return
    if hashlib.sha256(path.read_bytes()).hexdigest() != recorded:
        raise FFNError(
            f"--resume: {path} changed since the run wrote it, and runs as code on resume (its "
            f"worker_init now: {spec.worker_init!r}); read it, then take it as it is: --resume "
            "--accept-site-record, or go on with your site module's own settings: --resume "
            "--move-site --site SITE"
        )


# Characters a path may hold where Parsl puts it into a shell line unquoted (LocalProvider runs
# `bash <run_dir>/runinfo/.../submit_scripts/x.sh`; the batch providers likewise): a space splits
# it (the pool never starts, and nothing says why), a `;` would run what follows as a command.
_SHELL_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+,:=@%-]+")


def check_shell_safe(path: Path, what: str) -> None:
    """Refuse a run dir or venv path that a shell would split or run as a command."""
    if not _SHELL_SAFE_PATH.fullmatch(str(path)):
        bad = sorted({c for c in str(path) if not _SHELL_SAFE_PATH.fullmatch(c)})
        raise ConfigError(
            f"{what} {str(path)!r} holds {' '.join(repr(c) for c in bad)}: Parsl puts it into shell "
            "lines unquoted; choose a path of letters, digits and . _ / + , : = @ % -"
        )


@dataclass(frozen=True)
class ResolvedRun:
    """What a run, its dry run and its resume go on with, and where each came from."""

    config: RunConfig
    paths: RunPaths
    site: ModuleType  # the site module: make_config
    site_source: str  # its name, or the path of a user's module (recorded in site.json)
    spec: SiteSpec  # its settings for this run
    origin: str  # one line: which site and settings, from where


def resolve_run(args: argparse.Namespace) -> ResolvedRun:
    """The run's settings, paths and site, the same for a run, its dry run and its resume."""
    from pipeline.data.staging import reads_in_place
    from pipeline.run.run_config import load_run_config
    from site_configs import load_site
    from site_configs.spec import for_run

    config = load_run_config(args.config)
    paths = RunPaths(Path(args.run_dir or ROOT / "data" / "runs" / config.name).resolve())
    if args.resume:
        if not paths.config.is_file():
            raise FFNError(
                f"--resume: {paths.root} holds no run (no config.json); leave out --resume to start one"
            )
        if args.config is None:  # the run's own settings, not the demo's
            config = load_run_config(paths.config)
    if args.train_nodes is not None:
        config = replace(config, train_nodes=args.train_nodes)
    paths = replace(paths, eval_in_place=reads_in_place(config.data))
    check_shell_safe(paths.root, "run dir")
    source, recorded = choose_site(args, paths)
    site = load_site(source)
    allocation = _allocation(args, recorded is not None)
    if args.command == "study":  # jobs that hold its largest cell
        check_command(args.command, config)
        spec = study_site(recorded or site.SITE, config, allocation)
    else:  # one job = the nodes training uses
        spec = for_run(recorded or site.SITE, train_nodes=config.train_nodes, **allocation)
    config = checkpoints_within(config, spec)
    settings = args.config or (
        f"the run's own {paths.config.name}" if args.resume else "the demo's defaults"
    )
    site_from = "as the run recorded it" if recorded is not None else f"from {site.__file__}"
    origin = f"site {spec.name} ({site_from}), settings: {settings}"
    if recorded is not None:  # site.json runs as code: what its jobs will run first, shown
        origin += f"; worker_init from {paths.site.name}: {spec.worker_init!r}"
    return ResolvedRun(config, paths, site, _site_source(source), spec, origin)


def check_command(command: str, config: RunConfig) -> None:
    """A study's config runs as a study, any other as a run: neither half-does the other."""
    if command == "study" and not config.study.rank_counts:
        raise ConfigError("study: the config has no [study] rank_counts; see configs/study.toml")
    if command == "study" and config.pretrained_model:
        raise ConfigError(
            "study: a study trains; leave out pretrained_model (train_init_from may stay)"
        )
    if command == "run" and config.study.rank_counts:
        raise ConfigError(
            "the config holds a study ([study] rank_counts): run it with `python workflow.py study`"
        )


def describe_code(run_dir: Path) -> str:
    """Which code the run dir's last run imported (pipeline.run.code_copy), against the checkout's."""
    copy = last_copy(run_dir)
    if copy is None:
        return f"no copy in {run_dir / CODE_DIR} (where a run keeps the code its workers import)"
    if copy.name == copy_name():
        return f"the last run's workers imported {copy}, the checkout's code as it is now"
    return (
        f"the last run's workers imported {copy}; the checkout's code has changed since. A run's "
        "workers import the checkout as the run starts; what is up to date stays as the earlier "
        "code made it (delete an output to make it again)"
    )


def _check_given_forest(given: Path, paths: RunPaths) -> None:
    """`boundary_forest` names a file, and not the copy this run keeps of it."""
    if not given.is_file():
        raise BoundaryForestError(f"boundary_forest {given}: no such file")
    if given.resolve() == paths.boundary_forest.resolve():
        raise BoundaryForestError(
            f"boundary_forest {given} is this run's own copy: name the file of the run that learned it"
        )
