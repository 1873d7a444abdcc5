"""Baseline policies, each a few lines over the DepthPolicy interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specpolicy.errors import SpecPolicyError, check_bool, check_count, check_depth, check_number
from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.rollout.features import COLUMN


PROBABILITIES = ("top1", "margin", "cum_top1")


class ArPolicy(DepthPolicy):
    """Plain autoregressive decoding: depth 0 everywhere."""


@dataclass
class StaticPolicy(DepthPolicy):
    """Always draft k tokens; the policies below that stop rows while drafting start from this budget."""

    k: int = 4
    label: ClassVar[str] = "static"  # the policy's name in its errors

    def __post_init__(self) -> None:
        self.max_depth = check_depth(self.label, self.k)

    def budget(self, state: StepState) -> torch.Tensor:
        return torch.full_like(state.generated, self.k)


@dataclass
class DisableByBatchPolicy(StaticPolicy):
    """Draft k tokens, but none once `threshold` or more rows are in flight (vLLM's disable-by-batch-size)."""

    threshold: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("disable_by_batch threshold (rows in flight)", self.threshold)

    def budget(self, state: StepState) -> torch.Tensor:
        return torch.full_like(state.generated, self.k if state.rows < self.threshold else 0)


@dataclass
class HeuristicPolicy(DepthPolicy):
    """Transformers' schedule, per row: +2 after a step whose drafts were all accepted, -1 otherwise."""

    initial: int = 5
    max_k: int = 16
    min_k: int = 1

    def __post_init__(self) -> None:
        self.max_depth = check_depth("heuristic", self.max_k)
        if not (check_depth("heuristic min_k", self.min_k) <= check_depth("heuristic initial", self.initial)
                <= self.max_k):
            raise SpecPolicyError(f"heuristic depths need 0 <= min_k <= initial <= max_k, got min_k={self.min_k!r}, "
                                  f"initial={self.initial!r}, max_k={self.max_k}")
        self._k = torch.empty(0, dtype=torch.long)

    def reset(self, batch_size: int) -> None:
        self._k = torch.full((batch_size,), self.initial, dtype=torch.long)

    def budget(self, state: StepState) -> torch.Tensor:
        self._k = self._k.to(state.row_ids.device)
        return self._k[state.row_ids]

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        step = torch.where(accepted >= drafted, 2, -1)
        self._k[state.row_ids] = (self._k[state.row_ids] + step).clamp(self.min_k, self.max_k)


@dataclass
class ThresholdPolicy(StaticPolicy):
    """Draft up to k tokens, stopping a row at the first position whose feature crosses `threshold`."""

    k: int = 8
    threshold: float = 0.5
    feature: str = "top1"
    stop_above: bool = False  # top1: stop when below the threshold; entropy: stop when above it
    reads_features = True
    label: ClassVar[str] = "threshold"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(f"{self.label}: stop_above", self.stop_above)  # Hydra passes `no` on as a true string
        if self.feature not in COLUMN:
            raise SpecPolicyError(f"unknown feature {self.feature!r}; choose from {list(COLUMN)}")
        # outside a feature's range every row stops or none does: a typo, not a policy
        check_number(f"{self.label}: threshold", self.threshold)
        if self.feature in PROBABILITIES and not 0 <= self.threshold <= 1:
            raise SpecPolicyError(f"{self.label}: {self.feature} is a probability, so its threshold must be "
                                  f"in [0, 1], got {self.threshold}")
        if self.threshold < 0:  # entropy, position and load are >= 0 too
            raise SpecPolicyError(f"{self.label}: {self.feature} is never negative, so its threshold must be "
                                  f">= 0, got {self.threshold}")

    def keep(self, features: torch.Tensor, tokens: torch.Tensor, state: StepState, position: int) -> torch.Tensor:
        value = features[:, COLUMN[self.feature]]
        return value <= self.threshold if self.stop_above else value >= self.threshold


@dataclass
class ConfidencePolicy(ThresholdPolicy):
    """Stop when the draft's top-1 probability falls below `threshold`."""

    label: ClassVar[str] = "confidence"


@dataclass
class EntropyPolicy(ThresholdPolicy):
    """Stop when the draft's entropy (nats) rises above `threshold`."""

    threshold: float = 1.0
    feature: str = "entropy"
    stop_above: bool = True
    label: ClassVar[str] = "entropy"


@dataclass
class OraclePolicy(StaticPolicy):
    """Hindsight upper bound on acceptance for greedy decoding, not a method.

    Knows the target's greedy continuation of every row (from a prior plain run, `set_reference`)
    and drafts while the draft's token matches it, up to k: nothing it sends is rejected. It is no bound
    on speed: it drafts every token the target would keep, at any load, even where verifying it costs more.
    """

    k: int = 8
    greedy_only = True
    label: ClassVar[str] = "oracle"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._reference: torch.Tensor | None = None

    def set_reference(self, outputs: list[list[int]]) -> None:
        """The target's greedy outputs for the next batch, one per prompt, in the batch's order."""
        if not outputs:
            raise SpecPolicyError("the oracle's reference is empty: pass the target's greedy output of every prompt")
        width = max(map(len, outputs)) + self.k + 1
        ref = torch.full((len(outputs), width), -1, dtype=torch.long)
        for i, out in enumerate(outputs):
            ref[i, : len(out)] = torch.tensor(out, dtype=torch.long)
        self._reference = ref

    def reset(self, batch_size: int) -> None:
        if self._reference is None:
            raise SpecPolicyError("the oracle policy needs the target's greedy outputs first (set_reference)")
        if len(self._reference) != batch_size:
            raise SpecPolicyError(f"the oracle's reference holds {len(self._reference)} outputs for a batch of "
                                  f"{batch_size} prompts; set_reference with this batch's greedy outputs first")

    def keep(self, features: torch.Tensor, tokens: torch.Tensor, state: StepState, position: int) -> torch.Tensor:
        if self._reference.device != tokens.device:  # once: a copy per draft position would sit in the timed loop
            self._reference = self._reference.to(tokens.device)
        ref = self._reference
        index = (state.generated + position - 1).clamp(max=ref.shape[1] - 1)
        return ref[state.row_ids, index] == tokens
