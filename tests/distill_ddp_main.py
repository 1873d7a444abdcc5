"""Entry for test_distill_ddp: Lightning's DDP launcher re-runs this file once per extra rank."""

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from specpolicy.pipeline import train

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # the stages each rank runs, for the test to count
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        train(compose(config_name="train", overrides=sys.argv[1:]))
