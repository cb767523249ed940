"""Scores against ground truth, the watershed baselines, and the evaluation stage."""
