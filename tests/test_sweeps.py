"""Every parameter value of every wandb sweep composes as a Hydra override of scripts/train.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from compose import CONF, compose_config

SWEEPS = sorted((CONF / "sweep").glob("*.yaml"))


def overrides(sweep: Path) -> list[str]:
    spec = yaml.safe_load(sweep.read_text())
    assert spec["program"] == "scripts/train.py" and "${args_no_hyphens}" in spec["command"]
    assert spec["project"] == "specpolicy"  # the logger's project; a sweep's runs go to the sweep's
    out = []
    for name, param in spec["parameters"].items():
        if "value" in param:
            out.append(f"{name}={param['value']}")
        elif "values" in param:
            out += [f"{name}={v}" for v in param["values"]]
        else:  # a distribution: its bounds
            out += [f"{name}={param['min']}", f"{name}={param['max']}"]
    return out


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda p: p.stem)
def test_every_sweep_value_composes(sweep: Path, tmp_path: Path) -> None:
    assert SWEEPS, "conf/sweep/ holds the sweep definitions"
    for override in overrides(sweep):
        cfg = compose_config("train", [override], tmp_path)
        OmegaConf.resolve(cfg)
