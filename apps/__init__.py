"""Thin Parsl apps, one module per stage; each calls `pipeline/` and returns.

Every app is declared `cache=True`: with the run's task-exit checkpoints (site_configs.base) a
resumed workflow does not run an app again whose inputs are unchanged. Inputs are `File`s; their
identity for that purpose is path + size + modification time (registered below), so an input
file that changed makes its consumers run again.
"""

import os

from parsl.data_provider.files import File
from parsl.dataflow.memoization import id_for_memo


@id_for_memo.register(File)
def _id_for_file(file: File, output_ref: bool = False) -> bytes:
    if output_ref or not os.path.exists(file.filepath):
        return f"file:{file.filepath}".encode()
    stat = os.stat(file.filepath)
    return f"file:{file.filepath}:{stat.st_size}:{stat.st_mtime_ns}".encode()
