"""Synthetic training prompts: sampled from the chat template's user turn, filtered, cached, trained on."""

from __future__ import annotations

import copy

import pytest

from specpolicy.data import PromptSource
from specpolicy.distill import synthetic
from specpolicy.distill.synthetic import PromptSynthesis, user_turn_prefix
from specpolicy.errors import SpecPolicyError


def test_user_turn_prefix_is_the_template_up_to_the_message(tiny_model):
    tok = tiny_model().tokenizer
    prefix = user_turn_prefix(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text.startswith(prefix) and text[len(prefix):].startswith("hello<|im_end|>")


def test_a_tokenizer_without_chat_template_is_refused(tiny_model):
    tok = copy.deepcopy(tiny_model().tokenizer)
    tok.chat_template = None
    with pytest.raises(SpecPolicyError, match="no chat template"):
        user_turn_prefix(tok)


def test_greedy_synthesis_is_refused():
    with pytest.raises(SpecPolicyError, match=r"temperature must be a number > 0 \(greedy sampling writes one"):
        PromptSynthesis(temperature=0.0)


def test_unfinished_empty_and_repeated_samples_are_dropped(tiny_model, monkeypatch):
    loaded = tiny_model()
    tok, eos = loaded.tokenizer, loaded.model.generation_config.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    samples = [ids("Hi?") + [eos], ids("cut off"), ids(" Hi? ") + [eos], [eos], ids("Why?") + [eos]]
    monkeypatch.setattr(synthetic, "generate_responses", lambda *a, **k: samples)
    assert PromptSynthesis(num_prompts=5).sample(loaded.model, tok) == ["Hi?", "Why?"]


def test_prompts_are_sampled_once_and_saved_as_a_prompts_file(tiny_model, tmp_path, monkeypatch, single_thread):
    loaded = tiny_model()
    synth = PromptSynthesis(num_prompts=32, max_tokens=48, batch_size=16)
    first = synth.conversations(loaded.model, loaded.tokenizer, tmp_path)  # a real, random-model sampling run
    assert first and all(c[0]["role"] == "user" and c[0]["content"] for c in first)
    (path,) = (tmp_path / "distill").glob("synthetic-prompts-*.jsonl")
    assert PromptSource(prompts_file=str(path), split="all").load() == first

    monkeypatch.setattr(PromptSynthesis, "sample", lambda *a: pytest.fail("sampled again instead of reading the cache"))
    assert synth.conversations(loaded.model, loaded.tokenizer, tmp_path) == first


def test_openings_start_each_message_and_an_opening_alone_is_dropped(tiny_model, monkeypatch):
    loaded = tiny_model()
    tok, eos = loaded.tokenizer, loaded.model.generation_config.eos_token_id
    seen = []

    def generate(model, prompts, *args, **kwargs):
        seen.extend(tok.decode(p) for p in prompts)
        return [tok(" more.", add_special_tokens=False)["input_ids"] + [eos], [eos]] * (len(prompts) // 2)

    monkeypatch.setattr(synthetic, "generate_responses", generate)
    synth = PromptSynthesis(num_prompts=8, opening_words=2)
    openings = synth.openings([[{"role": "user", "content": "Translate this  text, please."}],
                               [{"role": "user", "content": "Why?"}]])
    assert openings == ["Translate this", "Why?"]
    prompts = synth.sample(loaded.model, tok, openings)
    prefix = user_turn_prefix(tok)
    assert {p.removeprefix(prefix) for p in seen} <= set(openings) and all(p.startswith(prefix) for p in seen)
    assert set(prompts) <= {"Translate this more.", "Why? more."}  # the samples that wrote nothing are gone


def test_openings_from_other_training_prompts_are_another_cache_entry(tiny_model, tmp_path, monkeypatch):
    loaded = tiny_model()
    monkeypatch.setattr(PromptSynthesis, "sample", lambda self, model, tok, openings: [f"{o} now" for o in openings]
                        or ["free"])
    sets = [[[{"role": "user", "content": f"{word} it"}]] for word in ("Say", "Write")]
    for synth in (PromptSynthesis(opening_words=1), PromptSynthesis()):
        for train in sets:
            synth.conversations(loaded.model, loaded.tokenizer, tmp_path, train)
    files = sorted((tmp_path / "distill").glob("synthetic-prompts-*.jsonl"))
    assert sorted(f.read_text() for f in files) == sorted(['{"prompt": "Say now"}\n', '{"prompt": "Write now"}\n',
                                                           '{"prompt": "free"}\n'])  # free sampling ignores them
    with pytest.raises(SpecPolicyError, match="needs training prompts"):
        PromptSynthesis(opening_words=1).openings([])
