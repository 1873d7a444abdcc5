"""Compose the real config tree in tests, as Hydra would for scripts/*.py (runtime keys included)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict, read_write

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_config(name: str, overrides: list[str], tmp_path: Path) -> DictConfig:
    """The config `scripts/<name>.py overrides...` would see, writing under `tmp_path`."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=[f"paths.checkpoints_dir={tmp_path}", *overrides], return_hydra_config=True)
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg
