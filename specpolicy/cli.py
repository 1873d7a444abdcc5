"""What every entry point shares: offline-by-default wandb, one-line errors instead of tracebacks, and
benchmark reports saved whole and printed."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from hydra.errors import InstantiationException
from omegaconf import DictConfig

from specpolicy.atomic import atomic_path
from specpolicy.errors import SpecPolicyError

log = logging.getLogger("specpolicy")


def entry(task: Callable[[Any], Any], cfg: DictConfig | Any) -> Any:
    """Run a pipeline task on its config (a Hydra config, or a script's parsed arguments); bad input exits with
    code 2 and one line naming the problem and the fix."""
    os.environ.setdefault("WANDB_MODE", "offline")  # no hub here; a user who sets WANDB_MODE goes online
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return task(cfg)
    except (SpecPolicyError, InstantiationException) as err:
        problem = bad_input(err)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def bad_input(err: BaseException) -> str | None:
    """The SpecPolicyError behind `err`, prefixed with the config key when it came from an object Hydra built
    (`eval.policies.static_k1.k=-1` ends in an InstantiationException whose cause is ours); None otherwise."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, SpecPolicyError):
        cause = cause.__cause__
    if cause is None:
        return None
    key = re.search(r"full_key: (\S+)", str(err)) if cause is not err else None
    if key is None or str(cause).startswith(f"{key.group(1)}."):  # the message names its setting already
        return str(cause)
    return f"{key.group(1)}: {cause}"


def publish(report: dict, out: str | Path) -> None:
    """Save a benchmark's JSON report at `out` (all or nothing: a killed run leaves the previous one) and print it."""
    text = json.dumps(report, indent=2)
    with atomic_path(out) as tmp:
        tmp.write_text(text)
    print(text)
