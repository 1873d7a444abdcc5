"""The depth head: a tiny MLP that reads one draft position's features (confidence + batch load) and
predicts whether the target will accept that token, given it accepted every earlier one.

It is the learned part of the `learned` policy, which turns these calibrated acceptance estimates
into continue/stop decisions that maximise expected goodput under the measured latency profile.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specpolicy.atomic import atomic_path
from specpolicy.errors import SpecPolicyError, check_count, check_int, check_number
from specpolicy.rollout.features import COLUMN, FEATURE_NAMES


@dataclass
class HeadConfig:
    hidden: int = 32
    layers: int = 2
    features: tuple[str, ...] = FEATURE_NAMES
    prior: float = 0.5  # acceptance rate of a first draft token in the training rollouts
    positions: int | None = None  # the deepest draft position in the training rollouts (None: not recorded)

    def __post_init__(self) -> None:
        if check_int("head.layers (0: a logistic regression)", self.layers, 0):
            check_count("head.hidden", self.hidden)  # hidden=0 would train a constant
        # written by the head stage, read by the policy (a prior of null or 1.5 failed, or was used, mid-decoding)
        check_number("the head's prior (a first draft token's acceptance)", self.prior, 0, 1)
        if self.positions is not None:
            check_count("the head's positions (the deepest draft position of its rollouts)", self.positions)

    @classmethod
    def from_dict(cls, values: dict) -> HeadConfig:
        """A config saved as plain values: the head's config.json, a head checkpoint's hyperparameters."""
        return cls(**{**values, "features": tuple(values["features"])})


class DepthHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        # built once, not per call: the policy asks at every draft position (non-persistent: not in head.pt)
        self.register_buffer("index", torch.tensor([COLUMN[name] for name in config.features]), persistent=False)
        # counts go on a log scale so one head spans batch 1 and batch 64
        counts = [name in ("position", "rows", "tokens") for name in config.features]
        self.register_buffer("counts", torch.tensor(counts), persistent=False)
        dims = [len(config.features)] + [config.hidden] * config.layers
        blocks = [nn.Sequential(nn.Linear(i, o), nn.GELU()) for i, o in zip(dims, dims[1:])]
        self.mlp = nn.Sequential(*blocks, nn.Linear(dims[-1], 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, F] (FEATURE_NAMES order) -> acceptance logits [N]."""
        x = features.index_select(1, self.index).float()
        x = torch.where(self.counts, torch.log2(1 + x), x)
        return self.mlp(x).squeeze(-1)

    def save(self, directory: str | Path) -> None:
        """head.pt last: its existence is what the head stage and `load` trust."""
        directory = Path(directory)
        with atomic_path(directory / "config.json") as tmp:
            tmp.write_text(json.dumps(asdict(self.config), indent=1))
        with atomic_path(directory / "head.pt") as tmp:
            torch.save(self.state_dict(), tmp)

    @classmethod
    def load(cls, directory: str | Path) -> DepthHead:
        directory = Path(directory)
        if not (directory / "head.pt").is_file():
            raise SpecPolicyError(f"no trained depth head at {directory}; run the head stage first "
                                  f"(python scripts/train.py experiment=... stages=[head])")
        try:  # written whole by `save`: a failure here is a damaged or hand-edited folder
            config = json.loads((directory / "config.json").read_text())
            head = cls(HeadConfig.from_dict(config))
            head.load_state_dict(torch.load(directory / "head.pt", map_location="cpu"))
        except (OSError, EOFError, ValueError, TypeError, KeyError, RuntimeError, pickle.UnpicklingError,
                SpecPolicyError) as err:
            why = err if isinstance(err, SpecPolicyError) else type(err).__name__  # ours says which value
            raise SpecPolicyError(f"the depth head at {directory} is damaged ({why}); delete it and run the head "
                                  f"stage again (stages=[head])") from err
        return head.eval().requires_grad_(False)
