"""Depth policies: how many tokens each row drafts at each step."""

from specpolicy.policy.base import DepthPolicy, StepState
from specpolicy.policy.baselines import (
    ArPolicy,
    ConfidencePolicy,
    DisableByBatchPolicy,
    EntropyPolicy,
    HeuristicPolicy,
    OraclePolicy,
    StaticPolicy,
)

__all__ = [
    "ArPolicy", "ConfidencePolicy", "DepthPolicy", "DisableByBatchPolicy", "DraftConfidence", "EntropyPolicy",
    "GoodputPolicy", "HeadEstimator", "HeuristicPolicy", "OraclePolicy", "StaticPolicy", "StepState",
]
LAZY = ("DraftConfidence", "GoodputPolicy", "HeadEstimator")


def __getattr__(name: str) -> object:
    """The goodput policy on first use: it imports the cost model, whose profiler imports the engine, which
    imports this package, so importing it here would be a cycle."""
    if name in LAZY:
        from specpolicy.policy import goodput

        return getattr(goodput, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
