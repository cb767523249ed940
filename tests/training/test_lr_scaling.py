"""Learning-rate scaling rules of Goyal et al. and Dong et al., checked against the formulas."""

import math

import pytest

from pipeline.training.lr_scaling import target_learning_rate, world_learning_rate

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
    rates = [
        world_learning_rate(BASE, [(0, 8)], "linear_warmup", s, warmup_steps=4) for s in range(6)
    ]
    assert rates == pytest.approx([0.001, 0.00275, 0.0045, 0.00625, 0.008, 0.008])
    assert world_learning_rate(BASE, [(0, 8)], "auto", 2, warmup_steps=4) == pytest.approx(0.0045)


def test_policies_without_warmup_start_at_the_target():
    assert world_learning_rate(BASE, [(0, 8)], "linear", 0, warmup_steps=100) == pytest.approx(
        0.008
    )


def test_unknown_policy_and_bad_worker_count():
    with pytest.raises(ValueError, match="lr_policy must be one of"):
        target_learning_rate(BASE, 2, "cubic")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        target_learning_rate(BASE, 0, "linear")


def test_staircase_decay_multiplies_the_scaled_rate_every_interval():
    rates = [
        world_learning_rate(BASE, [(0, 2)], "linear", s, 0, decay_factor=0.1, decay_every_steps=10)
        for s in (0, 9, 10, 19, 20)
    ]
    assert rates == pytest.approx([0.002, 0.002, 0.0002, 0.0002, 0.00002])
    assert world_learning_rate(BASE, [(0, 2)], "linear", 10**6, 0, 0.1, 0) == pytest.approx(0.002)


class TestAnotherWorldSize:
    """A run that goes on at another world size (pipeline.training.trainer) follows the new size's rule."""

    def test_a_larger_world_ramps_up_again_from_the_rate_it_had(self):
        # 2 ranks warmed up to 0.002 by step 4; 8 ranks from step 10 ramp 0.002 -> 0.008 over 4.
        worlds = [(0, 2), (10, 8)]
        rates = [
            world_learning_rate(BASE, worlds, "linear_warmup", s, warmup_steps=4)
            for s in (9, 10, 11, 13, 14, 20)
        ]
        assert rates == pytest.approx([0.002, 0.002, 0.0035, 0.0065, 0.008, 0.008])

    def test_a_smaller_world_takes_its_lower_rate_at_once(self):
        worlds = [(0, 8), (10, 2)]
        assert world_learning_rate(BASE, worlds, "auto", 10, 4) == pytest.approx(0.002)
        assert world_learning_rate(BASE, worlds, "auto", 9, 4) == pytest.approx(0.008)

    def test_a_change_during_the_first_warm_up_ramps_on_from_where_it_was(self):
        # 8 ranks reach 0.00275 at step 1 of 4; 16 ranks ramp from there to 0.016 over 4 steps.
        worlds = [(0, 8), (1, 16)]
        rate = world_learning_rate(BASE, worlds, "linear_warmup", 3, warmup_steps=4)
        assert rate == pytest.approx(0.00275 + (0.016 - 0.00275) * 2 / 4)

    def test_decay_applies_on_top_of_the_ramps(self):
        # 4 ranks: a ramp 0.001 -> 0.004 over 100 steps, halved every 100 steps.
        rates = [world_learning_rate(BASE, [(0, 4)], "auto", s, 100, 0.5, 100) for s in (50, 250)]
        assert rates == pytest.approx([0.0025, 0.004 * 0.25])
        decayed = world_learning_rate(BASE, [(0, 2), (10, 1)], "linear", 25, 0, 0.1, 20)
        assert decayed == pytest.approx(0.0001)

    def test_the_first_stretch_must_begin_at_step_0(self):
        with pytest.raises(ValueError, match="worlds must begin at step 0"):
            world_learning_rate(BASE, [(5, 2)], "linear", 6, 0)
