"""Synthetic latency profiles and heads for policy tests: known curves, no measuring."""

from __future__ import annotations

from pathlib import Path

import torch

from specpolicy.cost.profile import LatencyProfile
from specpolicy.policy.head import DepthHead, HeadConfig

ROWS = [1, 2, 4, 8, 16, 32, 64]
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def profile(per_token_ms: float = 1.0, fixed_ms: float = 30.0, draft_share: float = 0.1,
            overhead_ms: float | None = None) -> LatencyProfile:
    """A forward costs `fixed_ms` (streaming the weights) plus `per_token_ms` per token in flight: nearly
    free extra tokens at batch 1 (memory-bound), proportional cost at batch 64 (compute-bound); a drafting
    step costs `overhead_ms` more at every load (None: the profile did not measure it)."""
    target = [[fixed_ms + per_token_ms * r * t for t in TOKENS] for r in ROWS]
    draft = [[draft_share * ms for ms in row] for row in target]
    overhead = None if overhead_ms is None else [overhead_ms] * len(ROWS)
    return LatencyProfile("synthetic", "float32", 64, ROWS, TOKENS, target, draft, overhead)


def head_dir(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    DepthHead(HeadConfig(hidden=8)).save(directory)
    return directory
