"""The science of the FFN workflow, in plain Python (no Parsl), one subpackage per stage.

The groups, in the order imports run (a module imports only from its own group and the groups
before it; tests/test_layout.py checks it, and that no module reaches itself through others):

    core        errors, atomic writes, ROIs, configs to and from dicts, stamps, memory
    data        volumes (HDF5, zarr, precomputed), the synthetic data set, data staging
    preprocess  partitions of the ground truth and seed coordinates for training
    export      Neuroglancer precomputed layers: the export, its folder, shards, meshes, viewer
    network     the FFN model, its movement rule, device binding, the authors' released weights
    training    Horovod training: examples, settings, learning-rate scaling, metrics, the loop
    inference   flood filling, blockwise segmentation, stitching
    secondpass  agglomeration, split consensus, the fill of unsegmented voxels
    evaluation  scores against ground truth, the watershed baselines, the evaluation stage
    selection   checkpoint selection, released models taken as the selection
    study       the paper's study: its grid of cells, analysis and report
    run         the run itself: settings, run-dir layout, lock, watchdog, code copy, report
    cli         the command-line entry points (`python -m pipeline.cli.<name>`)

A stage's contract (the named inputs and outputs of its task) is in `apps/contracts.py`.
"""

import os

# Set before TensorFlow is first imported (every TF user imports `pipeline` first). TensorFlow
# enables oneDNN by default only on CPUs with AVX-512/AMX; on AVX2-only CPUs (the AMD EPYC this
# project is developed on) turning it on makes Conv3D training about twice as fast.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # hide INFO start-up notices, keep warnings

import warnings

# cloud-volume's Google libraries warn at import time that Python 3.11 reaches end of life in 2027.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

GROUPS = (
    "core",
    "data",
    "preprocess",
    "export",
    "network",
    "training",
    "inference",
    "secondpass",
    "evaluation",
    "selection",
    "study",
    "run",
    "cli",
)
