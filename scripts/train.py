"""Hydra entry point: `python scripts/train.py experiment=smollm2_135m [overrides]`. Logic lives in specpolicy."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specpolicy import pipeline
from specpolicy.cli import entry

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    entry(pipeline.train, cfg)


if __name__ == "__main__":
    main()
