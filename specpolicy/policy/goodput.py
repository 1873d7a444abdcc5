"""Goodput-maximising depth: keep drafting a row while one more token is expected to raise the row's
tokens per second under the cost model (in the spirit of SmartSpec, Liu et al. 2024).

At position i a row that expects E tokens from this step (bonus included) and would add c_i (the
probability that all of its drafts up to i are accepted) keeps drafting iff

    (E + c_i) / T(rows, i)  >  E / T(rows, i - 1)

where T is the cost model's step time at the current load. Acceptance estimates come from an
`estimator`: the draft's own top-1 probability (`goodput`), or the trained depth head (`learned`).
One mechanism, two estimators.

Before drafting, each row's budget (the "draft at all" decision, which must not cost a draft
forward) is the depth that maximises goodput, sum_i alpha^i tokens per T(rows, k), at the row's
estimated per-token acceptance alpha: a Beta-Bernoulli mean over the tokens it has had verified,
starting from `prior` (the learned policy takes it from its rollouts) with the weight of `strength`
tokens. Evidence fades by `memory` per step, so an estimate from long ago grows uncertain again. A
row whose estimate says depth 0 drafts one token only when an optimistic estimate (`optimism`
standard deviations above the mean) says drafting could pay: a hopeless draft at this load costs
nothing, a row near the break-even point keeps checking, and no probing schedule is needed.
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
                 dtype: str = "float32", prior: float | None = None, strength: float = 4.0, memory: float = 0.95,
                 optimism: float = 1.0):
        if not isinstance(profile, LatencyProfile):
            profile = LatencyProfile.load(profile_file(profile, device, dtype))
        self.cost = CostModel(profile)
        self.max_depth = k
        self.estimator = estimator or DraftConfidence()
        # the acceptance a row is assumed to have before it has drafted: the head's rollout statistics, or 0.5
        self.prior = prior if prior is not None else getattr(self.estimator, "prior", 0.5)
        self.strength, self.memory, self.optimism = strength, memory, optimism
        self._expected = self._reach = self._accepted = self._verified = self._budget = torch.empty(0)

    def reset(self, batch_size: int) -> None:
        self._accepted = torch.zeros(batch_size, dtype=torch.float64)  # faded counts of accepted draft tokens
        self._verified = torch.zeros(batch_size, dtype=torch.float64)  # ... and of draft tokens verified

    def budget(self, state: StepState) -> torch.Tensor:
        rows = state.row_ids.cpu()
        self._accepted[rows] *= self.memory
        self._verified[rows] *= self.memory
        cap = self.cost.max_useful_depth(state.rows, self.max_depth)  # even perfect acceptance loses beyond it
        if cap == 0:
            self._budget = torch.zeros(len(rows), dtype=torch.long)
            return torch.zeros_like(state.generated)
        n = self._verified[rows] + self.strength
        alpha = (self._accepted[rows] + self.strength * self.prior) / n
        hopeful = (alpha + self.optimism * (alpha * (1 - alpha) / n).sqrt()).clamp(max=1)
        best = self._best_depth(torch.stack([alpha, hopeful]), state.rows, cap)
        self._budget = torch.where(best[0] > 0, best[0], best[1].clamp(max=1))
        return self._budget.to(state.generated.device)

    def _best_depth(self, alpha: torch.Tensor, rows: int, cap: int) -> torch.Tensor:
        """The goodput-maximising depth <= cap for each per-token acceptance in `alpha` [...]."""
        depths = torch.arange(cap + 1)
        step_ms = torch.tensor([self.cost.step_ms(rows, int(d)) for d in depths], dtype=torch.float64)
        expected = (alpha[..., None] ** depths).cumsum(-1)  # tokens per step at each depth, bonus included
        return (expected / step_ms).argmax(-1)

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Per-token evidence of this step: `accepted` successes, then one failure if the row stopped at a
        rejection (accepted < drafted), or if it paid a draft forward and `keep` kept nothing (a row that
        drafts only to be stopped at position 1 gains nothing, and must learn that too)."""
        rows, drafted, accepted = state.row_ids.cpu(), drafted.cpu().double(), accepted.cpu().double()
        wasted = (self._budget > 0) & (drafted == 0)
        self._accepted[rows] += accepted
        self._verified[rows] += accepted + ((accepted < drafted) | wasted).double()

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
