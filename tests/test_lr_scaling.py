"""Learning-rate scaling rules of Goyal et al. and Dong et al., checked against the formulas."""

import math

import pytest

from pipeline.lr_scaling import scaled_learning_rate, target_learning_rate

BASE = 0.001


@pytest.mark.parametrize("workers", [1, 2, 8, 16, 64, 1024])
def test_targets(workers):
    assert target_learning_rate(BASE, workers, "none") == BASE
    assert target_learning_rate(BASE, workers, "linear") == pytest.approx(BASE * workers)
    assert target_learning_rate(BASE, workers, "sqrt") == pytest.approx(BASE * math.sqrt(workers))


def test_auto_is_linear_up_to_16_then_square_root():
    assert target_learning_rate(BASE, 16, "auto") == pytest.approx(0.016)
    assert target_learning_rate(BASE, 64, "auto") == pytest.approx(
        0.001 * 16 * 2
    )  # sqrt(64/16) = 2
    assert target_learning_rate(BASE, 1024, "auto") == pytest.approx(0.001 * 16 * 8)


def test_warmup_ramps_linearly_from_base_to_target():
    rates = [scaled_learning_rate(BASE, 8, "linear_warmup", s, warmup_steps=4) for s in range(6)]
    assert rates == pytest.approx([0.001, 0.00275, 0.0045, 0.00625, 0.008, 0.008])
    assert scaled_learning_rate(BASE, 8, "auto", 2, warmup_steps=4) == pytest.approx(0.0045)


def test_policies_without_warmup_start_at_the_target():
    assert scaled_learning_rate(BASE, 8, "linear", 0, warmup_steps=100) == pytest.approx(0.008)


def test_unknown_policy_and_bad_worker_count():
    with pytest.raises(ValueError, match="lr_policy must be one of"):
        target_learning_rate(BASE, 2, "cubic")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        target_learning_rate(BASE, 0, "linear")


def test_staircase_decay_multiplies_the_scaled_rate_every_interval():
    rates = [
        scaled_learning_rate(BASE, 2, "linear", s, 0, decay_factor=0.1, decay_every_steps=10)
        for s in (0, 9, 10, 19, 20)
    ]
    assert rates == pytest.approx([0.002, 0.002, 0.0002, 0.0002, 0.00002])
    assert scaled_learning_rate(BASE, 2, "linear", 10**6, 0, 0.1, 0) == pytest.approx(0.002)
