"""Rollouts come from prompts the draft was not distilled on, when there are enough of them."""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from specpolicy.stages import _unseen_by_draft


def _cfg(train_prompts: int | None):
    return OmegaConf.create({"distill": {"data": {"train_prompts": train_prompts}},
                             "collect": {"batch_sizes": [1, 4], "min_prompts_per_size": 3}})


def test_collect_skips_the_distillation_prompts():
    assert _unseen_by_draft(_cfg(6), list(range(10))) == [6, 7, 8, 9]


def test_collect_reuses_distillation_prompts_with_a_warning_when_too_few_are_left(caplog):
    with caplog.at_level(logging.WARNING, logger="specpolicy"):
        assert _unseen_by_draft(_cfg(7), list(range(10))) == list(range(10))
        assert _unseen_by_draft(_cfg(None), list(range(10))) == list(range(10))
    assert caplog.text.count("the rollouts reuse distillation prompts") == 2
