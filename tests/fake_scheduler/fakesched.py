"""Stand-in batch schedulers and launchers for tests/site_configs/test_site_configs.py (never for real use).

The scripts beside this file (`pbspro/qsub`, `cobalt/qstat`, `slurm/srun`, ...) call
`fakesched.py <flavour> <tool> ARGS...`. Put one flavour's folder first on PATH and these tools
behave, for the commands Parsl's providers send, like the real ones, on this machine:

    pbspro  qsub qstat qdel       PBS Pro: "1.fakepbs" ids, `qstat -x -f -F json`; and a Cray PALS
            mpiexec               flavoured mpiexec (--cpu-bind, --depth, --ppn) over the real MPICH
    cobalt  qsub qstat qdel       Cobalt: numeric ids, `qstat -u USER` table, -O output prefix,
            aprun                 the script must be executable; aprun -n N runs N MPICH ranks
    slurm   sbatch squeue scancel "Submitted batch job N", `squeue --format='%i %t'`; sacct says
            sacct scontrol srun   accounting is off (as the provider expects); srun -n N -> N ranks
    each    module                the sites' `module use` and `module load` (Lmod's command, which a
                                  site's worker_init runs): recorded, and nothing else done for the
                                  modules the sites load (`SITE_MODULES`); others refused as Lmod does

A job script runs in the background, in a session of its own (so `qdel` can kill every process it
started) and in a scratch folder of its own. As on the real machines, PBS and Cobalt jobs start
with a bare environment (HOME, USER, PATH=$FAKE_SITE_PATH): the site's `worker_init` must activate
the venv, while Slurm jobs inherit the submitting environment. Every job then gets what
$FAKE_NODE_ENV holds (a JSON object of variables): what the stand-in nodes' own environment sets,
such as a stand-in /sys for their energy counters. The launchers record their
arguments and start the program: once for one task, under the real MPICH
`mpiexec -launcher fork` ($FAKE_REAL_MPIEXEC) for several.

State lives in $FAKE_SCHED_DIR: `calls.jsonl` (every tool call with its arguments), `jobs/<id>.json`
(script, session id, cancelled), `jobs/<id>.exit` (the script's exit code once it ends).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# -- bookkeeping --


def state_dir() -> Path:
    folder = Path(os.environ["FAKE_SCHED_DIR"])
    (folder / "jobs").mkdir(parents=True, exist_ok=True)
    return folder


def record(flavour: str, tool: str, argv: list[str]) -> None:
    line = json.dumps({"flavour": flavour, "tool": tool, "argv": argv, "time": time.time()})
    with open(state_dir() / "calls.jsonl", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line + "\n")


def next_number() -> int:
    with open(state_dir() / "counter", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0) + 1
        f.seek(0)
        f.truncate()
        f.write(str(n))
    return n


def job_file(job_id: str) -> Path:
    return state_dir() / "jobs" / f"{job_id}.json"


def load_job(job_id: str) -> dict | None:
    path = job_file(job_id)
    return json.loads(path.read_text()) if path.exists() else None


def save_job(job: dict) -> None:
    job_file(job["id"]).write_text(json.dumps(job, indent=1))


def all_jobs() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((state_dir() / "jobs").glob("*.json"))]


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        pids = session_pids(sid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while pids and time.time() < deadline:
            time.sleep(0.05)
            pids = session_pids(sid)
        if not pids:
            return


def is_running(job: dict) -> bool:
    exited = (state_dir() / "jobs" / f"{job['id']}.exit").exists()
    return not exited and not job.get("cancelled") and bool(session_pids(job["sid"]))


def bare_environment() -> dict[str, str]:
    """What a PBS or Cobalt job starts with: login basics, the site's default PATH, and the
    FAKE_* settings these stand-ins themselves need."""
    keep = ("HOME", "USER", "LOGNAME", "LANG", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = os.environ.get("FAKE_SITE_PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update({k: v for k, v in os.environ.items() if k.startswith("FAKE_")})
    return env


def start_job(
    flavour: str,
    job_id: str,
    command: list[str],
    stdout: str,
    stderr: str,
    env: dict[str, str],
    nodes: int,
    options: dict,
) -> dict:
    """Run `command` in the background in its own session; its exit code goes to jobs/<id>.exit."""
    jobs = state_dir() / "jobs"
    env = {**env, **json.loads(os.environ.get("FAKE_NODE_ENV") or "{}")}  # the node's own
    scratch = jobs / f"{job_id}.cwd"
    scratch.mkdir(exist_ok=True)
    exit_file = jobs / f"{job_id}.exit"
    wrapper = ["/bin/sh", "-c", '"$@"; echo $? > "$0"', str(exit_file), *command]
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        proc = subprocess.Popen(
            wrapper,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=scratch,
            start_new_session=True,
        )
    job = {
        "id": job_id,
        "flavour": flavour,
        "command": command,
        "sid": proc.pid,
        "nodes": nodes,
        "stdout": stdout,
        "stderr": stderr,
        "options": options,
        "submitted": time.time(),
        "cancelled": False,
    }
    save_job(job)
    return job


def nodefile(job_id: str, nodes: int) -> str:
    path = state_dir() / "jobs" / f"{job_id}.nodes"
    path.write_text("localhost\n" * nodes)
    return str(path)


def cancel(job_ids: list[str], unknown_rc: int, finished_rc: int, finished_msg: str) -> int:
    rc = 0
    for job_id in job_ids:
        job = load_job(job_id)
        if job is None:
            print(f"Unknown Job Id {job_id}", file=sys.stderr)
            rc = rc or unknown_rc
            continue
        if not is_running(job):
            if finished_msg:
                print(finished_msg.format(job_id), file=sys.stderr)
            rc = rc or finished_rc
        job["cancelled"] = True
        save_job(job)
        kill_session(job["sid"])
    return rc


def parse_options(
    argv: list[str], with_value: set[str], flags: set[str] = frozenset()
) -> tuple[dict[str, list[str]], list[str]]:
    """Options (`-x V`, `--xx V`, `--xx=V`, flags) up to the first positional word; the rest."""
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word == "-":
            break
        if word == "--":
            i += 1
            break
        if word.startswith("--") and "=" in word:
            key, value = word.split("=", 1)
            options.setdefault(key, []).append(value)
        elif word in with_value and word not in flags and i + 1 < len(argv):
            options.setdefault(word, []).append(argv[i + 1])
            i += 1
        else:
            options.setdefault(word, []).append("")
        i += 1
    return options, argv[i:]


def directives(script: str, marker: str, with_value: set[str]) -> dict[str, list[str]]:
    """'#PBS -o x' / '#SBATCH --output=x' lines of a job script as options."""
    words: list[str] = []
    for line in Path(script).read_text().splitlines():
        if line.startswith(marker):
            words += line[len(marker) :].split()
    options, _ = parse_options(words, with_value)
    return options


def last(options: dict[str, list[str]], *names: str, default: str | None = None) -> str | None:
    for name in names:
        if name in options:
            return options[name][-1]
    return default


# -- launchers: record, then run the program once or as N MPICH ranks --


def run_program(flavour: str, tool: str, ntasks: int, program: list[str], env: dict) -> int:
    if not program:
        print(f"{tool}: no program given", file=sys.stderr)
        return 1
    if ntasks <= 1:
        os.execvpe(program[0], program, env)
    mpiexec = os.environ.get("FAKE_REAL_MPIEXEC")
    if not mpiexec:
        print(f"{tool}: FAKE_REAL_MPIEXEC is not set; cannot start {ntasks} ranks", file=sys.stderr)
        return 1
    hydra = [mpiexec, "-launcher", "fork", "-n", str(ntasks), *program]
    os.execve(mpiexec, hydra, env)
    return 1  # not reached


def aprun(argv: list[str]) -> int:
    record("cobalt", "aprun", argv)
    opts, program = parse_options(
        argv,
        {"-n", "-N", "-d", "-j", "-cc", "--cc", "-e", "--env", "-L", "--node-list", "-S", "-r"},
        {"-b", "-q"},
    )
    env = dict(os.environ)
    for assignment in opts.get("-e", []) + opts.get("--env", []):
        key, _, value = assignment.partition("=")
        env[key] = value
    return run_program("cobalt", "aprun", int(last(opts, "-n", default="1")), program, env)


def srun(argv: list[str]) -> int:
    record("slurm", "srun", argv)
    opts, program = parse_options(
        argv,
        {"-n", "--ntasks", "-N", "--nodes", "--ntasks-per-node", "-w", "--nodelist", "-c"}
        | {"--cpus-per-task", "--cpu-bind", "--mpi", "--export", "-J", "--job-name", "-o"}
        | {"--output", "-e", "--error", "--gpus-per-task", "--gpu-bind", "-m", "--mem"},
        {"-l", "--label", "--exclusive", "--overlap"},
    )
    return run_program(
        "slurm", "srun", int(last(opts, "-n", "--ntasks", default="1")), program, dict(os.environ)
    )


def pals_mpiexec(argv: list[str]) -> int:
    """Cray PALS mpiexec options as MPICH (hydra) understands them; binding flags are dropped."""
    record("pbspro", "mpiexec", argv)
    opts, program = parse_options(
        argv,
        {"-n", "--np", "-np", "-ppn", "--ppn", "--depth", "-d", "--cpu-bind", "--hostfile"}
        | {"-hosts", "--hosts", "--env", "-env", "--cpu-bind-list"},
        {"--line-buffer", "-l", "--label"},
    )
    mpiexec = os.environ.get("FAKE_REAL_MPIEXEC")
    if not mpiexec:
        print("mpiexec: FAKE_REAL_MPIEXEC is not set", file=sys.stderr)
        return 1
    hydra = [mpiexec, "-launcher", "fork", "-n", last(opts, "-n", "--np", "-np", default="1")]
    if last(opts, "-ppn", "--ppn"):
        hydra += ["-ppn", last(opts, "-ppn", "--ppn")]
    for assignment in opts.get("--env", []) + opts.get("-env", []):
        key, _, value = assignment.partition("=")
        hydra += ["-genv", key, value]
    os.execve(mpiexec, hydra + program, dict(os.environ))
    return 1  # not reached


# -- PBS Pro --

PBS_TRANSLATE = {"R": "R", "F": "F"}


def pbs_qsub(argv: list[str]) -> int:
    record("pbspro", "qsub", argv)
    value_opts = {"-q", "-A", "-N", "-l", "-o", "-e", "-S", "-j", "-m", "-W", "-v"}
    opts, rest = parse_options(argv, value_opts, {"-V"})
    if not rest or not Path(rest[0]).is_file():
        print(f"qsub: script file:: No such file or directory: {rest}", file=sys.stderr)
        return 2
    script = rest[0]
    from_script = directives(script, "#PBS", value_opts)
    merged = {**from_script, **opts}
    n = next_number()
    job_id = f"{n}.fakepbs"
    name = last(merged, "-N", default=Path(script).name)
    select = " ".join(merged.get("-l", []))
    match = re.search(r"select=(\d+)", select)
    nodes = int(match.group(1)) if match else 1
    env = dict(os.environ) if "-V" in opts else bare_environment()
    env.update(
        PBS_JOBID=job_id,
        PBS_JOBNAME=name,
        PBS_NODEFILE=nodefile(job_id, nodes),
        PBS_O_WORKDIR=os.getcwd(),
        PBS_QUEUE=last(merged, "-q", default="workq"),
    )
    stdout = last(merged, "-o", default=os.path.join(os.getcwd(), f"{name}.o{n}"))
    stderr = last(merged, "-e", default=os.path.join(os.getcwd(), f"{name}.e{n}"))
    shell = last(merged, "-S", default="/bin/bash")
    start_job("pbspro", job_id, [shell, script], stdout, stderr, env, nodes, merged)
    print(job_id)
    return 0


def pbs_qstat(argv: list[str]) -> int:
    record("pbspro", "qstat", argv)
    opts, ids = parse_options(argv, {"-F", "-u"}, {"-x", "-f"})
    jobs = {j["id"]: j for j in all_jobs()}
    wanted = ids or list(jobs)
    known, rc = {}, 0
    for job_id in wanted:
        job = jobs.get(job_id)
        if job is None:
            print(f"qstat: Unknown Job Id {job_id}", file=sys.stderr)
            rc = 153
            continue
        state = "R" if is_running(job) else "F"
        if state == "F" and "-x" not in opts:
            continue  # without -x, finished jobs are not listed
        known[job_id] = {"Job_Name": job["options"].get("-N", ["?"])[-1], "job_state": state}
    if last(opts, "-F") == "json":
        print(json.dumps({"timestamp": int(time.time()), "pbs_server": "fakepbs", "Jobs": known}))
    else:
        print("Job id            Name             User              Time Use S Queue")
        print("----------------  ---------------- ----------------  -------- - -----")
        for job_id, info in known.items():
            print(f"{job_id:<17} {info['Job_Name'][:16]:<16} user 0 {info['job_state']} workq")
    return rc


def pbs_qdel(argv: list[str]) -> int:
    record("pbspro", "qdel", argv)
    _, ids = parse_options(argv, {"-W"})
    return cancel(ids, unknown_rc=153, finished_rc=35, finished_msg="qdel: Job has finished {}")


# -- Cobalt --


def cobalt_qsub(argv: list[str]) -> int:
    record("cobalt", "qsub", argv)
    value_opts = {"-n", "-t", "-q", "-A", "-O", "--attrs", "--env", "-M", "--jobname", "--mode"}
    value_opts |= {"-o", "-e", "--cwd", "--dependencies"}
    opts, rest = parse_options(argv, value_opts)
    if not rest or not Path(rest[0]).is_file():
        print(f"qsub: file not found: {rest}", file=sys.stderr)
        return 1
    script = rest[0]
    if not os.access(script, os.X_OK):
        print(f"qsub: {script} is not executable (script mode runs it directly)", file=sys.stderr)
        return 1
    if "-t" not in opts or "-n" not in opts:
        print("qsub: -t (minutes) and -n (nodes) are required", file=sys.stderr)
        return 1
    job_id = str(1000 + next_number())
    nodes = int(last(opts, "-n"))
    prefix = last(opts, "-O", default=os.path.join(os.getcwd(), job_id))
    Path(prefix + ".cobaltlog").write_text(f"qsub {' '.join(argv)}\n")
    env = bare_environment()
    env.update(
        COBALT_JOBID=job_id,
        COBALT_JOBSIZE=str(nodes),
        COBALT_PARTNAME=f"0-{nodes - 1}" if nodes > 1 else "0",
        COBALT_NODEFILE=nodefile(job_id, nodes),
    )
    start_job(
        "cobalt",
        job_id,
        [script, *rest[1:]],
        prefix + ".output",
        prefix + ".error",
        env,
        nodes,
        opts,
    )
    print('Job routed to queue "{}".'.format(last(opts, "-q", default="default")))
    print(job_id)
    return 0


def cobalt_qstat(argv: list[str]) -> int:
    record("cobalt", "qstat", argv)
    opts, ids = parse_options(argv, {"-u", "--header"}, {"-f", "-l"})
    user = last(opts, "-u", default=os.environ.get("USER", "user"))
    print("JobID  User      WallTime  Nodes  State    Location")
    print("=====================================================")
    for job in all_jobs():
        if (ids and job["id"] not in ids) or not is_running(job):
            continue  # Cobalt forgets finished jobs
        minutes = int(job["options"].get("-t", ["10"])[-1])
        walltime = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
        print(f"{job['id']:<6} {user:<9} {walltime}  {job['nodes']:<5}  running  0")
    return 0


def cobalt_qdel(argv: list[str]) -> int:
    record("cobalt", "qdel", argv)
    _, ids = parse_options(argv, set())
    rc = cancel(ids, unknown_rc=1, finished_rc=0, finished_msg="")
    print("      Deleted Jobs\nJobID  User\n=====================")
    for job_id in ids:
        print(f"{job_id}  {os.environ.get('USER', 'user')}")
    return rc


# -- Slurm --


def slurm_sbatch(argv: list[str]) -> int:
    record("slurm", "sbatch", argv)
    value_opts = {"-J", "--job-name", "-o", "--output", "-e", "--error", "-N", "--nodes", "-t"}
    value_opts |= {"--time", "-p", "--partition", "-A", "--account", "-q", "--qos", "-C"}
    value_opts |= {"--constraint", "--ntasks-per-node", "--cpus-per-task", "--gpus-per-node"}
    value_opts |= {"--mem", "--clusters", "--gres", "--chdir"}
    opts, rest = parse_options(argv, value_opts, {"--exclusive", "--parsable"})
    if not rest or not Path(rest[0]).is_file():
        print("sbatch: error: Unable to open file", file=sys.stderr)
        return 1
    script = rest[0]
    merged = {**directives(script, "#SBATCH", value_opts), **opts}
    job_id = str(100 + next_number())
    nodes = int(last(merged, "-N", "--nodes", default="1"))
    name = last(merged, "-J", "--job-name", default=Path(script).name)
    hosts = ",".join(["localhost"] * nodes)
    env = dict(os.environ)  # Slurm's default --export=ALL
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_JOBID=job_id,
        SLURM_JOB_NAME=name,
        SLURM_NODELIST=hosts,
        SLURM_JOB_NODELIST=hosts,
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NNODES=str(nodes),
        SLURM_CPUS_ON_NODE=str(os.cpu_count() or 1),
        SLURM_NTASKS_PER_NODE=last(merged, "--ntasks-per-node", default="1"),
        SLURM_SUBMIT_DIR=os.getcwd(),
    )
    default_out = os.path.join(os.getcwd(), "slurm-%j.out")
    stdout = last(merged, "-o", "--output", default=default_out).replace("%j", job_id)
    stderr = last(merged, "-e", "--error", default=stdout).replace("%j", job_id)
    start_job("slurm", job_id, ["/bin/bash", script], stdout, stderr, env, nodes, merged)
    print(f"Submitted batch job {job_id}")
    return 0


def slurm_squeue(argv: list[str]) -> int:
    record("slurm", "squeue", argv)
    opts, _ = parse_options(argv, {"--format", "-o", "--job", "-j", "-u", "--clusters"}, {"-h"})
    wanted = [j for j in (last(opts, "--job", "-j", default="") or "").split(",") if j]
    header = "--noheader" not in opts and "-h" not in opts
    if header:
        print("JOBID ST")
    for job in all_jobs():
        if wanted and job["id"] not in wanted:
            continue
        state = "CA" if job["cancelled"] else ("R" if is_running(job) else "CD")
        print(f"{job['id']} {state}")
    return 0


def slurm_scancel(argv: list[str]) -> int:
    record("slurm", "scancel", argv)
    _, ids = parse_options(argv, {"--clusters", "-M"})
    return cancel(ids, unknown_rc=1, finished_rc=0, finished_msg="")


def slurm_sacct(argv: list[str]) -> int:
    record("slurm", "sacct", argv)
    print("Slurm accounting storage is disabled", file=sys.stderr)
    return 1


def slurm_scontrol(argv: list[str]) -> int:
    record("slurm", "scontrol", argv)
    if len(argv) >= 3 and argv[0] == "show" and argv[1] in ("hostname", "hostnames"):
        for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", argv[2]):
            match = re.fullmatch(r"(.*)\[(.*)\]", part)
            if not match:
                print(part)
                continue
            stem, ranges = match.groups()
            for item in ranges.split(","):
                lo, _, hi = item.partition("-")
                for k in range(int(lo), int(hi or lo) + 1):
                    print(f"{stem}{k:0{len(lo)}d}")
        return 0
    print(f"scontrol: fake supports only 'show hostname', not {argv}", file=sys.stderr)
    return 1


# -- Lmod's `module`, on every stand-in node --

# The modules the site modules' worker_init lines load (site_configs/*.py, and the loads their
# comments suggest where they hold a placeholder), and the folder Polaris adds to the search path.
SITE_MODULES = {
    "conda", "cray-mpich", "tensorflow", "mpich/opt/develop-git.6037a7a", "miniconda-3",  # ALCF
    "gpu", "PrgEnv-gnu", "cudatoolkit", "craype-accel-nvidia80", "cray-python",  # Perlmutter
    "python", "openmpi",  # a Slurm cluster
}  # fmt: skip
MODULE_PATHS = {"/soft/modulefiles"}


def module(flavour: str, argv: list[str]) -> int:
    """`module use PATH` / `module load NAME...`: recorded; a module or path not known is refused
    with Lmod's message (a job script goes on after it, as with Lmod)."""
    record(flavour, "module", argv)
    command, names = (argv[0], argv[1:]) if argv else ("", [])
    known = {"load": SITE_MODULES, "use": MODULE_PATHS}.get(command)
    if known is None:
        print(
            f"Lmod has detected the following error: unknown command {command!r}", file=sys.stderr
        )
        return 1
    if unknown := [name for name in names if name not in known]:
        print(
            "Lmod has detected the following error: The following module(s) are unknown: "
            + " ".join(f'"{name}"' for name in unknown),
            file=sys.stderr,
        )
        return 1
    return 0


TOOLS = {
    ("pbspro", "module"): lambda argv: module("pbspro", argv),
    ("cobalt", "module"): lambda argv: module("cobalt", argv),
    ("slurm", "module"): lambda argv: module("slurm", argv),
    ("pbspro", "qsub"): pbs_qsub,
    ("pbspro", "qstat"): pbs_qstat,
    ("pbspro", "qdel"): pbs_qdel,
    ("pbspro", "mpiexec"): pals_mpiexec,
    ("cobalt", "qsub"): cobalt_qsub,
    ("cobalt", "qstat"): cobalt_qstat,
    ("cobalt", "qdel"): cobalt_qdel,
    ("cobalt", "aprun"): aprun,
    ("slurm", "sbatch"): slurm_sbatch,
    ("slurm", "squeue"): slurm_squeue,
    ("slurm", "scancel"): slurm_scancel,
    ("slurm", "sacct"): slurm_sacct,
    ("slurm", "scontrol"): slurm_scontrol,
    ("slurm", "srun"): srun,
}

if __name__ == "__main__":
    flavour, tool, *args = sys.argv[1:]
    sys.exit(TOOLS[(flavour, tool)](args))
