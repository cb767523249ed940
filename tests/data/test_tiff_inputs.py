"""A folder of TIFF sections as an input volume (`folder:*.tif`, `pipeline.data.tiff_volumes`):
read in the order of the files' names, a section at a time, checked as any other input."""

import h5py
import numpy as np
import pytest
import tifffile

from pipeline.core.errors import (
    ChunkReadError,
    VolumeDtypeError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.data.staging import DataConfig, source_files, stage_files
from pipeline.data.volumes import open_volume, read_header, read_raw

VOXEL = (30.0, 6.0, 6.0)
SHAPE = (12, 20, 24)


def image() -> np.ndarray:
    return np.random.default_rng(127).integers(0, 256, SHAPE, dtype=np.uint8)


def write_sections(folder, array: np.ndarray, compressed=()) -> str:
    """One file per z section, named s1.tif ... s12.tif (unpadded: the order is by number), the
    sections in `compressed` zlib-compressed, the others plain; the volume's spec."""
    folder.mkdir(parents=True, exist_ok=True)
    for z, section in enumerate(array):
        compression = "zlib" if z in compressed else None
        tifffile.imwrite(folder / f"s{z + 1}.tif", section, compression=compression)
    return f"{folder}:*.tif"


def test_sections_read_as_a_volume_in_the_order_of_their_numbers(tmp_path):
    array = image()
    spec = write_sections(tmp_path / "em", array, compressed={3, 10})
    (tmp_path / "em" / "notes.txt").write_text("not a section")
    header = read_header(spec, VOXEL)
    assert header.shape == SHAPE and header.dtype == np.uint8 and header.voxel_size_nm == VOXEL
    np.testing.assert_array_equal(read_raw(spec, VOXEL)[0], array)
    with open_volume(spec) as volume:
        np.testing.assert_array_equal(volume[2:11, 5:17, 3:20], array[2:11, 5:17, 3:20])
    # Staged as a copy, as HDF5 is; a resume watches the folder's files.
    stage_files(tmp_path / "staged.h5", spec, voxel_size_nm=VOXEL, roi="1:9, 0:20, 4:24")
    with h5py.File(tmp_path / "staged.h5") as f:
        np.testing.assert_array_equal(f["raw"][...], array[1:9, :, 4:])
    data = DataConfig(eval_raw=spec, voxel_size_nm=VOXEL)
    assert source_files(data, "eval") == [tmp_path / "em"]


def test_a_section_is_decoded_when_a_read_needs_it(tmp_path):
    array = image()
    spec = write_sections(tmp_path / "em", array, compressed={5})
    damaged = tmp_path / "em" / "s6.tif"
    content = damaged.read_bytes()  # the header first, then the compressed image
    damaged.write_bytes(content[:-40] + bytes(40))
    with open_volume(spec) as volume:
        np.testing.assert_array_equal(volume[:5], array[:5])
        with pytest.raises(ChunkReadError, match=f"^{damaged}: section 5 cannot be read"):
            volume[4:7]


def replace_s4(array: np.ndarray):
    return lambda folder: tifffile.imwrite(folder / "s4.tif", array)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            replace_s4(np.zeros((20, 23), np.uint8)),
            VolumeShapeError,
            r"s4.tif: section of shape \(20, 23\) \(y, x\), the first \(s1.tif\) \(20, 24\)",
        ),
        (
            replace_s4(np.zeros((20, 24), np.uint16)),
            VolumeDtypeError,
            r"s4.tif: section of dtype uint16, the first \(s1.tif\) uint8",
        ),
        (
            replace_s4(np.zeros((2, 20, 24), np.uint8)),
            VolumeShapeError,
            "s4.tif: a section is one 2-D greyscale image; this file holds 2",
        ),
        (
            lambda folder: (folder / "s4.tif").write_bytes(b"not a TIFF"),
            VolumeReadError,
            "s4.tif: not a readable TIFF file",
        ),
    ],
)
def test_a_section_unlike_the_others_is_refused_naming_its_file(tmp_path, change, error, message):
    spec = write_sections(tmp_path / "em", image())
    change(tmp_path / "em")
    with pytest.raises(error, match=message):
        read_header(spec, VOXEL)


def test_a_folder_without_sections_or_a_voxel_size_fails_with_one_line(tmp_path):
    with pytest.raises(VolumeFileMissing, match="no folder of TIFF sections"):
        read_raw(f"{tmp_path / 'nothing'}:*.tif", VOXEL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VolumeFileMissing, match=r"no section file matches '\*.tiff'"):
        read_raw(f"{tmp_path / 'empty'}:*.tiff", VOXEL)
    spec = write_sections(tmp_path / "em", image())
    with pytest.raises(VoxelSizeError, match="give the voxel size"):
        read_header(spec)
    uint16 = write_sections(tmp_path / "deep", image().astype(np.uint16) * 200)
    with pytest.raises(VolumeDtypeError, match="raw image must be uint8, got uint16"):
        read_header(uint16, VOXEL)
