"""Parsl's monitoring database (`monitoring.db`), read by the report and `status`: the stage of
each Parsl app, and read-only queries."""

import sqlite3
from pathlib import Path

# Parsl app function names -> the stage names the workflow prints.
STAGE_OF_APP = {
    "stage_volume": "stage",
    "preprocess": "preprocess",
    "train": "train",
    "select_checkpoint": "select",
    "infer_block": "infer",
    "pair_block": "stitch",
    "join_blocks": "stitch",
    "relabel_part": "stitch",
    "finish_stitch": "stitch",
    "consensus_pairs": "consensus",
    "join_consensus_pairs": "consensus",
    "relabel_consensus_part": "consensus",
    "finish_consensus": "consensus",
    "pair_core": "agglomerate",
    "join_pairs": "agglomerate",
    "decide_core": "agglomerate",
    "merge_pairs": "agglomerate",
    "count_part": "agglomerate",
    "sum_sizes": "agglomerate",
    "relabel_merged_part": "agglomerate",
    "finish_agglomeration": "agglomerate",
    "merge_graph": "agglomerate",
    "relabel_graph_part": "agglomerate",
    "finish_graph": "agglomerate",
    "count_region": "evaluate",
    "boundary_forest": "evaluate",
    "given_boundary_forest": "evaluate",
    "learned_baseline": "evaluate",
    "evaluate": "evaluate",
    "begin_export": "export",
    "export_region": "export",
    "export_meshes": "export",
    "plan_meshes": "export",
    "merge_meshes": "export",
    "export_skeletons": "export",
    "plan_skeletons": "export",
    "merge_skeletons": "export",
    "report_study": "study",
    "finish_export": "export",
}


def query(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """The rows `sql` selects from Parsl's monitoring database `db`, opened read-only (a running
    workflow's Parsl writes it meanwhile); none where it or its tables do not exist yet."""
    if not db.is_file():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        try:
            return connection.execute(sql, params).fetchall()
        except sqlite3.OperationalError:  # no tables yet: monitoring never wrote
            return []
