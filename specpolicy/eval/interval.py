"""How sure a speedup is: a paired bootstrap over the units an evaluation timed side by side.

Each unit is one batch of one pass, decoded by every decoder in turn (`runner.side_by_side`), so the
machine's drift and the prompts' difficulty hit every decoder of a unit alike. Resampling keeps those
pairs together, and keeps every pass over the same batch together too (a unit's third element names its
batch): another pass over the same prompts draws new machine noise but no new prompts, so counting passes
as draws would make the interval as narrow as the passes are many. The interval says how far another draw
of batches, and of the machine's noise, could move a ratio of totals, which is how the report defines
speedup. On the 2-core VMs here
the demo's `learned` read 0.90x plain decoding at batch 8 in one run and 1.02x in a three-pass rerun of
the same prompts: a figure whose interval holds 1.0 is a tie, not a loss or a win.

A percentile bootstrap over few batches is too narrow: the spread of n resampled batches is that of n
draws divided by n, not n - 1, and its percentiles are normal, not Student-t, ones. Simulated with
two identical decoders and 20% timing noise, its 95% interval excluded 1.0x in 22% of runs at 4
batches, 11% at 8 and 9% at 16. The expanded percentile interval (Hesterberg 2015, "What Teachers
Should Know About the Bootstrap", The American Statistician 69(4), sec. 4.3) reads the percentiles
at the tail probability where a normal quantile, widened by sqrt(n / (n - 1)), meets Student's t
with n - 1 degrees of freedom: 6.5% at 6 batches, 5.5% at 8, 4% at 16 in the same simulation
(`tests/test_interval.py` checks it). Below MIN_UNITS batches no interval is trustworthy (10-15%).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

MIN_UNITS = 6  # fewer batches: even the expanded interval excludes a tie 10-15% of the time, not 5%
RESAMPLES = 4000

Unit = Sequence[float]  # (tokens, seconds[, batch]) of one decoder in one unit; without a batch, its own


def _by_batch(units: Sequence[Unit]) -> dict[float, np.ndarray]:
    """(tokens, seconds) summed over the passes of each batch."""
    totals: dict[float, np.ndarray] = {}
    for i, unit in enumerate(units):
        batch = unit[2] if len(unit) > 2 else -1 - i
        totals[batch] = totals.get(batch, np.zeros(2)) + np.asarray(unit[:2], dtype=float)
    return totals


def ratio_interval(a: Sequence[Unit], b: Sequence[Unit], level: float = 0.95,
                   seed: int = 0) -> tuple[float, float] | None:
    """The `level` expanded percentile interval of (tokens/s of `a`) / (tokens/s of `b`), each a ratio of totals
    over the batches both timed; None with fewer than MIN_UNITS such batches. Units without a batch pair by
    order."""
    a_batches, b_batches = _by_batch(a), _by_batch(b)
    common = [batch for batch in a_batches if batch in b_batches]
    n = len(common)
    if n < MIN_UNITS:
        return None
    (tok_a, s_a), (tok_b, s_b) = (np.stack([t[batch] for batch in common]).T for t in (a_batches, b_batches))
    pick = np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))
    ratio = (tok_a[pick].sum(1) / s_a[pick].sum(1)) / (tok_b[pick].sum(1) / s_b[pick].sum(1))
    tail = expanded_tail(n, level)
    low, high = np.percentile(ratio, [tail, 100 - tail])
    return float(low), float(high)


def expanded_tail(n: int, level: float = 0.95) -> float:
    """The percent of resamples each end of a `level` interval over n batches leaves out: 0.24 at 6 batches for
    95%, against the plain percentile interval's 2.5, which it nears as n grows."""
    return 100 * stats.norm.cdf(np.sqrt(n / (n - 1)) * stats.t.ppf((1 - level) / 2, n - 1))
