"""Families and settings beyond the tiny llama/qwen2 defaults: the engine computes what the model's own forward does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import DEVICE, TINY
from specpolicy.decode import Engine
from specpolicy.decode.cache import RaggedCache, forward
from specpolicy.errors import SpecPolicyError
from specpolicy.models import RandomInitSource
from specpolicy.models.draft import FreshDraft, LayerSubsetDraft, decoder_layers
from specpolicy.policy import ArPolicy, StaticPolicy

pytestmark = pytest.mark.usefixtures("single_thread")


def test_eager_attention_decodes_as_generate(tiny_model) -> None:
    """Eager attention builds transformers' mask where SDPA uses its causal flag: a single row's prefill saw its
    own future (the base Cache puts the first query after the new keys), so batch 1 decoded other tokens."""
    target = tiny_model("llama", attn_implementation="eager")
    assert target.model.config._attn_implementation == "eager"
    draft = LayerSubsetDraft(layers=[0, 1, 2]).build(target)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (11, 3, 7)]
    refs = [target.model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = Engine(target.model, draft.model, max_new_tokens=10, eos_token_id=[])
    for rows in ([0], [1], [0, 1, 2]):
        for policy in (ArPolicy(), StaticPolicy(k=3)):
            outputs = engine.generate([prompts[r] for r in rows], policy).outputs
            assert outputs == [refs[r] for r in rows], (rows, policy)


@pytest.mark.parametrize("family, config", [
    ("granite", {"logits_scaling": 4.0}),  # logits / 4
    ("cohere", {"logit_scale": 0.5}),  # logits * 0.5
    ("gemma2", {"final_logit_softcapping": 2.0, "head_dim": 16}),  # 2 tanh(logits / 2), sliding-window layers
])
def test_engine_logits_are_the_models_own(tiny_model, family: str, config: dict) -> None:
    """Families whose forward rescales the LM head's output: the engine's logits (which run the head alone) must be
    rescaled alike, or sampling draws from another distribution. A single row, then two rows at other offsets."""
    model = tiny_model(family, **config).model
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()  # [2, 9, V]
        cache = RaggedCache(1, 16)
        logits, _ = forward(model, cache, ids[:1], torch.zeros(1, dtype=torch.long, device=DEVICE), 9,
                            torch.arange(9, device=DEVICE)[None], 15)
        torch.testing.assert_close(logits, expected[:1], atol=1e-4, rtol=1e-4)  # GEMMs of other shapes round apart
        cache = RaggedCache(2, 16)  # row 1 reads its first 4 tokens, then both rows read on from their own offsets
        forward(model, cache, ids[1:, :4], torch.zeros(1, dtype=torch.long, device=DEVICE), 4,
                torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 15, rows=slice(1, 2))
        forward(model, cache, ids[:1, :6], torch.zeros(1, dtype=torch.long, device=DEVICE), 6,
                torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 15, rows=slice(0, 1))
        starts = torch.tensor([6, 4], device=DEVICE)
        chunk = torch.stack([ids[0, 6:9], ids[1, 4:7]])  # [2, 3]
        logits, _ = forward(model, cache, chunk, starts, 9, torch.arange(3, device=DEVICE).expand(2, -1), 15)
    torch.testing.assert_close(logits, torch.stack([expected[0, 6:9], expected[1, 4:7]]), atol=1e-4, rtol=1e-4)


def test_layer_drafts_keep_each_layers_own_kind(tiny_model) -> None:
    """SmolLM3 skips RoPE in every 4th layer (`no_rope_layers`, one entry per layer): a draft of target layers
    [3, 0, 1] must skip it in its layer 0, as target layer 3 does, not in its (nonexistent) layer 3."""
    target = tiny_model("smollm3")
    assert target.model.config.no_rope_layers == [1, 1, 1, 0]
    draft = LayerSubsetDraft(layers=[3, 0, 1]).build(target).model
    assert draft.config.no_rope_layers == [0, 1, 1] and draft.config.layer_types == ["full_attention"] * 3
    assert [layer.self_attn.use_rope for layer in draft.model.layers] == [0, 1, 1]
    ids = torch.tensor([[4, 5, 6, 7, 8]], device=DEVICE)
    with torch.no_grad():  # layer 3 alone, without RoPE, as in the target
        hidden = target.model.model.embed_tokens(ids)
        positions = torch.arange(5, device=DEVICE)[None]
        rope = target.model.model.rotary_emb(hidden, positions)
        hidden = target.model.model.layers[3](hidden, position_embeddings=rope, position_ids=positions,
                                               attention_mask=None)
        expected = target.model.lm_head(target.model.model.norm(hidden))
        got = LayerSubsetDraft(layers=[3]).build(target).model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_layer_drafts_of_a_mixture_of_experts_keep_dense_and_expert_layers_apart() -> None:
    """Qwen2-MoE names its dense layers by number (`mlp_only_layers`): a draft of target layers [1, 2] has the
    dense layer 1 at its layer 0. A kind placed by a rule the new numbering breaks (`decoder_sparse_step`)
    is refused by name, not by a state-dict error."""
    moe = {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32}
    target = RandomInitSource("qwen2_moe", {**moe, "mlp_only_layers": [1, 3]}, device=str(DEVICE)).load()
    draft = LayerSubsetDraft(layers=[1, 2]).build(target).model
    assert draft.config.mlp_only_layers == [0]
    for got, want in zip(draft.model.layers, target.model.model.layers[1:3]):
        assert type(got.mlp) is type(want.mlp)
        torch.testing.assert_close(got.state_dict(), want.state_dict())
    stepped = RandomInitSource("qwen2_moe", {**moe, "decoder_sparse_step": 2}, device=str(DEVICE)).load()
    with pytest.raises(SpecPolicyError, match=r"target layer 1 would sit at draft layer 0, .*draft=fresh"):
        LayerSubsetDraft(layers=[1, 3]).build(stepped)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "phi", "falcon", "opt"])
def test_fresh_drafts_of_families_laid_out_unlike_llama(family: str) -> None:
    """Final norms named ln_f / final_layer_norm, MLP sizes not named intermediate_size, a derived head_dim, OPT's
    layers under model.decoder: each stopped `draft=fresh` with an AttributeError. At the target's width every
    weight outside the layers is the target's; a narrower draft builds and decodes (losslessly, as any draft)."""
    target = RandomInitSource(family, TINY, device=str(DEVICE)).load()
    draft = FreshDraft(num_hidden_layers=1).build(target).model
    in_layers = {id(p) for p in decoder_layers(draft).parameters()}
    t_params = dict(target.model.named_parameters())
    outside = [(name, p) for name, p in draft.named_parameters() if id(p) not in in_layers]
    assert outside and all(torch.equal(p, t_params[name]) for name, p in outside)
    narrow = FreshDraft(num_hidden_layers=1, hidden_size=32, num_attention_heads=2).build(target).model
    engine = Engine(target.model, narrow, max_new_tokens=6, eos_token_id=[])
    prompts = [[5, 6, 7], [8, 9]]
    assert engine.generate(prompts, StaticPolicy(k=2)).outputs == engine.generate(prompts, ArPolicy()).outputs


def test_decoder_layers_are_found_deeper_but_only_as_attention_blocks() -> None:
    """OPT keeps its layers at model.decoder.layers; a list of as many other modules before them (Gemma3n's
    per-layer projections) is not the layer stack."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.Linear(2, 2)

    class Model(torch.nn.Module):
        config = SimpleNamespace(num_hidden_layers=2, model_type="toy")

        def __init__(self) -> None:
            super().__init__()
            self.altup = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([Block(), Block()])

        @property
        def base_model(self) -> torch.nn.Module:
            return self

    model = Model()
    assert decoder_layers(model) is model.decoder.layers


def test_fresh_drafts_keep_the_targets_head_dim(tiny_model) -> None:
    """Qwen3 sets head_dim apart from hidden / heads (here 32, not 64 / 4): a fresh draft of the target's width and
    heads keeps it; a narrower one derives it from its own sizes."""
    target = tiny_model("qwen3", head_dim=32)
    assert FreshDraft(num_hidden_layers=1).build(target).model.config.head_dim == 32
    narrow = FreshDraft(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    assert narrow.build(target).model.config.head_dim == 16


def test_a_peft_wrapped_draft_decodes_as_its_merged_model(tiny_model) -> None:
    """A LoRA draft straight from `get_peft_model` stopped in "'CausalLMOutputWithPast' object has no attribute
    'last_hidden_state'": the engine reads `base_model`, which for a PeftModel is the wrapper of the whole LM."""
    import copy

    import peft

    target = tiny_model("llama")
    # B != 0: it acts; a LoRA embedding (no num_embeddings) too
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"], init_lora_weights=False)
    wrapped = peft.get_peft_model(copy.deepcopy(target.model), lora).eval()
    merged = copy.deepcopy(wrapped).merge_and_unload()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 4, 12)]
    runs = {name: Engine(target.model, draft, max_new_tokens=12, eos_token_id=[]).generate(prompts, StaticPolicy(k=3))
            for name, draft in (("wrapped", wrapped), ("merged", merged), ("unadapted", target.model))}
    plain = Engine(target.model, max_new_tokens=12, eos_token_id=[]).generate(prompts, ArPolicy()).outputs
    assert all(run.outputs == plain for run in runs.values())
    assert runs["wrapped"].stats.accepted == runs["merged"].stats.accepted < runs["unadapted"].stats.accepted
