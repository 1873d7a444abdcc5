"""The cost model: step time for any batch and depth, interpolated from a measured latency profile,
and the goodput (tokens kept per second) a depth is expected to give."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from specpolicy.cost.profile import LatencyProfile
from specpolicy.errors import SpecPolicyError


def remembered(method: Callable[..., Any]) -> Callable[..., Any]:
    """A CostModel method answered once per arguments: policies ask the same few questions every decode step,
    and the answers must cost nothing on the clock they price."""
    @functools.wraps(method)
    def answer(self: CostModel, *args: Any, **kwargs: Any) -> Any:
        key = (method.__name__, *args, *kwargs.items())  # no binding of names to positions: it costs ~10 us a call
        if key not in self._known:
            self._known[key] = method(self, *args, **kwargs)
        return self._known[key]
    return answer


class CostModel:
    """Predicts milliseconds per decode step from a `LatencyProfile`.

    A step at depth d >= 1 runs d draft forwards of ~1 token per row and one target forward of d+1
    tokens per row (the verify pass pays for the longest row), plus the profile's measured drafting
    correction (sampling, features, bookkeeping; `cost.overhead`) once per draft position, as sampling and
    features are paid; it is measured at depth 1, where position and step coincide. Depth 0 is one target
    forward of 1 token. Between measured points the curve is interpolated bilinearly (log2 rows x tokens), and
    clamped outside the grid: steps in the curve stay steps, never smoothed into a line. They are real:
    on a 2-core CPU in fp32 (through `nn.Linear`, before `models.skinny`) a SmolLM2-135M forward of 3
    tokens took 126 ms and of 4 tokens 98 ms (the matmul kernel changes with the row count), so the
    goodput rule there prefers depth 3 to 2.
    """

    def __init__(self, profile: LatencyProfile):
        if not isinstance(profile, LatencyProfile):  # a path: "'str' object has no attribute 'rows'"
            raise SpecPolicyError(f"CostModel takes a LatencyProfile, e.g. CostModel(LatencyProfile.load(path)), got "
                                  f"{type(profile).__name__}")
        self.profile = profile
        self._log_rows = np.log2(np.asarray(profile.rows, dtype=float))
        self._tokens = np.asarray(profile.tokens, dtype=float)
        self._grids = {"target": np.asarray(profile.target_ms), "draft": np.asarray(profile.draft_ms)}
        self._overhead = np.asarray(profile.draft_step_overhead_ms or np.zeros(len(profile.rows)), dtype=float)
        self._known: dict[tuple, float | int | np.ndarray] = {}  # `remembered` answers

    @remembered
    def forward_ms(self, model: str, rows: float, tokens: float) -> float:
        grid = self._grids[model]
        per_rows = [np.interp(tokens, self._tokens, grid[i]) for i in range(len(self._log_rows))]
        return float(np.interp(math.log2(max(rows, 1)), self._log_rows, per_rows))

    @remembered
    def draft_ms(self, rows: float) -> float:
        """One draft position: a 1-token draft forward and its share of the drafting overhead."""
        overhead = float(np.interp(math.log2(max(rows, 1)), self._log_rows, self._overhead))
        return self.forward_ms("draft", rows, 1) + overhead

    def catch_up_ms(self, rows: float, tokens: int) -> float:
        """What a draft forward that must first read `tokens` committed tokens per row (a prompt, or what was
        committed while nobody drafted) costs beyond a 1-token one. Past the grid's longest chunk the tokens
        in flight are what cost, so the chunk is priced as more rows of that length, and past the grid's
        largest cell in proportion to it."""
        longest, most = self.profile.tokens[-1], self.profile.rows[-1]
        if tokens <= longest:
            ms = self.forward_ms("draft", rows, tokens)
        elif rows * tokens <= most * longest:
            ms = self.forward_ms("draft", rows * tokens / longest, longest)
        else:
            ms = self.forward_ms("draft", most, longest) * rows * tokens / (most * longest)
        return max(ms - self.forward_ms("draft", rows, 1), 0.0)

    def step_ms(self, rows: float, depth: int) -> float:
        return depth * self.draft_ms(rows) + self.forward_ms("target", rows, depth + 1)

    @remembered
    def step_times(self, rows: float, depth: int) -> np.ndarray:
        """step_ms for depths 0..depth, as one array."""
        return np.array([self.step_ms(rows, d) for d in range(depth + 1)])

    def goodput(self, rows: float, depth: int, expected_tokens: float) -> float:
        """Tokens per second for `rows` rows keeping `expected_tokens` each per step (bonus included)."""
        return rows * expected_tokens / self.step_ms(rows, depth) * 1e3

    @remembered
    def max_useful_depth(self, rows: float, limit: int) -> int:
        """The deepest depth <= limit that could beat not drafting, were every draft accepted: no acceptance
        makes a deeper one pay, so drafting that deep (or at all, if 0) is waste at this load. Every depth is
        tried, not only up to the first that pays less than the one before: the curve's steps can make 4
        tokens cheaper than 3, and then depth 3 pays where depth 2 does not."""
        plain = self.goodput(rows, 0, 1)
        return max((d for d in range(1, limit + 1) if self.goodput(rows, d, d + 1) > plain), default=0)
