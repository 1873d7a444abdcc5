"""Goodput-maximising depth: keep drafting a row while one more token is expected to raise the row's
tokens per second under the cost model (in the spirit of SmartSpec, Liu et al. 2024).

At position i a row that expects E tokens from this step (bonus included) and would add c_i (the
probability that all of its drafts up to i are accepted) keeps drafting iff

    (E + c_i) / T(rows, i)  >  E / T(rows, i - 1)

where T is the cost model's step time at the current load. Acceptance estimates come from an
`estimator`: the draft's own top-1 probability (`goodput`), or the trained depth head (`learned`).
One mechanism, two estimators.

Before drafting, each row's budget is the depth that maximises goodput if its tokens are accepted at
the rate it has shown so far (a moving average, starting from `prior`, which the learned policy takes
from its rollouts): sum_i alpha^i tokens per T(rows, k). A
row whose history says speculation does not pay gets depth 0 and costs no draft forward at all; every
`probe_every` such steps it drafts one token to refresh its estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specpolicy.cost.model import CostModel
from specpolicy.cost.profile import LatencyProfile, profile_file
from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.policy.head import DepthHead
from specpolicy.rollout.features import COLUMN


class DraftConfidence:
    """The draft's top-1 probability as its own acceptance estimate (exact for a perfect draft)."""

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, COLUMN["top1"]]


@dataclass
class HeadEstimator:
    """The trained depth head's acceptance probability."""

    path: str
    head: DepthHead = field(init=False)

    def __post_init__(self) -> None:
        self.head = DepthHead.load(self.path)

    @property
    def prior(self) -> float:
        """How often the draft's first token was accepted in the rollouts the head learned from."""
        return self.head.config.prior

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        self.head.to(features.device)
        return torch.sigmoid(self.head(features))


class GoodputPolicy(DepthPolicy):
    """`profile` is a LatencyProfile, or the profile stage's directory (the file for `device`/`dtype` is used)."""

    def __init__(self, profile: str | Path | LatencyProfile, k: int = 8,
                 estimator: DraftConfidence | HeadEstimator | None = None, device: str = "auto",
                 dtype: str = "float32", prior: float | None = None, smoothing: float = 0.3, probe_every: int = 8):
        if not isinstance(profile, LatencyProfile):
            profile = LatencyProfile.load(profile_file(profile, device, dtype))
        self.cost = CostModel(profile)
        self.max_depth = k
        self.estimator = estimator or DraftConfidence()
        # the acceptance a row is assumed to have before it has drafted: the head's rollout statistics, or 0.5
        self.prior = prior if prior is not None else getattr(self.estimator, "prior", 0.5)
        self.smoothing, self.probe_every = smoothing, probe_every
        self._expected = self._reach = self._alpha = self._idle = torch.empty(0)

    def reset(self, batch_size: int) -> None:
        self._alpha = torch.full((batch_size,), self.prior)
        self._idle = torch.zeros(batch_size, dtype=torch.long)

    def budget(self, state: StepState) -> torch.Tensor:
        cap = self.cost.max_useful_depth(state.rows, self.max_depth)  # even perfect acceptance loses beyond it
        rows = state.row_ids.cpu()
        depths = torch.arange(cap + 1)
        step_ms = torch.tensor([self.cost.step_ms(state.rows, int(d)) for d in depths], dtype=torch.float64)
        alpha = self._alpha[rows].double()[:, None]  # [A, 1]
        expected = (alpha ** depths).cumsum(-1)  # [A, cap+1]: tokens per step at each depth, bonus included
        best = (expected / step_ms).argmax(-1)
        probe = (best == 0) & (self._idle[rows] >= self.probe_every) & (cap > 0)
        best = torch.where(probe, 1, best)
        self._idle[rows] = torch.where(best == 0, self._idle[rows] + 1, 0)
        return best.to(state.generated.device)

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Per-token acceptance seen this step: a accepted of k drafted, a rejection after them if a < k."""
        rows, drafted, accepted = state.row_ids.cpu(), drafted.cpu().double(), accepted.cpu().double()
        seen = accepted / (accepted + (accepted < drafted).double()).clamp(min=1)
        update = drafted > 0
        alpha = self._alpha[rows]
        self._alpha[rows] = torch.where(update, (1 - self.smoothing) * alpha + self.smoothing * seen.float(), alpha)

    def keep(self, features: torch.Tensor, tokens: torch.Tensor, state: StepState, position: int) -> torch.Tensor:
        if position == 1:
            self._expected = torch.ones(features.shape[0], device=features.device)  # the bonus token
            self._reach = torch.ones_like(self._expected)
        self._reach = self._reach * self.estimator(features)  # P(drafts 1..position all accepted)
        before = self.cost.step_ms(state.rows, position - 1)
        after = self.cost.step_ms(state.rows, position)
        keep = (self._expected + self._reach) * before > self._expected * after
        self._expected = self._expected + self._reach * keep
        return keep
