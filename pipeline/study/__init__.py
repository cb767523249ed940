"""The paper's study (Dong et al., SC'19): the grid of training cells, its analysis and report."""
