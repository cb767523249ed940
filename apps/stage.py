"""Stage the input volumes into the run directory (synthetic data or the user's files)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def stage_volume(data: dict, role: str, outputs=()):
    """`role` is "train" or "eval"; writes outputs[0] (an .h5 with raw and, if known, labels)."""
    from pipeline.config import from_dict
    from pipeline.staging import DataConfig, stage_files, stage_synthetic, staged_complete

    data, path = from_dict(DataConfig, data), outputs[0].filepath
    if not staged_complete(path):
        if data.synthetic:
            seed = data.train_seed if role == "train" else data.eval_seed
            stage_synthetic(path, data.synthetic_preset, seed, data.synthetic_shape_zyx)
        elif role == "train":
            stage_files(path, data.train_raw, data.train_labels, data.voxel_size_nm)
        else:
            stage_files(path, data.eval_raw, data.eval_labels, data.voxel_size_nm)
    return path
