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
    "ArPolicy", "ConfidencePolicy", "DepthPolicy", "DisableByBatchPolicy", "EntropyPolicy", "HeuristicPolicy",
    "OraclePolicy", "StaticPolicy", "StepState",
]
