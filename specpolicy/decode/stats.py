"""What one decode run measured: tokens, time, forwards, acceptance, depth and FLOPs by bucket."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

from specpolicy.cost.flops import BUCKETS


def reached(drafted: torch.Tensor, accepted: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[A, K]: whether each row drafted each of `positions` (1-based) with every earlier one accepted, i.e. the
    positions where conditional acceptance, P(accept i | accepted 1..i-1), is measured."""
    return (drafted[:, None] >= positions) & (accepted[:, None] >= positions - 1)


@dataclass
class DecodeStats:
    max_depth: int
    batch_size: int
    tokens: int = 0
    wall_s: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    steps: int = 0  # verify steps
    policy_s: float = 0.0  # host time inside the policy's budget/keep/observe (what deciding costs)
    step_s: list[float] = field(default_factory=list)  # wall time of each verify step (the first reads the prompts)
    row_steps: int = 0  # (row, verify step) pairs
    drafted: int = 0
    accepted: int = 0
    drafted_at: torch.Tensor = field(init=False)  # [max_depth] rows that drafted position i+1
    accepted_at: torch.Tensor = field(init=False)  # [max_depth] rows whose position i+1 was accepted
    reached_at: torch.Tensor = field(init=False)  # [max_depth] rows that drafted position i+1 and had 1..i accepted
    depth_at_load: torch.Tensor = field(init=False)  # [batch_size+1] drafted tokens summed by rows in flight
    steps_at_load: torch.Tensor = field(init=False)  # [batch_size+1] row-steps by rows in flight
    flops: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))  # BUCKETS
    ar_flops: float = 0.0  # what plain decoding would spend on the same output
    pending: list[Callable[[], None]] = field(default_factory=list, repr=False)  # bookkeeping `later` queued

    def __post_init__(self) -> None:
        self.drafted_at = torch.zeros(self.max_depth, dtype=torch.long)
        self.accepted_at = torch.zeros(self.max_depth, dtype=torch.long)
        self.reached_at = torch.zeros(self.max_depth, dtype=torch.long)
        self.depth_at_load = torch.zeros(self.batch_size + 1, dtype=torch.long)
        self.steps_at_load = torch.zeros(self.batch_size + 1, dtype=torch.long)

    @classmethod
    def total(cls, runs: list[DecodeStats]) -> DecodeStats:
        """The counts of several runs (the batches of one policy) summed, so every rate is computed once, here."""
        out = cls(max_depth=max(r.max_depth for r in runs), batch_size=max(r.batch_size for r in runs))
        counts = [f.name for f in fields(cls) if f.name not in ("max_depth", "batch_size", "pending")]
        for r in runs:
            for name in counts:
                part = getattr(r, name)
                if isinstance(part, torch.Tensor):  # a smaller last batch has shorter by-load counts
                    getattr(out, name)[: len(part)] += part
                else:
                    setattr(out, name, getattr(out, name) + part)
        return out

    def record_step(self, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """drafted/accepted [A] draft tokens per row in one verify step (host tensors)."""
        self.steps += 1
        self.row_steps += drafted.numel()
        self.drafted += int(drafted.sum())
        self.accepted += int(accepted.sum())
        positions = torch.arange(1, self.max_depth + 1)
        self.drafted_at += (drafted[:, None] >= positions).sum(0)
        self.accepted_at += (accepted[:, None] >= positions).sum(0)
        self.reached_at += reached(drafted, accepted, positions).sum(0)
        self.depth_at_load[drafted.numel()] += drafted.sum()
        self.steps_at_load[drafted.numel()] += drafted.numel()

    def later(self, charge: Callable[..., None], *args) -> None:
        """Queue bookkeeping that decoding does not need (FLOP buckets, histograms) for `flush`, after the
        clock stops: its few dozen tiny tensor ops per step would otherwise be timed as decoding, which
        `model.generate`, the baseline, never pays. Arguments must not change after queueing."""
        self.pending.append(functools.partial(charge, *args))

    def flush(self) -> None:
        for charge in self.pending:
            charge()
        self.pending.clear()

    @contextmanager
    def deciding(self) -> Iterator[None]:
        """Time spent inside a policy call goes to `policy_s`."""
        t0 = time.perf_counter()
        yield
        self.policy_s += time.perf_counter() - t0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """tau: tokens kept per verify step and row, bonus token included (none after a kept EOS: the row ended)."""
        return self.tokens / self.row_steps if self.row_steps else 0.0

    @property
    def mean_depth(self) -> float:
        return self.drafted / self.row_steps if self.row_steps else 0.0

    def flops_dict(self) -> dict[str, float]:
        out = dict(zip(BUCKETS, self.flops.tolist()))
        return {**out, "total": float(self.flops.sum()), "ar_equivalent": self.ar_flops}
