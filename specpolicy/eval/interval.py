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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_UNITS = 4  # fewer batches give a bootstrap that mostly resamples one or two: no interval
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
    """The `level` percentile interval of (tokens/s of `a`) / (tokens/s of `b`), each a ratio of totals over
    the batches both timed; None with fewer than MIN_UNITS such batches. Units without a batch pair by order."""
    a_batches, b_batches = _by_batch(a), _by_batch(b)
    common = [batch for batch in a_batches if batch in b_batches]
    n = len(common)
    if n < MIN_UNITS:
        return None
    (tok_a, s_a), (tok_b, s_b) = (np.stack([t[batch] for batch in common]).T for t in (a_batches, b_batches))
    pick = np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))
    ratio = (tok_a[pick].sum(1) / s_a[pick].sum(1)) / (tok_b[pick].sum(1) / s_b[pick].sum(1))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratio, [tail, 100 - tail])
    return float(low), float(high)
