"""The one interface every depth policy implements; the engine never asks which policy it runs.

Per step the engine calls `budget` (each row's maximum depth, given the batch load), then `keep`
after each draft position (stop a row early from that position's features), then `observe` (what
the target accepted). Rows are named by their index in the original batch (`row_ids`), so per-row
state survives finished rows leaving the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepState:
    row_ids: torch.Tensor  # [A] index of each row in flight in the original batch
    generated: torch.Tensor  # [A] tokens generated so far
    rows: int  # rows in flight
    tokens: int  # context tokens in flight (sum of row lengths)
    remaining: int | None = None  # the most new tokens a row in flight may still need (None: no bound)
    unread: int = 1  # the most committed tokens a row's draft has yet to read (its next draft forward reads them)


class DepthPolicy:
    """Base policy: never drafts. Subclasses override what they decide."""

    max_depth: int = 0  # upper bound on any row's depth (the engine cuts budgets to it); 0 = never drafts
    greedy_only: bool = False  # True for policies that are only meaningful for greedy decoding
    reads_features: bool = False  # True if `keep` reads the draft features (the engine computes them only then)

    def reset(self, batch_size: int) -> None:
        """A new batch starts."""

    def budget(self, state: StepState) -> torch.Tensor:
        return torch.zeros_like(state.generated)

    def keep(self, features: torch.Tensor | None, tokens: torch.Tensor, state: StepState,
             position: int) -> torch.Tensor | None:
        """Whether each row keeps the token proposed at `position` (1-based); None = no per-position decision.
        `features` is None unless the policy sets `reads_features`."""
        return None

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """After verification: drafted [A] and accepted [A] draft tokens per row."""
