"""The draft's frequency-ranked vocabulary subset (FR-Spec): head, ranking, FLOPs, saved-folder round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpolicy.cost.flops import FlopModel
from specpolicy.decode import Engine
from specpolicy.models import RandomInitSource
from specpolicy.models.draft import LayerSubsetDraft, PretrainedDraft, PretrainedSource
from specpolicy.models.loading import save_model
from specpolicy.models.vocab import (
    VOCAB_FILE, SubsetHead, frequent_tokens, restore_full_head, use_subset_head, vocab_file_text,
)
from specpolicy.policy import ArPolicy, StaticPolicy

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target():
    return RandomInitSource(model_type="llama", config=TINY, device="cpu").load()


def test_frequent_tokens_ranks_always_then_counts_then_ids():
    responses = [[9, 9, 9, 4, 4, 8], [4, 9, 1]]
    assert frequent_tokens(responses, 3, 20, always=[17]).tolist() == [4, 9, 17]
    assert frequent_tokens(responses, 6, 20).tolist() == [0, 1, 2, 4, 8, 9]  # filled by id after the counted
    with pytest.raises(ValueError, match="must be in 1..20"):
        frequent_tokens(responses, 21, 20)


def test_subset_head_scores_its_tokens_only_and_costs_only_their_rows(target):
    built = LayerSubsetDraft(layers=[0, -1]).build(target)
    draft = built.model
    ids = torch.tensor([[5, 6, 7, 8]])
    full_logits = draft(ids).logits
    flops_full = FlopModel.from_model(draft).per_token(0)
    vocab = torch.tensor([2, 5, 40, 41, 200])
    use_subset_head(built, vocab)
    assert built.name.endswith("-vocab5")
    logits = draft(ids).logits
    assert logits.shape == full_logits.shape
    torch.testing.assert_close(logits[..., vocab], full_logits[..., vocab])
    outside = torch.ones(logits.shape[-1], dtype=torch.bool).index_fill_(0, vocab, False)
    assert torch.isneginf(logits[..., outside]).all()
    hidden = draft.config.hidden_size
    assert flops_full - FlopModel.from_model(draft).per_token(0) == 2 * hidden * (full_logits.shape[-1] - len(vocab))
    restore_full_head(draft, built.full_head)
    torch.testing.assert_close(draft(ids).logits, full_logits)


def test_subset_head_keeps_a_biased_heads_bias():
    """Some LM heads have a bias (GPT-J, Phi-2); the subset scores its tokens as the full head does."""
    full = torch.nn.Linear(8, 50, bias=True).requires_grad_(False)
    torch.nn.init.normal_(full.bias, std=5.0)
    hidden, vocab = torch.randn(3, 8), torch.tensor([1, 7, 30])
    torch.testing.assert_close(SubsetHead(full, vocab)(hidden)[:, vocab], full(hidden)[:, vocab])


def test_a_saved_subset_is_found_through_a_home_relative_path(target, tmp_path: Path, monkeypatch):
    """The model loads from `~/...` (`PretrainedSource` expands it); its subset must come with it."""
    built = LayerSubsetDraft(layers=[0, -1]).build(target)
    vocab = frequent_tokens([], 64, target.model.config.vocab_size)
    save_model(tmp_path / "d", built.model, built.tokenizer, {VOCAB_FILE: vocab_file_text(vocab)})
    monkeypatch.setenv("HOME", str(tmp_path))
    draft = PretrainedDraft(PretrainedSource(path="~/d", device="cpu")).build(target)
    assert isinstance(draft.model.get_output_embeddings(), SubsetHead)


def test_saved_subset_is_applied_on_load_and_decoding_stays_lossless(target, tmp_path: Path):
    built = LayerSubsetDraft(layers=[0, -1]).build(target)
    vocab = frequent_tokens([], 64, target.model.config.vocab_size, always=[target.tokenizer.eos_token_id])
    save_model(tmp_path / "d", built.model, built.tokenizer, {VOCAB_FILE: vocab_file_text(vocab)})
    assert json.loads((tmp_path / "d" / VOCAB_FILE).read_text())["token_ids"] == vocab.tolist()
    draft = PretrainedDraft(PretrainedSource(path=str(tmp_path / "d"), device="cpu")).build(target)
    assert isinstance(draft.model.get_output_embeddings(), SubsetHead) and draft.name.endswith("-vocab64")
    assert draft.cost["flops_ratio"] < built.cost["flops_ratio"]
    prompts = [[3, 50, 60, 70], [9, 8], [100, 101, 102, 103, 104, 105]]
    for temperature in (0.0, 1.0):  # the draft's -inf logits must pass through sampling and acceptance
        engine = Engine(target.model, draft.model, max_new_tokens=10, temperature=temperature, seed=1)
        plain = engine.generate(prompts, ArPolicy())
        spec = engine.generate(prompts, StaticPolicy(k=3))
        assert spec.stats.drafted > 0
        assert all(0 <= t < target.model.config.vocab_size for out in spec.outputs for t in out)
        if temperature == 0.0:
            assert spec.outputs == plain.outputs
