"""Speedup intervals: a paired bootstrap over side-by-side units, so drift common to both decoders of a
unit cancels, while noise between them widens the interval."""

from __future__ import annotations

import numpy as np
import pytest

from specpolicy.eval.interval import MIN_UNITS, ratio_interval


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


def test_too_few_units_give_no_interval():
    units = [(100, 1.0)] * (MIN_UNITS - 1)
    assert ratio_interval(units, units) is None
    assert ratio_interval(units + [(100, 1.0)], units + [(50, 1.0)]) is not None


def test_passes_over_the_same_batches_are_not_new_draws():
    """Three passes over four batches resample four batches, not twelve units: the interval is the one pass's."""
    rng = np.random.default_rng(2)
    ar = [(100, 1.0, b) for b in range(4)]
    policy = [(100, float(s), b) for b, s in enumerate(rng.normal(1.0, 0.05, 4))]
    assert ratio_interval(policy * 3, ar * 3) == pytest.approx(ratio_interval(policy, ar))
    assert ratio_interval(policy[:3] * 4, ar[:3] * 4) is None
