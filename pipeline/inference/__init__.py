"""Flood-filling inference: the seed loop, blockwise segmentation and stitching of the blocks."""
