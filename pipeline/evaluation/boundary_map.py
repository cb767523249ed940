"""The boundary map the second pass's fill floods (pipeline.secondpass.agglomeration.filled_part),
predicted box by box by the boundary forest learned for the learned watershed."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np

from pipeline.data.staging import read_staged
from pipeline.data.volumes import open_volume

Box = tuple[slice, ...]


@contextmanager
def boundary_reader(
    boundary: Sequence[str | Path], shape: Sequence[int]
) -> Iterator[Callable[[Box], np.ndarray] | None]:
    """With `boundary` (the forest, the staged volume whose image it reads), a reader of the
    volume's boundary map (box -> P(boundary)); without (the fill is off), None. The forest is
    loaded at the first box: a task that rewrites no part loads none."""
    if not boundary:
        yield None
        return
    # scikit-learn takes seconds to import: not in a task that does not fill.
    from pipeline.evaluation.evaluate import load_boundary_forest
    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, box_boundary_probability

    forest_path, volume = boundary
    forest = cache(lambda: load_boundary_forest(forest_path))
    with open_volume(read_staged(volume).raw) as raw:
        yield lambda box: box_boundary_probability(
            forest(), raw.__getitem__, box, shape, BoundaryForestConfig()
        )
