"""The learned watershed as second-pass evidence: which touching segments it joins, and that
part-by-part sums give the whole volume's decision."""

import numpy as np

from pipeline.evaluation.scores import OverlapCounts
from pipeline.secondpass.watershed_evidence import (
    contact_boundary_sums,
    dominant_basins,
    summed_contacts,
    supported_pairs,
)


def three_pieces() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A bar of 3 x 4 x 12 voxels: FFN cut it into segments 1, 2 and 3 along x; the watershed
    holds 1 and 2 in basin 7 and 3 in basin 8; the forest sees a boundary only between 2 and 3."""
    segmentation = np.zeros((3, 4, 12), np.uint64)
    segmentation[..., :4], segmentation[..., 4:8], segmentation[..., 8:] = 1, 2, 3
    watershed = np.where(segmentation == 3, 8, 7).astype(np.uint64)
    watershed[0, 0, 0] = 9  # one voxel of segment 1 elsewhere: its share is 47 of 48
    boundary = np.full(segmentation.shape, 0.1, np.float32)
    boundary[..., 7:9] = 0.9
    return segmentation, watershed, boundary


def test_each_segment_gets_the_basin_holding_most_of_it_and_that_share():
    segmentation, watershed, _ = three_pieces()
    segments, basins, shares = dominant_basins(OverlapCounts.of(segmentation, watershed))
    assert segments.tolist() == [1, 2, 3]
    assert basins.tolist() == [7, 7, 8]
    assert np.allclose(shares, [47 / 48, 1, 1])


def test_unsegmented_voxels_count_in_a_segments_share_but_never_as_its_basin():
    segment = np.ones((1, 1, 10), np.uint64)
    basins = np.zeros((1, 1, 10), np.uint64)
    basins[..., :3] = 5  # 7 of its 10 voxels in no basin
    _, basin, share = dominant_basins(OverlapCounts.of(segment, basins))
    assert basin.tolist() == [5] and np.allclose(share, [0.3])


def test_only_segments_in_one_basin_with_little_boundary_between_them_are_joined():
    segmentation, watershed, boundary = three_pieces()
    pairs, sums, faces = contact_boundary_sums(segmentation, boundary)
    assert pairs.tolist() == [[1, 2], [2, 3]]
    assert faces.tolist() == [12, 12]  # a 3 x 4 face each
    mean = sums / faces
    assert np.allclose(mean, [0.1, 0.9])
    dominant = dominant_basins(OverlapCounts.of(segmentation, watershed))
    assert supported_pairs(pairs, mean, dominant, 0.9, 0.5).tolist() == [[1, 2]]
    # Stricter than segment 1's share, or than the contact's P(boundary): nothing is joined.
    assert len(supported_pairs(pairs, mean, dominant, 0.99, 0.5)) == 0
    assert len(supported_pairs(pairs, mean, dominant, 0.9, 0.05)) == 0
    # The basins differ for 2 and 3: not joined even if no boundary were seen between them.
    assert supported_pairs(pairs, np.zeros(2), dominant, 0.5, 1.0).tolist() == [[1, 2]]


def test_parts_summed_decide_as_the_whole_volume():
    segmentation, watershed, boundary = three_pieces()
    whole = contact_boundary_sums(segmentation, boundary)
    # Two parts along x that overlap by one voxel, so each face lies in exactly one part.
    left = contact_boundary_sums(segmentation[..., :6], boundary[..., :6])
    right = contact_boundary_sums(segmentation[..., 5:], boundary[..., 5:])
    summed = summed_contacts(
        np.concatenate([left[0], right[0]]),
        np.concatenate([left[1], right[1]]),
        np.concatenate([left[2], right[2]]),
    )
    for a, b in zip(whole, summed, strict=True):
        assert np.allclose(a, b)
    parts = OverlapCounts.of(segmentation[..., :6], watershed[..., :6]) + OverlapCounts.of(
        segmentation[..., 6:], watershed[..., 6:]
    )
    for a, b in zip(
        dominant_basins(OverlapCounts.of(segmentation, watershed)),
        dominant_basins(parts),
        strict=True,
    ):
        assert np.allclose(a, b)


def test_segments_the_overlaps_never_saw_are_not_joined():
    segmentation, watershed, _ = three_pieces()
    dominant = dominant_basins(OverlapCounts.of(segmentation, watershed))
    assert len(supported_pairs(np.array([[1, 4], [5, 6]]), np.zeros(2), dominant, 0.0, 1.0)) == 0
