"""Rollout collection: decode with a fixed maximum depth and log, for every row, step and draft
position, the shared features and whether the target accepted the token."""

from __future__ import annotations

import torch

from specpolicy.decode.stats import reached
from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.rollout.features import FEATURE_NAMES


class RecordingPolicy(DepthPolicy):
    """Wraps a policy and records (features, accepted) for each position a row reached.

    A position is recorded if the row drafted it and every earlier draft was accepted: the label is
    then the conditional acceptance the depth head learns, P(accept i | accepted 1..i-1).
    """

    reads_features = True

    def __init__(self, inner: DepthPolicy):
        self.inner, self.max_depth, self.greedy_only = inner, inner.max_depth, inner.greedy_only
        self._features: list[torch.Tensor] = []
        self.records: list[torch.Tensor] = []  # [n, F + 3]: features, accepted, batch size, group
        # group: the prompt's index among all this recorder decoded, in order; collect decodes the same prompts
        # from the first at every batch size, so a prompt (whose greedy sequence is the same at every size) has
        # one group in every shard, and the head's validation split keeps it whole
        self._first = self._decoded = 0

    def reset(self, batch_size: int) -> None:
        self.inner.reset(batch_size)
        self._batch_size = batch_size
        self._first, self._decoded = self._decoded, self._decoded + batch_size

    def budget(self, state: StepState) -> torch.Tensor:
        self._features = []
        return self.inner.budget(state)

    def keep(self, features: torch.Tensor, tokens: torch.Tensor, state: StepState, position: int
             ) -> torch.Tensor | None:
        self._features.append(features)
        return self.inner.keep(features, tokens, state, position)

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        self.inner.observe(state, drafted, accepted)
        if not self._features:
            return
        features = torch.stack(self._features, 1)  # [A, k, F]
        position = torch.arange(1, features.shape[1] + 1, device=features.device)
        kept = reached(drafted, accepted, position)  # [A, k]
        label = (position <= accepted[:, None]).float()
        load = torch.full_like(label, float(self._batch_size))
        group = (self._first + state.row_ids).to(label)[:, None].expand_as(label)
        record = torch.cat([features, label[..., None], load[..., None], group[..., None]], -1)
        self.records.append(record[kept].cpu())


COLUMNS = (*FEATURE_NAMES, "accepted", "batch_size", "group")
