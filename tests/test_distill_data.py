"""Distillation data: more positions per prompt (sampled responses, prompt positions), scored consistently,
and cached under keys that change only when the models or settings do."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY
from specpolicy.distill.data import (DistillData, collate_rows, fingerprint, generate_responses, hidden_states,
                                     masked_logits, unrolled_hidden_states)
from specpolicy.errors import SpecPolicyError
from specpolicy.models import RandomInitSource
from specpolicy.models.draft import LayerSubsetDraft
from specpolicy.models.fusion import model_inputs, shift
from specpolicy.models.vocab import restore_full_head, use_subset_head

PROMPTS = [[5, 9, 3, 7], [11, 4], [8, 8, 2, 6, 1]]


def _build(tiny_model, tmp_path, **settings) -> datasets.Dataset:
    target = tiny_model().model
    data = DistillData(max_new_tokens=6, top_k=4, batch_size=2, **settings)
    return datasets.load_from_disk(str(data.build(target, target, PROMPTS, 4, tmp_path, "train")))


def test_samples_per_prompt_gives_each_copy_its_own_response(tiny_model, tmp_path, single_thread):
    rows = _build(tiny_model, tmp_path, temperature=1.0, samples_per_prompt=3)
    assert len(rows) == 9
    assert [ids[:n] for ids, n in zip(rows["input_ids"], rows["prompt_len"])] == [p for p in PROMPTS for _ in range(3)]
    responses = [tuple(ids[n:]) for ids, n in zip(rows["input_ids"], rows["prompt_len"])]
    assert len(set(responses)) == 9  # every copy and every batch samples from its own random stream


def test_sampled_responses_do_not_depend_on_the_batch(tiny_model, tmp_path, single_thread):
    """Each prompt samples from the stream its index names, whatever batch it is generated in, so one cache entry
    serves every batch size (seeding each batch's engine used to change every response with the batch size)."""
    target = tiny_model().model
    datas = [DistillData(max_new_tokens=6, top_k=4, temperature=1.0, batch_size=b) for b in (1, 3)]
    assert datas[0].key(target, target, PROMPTS, 4) == datas[1].key(target, target, PROMPTS, 4)
    rows = [datasets.load_from_disk(str(d.build(target, target, PROMPTS, 4, tmp_path / str(d.batch_size), "train")))
            for d in datas]
    assert rows[0]["input_ids"] == rows[1]["input_ids"]


@pytest.mark.parametrize("settings, message", [
    ({"samples_per_prompt": 2, "temperature": 0.0}, "samples_per_prompt=2.*temperature > 0"),
    ({"max_new_tokens": 0}, "distill.data.max_new_tokens must be an integer >= 1, got 0"),
    ({"train_prompts": 0}, r"distill.data.train_prompts \(or null for the whole split\) must be an integer >= 1"),
    # strings used to reach the engine (blamed as engine.temperature) or a comparison's TypeError traceback
    ({"temperature": "abc"}, r"distill.data.temperature must be a number >= 0, got 'abc'"),
    ({"samples_per_prompt": "abc"}, r"distill.data.samples_per_prompt must be an integer >= 1, got 'abc'"),
    ({"top_k": -1}, r"distill.data.top_k \(0: targets computed on the fly\) must be an integer >= 0, got -1"),
    ({"test_prompts": "abc"}, r"distill.data.test_prompts \(0: no test metrics; null: the whole split\) must be an"),
])
def test_data_settings_are_refused_before_generating(settings: dict, message: str):
    with pytest.raises(SpecPolicyError, match=message):
        DistillData(**settings)
    DistillData(train_prompts=None)  # the whole split


def test_prompt_loss_scores_every_position_with_the_targets_top_k(tiny_model, tmp_path, single_thread):
    target = tiny_model().model
    rows = _build(tiny_model, tmp_path, prompt_loss=True)
    batch = collate_rows([rows[i] for i in range(len(rows))], pad_id=0, max_length=None)
    lengths = [len(ids) for ids in rows["input_ids"]]
    assert batch["loss_mask"].sum(1).tolist() == [n - 1 for n in lengths]  # all but the last token predict one
    with torch.no_grad():
        top = masked_logits(target, batch).topk(4, dim=-1).indices
    assert torch.equal(top, batch["topk_ids"].long())  # cached targets line up with the positions trained on

    plain = collate_rows([{k: rows[i][k] for k in ("input_ids", "prompt_len")} for i in range(len(rows))],
                         pad_id=0, max_length=None)
    assert plain["loss_mask"].sum(1).tolist() == [n - p for n, p in zip(lengths, rows["prompt_len"])]


def test_fingerprint_reads_what_a_model_computes_not_its_folder(tiny_model, tmp_path):
    model = tiny_model().model
    for name in ("a", "b"):
        model.save_pretrained(tmp_path / name)
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("a", "b"))
    assert a.config.name_or_path != b.config.name_or_path
    assert fingerprint(a) == fingerprint(b)  # a moved or freshly cloned project reuses its cached data
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1.0
    assert fingerprint(a) != fingerprint(b)

    loaded = RandomInitSource(model_type="llama", config=TINY, seed=5, device="cpu").load()  # its head changes
    full = loaded.model.get_output_embeddings()
    prints = []
    for subset in ([0, 2, 4, 6], [0, 3, 6, 9]):  # the same weights scoring other tokens write other responses
        use_subset_head(loaded, torch.tensor(subset))
        prints.append(fingerprint(loaded.model))
        restore_full_head(loaded.model, full)
    assert prints[0] != prints[1] and fingerprint(loaded.model) not in prints


def test_the_cache_key_holds_only_what_changes_the_data(tiny_model):
    """A seed sweep regenerated every greedy set, and a top_k sweep every held-out set (which keeps no top-k)."""
    target = tiny_model().model

    def key(kept: int = 4, **settings) -> str:  # kept: the top-k this set keeps
        return DistillData(**settings).key(target, target, PROMPTS, kept)

    assert key(seed=0) == key(seed=1) and key(temperature=1.0, seed=0) != key(temperature=1.0, seed=1)
    assert key(0, top_k=64) == key(0, top_k=16) and key(4) != key(8)
    assert key(max_new_tokens=6) != key(max_new_tokens=7) and key(batch_size=2) == key(batch_size=4)


def test_a_draft_writes_its_responses_as_it_drafts_whatever_mode_it_is_in(tiny_model, single_thread):
    """The distil stage sets the draft training (dropout on) before it writes its on-policy data."""
    model = tiny_model(attention_dropout=0.5).model
    expected = generate_responses(model, PROMPTS, 6, 2)
    model.train()
    try:
        assert generate_responses(model, PROMPTS, 6, 2) == expected and model.training
    finally:
        model.eval()


@pytest.mark.parametrize("family, config", [
    ("llama", {}),
    ("mistral", {"sliding_window": 4}),  # windows shorter than the sequence: the masks must slide as the model does
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
])
def test_unrolled_passes_read_what_the_engines_draft_reads(tiny_model, single_thread, family, config):
    """Pass m at token j must equal the draft run token by token as the engine runs it: the committed
    prefix up to t = j - m + 1 with the target's features, then drafted tokens that read the draft's own
    previous state. An off-by-one in the mask or the features changes the states by O(1), not 1e-5."""
    target = tiny_model(family, **config).model
    draft = LayerSubsetDraft([0, 3], fuse_features=True).build(tiny_model(family, **config)).model
    weight = draft.feature_fusion.proj.weight
    d = weight.shape[0]
    with torch.no_grad():
        weight[:, d:] = 0.3 * torch.randn(d, d, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}

    def run(n: int, feats: torch.Tensor) -> torch.Tensor:  # the draft on the first n tokens, given their features
        return draft.base_model(**model_inputs(draft, tokens[:, :n], feats)).last_hidden_state

    with torch.no_grad():
        batch["features"] = hidden_states(target, batch)
        passes = unrolled_hidden_states(draft, batch, 3)
        committed = shift(batch["features"])
        assert torch.allclose(passes[0], hidden_states(draft, batch), atol=1e-3)
        for t in range(7):
            own = [run(t + 1, committed[:, : t + 1])[:, t]]  # the state the first drafted token reads
            for m in (2, 3):
                feats = torch.cat([committed[:, : t + 1], torch.stack(own, 1)], 1)
                own.append(run(t + m, feats)[:, t + m - 1])
                assert torch.allclose(passes[m - 1][:, t + m - 1], own[-1], atol=1e-3), (t, m)  # rounding: ~2e-4
        assert (passes[1] - passes[0]).abs().max() > 0.1  # the passes differ: the test can fail


def test_a_draft_of_fewer_vocabulary_rows_distils_on_the_ids_it_has(tiny_model) -> None:
    """A draft of one tokenizer padded to fewer rows (Qwen2.5-0.5B for -7B) learns the target's distribution over
    the ids it has, online or from the cache, and reads an id past its rows (a response may hold one)."""
    from specpolicy.distill.losses import forward_kl
    from specpolicy.distill.module import DistillModule

    target = tiny_model("qwen2", vocab_size=320).model
    draft = tiny_model("qwen2", seed=1, vocab_size=300, num_hidden_layers=2).model
    row = {"input_ids": [5, 310, 7, 299, 3, 9], "prompt_len": 2}
    module = DistillModule(draft, target, loss=forward_kl, optimizer=None)
    online = collate_rows([row], 0, None)
    logp = torch.log_softmax(torch.randn(4, 320), -1).topk(4, -1)
    cached = collate_rows([{**row, "topk_ids": logp.indices.tolist(), "topk_logp": logp.values.tolist()}], 0, None)
    for batch in (online, cached):
        p_logits, q_logp, *_ = module._distributions(batch)
        assert p_logits.shape == q_logp.shape == (4, 300)
        assert torch.isfinite(module._loss(p_logits, q_logp))
