"""FFN preprocessing: partition classes, balanced coordinates, coordinate files, shards, CLI."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

import pipeline.preprocess.partitions as partitions_module
from pipeline.cli.partitions import main
from pipeline.core.errors import ConfigError, CoordinatesError
from pipeline.data.volumes import write_volumes
from pipeline.preprocess.partitions import (
    DEFAULT_THRESHOLDS,
    EXCLUDED,
    PartitionConfig,
    build_coordinates,
    compute_partitions,
    load_coordinates,
    save_coordinates,
    shard,
)


def blocky_labels(shape, seed, ids=5, block=3):
    """Random labels in blocks (so own-label fractions cover the whole range), some unlabeled."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, ids, size=[-(-s // block) for s in shape])
    labels = np.kron(coarse, np.ones((block,) * 3, dtype=np.int64))[tuple(slice(s) for s in shape)]
    noise = rng.random(shape) < 0.1  # sprinkle single voxels of other ids
    labels[noise] = rng.integers(0, ids, size=int(noise.sum()))
    return labels.astype(np.uint64)


def brute_force_partitions(labels, thresholds, radius, margin, min_object_voxels=0):
    """The definition, one voxel at a time."""
    out = np.full(labels.shape, EXCLUDED, dtype=np.uint8)
    window_size = np.prod([2 * r + 1 for r in radius])
    for p in np.ndindex(labels.shape):
        if any(c < m or c >= s - m for c, m, s in zip(p, margin, labels.shape, strict=True)):
            continue
        if labels[p] == 0 or np.count_nonzero(labels == labels[p]) < min_object_voxels:
            out[p] = 0
            continue
        window = labels[tuple(slice(c - r, c + r + 1) for c, r in zip(p, radius, strict=True))]
        fraction = np.count_nonzero(window == labels[p]) / window_size
        out[p] = 1 + sum(fraction >= t for t in thresholds)
    return out


# ---------------------------------------------------------------------------------------------
# Partitions


def test_partitions_of_a_hand_made_volume():
    # 5x5x5 (z, y, x), lom radius 1 -> 27-voxel windows, margin 1 -> interior z, y, x in {1, 2, 3}.
    # Object 1 fills x <= 1, object 2 fills x >= 2, except: the single voxel (2, 2, 3) is object 3
    # and (3, 3, 1) is unlabeled. Thresholds (0.1, 0.5, 0.9) -> classes
    #   1: f < 0.1,  2: 0.1 <= f < 0.5,  3: 0.5 <= f < 0.9,  4: f >= 0.9.
    labels = np.zeros((5, 5, 5), dtype=np.uint64)
    labels[:, :, :2] = 1
    labels[:, :, 2:] = 2
    labels[2, 2, 3] = 3
    labels[3, 3, 1] = 0
    expected = np.full((5, 5, 5), 255, dtype=np.uint8)  # the 1-voxel border: excluded
    # x = 1, object 1: window x in {0, 1, 2} holds 2 columns of object 1 = 18 voxels, less the
    # unlabeled (3, 3, 1) when it is in the window (z, y in {2, 3}): 18/27 = 0.667 or 17/27 = 0.63
    # -> class 3 either way.
    expected[1:4, 1:4, 1] = 3
    # x = 2, object 2: window x in {1, 2, 3} holds columns 2, 3 = 18, less object 3's voxel, which
    # is in every such window: 17/27 = 0.63 -> class 3.
    expected[1:4, 1:4, 2] = 3
    # x = 3, object 2: window x in {2, 3, 4} is object 2 except (2, 2, 3): 26/27 = 0.963 -> class 4
    expected[1:4, 1:4, 3] = 4
    # Object 3 alone in its window: 1/27 = 0.037 -> class 1; the unlabeled voxel: class 0.
    expected[2, 2, 3] = 1
    expected[3, 3, 1] = 0

    got = compute_partitions(labels, thresholds=(0.1, 0.5, 0.9), lom_radius_zyx=(1, 1, 1))

    np.testing.assert_array_equal(got, expected)
    # FFN's default thresholds: 1/27 = 0.037 is in [0.025, 0.05) -> class 2; 17/27 = 0.63 and
    # 18/27 = 0.667 in [0.6, 0.7) -> class 10; 26/27 = 0.963 >= 0.9 -> class 13.
    default = compute_partitions(labels, lom_radius_zyx=(1, 1, 1))
    assert (default[2, 2, 3], default[1, 1, 1], default[1, 1, 2], default[1, 1, 3]) == (
        2,
        10,
        10,
        13,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partitions_match_brute_force(seed):
    # Anisotropic radius; window 3*5*7 = 105 voxels, so thresholds 0.2, 0.4, ... are hit exactly
    # (21/105 = 0.2): ties must fall into the upper class, as in FFN.
    labels = blocky_labels((11, 14, 17), seed)
    labels[labels > 0] += np.uint64(2**63)  # huge ids must work as well as small ones
    radius, margin = (1, 2, 3), (2, 2, 4)

    got = compute_partitions(labels, DEFAULT_THRESHOLDS, radius, margin)

    np.testing.assert_array_equal(
        got, brute_force_partitions(labels, DEFAULT_THRESHOLDS, radius, margin)
    )


def test_small_objects_are_left_unlabeled_as_ffn_clears_dust():
    # Object 3 is a 2-voxel speck, as annotations leave behind; at min_object_voxels 3 its voxels
    # are class 0 (never sampled) while the others keep their classes, counted with the speck.
    labels = np.ones((5, 5, 5), dtype=np.uint64)
    labels[:, :, 3:] = 2
    labels[2, 2, 2:4] = 3
    every = compute_partitions(labels, (0.1, 0.5, 0.9), (1, 1, 1))
    no_specks = compute_partitions(labels, (0.1, 0.5, 0.9), (1, 1, 1), min_object_voxels=3)

    assert every[2, 2, 2] != 0 and every[2, 2, 3] != 0
    assert no_specks[2, 2, 2] == 0 and no_specks[2, 2, 3] == 0
    speck = labels == 3
    np.testing.assert_array_equal(no_specks[~speck], every[~speck])


@pytest.mark.parametrize("min_object_voxels", [0, 150, 1000])
def test_partitions_without_small_objects_match_brute_force(min_object_voxels):
    labels = blocky_labels((9, 12, 14), seed=3, ids=9)
    sizes = np.unique(labels[labels > 0], return_counts=True)[1]
    assert sizes.min() < 150 <= sizes.max()  # some objects are left out at 150, not all

    got = compute_partitions(
        labels, DEFAULT_THRESHOLDS, (1, 2, 2), (1, 2, 2), min_object_voxels=min_object_voxels
    )

    expected = brute_force_partitions(
        labels, DEFAULT_THRESHOLDS, (1, 2, 2), (1, 2, 2), min_object_voxels
    )
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("chunk_voxels", [1 << 22, 7])
def test_objects_processed_in_pieces_match_brute_force(monkeypatch, chunk_voxels):
    # Diagonal rods: their bounding boxes are mostly empty, so they are processed in blocks
    # (made tiny here so that a small volume has several); huge objects are also cut into chunks
    # of voxels (also made tiny in the second case).
    monkeypatch.setattr(partitions_module, "PIECE_ZYX", (4, 4, 4))
    monkeypatch.setattr(partitions_module, "CHUNK_VOXELS", chunk_voxels)
    labels = np.zeros((16, 20, 22), dtype=np.uint64)
    t = np.arange(16)
    for k, (y0, x0) in enumerate([(0, 0), (3, 6), (1, 12)], start=1):
        for dy, dx in np.ndindex(2, 2):  # a 2x2 cross-section
            labels[t, y0 + t + dy, x0 + t // 2 + dx] = k
    radius, margin = (1, 1, 2), (1, 2, 2)
    rod = np.stack(np.nonzero(labels == 1))
    assert len(partitions_module._pieces(rod, np.array(radius))) > 1  # the block path is taken

    got = compute_partitions(labels, DEFAULT_THRESHOLDS, radius, margin)

    np.testing.assert_array_equal(
        got, brute_force_partitions(labels, DEFAULT_THRESHOLDS, radius, margin)
    )


def test_partitions_zero_radius_counts_only_the_voxel_itself():
    labels = blocky_labels((4, 5, 6), seed=3)
    got = compute_partitions(labels, (0.5,), lom_radius_zyx=(0, 0, 0))
    np.testing.assert_array_equal(got, np.where(labels > 0, 2, 0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"thresholds": ()},
        {"thresholds": (0.5, 0.2)},
        {"thresholds": (0.2, 0.2)},
        {"thresholds": (0.0, 0.5)},
        {"thresholds": (0.5, 1.5)},
        {"lom_radius_zyx": (1, 1)},
        {"lom_radius_zyx": (1, -1, 1)},
        {"margin_zyx": (1, 0, 1)},  # smaller than the radius
        {"lom_radius_zyx": (3, 1, 1)},  # 7 > 5: no interior left
    ],
)
def test_partitions_reject_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        compute_partitions(
            np.ones((5, 5, 5), dtype=np.uint64), **{"lom_radius_zyx": (1, 1, 1), **kwargs}
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"thresholds": (0.3, 0.2)},
        {"lom_radius_zyx": (1, 2)},
        {"margin_zyx": (7, 15, 16)},
        {"samples_per_class": 0},
        {"seed": -1},
        {"min_object_voxels": -1},
        {"min_object_voxels": 1.5},
    ],
)
def test_config_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        PartitionConfig(**kwargs)


def test_config_defaults():
    config = PartitionConfig(thresholds=[0.5], lom_radius_zyx=[1, 2, 3])
    assert config.thresholds == (0.5,) and config.lom_radius_zyx == (1, 2, 3)
    assert config.margin == (1, 2, 3)  # margin defaults to the radius
    assert PartitionConfig().lom_radius_zyx == (8, 16, 16)


# ---------------------------------------------------------------------------------------------
# Coordinates


@pytest.fixture(scope="module")
def partitions():
    return compute_partitions(blocky_labels((12, 20, 20), seed=4), lom_radius_zyx=(1, 2, 2))


def test_coordinates_are_balanced_and_valid(partitions):
    coords = build_coordinates(partitions, samples_per_class=40, seed=0)

    classes = partitions[tuple(coords.T)]
    present = [c for c in np.unique(partitions) if c not in (0, 255)]
    assert coords.dtype == np.int32 and coords.shape == (40 * len(present), 3)
    assert sorted(set(classes)) == present  # never 0 (unlabeled) or 255 (margin)
    for c in present:
        picked = coords[classes == c]
        assert len(picked) == 40
        voxels = np.count_nonzero(partitions == c)
        unique = len(np.unique(picked, axis=0))
        # Enough voxels: all distinct; too few: every voxel used, then repeated.
        assert unique == min(voxels, 40)
    assert any(np.count_nonzero(partitions == c) < 40 for c in present)  # the repeat case is tested


def test_coordinates_depend_only_on_the_seed(partitions):
    first = build_coordinates(partitions, 30, seed=5)
    np.testing.assert_array_equal(first, build_coordinates(partitions, 30, seed=5))
    assert not np.array_equal(first, build_coordinates(partitions, 30, seed=6))


def test_coordinates_need_a_sampleable_voxel():
    with pytest.raises(CoordinatesError):
        build_coordinates(np.full((3, 3, 3), 255, dtype=np.uint8), 10, seed=0)


# ---------------------------------------------------------------------------------------------
# Shards


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_shards_are_disjoint_and_cover_everything(size):
    coords = np.arange(20 * 3).reshape(20, 3)
    shards = [shard(coords, rank, size) for rank in range(size)]
    assert all(len(s) > 0 for s in shards)
    together = np.concatenate(shards)
    assert len(together) == len(coords)
    np.testing.assert_array_equal(np.unique(together, axis=0), coords)


@pytest.mark.parametrize(("rank", "size"), [(-1, 2), (2, 2), (0, 0), (True, 2), (0.0, 1)])
def test_shard_rejects_bad_rank_or_size(rank, size):
    with pytest.raises(ConfigError):
        shard(np.zeros((5, 3)), rank, size)


def test_shard_refuses_empty_shards():
    with pytest.raises(CoordinatesError, match="3 coordinate"):
        shard(np.zeros((3, 3)), 0, 4)


# ---------------------------------------------------------------------------------------------
# Files


@pytest.fixture
def coordinates_file(tmp_path, partitions):
    coords = build_coordinates(partitions, 10, seed=0)
    path = tmp_path / "coords.npz"
    config = PartitionConfig(lom_radius_zyx=(1, 2, 2), samples_per_class=10)
    save_coordinates(path, coords, "vol", classes=partitions[tuple(coords.T)], config=config)
    return path, coords, partitions[tuple(coords.T)]


def test_coordinates_file_round_trip(coordinates_file):
    path, coords, classes = coordinates_file
    loaded = load_coordinates(path)
    assert loaded.volume_name == "vol"
    np.testing.assert_array_equal(loaded.coords, coords)
    np.testing.assert_array_equal(loaded.classes, classes)
    assert loaded.coords.dtype == np.int32 and loaded.classes.dtype == np.uint8


def test_coordinates_file_shards(coordinates_file):
    path, coords, classes = coordinates_file
    second = load_coordinates(path, rank=1, size=3)
    np.testing.assert_array_equal(second.coords, coords[1::3])
    np.testing.assert_array_equal(second.classes, classes[1::3])
    with pytest.raises(CoordinatesError, match="coords.npz"):
        load_coordinates(path, rank=0, size=len(coords) + 1)


def test_truncated_coordinates_file_is_rejected(coordinates_file):
    path = coordinates_file[0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CoordinatesError, match="coords.npz"):
        load_coordinates(path)


def test_missing_coordinates_file_is_rejected(tmp_path):
    with pytest.raises(CoordinatesError, match="file not found"):
        load_coordinates(tmp_path / "nothing.npz")


@pytest.mark.parametrize(
    "arrays",
    [
        {"x": np.zeros(3)},  # not a coordinates file
        {
            "format_version": 1,
            "coords": np.zeros((4, 2), int),
            "classes": np.ones(4),
            "volume_name": "v",
        },
        {
            "format_version": 1,
            "coords": np.zeros((4, 3)),
            "classes": np.ones(4, int),
            "volume_name": "v",
        },
        {
            "format_version": 1,
            "coords": np.zeros((4, 3), int),
            "classes": np.ones(3, int),
            "volume_name": "v",
        },
        {
            "format_version": 1,
            "coords": -np.ones((4, 3), int),
            "classes": np.ones(4, int),
            "volume_name": "v",
        },
        {
            "format_version": 1,
            "coords": np.zeros((4, 3), int),
            "classes": np.ones(4, int),
            "volume_name": 7,
        },
        {
            "format_version": 9,
            "coords": np.zeros((4, 3), int),
            "classes": np.ones(4, int),
            "volume_name": "v",
        },
    ],
)
def test_malformed_coordinates_file_is_rejected(tmp_path, arrays):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(CoordinatesError, match="bad.npz"):
        load_coordinates(path)


def test_non_npz_file_is_rejected(tmp_path):
    path = tmp_path / "coords.npz"
    path.write_text("not a zip file\n")
    with pytest.raises(CoordinatesError, match="not a readable"):
        load_coordinates(path)


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_end_to_end(tmp_path, capsys):
    labels = blocky_labels((10, 16, 16), seed=6)
    labels_path = write_volumes(tmp_path / "vol.h5", {"labels": labels}, (40.0, 8.0, 8.0))
    parts_path, coords_path = tmp_path / "parts.h5", tmp_path / "out" / "coords.npz"

    code = main(
        [
            *("--labels", f"{labels_path}:labels"),
            *("--partitions-out", str(parts_path), "--coordinates-out", str(coords_path)),
            *("--lom-radius", "1", "2", "2", "--thresholds", "0.3", "0.6", "0.9"),
            *("--samples-per-class", "25", "--seed", "1", "--min-object-voxels", "500"),
        ]
    )

    assert code == 0
    expected = compute_partitions(labels, (0.3, 0.6, 0.9), (1, 2, 2), min_object_voxels=500)
    with h5py.File(parts_path, "r") as f:
        np.testing.assert_array_equal(f["partitions"][...], expected)
        assert tuple(f["partitions"].attrs["voxel_size_nm"]) == (40.0, 8.0, 8.0)
    assert (expected == 0).sum() > (
        compute_partitions(labels, (0.3, 0.6, 0.9), (1, 2, 2)) == 0
    ).sum()
    coordinates = load_coordinates(coords_path)
    assert coordinates.volume_name == "vol"  # the labels file's stem
    np.testing.assert_array_equal(coordinates.coords, build_coordinates(expected, 25, seed=1))
    out = capsys.readouterr().out
    assert "[0.9, 1]" in out and "margin (excluded)" in out


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    code = main(
        [
            *("--labels", f"{tmp_path / 'missing.h5'}:labels"),
            *(
                "--partitions-out",
                str(tmp_path / "p.h5"),
                "--coordinates-out",
                str(tmp_path / "c.npz"),
            ),
        ]
    )
    assert code == 2  # a pipeline error (pipeline.cli)
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"error: {tmp_path / 'missing.h5'}: file not found")
    )


def test_cli_help():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.partitions", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--coordinates-out" in result.stdout and "--lom-radius" in result.stdout
