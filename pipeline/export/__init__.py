"""Neuroglancer precomputed layers: the export stage, its folder layout, shards, meshes, the viewer."""
