"""How sure a speedup is: a paired bootstrap over the units an evaluation timed side by side.

Each unit is one batch of one pass, decoded by every decoder in turn (`runner.side_by_side`), so the
machine's drift and the prompts' difficulty hit every decoder of a unit alike. Resampling whole units
keeps those pairs together: the interval says how far another draw of batches, and of the machine's
noise, could move a ratio of totals, which is how the report defines speedup. On the 2-core VMs here
the demo's `learned` read 0.90x plain decoding at batch 8 in one run and 1.02x in a three-pass rerun of
the same prompts: a figure whose interval holds 1.0 is a tie, not a loss or a win.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_UNITS = 4  # fewer units give a bootstrap that mostly resamples one or two batches: no interval
RESAMPLES = 4000

Unit = Sequence[float]  # (tokens, seconds) of one decoder in one unit


def ratio_interval(a: Sequence[Unit], b: Sequence[Unit], level: float = 0.95,
                   seed: int = 0) -> tuple[float, float] | None:
    """The `level` percentile interval of (tokens/s of `a`) / (tokens/s of `b`), each a ratio of totals over
    the same units in the same order; None with fewer than MIN_UNITS units (or none in common)."""
    n = min(len(a), len(b))
    if n < MIN_UNITS:
        return None
    (tok_a, s_a), (tok_b, s_b) = np.asarray(a[:n], dtype=float).T, np.asarray(b[:n], dtype=float).T
    pick = np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))
    ratio = (tok_a[pick].sum(1) / s_a[pick].sum(1)) / (tok_b[pick].sum(1) / s_b[pick].sum(1))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratio, [tail, 100 - tail])
    return float(low), float(high)
