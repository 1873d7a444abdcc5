"""The Hydra tasks behind scripts/train.py and scripts/evaluate.py.

Stages read their inputs from and write their outputs to `paths.experiment_dir`, so each can be
rerun alone and is skipped when its output exists.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.data import encode_prompts
from specpolicy.errors import SpecPolicyError
from specpolicy.models import LoadedModel

log = logging.getLogger("specpolicy")


def load_target(cfg: DictConfig) -> LoadedModel:
    target = instantiate(cfg.target).load()
    log.info("target %s: %.1fM parameters, context %d", target.name, target.model.num_parameters() / 1e6,
             target.context_length)
    return target


def prepare(cfg: DictConfig) -> None:
    """Load the target once, so a GGUF source is converted and cached before any timed work."""
    load_target(cfg)


STAGES: dict[str, Callable[[DictConfig], None]] = {"prepare": prepare}


def train(cfg: DictConfig) -> None:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise SpecPolicyError(f"unknown stage(s) {unknown} in stages=; choose from {list(STAGES)}")
    torch.manual_seed(cfg.seed)
    for stage in cfg.stages:
        log.info("stage %s", stage)
        STAGES[stage](cfg)


def evaluate(cfg: DictConfig) -> None:
    """Greedy generation with the target on a few prompts, printed."""
    target = load_target(cfg)
    conversations = instantiate(cfg.data).load()[: cfg.eval.num_prompts]
    max_new = cfg.engine.max_new_tokens
    prompts = encode_prompts(target.tokenizer, conversations, target.context_length, reserve=max_new)
    device = target.model.device
    for conversation, ids in zip(conversations, prompts):
        out = target.model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new, do_sample=False)
        text = target.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        print(f"\n>>> {conversation[-1]['content']}\n{text}")
