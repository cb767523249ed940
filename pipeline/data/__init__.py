"""Volumes in and out (HDF5, zarr, Neuroglancer precomputed), the built-in synthetic data set, and
the data-staging stage."""
