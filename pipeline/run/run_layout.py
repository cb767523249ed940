"""The run directory's layout, defined once: where every stage's outputs, the run's records and
Parsl's own files live. The planner, the report, the watchdog, `status`, `view` and the sites read
it from here.

    staged/           the staged volumes (train.h5, select.h5, eval.h5, or eval.json for a volume
                      read in place)
    preprocess/       partitions.h5, coordinates.npz
    train/            checkpoints, metrics.csv, train.log, train_summary.json
    selection.json    the chosen checkpoint
    inference/        blocks/ and stitch/ (second/ for a consensus's second pass)
    agglomerate/      FFN's second pass
    baseline/         the learned watershed and its boundary forest
    evaluation/       the per-region overlap counts; evaluation.json the scores
    precomputed/      the Neuroglancer layers
    report.md         the run's report
    config.json       the resolved settings; site.json the site it ran on
    runinfo/          Parsl's logs, the submitted blocks (jobs.jsonl), the watchdog's log
    monitoring.db     Parsl's monitoring database
    code/             the code the run's workers import (pipeline.run.code_copy)
    study/            a study's cells and report
"""

from dataclasses import dataclass
from pathlib import Path

LAYOUT = {
    "train_volume": "staged/train.h5",
    "eval_copy": "staged/eval.h5",
    "eval_record": "staged/eval.json",
    "select_volume": "staged/select.h5",
    "partitions": "preprocess/partitions.h5",
    "coordinates": "preprocess/coordinates.npz",
    "train_dir": "train",
    "train_summary": "train/train_summary.json",
    "train_log": "train/train.log",
    "train_config": "train/config.json",
    "train_metrics": "train/metrics.csv",
    "train_curves": "train/curves.png",
    "selection": "selection.json",
    "blocks_dir": "inference/blocks",
    "stitch_dir": "inference/stitch",
    "stitch_summary": "inference/stitch.json",
    # FFN's second pass ([agglomeration]): the first pass is stitched here, a consensus's second
    # inference pass beside it, and what the export shows is made from them.
    "first_pass": "agglomerate/first_pass",
    "second_blocks_dir": "inference/second/blocks",
    "second_stitch_dir": "inference/second/stitch",
    "second_stitch_summary": "inference/second/stitch.json",
    "second_pass": "agglomerate/second_pass",
    "consensus": "agglomerate/consensus",
    "consensus_dir": "agglomerate/consensus_ids",
    "consensus_summary": "agglomerate/consensus.json",
    "agglomerate_dir": "agglomerate",
    "agglomerate_summary": "agglomerate/agglomerate.json",
    # With pairs decided, the merges as a graph over the export's supervoxels (a proofreader's
    # to edit), and the layer of the merged objects made from it, which the evaluation scores.
    "merge_graph": "agglomerate/graph.csv",
    "merged": "agglomerate/merged",
    "merged_summary": "agglomerate/merged.json",
    "evaluation": "evaluation.json",
    # The learned watershed's forest, learned on the training part; the fill floods its map too.
    "boundary_forest": "baseline/boundary_forest.joblib",
    "learned_baseline": "baseline/learned_watershed.h5",
    "learned_baseline_record": "baseline/learned_watershed.json",
    "counts_dir": "evaluation",
    "precomputed": "precomputed",
    "report": "report.md",
    # A study (`workflow.py study`): one training folder per cell, the study's report beside.
    "study_cells": "study/cells",
    "study_report": "study/report.md",
    "study_results": "study/results.json",
    "config": "config.json",
    "site": "site.json",
    # The digest of site.json as the run wrote it: a resume refuses a site.json changed since.
    "site_digest": "runinfo/site.json.sha256",
    # Parsl's run dir (parsl.log, one folder per run: 000/, 001/, ...), the blocks submitted and
    # the watchdog's log; Parsl's monitoring database beside it.
    "runinfo": "runinfo",
    "jobs": "runinfo/jobs.jsonl",
    "watchdog_log": "runinfo/watchdog.log",
    "monitoring_db": "monitoring.db",
}


@dataclass(frozen=True)
class RunPaths:
    """Where every stage's outputs live in a run directory: `paths.selection` is
    `<root>/selection.json`, and so on for every name of LAYOUT."""

    root: Path
    # pipeline.data.staging.reads_in_place: the volume to segment is staged as a record, not a copy.
    eval_in_place: bool = False

    @property
    def eval_volume(self) -> Path:
        return self.root / LAYOUT["eval_record" if self.eval_in_place else "eval_copy"]

    @property
    def objects(self) -> Path:
        """The folder whose segmentation layer holds the run's objects as they are scored: the
        merged layer where the second pass merged pairs (the export then holds their
        supervoxels), else the export."""
        merged = self.root / LAYOUT["merged"]
        return merged if merged.is_dir() else self.root / LAYOUT["precomputed"]

    def __getattr__(self, name: str) -> Path:
        if name not in LAYOUT:
            raise AttributeError(f"a run directory has no {name!r} (pipeline.run.run_layout)")
        return self.root / LAYOUT[name]
