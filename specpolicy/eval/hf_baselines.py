"""transformers' own decoding on the same models and prompts, timed like the engine, so every
report shows whether the engine's baseline is honest (`hf_generate`) and how it compares with
transformers' assisted generation (`hf_assisted`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from transformers import GenerationConfig, PreTrainedModel

from specpolicy.errors import SpecPolicyError
from specpolicy.eval.runner import Baseline
from specpolicy.models.fusion import fuses_features
from specpolicy.models.loading import eos_ids
from specpolicy.runtime import synchronize


def hf_decoders(target: PreTrainedModel, draft: PreTrainedModel, batch_size: int, max_new_tokens: int,
                pad_id: int | None, eos: list[int], assisted: dict[str, int], temperature: float = 0.0,
                top_p: float = 1.0) -> dict[str, Baseline]:
    """transformers' decoders for one batch size, as `eval.runner.side_by_side` takes them: `generate`, and at batch
    1 assisted generation under each name in `assisted` at its k (where the pair allows it: `unassistable`). `eos`:
    the engine's end tokens (`Engine.eos`), which `engine.eos_token_id` may set apart from the model's: read from
    its generation_config, transformers' decoders wrote on past an EOS the engine stopped at."""
    warp = {"temperature": temperature, "top_p": top_p}
    decoders = {"hf_generate": partial(hf_generate, target, max_new_tokens=max_new_tokens, pad_id=pad_id, eos_id=eos,
                                       **warp)}
    if batch_size == 1 and not unassistable(target, draft):
        decoders.update({name: partial(hf_assisted, target, draft, max_new_tokens=max_new_tokens, k=k, eos_id=eos,
                                       **warp) for name, k in assisted.items()})
    return decoders


@contextmanager
def _neutral(*models: PreTrainedModel) -> Iterator[None]:
    """The models with a generation_config of transformers' defaults (their token ids kept) while they generate: a
    hub model's own (repetition_penalty, no_repeat_ngram_size, min_new_tokens, ...) changed what the baseline
    decoded and what it cost, and `generate` fills every setting it is not given from it."""
    saved = [model.generation_config for model in models]
    for model, config in zip(models, saved):
        model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                                   pad_token_id=config.pad_token_id)
    try:
        yield
    finally:
        for model, config in zip(models, saved):
            model.generation_config = config


def _timed(fn: Callable[[], list[list[int]]], device: torch.device) -> tuple[list[list[int]], float]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def sampling(temperature: float, top_p: float) -> dict:
    """`generate`'s settings for the engine's sampling: greedy at temperature 0; else softmax(logits/T) within
    top-p, as `decode.sampling.probs`, with the top-k of 50 that transformers applies by default switched off."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, pad_id: int | None,
                eos_id: int | list[int] | None, temperature: float = 0.0,
                top_p: float = 1.0) -> tuple[list[list[int]], float]:
    """`model.generate` on one left-padded batch: generated ids per prompt (cut after EOS) and seconds. A tokenizer
    without a pad token (Llama 3, GPT-2) pads with EOS, as `generate` itself does; the mask hides it."""
    if pad_id is None:
        pad_id = (eos_ids(eos_id) or [0])[0]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)

    def run() -> list[list[int]]:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=eos_id, **sampling(temperature, top_p))
        return [_cut(row[width:].tolist(), eos_id) for row in out]

    with _neutral(model):
        return _timed(run, model.device)


def assisted_settings(k: int) -> dict:
    """transformers 5.x defaults are 20 draft tokens, a constant schedule and a 0.4 confidence cut-off; pin
    k, the schedule and no cut-off so the comparison with static k is like for like."""
    return {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


@torch.inference_mode()
def hf_assisted(target: PreTrainedModel, draft: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int,
                k: int, eos_id: int | list[int] | None, temperature: float = 0.0,
                top_p: float = 1.0) -> tuple[list[list[int]], float]:
    """Assisted generation (`assistant_model=`; speculative sampling when sampled), one prompt at a time (it
    supports batch 1 only)."""
    if why := unassistable(target, draft):
        raise SpecPolicyError(f"{why}; compare this draft with the engine's policies only")
    settings = assisted_settings(k)

    def run() -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=target.device)
            out = target.generate(input_ids=ids, assistant_model=draft, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_id, **settings, **sampling(temperature, top_p))
            outs.append(_cut(out[0, len(p):].tolist(), eos_id))
        return outs

    with _neutral(target, draft):
        draft.generation_config.update(**settings)  # the assistant drafts by its own generation_config
        return _timed(run, target.device)


def unassistable(target: PreTrainedModel, draft: PreTrainedModel) -> str | None:
    """Why transformers' assisted generation cannot run this pair, or None: it cannot pass a draft the target's
    features, and it takes a draft of another vocabulary size for one of another tokenizer (and asks for both
    tokenizers), where the engine drafts in the ids both models have."""
    if fuses_features(draft):
        return "transformers' assisted generation cannot pass a draft the target's features"
    rows = draft.config.vocab_size, target.config.vocab_size
    if rows[0] != rows[1]:
        return (f"transformers' assisted generation takes a draft of another vocabulary size ({rows[0]} rows, target "
                f"{rows[1]}) for one of another tokenizer")
    return None


def _cut(ids: list[int], eos_id: int | list[int] | None) -> list[int]:
    eos = set(eos_ids(eos_id))
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids
