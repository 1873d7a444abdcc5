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
from specpolicy.eval.runner import format_table, side_by_side, summarise
from specpolicy.models import LoadedModel, check_compatible

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
    """Decode validation prompts with every policy in `eval.policies`, side by side, and print the table."""
    target = load_target(cfg)
    draft = instantiate(cfg.draft).build(target)
    check_compatible(target, draft)
    engine = instantiate(cfg.engine)(target.model, draft.model)
    conversations = instantiate(cfg.data).load()[: cfg.eval.num_prompts]
    prompts = encode_prompts(target.tokenizer, conversations, target.context_length, reserve=engine.max_new_tokens)
    policies = {name: instantiate(policy) for name, policy in cfg.eval.policies.items()}
    runs = side_by_side(engine, prompts, policies, cfg.eval.batch_size)
    rows = summarise(runs)
    print(f"\ntarget {target.name}, draft {draft.name}, {len(prompts)} prompts, batch {cfg.eval.batch_size}, "
          f"{engine.max_new_tokens} new tokens, temperature {engine.temperature}, device {engine.device}\n")
    print(format_table(rows))
    for conversation, output in list(zip(conversations, runs["ar"].outputs))[: cfg.eval.show]:
        print(f"\n>>> {conversation[-1]['content']}\n{target.tokenizer.decode(output, skip_special_tokens=True)}")
