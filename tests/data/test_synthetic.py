"""The synthetic data set: reproducible, well-formed ground truth, and not trivially segmentable."""

import dataclasses
import json

import cc3d
import h5py
import numpy as np
import pytest
from scipy import ndimage
from skimage.metrics import adapted_rand_error

from pipeline.cli.synthetic import main
from pipeline.core.errors import ConfigError
from pipeline.data.synthetic import PRESETS, SyntheticConfig, generate
from pipeline.data.volumes import read_volume_pair

# The default tissue in a small box (640 nm cube, about 10 objects): fast enough for every test.
SMALL = PRESETS["default"].with_geometry((32, 64, 64))


@pytest.fixture(scope="module")
def default_volume() -> tuple[np.ndarray, np.ndarray]:
    """The data set the workflow ships with (about 1 s to generate)."""
    return generate(PRESETS["default"])


def test_same_seed_gives_identical_bytes():
    raw_a, labels_a = generate(SMALL)
    raw_b, labels_b = generate(SMALL)
    assert raw_a.tobytes() == raw_b.tobytes()
    assert labels_a.tobytes() == labels_b.tobytes()


def test_other_seed_gives_other_volume():
    raw_a, labels_a = generate(SMALL)
    raw_b, labels_b = generate(dataclasses.replace(SMALL, seed=SMALL.seed + 1))
    assert not np.array_equal(raw_a, raw_b)
    assert not np.array_equal(labels_a, labels_b)


def test_arrays_follow_the_volume_convention(default_volume):
    raw, labels = default_volume
    assert raw.dtype == np.uint8 and labels.dtype == np.uint64
    assert raw.shape == labels.shape == PRESETS["default"].shape_zyx


def test_default_preset_has_tens_of_objects(default_volume):
    _, labels = default_volume
    assert 35 <= labels.max() <= 80  # 49 measured; each object spans many FFN fields of view


def test_ids_are_exactly_one_to_n(default_volume):
    _, labels = default_volume
    n = int(labels.max())
    np.testing.assert_array_equal(np.unique(labels), np.arange(n + 1))


def test_every_object_is_one_6_connected_component(default_volume):
    _, labels = default_volume
    # cc3d splits each id into its 6-connected pieces; as many pieces as ids means one piece each.
    pieces = cc3d.connected_components(labels, connectivity=6)
    assert pieces.max() == labels.max()


def test_membranes_are_thin_and_darker_than_cytoplasm(default_volume):
    raw, labels = default_volume
    membrane = labels == 0
    assert 0.05 < membrane.mean() < 0.25  # about 1 voxel between neighbouring objects
    assert raw[~membrane].mean() - raw[membrane].mean() > 30  # about 58 grey levels measured


def threshold_segmentation(raw: np.ndarray, threshold: float) -> np.ndarray:
    """The naive baseline: 6-connected components of the bright voxels.

    Dark voxels go to the nearest component, so that they do not count as one giant merged segment.
    """
    segments = cc3d.connected_components(raw > threshold, connectivity=6)
    nearest = ndimage.distance_transform_edt(
        segments == 0, return_distances=False, return_indices=True
    )
    return segments[tuple(nearest)]


def test_thresholding_does_not_segment_it(default_volume):
    raw, labels = default_volume
    for threshold in np.linspace(*np.percentile(raw, [5, 95]), 10):
        # adapted_rand_error ignores voxels that are 0 in the ground truth (membranes).
        error = adapted_rand_error(labels, threshold_segmentation(raw, threshold))[0]
        assert error > 0.5, f"threshold {threshold:.0f} segments the volume (error {error:.2f})"


def test_benchmark_preset_is_the_default_tissue_in_a_bigger_box():
    assert PRESETS["default"].with_geometry((128, 256, 256)) == PRESETS["benchmark"]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"shape_zyx": (-32, 64, 64)}, "shape_zyx must be 3 positive integers"),
        ({"shape_zyx": (32, 64)}, "shape_zyx must be 3 positive integers"),
        ({"voxel_size_nm": (20.0, 0.0, 10.0)}, "voxel_size_nm must be 3 positive numbers"),
        ({"tube_radius_nm": (120.0, 40.0)}, "tube_radius_nm must be \\(low, high\\)"),
        ({"branch_probability": 1.5}, "branch_probability must be in \\[0, 1\\)"),
        ({"noise_sd": -1.0}, "noise_sd must be >= 0"),
        ({"tube_count": 0, "blob_count": 0}, "no objects"),
    ],
)
def test_bad_setting_raises_config_error(setting, message):
    with pytest.raises(ConfigError, match=message):
        SyntheticConfig(**setting)


def test_cli_writes_a_volume_pair_with_its_voxel_size(tmp_path, capsys):
    path = tmp_path / "v.h5"
    argv = [str(path), "--shape", "16", "48", "48", "--voxel-size", "30", "8", "8", "--seed", "3"]
    assert main(argv) == 0

    volume = read_volume_pair(f"{path}:raw", f"{path}:labels")
    assert volume.shape == (16, 48, 48)
    assert volume.voxel_size_nm == (30.0, 8.0, 8.0)
    with h5py.File(path) as f:
        config = json.loads(f.attrs["synthetic_config"])
    assert config["seed"] == 3 and config["voxel_size_nm"] == [30.0, 8.0, 8.0]
    summary = capsys.readouterr().out.strip()
    assert "\n" not in summary and f"{int(volume.labels.max())} objects" in summary


def test_cli_reports_a_bad_setting_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "v.h5"), "--voxel-size", "20", "0", "10"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: synthetic config: voxel_size_nm")
    assert not (tmp_path / "v.h5").exists()


def test_cli_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--preset" in capsys.readouterr().out
