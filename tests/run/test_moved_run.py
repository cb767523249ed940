"""A run dir is its own database (issue 31, items 5 and 6): moved or copied, it resumes with its own
files, never with those of the dir it came from; and a file of a stamped folder rewritten in place
with its size kept (a chunk partly zeroed) is not trusted.

Each scenario starts from a copy of the finished `configs/tiny.toml` run (the `tiny_run` fixture),
injects the real fault and resumes.
"""

import json
import shutil

import numpy as np
import pytest
from faults import zero_bytes
from workflow_runs import TINY, copy_run, segmentation, tiny_variant, tries, workflow

from pipeline.core.errors import ChunkReadError
from pipeline.core.stamps import read_stamp, stamp_path
from pipeline.export.layers import export_complete
from pipeline.inference.blocks import read_block_result
from pipeline.selection.checkpoints import chosen_checkpoint

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def resume(run_dir, config=TINY, *extra: str) -> str:
    return workflow("--config", str(config), "--run-dir", str(run_dir), "--resume", *extra).stdout


def naming(run_dir, where) -> list[str]:
    """The stamps and records of `run_dir` that name the path `where` (the dir it came from)."""
    return [
        str(path.relative_to(run_dir))
        for pattern in ("**/*.stamp.json", "**/*.record", "selection.json")
        for path in run_dir.glob(pattern)
        if str(where) in path.read_text()
    ]


def test_a_moved_run_dir_is_up_to_date_and_segments_with_its_own_checkpoint(tiny_run, tmp_path):
    """Issue 31: selection.json named the checkpoint by its absolute path: with the original dir
    gone, every block of a moved run failed."""
    origin = copy_run(tiny_run, tmp_path / "origin" / "run")
    moved = shutil.move(origin, tmp_path / "elsewhere" / "moved")
    assert not origin.exists()
    assert "nothing to do: every task is up to date" in resume(moved)
    # A changed inference setting: every block segments again, with the moved run's weights.
    config = tiny_variant(tmp_path, "min_size", {"min_segment_size = 20": "min_segment_size = 21"})
    out = resume(moved, config)
    assert "infer      0/4 up to date" in out
    assert "settings changed: inference.min_segment_size 20 -> 21" in out
    assert tries(moved)["infer_block"] == 4  # each once: none failed
    blocks = sorted((moved / "inference" / "blocks").glob("block_*[0-9].npz"))
    recorded = {read_block_result(b).provenance["checkpoint"] for b in blocks}
    assert recorded == {json.loads((moved / "selection.json").read_text())["checkpoint"]}
    assert not any(str(tmp_path / "origin") in name for name in recorded)
    assert chosen_checkpoint(moved / "selection.json").is_relative_to(moved)
    assert naming(moved, tiny_run) == []  # no stamp nor selection.json names where it was made


def test_a_copied_run_dir_uses_its_own_checkpoint_not_the_originals(tiny_run, tmp_path):
    """Issue 31: with the original present, a copy silently segmented with its weights."""
    copy = copy_run(tiny_run, tmp_path / "copy")
    checkpoint = chosen_checkpoint(copy / "selection.json")
    assert checkpoint.is_relative_to(copy), checkpoint
    assert checkpoint.with_name(checkpoint.name + ".index").is_file()
    assert "nothing to do: every task is up to date" in resume(copy)


def test_a_stitched_chunk_rewritten_with_its_size_kept_is_written_again(tiny_run, tmp_path):
    """Issue 31: 100 bytes zeroed in a chunk of the stitched segmentation kept its size, the
    folder's stamp (names and sizes) trusted it: --resume said nothing to do, export_complete
    was True, and the export showed the damaged voxels."""
    run_dir = copy_run(tiny_run, tmp_path / "run")
    chunks = run_dir / "precomputed" / "segmentation" / "10_10_20"  # its full resolution
    state = read_stamp(chunks)["outputs"][chunks.name]
    # A chunk with labels where it is zeroed: the fault changes voxels.
    chunk = next(c for c in sorted(chunks.iterdir()) if any(c.read_bytes()[1000:1100]))
    size = chunk.stat().st_size
    zero_bytes(chunk, 1000, 100)
    assert chunk.stat().st_size == size
    # The fault is real: a shard's chunks are gzipped, so it is not read at all (never as zeros).
    with pytest.raises(ChunkReadError, match=r"shard 10_10_20/.*cannot be read"):
        segmentation(run_dir)
    assert not export_complete(run_dir / "precomputed")
    out = resume(run_dir)
    # 4 pairs tasks, the join, one part (the tiny volume is one shard), the last: the last runs.
    assert "stitch     6/7 up to date; runs: stitch: output changed since it was made" in out
    assert "finish_stitch" in tries(run_dir)
    np.testing.assert_array_equal(segmentation(run_dir), segmentation(tiny_run))
    assert export_complete(run_dir / "precomputed")
    assert read_stamp(chunks)["outputs"][chunks.name][:2] == state[:2]  # same files and bytes
    assert "nothing to do: every task is up to date" in resume(run_dir)


def test_a_moved_run_with_a_selection_file_from_before_uses_its_own_checkpoint(tiny_run, tmp_path):
    """The fault as issue 31 saw it: a run whose selection.json names its checkpoint by absolute
    path (as written before paths were relative) is moved; the old dir is gone. Every block
    failed; now the same path's tail is found in the moved run."""
    origin = copy_run(tiny_run, tmp_path / "origin" / "run")
    selection = origin / "selection.json"
    record = json.loads(selection.read_text())
    absolute = str(origin / "train" / "checkpoints" / f"ckpt-{record['step']}")
    selection.write_text(json.dumps(record | {"checkpoint": absolute}, indent=2) + "\n")
    stamp = json.loads(stamp_path(selection).read_text())  # as that run's select stamped it
    stamp["outputs"]["selection.json"] = [selection.stat().st_size, selection.stat().st_mtime_ns]
    stamp_path(selection).write_text(json.dumps(stamp))
    moved = shutil.move(origin, tmp_path / "elsewhere" / "moved")
    assert not origin.exists()
    config = tiny_variant(tmp_path, "min_size", {"min_segment_size = 20": "min_segment_size = 21"})
    out = resume(moved, config)
    assert "select     1/1 up to date" in out and "infer      0/4 up to date" in out
    assert tries(moved)["infer_block"] == 4  # each once: none failed
    assert chosen_checkpoint(moved / "selection.json").is_relative_to(moved)
