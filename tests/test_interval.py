"""Speedup intervals: a paired bootstrap over side-by-side units, so drift common to both decoders of a
unit cancels, while noise between them widens the interval."""

from __future__ import annotations

import numpy as np
import pytest

from specpolicy.eval.interval import MIN_UNITS, expanded_tail, ratio_interval


def test_drift_that_hits_both_decoders_of_a_unit_cancels():
    """Units 10x apart in speed (a slow spell, hard prompts) with a policy exactly 1.1x ar in each: resampling
    units unpaired would spread the ratio over ~0.3-3x."""
    seconds = np.geomspace(1.0, 10.0, 12)
    ar = [(100, s) for s in seconds]
    policy = [(110, s) for s in seconds]
    low, high = ratio_interval(policy, ar)
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_noise_between_decoders_widens_the_interval_around_the_ratio_of_totals():
    rng = np.random.default_rng(1)
    ar = [(100, 1.0) for _ in range(16)]
    tie = [(100, float(s)) for s in rng.normal(1.0, 0.05, 16)]
    low, high = ratio_interval(tie, ar)
    assert low < 1.0 < high and high - low > 0.02
    faster = [(200, s) for _, s in tie]
    low, high = ratio_interval(faster, ar)
    assert 1.8 < low < 2.0 < high < 2.2


def test_the_tails_are_hesterbergs_expanded_ones():
    """Phi(sqrt(n / (n - 1)) * t(n - 1, 0.025)): at 6 batches sqrt(6/5) * -2.5706 = -2.8159, so 0.243% per tail;
    the simulation below is one-sided and too loose to tell this from the plain 2.5%."""
    assert expanded_tail(6) == pytest.approx(0.2432, abs=1e-4)
    assert expanded_tail(16) == pytest.approx(1.3856, abs=1e-4)
    assert expanded_tail(100_000) == pytest.approx(2.5, abs=1e-3)


def test_too_few_units_give_no_interval():
    units = [(100, 1.0)] * (MIN_UNITS - 1)
    assert ratio_interval(units, units) is None
    assert ratio_interval(units + [(100, 1.0)], units + [(50, 1.0)]) is not None


def test_passes_over_the_same_batches_are_not_new_draws():
    """Three passes over six batches resample six batches, not 18 units: the interval is the one pass's."""
    rng = np.random.default_rng(2)
    ar = [(100, 1.0, b) for b in range(MIN_UNITS)]
    policy = [(100, float(s), b) for b, s in enumerate(rng.normal(1.0, 0.05, MIN_UNITS))]
    interval = ratio_interval(policy, ar)
    assert interval is not None and ratio_interval(policy * 3, ar * 3) == pytest.approx(interval)
    assert ratio_interval(policy[:-1] * 4, ar[:-1] * 4) is None


@pytest.mark.parametrize("batches", [MIN_UNITS, 8, 16])
def test_two_identical_decoders_differ_about_one_time_in_twenty(batches):
    """The 95% interval of a tie must exclude 1.0x ~5% of the time. A plain percentile bootstrap did so in
    13% of these runs at 6 batches, 11% at 8 and 8.5% at 16 (timing noise of 20%, batches 2.7x apart)."""
    rng = np.random.default_rng(3)
    runs, flagged = 300, 0
    for _ in range(runs):
        batch = np.exp(rng.normal(0.0, 1.0, batches))  # a batch's difficulty, shared by both decoders
        a, b = ([(100, float(s), i) for i, s in enumerate(batch * rng.lognormal(0.0, 0.2, batches))]
                for _ in range(2))
        low, high = ratio_interval(a, b)
        flagged += not low <= 1.0 <= high
    assert flagged / runs < 0.085
