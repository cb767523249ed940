"""Stamps (pipeline.core.stamps): a task's outputs are trusted only while its settings, its inputs and
the outputs themselves are what they were when it ran."""

import json
import os
import time
from collections.abc import Callable

import numpy as np
import pytest
from faults import zero_bytes

from pipeline.core.roi import Roi
from pipeline.core.stamps import (
    Cells,
    Part,
    Task,
    digest,
    plan,
    run_once,
    save_cells,
    stamp_path,
    why_stale,
)


def make(text: str):
    """A task's work: write `text` to its output; returns the work and a list of its calls."""
    calls = []

    def work(output):
        def run() -> None:
            calls.append(text)
            output.write_text(text)

        return run

    return work, calls


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "user" / "volume.h5"
    path.parent.mkdir()
    path.write_text("voxels")
    return path


def test_a_task_runs_once_then_is_up_to_date(tmp_path, source):
    output = tmp_path / "staged.h5"
    work, calls = make("copy")
    assert run_once({"seed": 1}, [source], [output], work(output)) == "ran"
    assert run_once({"seed": 1}, [source], [output], work(output)) == "up to date"
    assert calls == ["copy"] and stamp_path(output).is_file()


def test_a_changed_setting_is_named(tmp_path, source):
    output = tmp_path / "out.txt"
    run_once({"train": {"max_steps": 30}}, [source], [output], make("a")[0](output))
    assert why_stale({"train": {"max_steps": 40}}, [source], [output]) == (
        "settings changed: train.max_steps 30 -> 40"
    )


def test_a_setting_added_since_a_run_was_stamped_keeps_it_up_to_date_at_its_old_value(
    tmp_path, source
):
    """A run trained before virtual_ranks, and one before optimizer, stay up to date while those
    settings do what the runs did; another optimizer is a change."""
    now = {"train": {"max_steps": 30, "virtual_ranks": 1, "optimizer": "adam", "momentum": 0.9}}
    stamped_by = {
        "before virtual ranks": {"train": {"max_steps": 30}},
        "before optimizers": {"train": {"max_steps": 30, "virtual_ranks": 1}},
    }
    for name, settings in stamped_by.items():
        output = tmp_path / f"{name}.txt"
        run_once(settings, [source], [output], make("a")[0](output))
        assert why_stale(now, [source], [output]) is None, name
        sgd = {"train": now["train"] | {"optimizer": "sgd_momentum"}}
        assert why_stale(sgd, [source], [output]).startswith("settings changed: train.momentum")
        virtual = {"train": now["train"] | {"virtual_ranks": 2}}
        assert why_stale(virtual, [source], [output]).startswith("settings changed:")


def test_a_trainings_rank_count_does_not_make_it_stale_and_older_stamps_agree(tmp_path, source):
    """A finished training is not run again at another node count (it would go on from its
    checkpoints), also where a version that kept the ranks in the identity stamped it."""
    output = tmp_path / "train_summary.json"
    run_once({"train": {"max_steps": 30}, "ranks": 2}, [source], [output], make("a")[0](output))
    assert why_stale({"train": {"max_steps": 30}, "ranks": 1}, [source], [output]) is None

    stamp = json.loads(stamp_path(output).read_text())
    tokens = [token for _, token in stamp["inputs"]]
    stamp["identity"] = digest({"settings": stamp["settings"], "inputs": tokens})  # as then
    stamp_path(output).write_text(json.dumps(stamp))
    assert why_stale({"train": {"max_steps": 30}, "ranks": 1}, [source], [output]) is None
    more = why_stale({"train": {"max_steps": 40}, "ranks": 1}, [source], [output])
    assert more.startswith("settings changed:") and "train.max_steps 30 -> 40" in more


def test_a_rewritten_source_file_is_noticed_even_with_its_old_size_and_mtime(tmp_path, source):
    output = tmp_path / "out.txt"
    run_once({}, [source], [output], make("a")[0](output))
    stat = source.stat()
    source.write_text("VOXELS")  # same size ...
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and mtime put back
    assert why_stale({}, [source], [output]) == "input changed: user/volume.h5"


@pytest.mark.parametrize("fault", ["delete", "truncate", "rewrite"])
def test_a_missing_or_changed_output_is_not_trusted(tmp_path, source, fault):
    output = tmp_path / "out.txt"
    run_once({}, [source], [output], make("result")[0](output))
    if fault == "delete":
        output.unlink()
    elif fault == "truncate":
        output.write_text("res")
    else:
        time.sleep(0.01)
        output.write_text("RESULT")
    reason = why_stale({}, [source], [output])
    assert reason and reason.startswith("output missing" if fault == "delete" else "output changed")
    work, calls = make("result")
    assert run_once({}, [source], [output], work(output)) == "ran" and calls == ["result"]


@pytest.mark.parametrize("fault", ["truncate", "delete", "add", "rename"])
def test_a_changed_file_deep_in_an_output_folder_is_noticed(tmp_path, source, fault):
    folder = tmp_path / "export"

    def export() -> None:
        for name in ("info", "seg/info", "seg/s0/0-64_0-64_0-64", "seg/mesh/7:0"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(name)

    run_once({}, [source], [folder], export)
    assert why_stale({}, [source], [folder]) is None
    chunk = folder / "seg" / "s0" / "0-64_0-64_0-64"
    if fault == "truncate":
        chunk.write_text("0-64")
    elif fault == "delete":
        chunk.unlink()
    elif fault == "add":
        (folder / "seg" / "s0" / "64-128_0-64_0-64").write_text("x")
    else:
        chunk.rename(chunk.with_name("0-64_0-64_64-128"))  # same size, another name
    assert why_stale({}, [source], [folder]) == "output changed since it was made: " + (
        "/".join(folder.parts[-2:])
    )


def chunked(folder):
    """A task's work: an output folder of a few chunk files (100 bytes each)."""

    def export() -> None:
        for name in ("info", "seg/info", "seg/s0/0-64_0-64_0-64", "seg/s0/64-128_0-64_0-64"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(bytes(range(100)))

    return export


def test_a_same_size_rewrite_deep_in_an_output_folder_is_noticed(tmp_path, source):
    """Issue 31: a folder's state was its files' names and sizes, so a chunk partly zeroed (its
    size kept) left the stitched volume trusted. Its mtime changes: the state has it."""
    folder = tmp_path / "export"
    run_once({}, [source], [folder], chunked(folder))
    time.sleep(0.05)  # the fault comes later than the task (file times are a few ms coarse)
    zero_bytes(folder / "seg" / "s0" / "64-128_0-64_0-64", 10, 50)
    assert why_stale({}, [source], [folder]) == "output changed since it was made: " + (
        "/".join(folder.parts[-2:])
    )


def test_a_copy_with_its_mtimes_is_up_to_date_so_a_rewrite_that_restores_them_is_not_seen(
    tmp_path, source
):
    """The state has mtimes, not ctimes: a copy (`cp -a`, copytree) gets new ctimes and stays
    up to date; the price is that a rewrite putting size and mtime back (os.utime) is not seen:
    only reading the content would (stamps read none)."""
    import shutil

    folder = tmp_path / "run" / "export"
    run_once({}, [source], [folder], chunked(folder))
    copy = shutil.copytree(tmp_path / "run", tmp_path / "copy") / "export"
    assert why_stale({}, [source], [copy]) is None
    chunk = copy / "seg" / "s0" / "0-64_0-64_0-64"
    stat = chunk.stat()
    time.sleep(0.05)
    zero_bytes(chunk, 10, 50)
    assert why_stale({}, [source], [copy]) is not None
    os.utime(chunk, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert why_stale({}, [source], [copy]) is None  # the documented limit


def test_a_task_that_rewrites_its_own_output_later_is_up_to_date_after(tmp_path, source):
    """The state is read after the task's work: what it rewrote itself is its fresh state."""
    folder = tmp_path / "export"
    export = chunked(folder)

    def twice() -> None:
        export()
        time.sleep(0.05)
        zero_bytes(folder / "seg" / "s0" / "0-64_0-64_0-64", 10, 50)  # as a repair rewrites a chunk

    assert run_once({}, [source], [folder], twice) == "ran"
    assert why_stale({}, [source], [folder]) is None


def test_a_folders_stamp_from_before_mtimes_is_still_up_to_date(tmp_path, source):
    """A stamp written before the state had mtimes (names and sizes): read as it was made, so
    an upgrade does not run every stitch and export again; a truncated file is still seen."""
    from pipeline.core.stamps import folder_state

    folder = tmp_path / "export"
    run_once({}, [source], [folder], chunked(folder))
    stamp = json.loads(stamp_path(folder).read_text())
    assert len(stamp["outputs"]["export"]) == 4  # files, bytes, digest, what it covers
    stamp["outputs"]["export"] = folder_state(folder, with_mtime=False)
    stamp_path(folder).write_text(json.dumps(stamp))
    assert why_stale({}, [source], [folder]) is None
    (folder / "info").write_bytes(b"cut")
    assert why_stale({}, [source], [folder]).startswith("output changed since it was made")


def test_a_folders_state_is_read_without_holding_its_listing(tmp_path):
    import tracemalloc

    from pipeline.core.stamps import output_state

    folder = tmp_path / "export"
    for part in ("s0", "mesh"):
        (folder / part).mkdir(parents=True)
        for i in range(10_000):
            (folder / part / f"{i}:0").write_bytes(b"x" * (i % 7))
    tracemalloc.start()
    state = output_state(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert state[:2] == [20_000, 2 * sum(i % 7 for i in range(10_000))]  # files, bytes
    # Listing the 20,000 paths, sorted, with names and sizes, took 13 MB (traced, before).
    assert peak < 1_000_000, f"{peak} bytes traced while reading the state of 20,000 files"


def test_a_task_killed_half_way_is_not_taken_for_done(tmp_path, source):
    output = tmp_path / "out.txt"
    run_once({"v": 1}, [source], [output], make("old")[0](output))

    def dies() -> None:
        output.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_once({"v": 2}, [source], [output], dies)
    # Not even for the old settings: the output is not the one the stamp saw.
    assert why_stale({"v": 1}, [source], [output]).startswith("output changed since it was made")


def staging_into(staged):
    """A staging task's work: write `content` into `staged`, return its digest (as staging
    returns the digest of what it copied)."""

    def stage(content: str):
        def run() -> str:
            staged.write_text(content)
            return f"digest of {content}"

        return run

    return stage


def test_a_task_that_fails_before_it_writes_keeps_the_stamps_of_its_outputs(tmp_path, source):
    """A stage never drops the stamp of an output it did not remake: a task that failed on a
    damaged input leaves its outputs valid for the input as it was, should it come back (a
    checkpoint chosen again after one set aside, a volume staged again from the same data)."""
    staged, result = tmp_path / "staged.h5", tmp_path / "result.txt"

    stage = staging_into(staged)

    def fails_reading() -> None:
        raise OSError(f"{staged}: Read less bytes than requested")

    run_once({}, [source], [staged], stage("v"))
    run_once({}, [staged], [result], make("r")[0](result))
    run_once({"damaged": 1}, [source], [staged], stage("w"))
    assert why_stale({}, [staged], [result]).startswith("input changed")
    with pytest.raises(OSError):
        run_once({}, [staged], [result], fails_reading)
    run_once({}, [source], [staged], stage("v"))  # the input as it was
    assert why_stale({}, [staged], [result]) is None


def test_a_rebuilt_output_with_the_same_content_digest_keeps_what_reads_it(tmp_path, source):
    staged, result = tmp_path / "staged.h5", tmp_path / "result.txt"

    stage = staging_into(staged)
    run_once({}, [source], [staged], stage("v"))
    run_once({}, [staged], [result], make("r")[0](result))
    staged.unlink()
    run_once({}, [source], [staged], stage("v"))
    assert why_stale({}, [staged], [result]) is None  # same token: still valid
    run_once({"other": 1}, [source], [staged], stage("w"))
    assert why_stale({}, [staged], [result]) == "input changed: " + "/".join(staged.parts[-2:])


def test_the_plan_reruns_exactly_what_follows_a_change(tmp_path, source):
    staged, block, merged = (tmp_path / n for n in ("staged.h5", "block.npz", "merged.h5"))
    tasks = [
        Task("stage", "stage", {"seed": 1}, (source,), (staged,)),
        Task("infer[0]", "infer", {"min_size": 20}, (staged,), (block,)),
        Task("stitch", "stitch", {}, (block,), (merged,)),
    ]
    assert plan(tasks) == {
        "stage": "not run yet",
        "infer[0]": "after stage",
        "stitch": "after infer",
    }
    for task in tasks:
        run_once(task.settings, task.inputs, task.outputs, make(task.name)[0](task.outputs[0]))
    assert set(plan(tasks).values()) == {None}

    tasks[1] = Task("infer[0]", "infer", {"min_size": 200}, (staged,), (block,))
    assert plan(tasks) == {
        "stage": None,
        "infer[0]": "settings changed: min_size 20 -> 200",
        "stitch": "after infer",
    }
    # --stages stitch: a task left out is kept as it is, stale or not.
    assert plan(tasks, runnable=lambda t: t.stage == "stitch") == {
        "stage": None,
        "infer[0]": None,
        "stitch": None,
    }


def test_every_output_of_a_task_carries_its_stamp(tmp_path, source):
    partitions, coordinates, training = (tmp_path / n for n in ("p.h5", "c.npz", "summary.json"))

    def preprocess() -> None:
        partitions.write_text("p")
        coordinates.write_text("c")

    run_once({}, [source], [partitions, coordinates], preprocess)
    run_once({}, [coordinates], [training], make("t")[0](training))
    moved = tmp_path / "moved"  # a run dir copied elsewhere keeps its tokens
    moved.mkdir()
    for path in (partitions, coordinates, training):
        for name in (path, stamp_path(path)):
            os.replace(name, moved / name.name)
    assert why_stale({}, [moved / "c.npz"], [moved / "summary.json"]) is None


def test_a_stamp_records_what_a_person_can_read(tmp_path, source):
    output = tmp_path / "out.txt"
    run_once({"inference": {"min_segment_size": 20}}, [source], [output], make("a")[0](output))
    record = json.loads(stamp_path(output).read_text())
    assert record["settings"] == {"inference": {"min_segment_size": 20}}
    assert record["inputs"][0][0] == "user/volume.h5" and set(record) >= {
        "identity",
        "outputs",
        "token",
    }


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_each_task_of_one_worker_records_its_own_peak_memory(tmp_path, source):
    import numpy as np

    def task(name: str, megabytes: int):
        def run() -> None:
            np.ones(megabytes << 17).sum()  # 8-byte floats: `megabytes` MiB, resident while summed
            (tmp_path / name).write_text(name)

        run_once({"name": name}, [source], [tmp_path / name], run)
        return json.loads(stamp_path(tmp_path / name).read_text())["measured"]

    large, small = task("large", 400), task("small", 10)
    assert large["peak_rss_mib"] - small["peak_rss_mib"] > 350  # not the process's lifetime peak
    assert large["seconds"] > 0


def test_a_task_records_its_cpu_time_beside_its_wall_time(tmp_path, source):
    def task(name: str, work) -> dict:
        def run() -> None:
            work()
            (tmp_path / name).write_text(name)

        run_once({"name": name}, [source], [tmp_path / name], run)
        return json.loads(stamp_path(tmp_path / name).read_text())["measured"]

    def busy() -> None:
        started = time.process_time()
        while time.process_time() - started < 0.3:
            pass

    waited, computed = task("waited", lambda: time.sleep(0.3)), task("computed", busy)
    assert waited["seconds"] >= 0.3 and waited["cpu_seconds"] < 0.1  # it waited: no CPU
    assert computed["cpu_seconds"] >= 0.3


def test_a_tasks_cyclic_garbage_is_collected_before_the_next_though_the_worker_is_frozen():
    import gc
    import weakref

    from pipeline.core.memory import reset_peak_memory

    class Node:
        pass

    reset_peak_memory()  # a first task: what the worker holds now is frozen
    garbage = Node()
    garbage.cycle = garbage  # left behind by a task: only the cycle collector frees it
    gone = weakref.ref(garbage)
    del garbage
    reset_peak_memory()
    assert gone() is None and gc.get_freeze_count() > 0


# An output named *.record holds its own stamp: no stamp file beside it.


def record_task(record, content=None):
    """A task's work: write a JSON object (or `content`) to `record`; with a list of its calls."""
    calls = []

    def run() -> None:
        calls.append(record.name)
        record.write_text(json.dumps({"files": {"info": [1, 2]}} if content is None else content))

    return run, calls


def test_a_record_holds_its_own_stamp_and_is_up_to_date_after(tmp_path, source):
    record = tmp_path / "mesh_0.record"
    work, calls = record_task(record)
    assert run_once({"v": 1}, [source], [record], work) == "ran"
    assert not stamp_path(record).exists()
    held = json.loads(record.read_text())
    assert held["files"] == {"info": [1, 2]} and held["stamp"]["settings"] == {"v": 1}
    assert run_once({"v": 1}, [source], [record], work) == "up to date" and len(calls) == 1
    assert plan([Task("mesh[0]", "mesh", {"v": 1}, (source,), (record,))]) == {"mesh[0]": None}


def test_a_record_is_stale_when_settings_change_or_it_is_cut(tmp_path, source):
    record = tmp_path / "mesh_0.record"
    work, calls = record_task(record)
    run_once({"v": 1}, [source], [record], work)
    assert why_stale({"v": 2}, [source], [record]) == "settings changed: v 1 -> 2"

    whole = record.stat().st_size
    with open(record, "r+b") as f:
        f.truncate(whole // 2)
    assert record.stat().st_size < whole
    assert why_stale({"v": 1}, [source], [record]) is not None
    assert run_once({"v": 1}, [source], [record], work) == "ran" and len(calls) == 2
    # Whole again (its stamp's times may print to other lengths: compare what it holds).
    assert json.loads(record.read_text())["files"] == {"info": [1, 2]}
    assert why_stale({"v": 1}, [source], [record]) is None


def test_a_record_beside_a_plain_output_is_checked_too(tmp_path, source):
    plain, record = tmp_path / "out.txt", tmp_path / "mesh_0.record"
    write_record, _ = record_task(record)

    def both() -> None:
        plain.write_text("p")
        write_record()

    run_once({}, [source], [plain, record], both)
    assert why_stale({}, [source], [plain, record]) is None
    record.write_text("{}")  # whole, but not what the task wrote: no stamp
    assert why_stale({}, [source], [plain, record]) == (
        "output changed since it was made: " + "/".join(record.parts[-2:])
    )
    record.unlink()
    assert why_stale({}, [source], [plain, record]).startswith("output missing")


def test_a_record_of_a_task_killed_half_way_is_not_taken_for_done(tmp_path, source):
    record = tmp_path / "mesh_0.record"
    run_once({"v": 1}, [source], [record], record_task(record)[0])

    def dies() -> None:
        assert not record.exists()  # the old one went before the work began
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_once({"v": 2}, [source], [record], dies)
    assert why_stale({"v": 1}, [source], [record]) == "not run yet"  # not even for the old settings


def test_kept_stamp_keeps_a_rewritten_output_up_to_date(tmp_path, source):
    """A repair writes outputs again as their tasks made them: inside `kept_stamp` the record
    gets its stamp back and a plain output's new state is recorded; outside, the plain output
    is taken for changed."""
    from pipeline.core.stamps import kept_stamp

    record, plain = tmp_path / "mesh_0.record", tmp_path / "out.txt"
    run_once({}, [source], [record], record_task(record)[0])
    run_once({}, [source], [plain], make("p")[0](plain))
    time.sleep(0.01)  # a new mtime (file times are a few ms coarse)

    with kept_stamp(record):
        record_task(record)[0]()  # as the task wrote it: no stamp
    with kept_stamp(plain):
        plain.write_text("p")
    assert why_stale({}, [source], [record]) is None and why_stale({}, [source], [plain]) is None

    time.sleep(0.01)
    plain.write_text("p")
    assert why_stale({}, [source], [plain]).startswith("output changed since it was made")


def test_a_record_that_is_not_a_json_object_is_refused(tmp_path, source):
    record = tmp_path / "mesh_0.record"
    with pytest.raises(ValueError, match="must write a JSON object"):
        run_once({}, [source], [record], record_task(record, content=[1, 2])[0])
    assert why_stale({}, [source], [record]) is not None


def keep_cells(output, grid) -> Callable[[], str]:
    """A task's work that writes `output` and keeps its cells (2 cells of 4^3 along z): its
    token is their digest (`save_cells`)."""

    def run() -> str:
        output.write_text("a table")
        return save_cells(output, Cells("the table", (0, 0, 0), (4, 4, 4), np.asarray(grid)))

    return run


def readers(source, table) -> list[Task]:
    """A task per cell of `table`, each reading that cell only."""
    return [
        Task(f"read[{k}]", "read", {"k": k}, (source, table), (table.with_name(f"read{k}.txt"),),
             (None, Part(Roi((4 * k, 0, 0), (4 * k + 4, 4, 4)))))
        for k in range(2)
    ]  # fmt: skip


def run_readers(tasks) -> set[int]:
    ran = set()
    for k, task in enumerate(tasks):
        work = make(str(k))[0](task.outputs[0])
        if run_once(task.settings, task.inputs, task.outputs, work, task.regions) == "ran":
            ran.add(k)
    return ran


def test_a_task_reading_cells_of_an_output_runs_again_only_where_they_changed(tmp_path, source):
    table = tmp_path / "ids.npy"
    grids = {"first": [[[[1]]], [[[2]]]], "second": [[[[1]]], [[[3]]]]}
    run_once({"v": 1}, [source], [table], keep_cells(table, grids["first"]))
    tasks = readers(source, table)
    assert run_readers(tasks) == {0, 1}
    run_once({"v": 2}, [source], [table], keep_cells(table, grids["second"]))  # cell 1 changed
    assert plan(tasks)["read[0]"] is None and "input changed" in plan(tasks)["read[1]"]
    assert run_readers(tasks) == {1}
    # Cells that are not the output's own (its stamp's token is not their digest) key nothing:
    # each reader is keyed on the whole output again.
    save_cells(table, Cells("the table", (0, 0, 0), (4, 4, 4), np.asarray(grids["first"])))
    assert run_readers(tasks) == {0, 1}


def test_a_stamp_made_before_its_task_read_parts_stays_up_to_date_while_its_inputs_do(
    tmp_path, source
):
    table = tmp_path / "ids.npy"
    run_once({"v": 1}, [source], [table], keep_cells(table, [[[[1]]], [[[2]]]]))
    (task, _) = readers(source, table)
    run_once(task.settings, task.inputs, task.outputs, make("0")[0](task.outputs[0]))  # no parts
    assert why_stale(task.settings, task.inputs, task.outputs, task.regions) is None
    run_once({"v": 2}, [source], [table], keep_cells(table, [[[[1]]], [[[3]]]]))
    assert why_stale(task.settings, task.inputs, task.outputs, task.regions) is not None
