"""Goodput-maximising depth: keep drafting while one more token is expected to raise the batch's
tokens per second under the cost model (in the spirit of SmartSpec, Liu et al. 2024).

A step's time is shared: the verify pass is one forward as wide as the deepest row, and every draft
forward reads every row. So depth is an economic decision for the batch, made from each row's own
acceptance estimate: at position i, with the rows expecting E tokens in all from this step (bonus
included) and c_i more from x_i (the sum over rows of the probability that all of a row's drafts up to
i are accepted), the batch keeps x_i iff

    (E + c_i) / T_keep  >  E / T_stop,    T_stop = i D + V(i),   T_keep = i D + V(i + 1) [+ D]

(E and E + c_i counted as the slowest row sets them, below), where D is a draft forward and V(n) a
verify pass of n tokens per row at the current load (cost model), and the last D is paid only if the
budget goes deeper (the draft then reads x_i). The i draft forwards that produced x_1..x_i are spent
whatever is decided now, so both times hold them: leaving them out
made `learned` stop 2 of 3 drafted tokens at batch 1 after paying for them (1.02x plain decoding,
against 1.08x for drafting one token always). Deciding per row instead of per batch (E and c of one
row) lets one confident row among 32 widen the verify pass for all of them (with that rule, `learned`
drafted 0.15 tokens per row-step at batch 32 and ran at 0.73x of plain decoding). Acceptance estimates
come from an `estimator`: the draft's own top-1 probability (`goodput`), or the trained depth head
(`learned`). One mechanism, two estimators.

Before drafting, the batch's budget (the "draft at all" decision, which must not cost a draft
forward) is the depth that maximises goodput, sum over rows and i of alpha_r^i tokens per T(rows, k),
at each row's estimated per-token acceptance alpha_r: a Beta-Bernoulli mean over the tokens it has had
verified, starting from `prior` (the learned policy takes it from its rollouts) with the weight of
`strength` tokens. Evidence fades by `memory` per step, so an estimate from long ago grows uncertain
again. When the estimates say depth 0, the batch drafts one token only if optimistic estimates
(`optimism` standard deviations above the mean) say drafting could pay: a hopeless draft at this load
costs nothing, a batch near the break-even point keeps checking, and no probing schedule is needed.

A batch is done when its last row is (rows leave the engine's batch, none join), and speculation makes
rows uneven: with acceptance 0.3, one token drafted per step, rows decoded alone needed 18.7 steps for 24
tokens and pairs of rows 19.75 (SmolLM2-135M, validation prompts), which turned a 3% gain per row-step
at batch 2 into a 4% loss. So a step's tokens are discounted by the wait for the slowest row
(`batch_tokens`): nothing for one row or no known length, more for more rows and for a more variable
draft, less as the remaining length grows. `wait_for_slowest=False` drops the discount, for batches
whose finished rows are replaced at once (continuous batching), where tokens per step is the goal.

A draft that has not drafted yet has not read the prompt either, and its first drafting step reads it:
13 ms per row here, 3% of decoding 24 tokens at batch 1. The budget spreads that catch-up over the
steps left (`CostModel.catch_up_ms`), so drafting starts only where the rest of the row can repay it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specpolicy.cost.model import CostModel
from specpolicy.cost.profile import LatencyProfile, profile_file
from specpolicy.errors import SpecPolicyError, check_bool, check_depth, check_number
from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.policy.head import DepthHead
from specpolicy.rollout.features import COLUMN

log = logging.getLogger("specpolicy")


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: 0 for one, 1/sqrt(pi) for two, ~2.07 for 32."""
    if n <= 1:
        return 0.0
    x = torch.linspace(-12.0, 12.0, 24001, dtype=torch.float64)
    density = n * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi) * torch.special.ndtr(x) ** (n - 1)
    return float(torch.trapezoid(x * density, x))


def batch_tokens(mean: float | np.ndarray, var: float | np.ndarray, rows: int,
                 remaining: int | None) -> float | np.ndarray:
    """Tokens per step the slowest of `rows` rows sets for the batch, when each row keeps `mean` tokens
    per step with variance `var` and the batch ends once a row has made `remaining` more. A row needs
    about remaining / mean steps, give or take sqrt(remaining var / mean^3) (renewal count, normal
    approximation); the last of `rows` rows needs `expected_max_normal(rows)` such deviations more."""
    if remaining is None or rows <= 1:
        return mean
    return mean / (1 + expected_max_normal(rows) * np.sqrt(np.maximum(var, 0.0) / (remaining * mean)))


class DraftConfidence:
    """The draft's top-1 probability as its own estimate of greedy acceptance (exact for a perfect draft); sampled,
    a token is kept with probability min(1, q/p), which it does not estimate (evaluate says so)."""

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

    @property
    def positions(self) -> int | None:
        """The deepest draft position the head learned from."""
        return self.head.config.positions

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        if self.head.index.device != features.device:
            self.head.to(features.device)
        return torch.sigmoid(self.head(features))


class GoodputPolicy(DepthPolicy):
    """`profile` is a LatencyProfile, a profile's .json file, or the profile stage's directory (the file for
    `device`, `dtype` and `skinny_gemm` is used: the defaults are those of the sources and conf/policy/).
    `estimator` maps draft features [N, F] to acceptance probabilities [N]: `DraftConfidence()` (the default:
    `goodput`) or `HeadEstimator(<head folder>)` (`learned`)."""

    reads_features = True

    def __init__(self, profile: str | Path | LatencyProfile, k: int = 8,
                 estimator: DraftConfidence | HeadEstimator | None = None, device: str = "auto",
                 dtype: str = "float32", skinny_gemm: bool = True, prior: float | None = None, strength: float = 4.0,
                 memory: float = 0.95, optimism: float = 0.25, wait_for_slowest: bool = True):
        check_number("goodput/learned strength", strength, 0, low_open=True)
        check_number("goodput/learned memory", memory, 0, 1, low_open=True)
        check_number("goodput/learned optimism", optimism, 0)
        check_bool("goodput/learned wait_for_slowest", wait_for_slowest)
        if prior is not None:
            check_number("goodput/learned prior (or null)", prior, 0, 1)
        self.max_depth = check_depth("goodput/learned", k)
        if not isinstance(profile, (str, Path, LatencyProfile)):  # None or a dict failed inside pathlib
            raise SpecPolicyError(f"goodput/learned profile must be the profile stage's folder, a profile's .json "
                                  f"file or a LatencyProfile, got {profile!r:.80}")
        if not isinstance(profile, LatencyProfile):
            settings = f"runtime.dtype={dtype} runtime.skinny_gemm={str(skinny_gemm).lower()}"
            profile = LatencyProfile.load(profile_file(profile, device, dtype, skinny_gemm), settings)
        self.cost = CostModel(profile)
        if estimator is not None and (isinstance(estimator, type) or not callable(estimator)):  # a path, a class
            raise SpecPolicyError(f"goodput/learned estimator must map features to acceptance probabilities, e.g. "
                                  f"HeadEstimator(<head folder>) or DraftConfidence(), got {estimator!r}")
        self.estimator = estimator or DraftConfidence()
        self._cap_depth(profile, getattr(self.estimator, "positions", None))
        # the acceptance a row is assumed to have before it has drafted: the head's rollout statistics, or 0.5
        self.prior = prior if prior is not None else getattr(self.estimator, "prior", 0.5)
        self.strength, self.memory, self.optimism = strength, memory, optimism
        self.wait_for_slowest = wait_for_slowest
        self._moments, self._reach = np.zeros((2, 0)), np.zeros(0)
        self._accepted = self._verified = np.zeros(0)  # per-row evidence, on the host: a few rows, every step
        self._depth = 0  # this step's budget: keeping a token short of it commits to one more draft forward
        self._limit = np.zeros(0)  # per row, the most tokens it may draft this step (the engine cuts it there)

    def _cap_depth(self, profile: LatencyProfile, positions: int | None) -> None:
        """No deeper than its inputs know: past the profile's widest verify pass the cost model would price
        every depth as that pass (it clamps), and past the rollouts' deepest position the head extrapolates."""
        limits = {f"the profile times verify passes of up to {profile.tokens[-1]} tokens (profile.tokens)":
                  profile.tokens[-1] - 1}
        if positions is not None:
            limits[f"the head's rollouts reach draft position {positions} (collect.k)"] = positions
        for why, depth in limits.items():
            if depth < self.max_depth:
                log.warning("goodput/learned: k=%d capped at %d: %s", self.max_depth, depth, why)
                self.max_depth = depth

    def reset(self, batch_size: int) -> None:
        self._accepted = np.zeros(batch_size)  # faded counts of accepted draft tokens
        self._verified = np.zeros(batch_size)  # ... and of draft tokens verified

    def budget(self, state: StepState) -> torch.Tensor:
        rows, generated = torch.stack([state.row_ids, state.generated]).cpu().numpy()  # one device-to-host copy
        self._accepted[rows] *= self.memory
        self._verified[rows] *= self.memory
        cap = self.cost.max_useful_depth(state.rows, self.max_depth)  # even perfect acceptance loses beyond it
        self._limit = np.full(len(rows), cap)
        if state.remaining is not None:  # the engine drafts no further than a row's last token: a row about to
            # finish drafts less than the rest, and its confidence must not choose their depth
            self._limit = np.minimum(cap, state.remaining - 1 - (generated - generated.min()))
            cap = min(cap, state.remaining - 1)
        depth = 0
        if cap:
            n = self._verified[rows] + self.strength
            alpha = (self._accepted[rows] + self.strength * self.prior) / n
            depth = self._best_depth(alpha, state, cap)
            if not depth:
                hopeful = np.minimum(alpha + self.optimism * np.sqrt(alpha * (1 - alpha) / n), 1.0)
                depth = min(self._best_depth(hopeful, state, cap), 1)
        self._depth = depth
        return torch.full_like(state.generated, depth)

    def _best_depth(self, alpha: np.ndarray, state: StepState, cap: int) -> int:
        """The depth <= cap that maximises the batch's goodput when row r accepts each draft with alpha[r]."""
        j = np.arange(cap + 1)
        # P(a row keeps more than j tokens): the bonus, then each draft accepted, none past the row's limit
        reach = alpha[:, None] ** j * (j <= self._limit[:, None])
        first, second = reach.cumsum(-1), (reach * (2 * j + 1)).cumsum(-1)  # E[kept], E[kept^2] at depth 0..cap
        tokens = self._tokens(first, second, state)
        times = self.cost.step_times(state.rows, cap)
        if state.remaining:  # the draft's unread tokens, paid once, shared by the ~remaining / tokens steps left
            times = times + (j > 0) * self.cost.catch_up_ms(state.rows, state.unread) * tokens / state.remaining
        return int(np.argmax(tokens / times))

    def _tokens(self, first: np.ndarray, second: np.ndarray, state: StepState) -> np.ndarray:
        """The batch's tokens per step per row, as the slowest row sets them (`batch_tokens`), from each row's
        E[kept] and E[kept^2] (rows along axis 0)."""
        return batch_tokens(first.mean(0), (second - first**2).mean(0), state.rows,
                            state.remaining if self.wait_for_slowest else None)

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Per-token evidence of this step: `accepted` successes, then one failure if the row stopped at a
        rejection (accepted < drafted), or if it paid a draft forward and `keep` kept nothing (a row that
        drafts only to be stopped at position 1 gains nothing, and must learn that too)."""
        rows, drafted, accepted = state.row_ids.cpu().numpy(), drafted.cpu().numpy(), accepted.cpu().numpy()
        wasted = (self._depth > 0) & (drafted == 0)
        self._accepted[rows] += accepted
        self._verified[rows] += accepted + ((accepted < drafted) | wasted)

    def keep(self, features: torch.Tensor, tokens: torch.Tensor, state: StepState, position: int) -> torch.Tensor:
        accept = self.estimator(features).cpu().numpy()  # the one device-to-host copy; the rest is a few numbers
        if position == 1:  # per row, E[kept] and E[kept^2] of this step so far: the bonus token
            self._moments, self._reach = np.ones((2, len(accept))), np.ones(len(accept))
        self._reach = self._reach * accept * (position <= self._limit)  # P(drafts 1..position all kept), per row
        draft = self.cost.draft_ms(state.rows)
        paid = position * draft  # the forwards behind x_1..x_i: spent, whatever is decided now
        stop = paid + self.cost.forward_ms("target", state.rows, position)
        go = paid + self.cost.forward_ms("target", state.rows, position + 1)
        if position < self._depth:  # a kept x_i goes through the draft for x_{i+1}
            go += draft
        kept = self._moments + np.stack([self._reach, (2 * position + 1) * self._reach])  # x_i kept too
        first, second = np.stack([self._moments, kept], -1)  # [row, stop/go] each
        tokens_stop, tokens_go = self._tokens(first, second, state)
        keep = bool(tokens_go * stop > tokens_stop * go)
        if keep:
            self._moments = kept
        return torch.full((len(accept),), keep, device=features.device)
