"""What every entry point shares: offline-by-default wandb, and one-line errors instead of tracebacks."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from omegaconf import DictConfig

from specpolicy.errors import SpecPolicyError

log = logging.getLogger("specpolicy")


def entry(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run a pipeline task; bad input exits with code 2 and one line naming the problem and the fix."""
    os.environ.setdefault("WANDB_MODE", "offline")  # no hub here; a user who sets WANDB_MODE goes online
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return task(cfg)
    except SpecPolicyError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
