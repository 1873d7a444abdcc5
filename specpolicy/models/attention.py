"""Which keys each layer's attention reads: the whole prefix, or a sliding window of the last few.

The engine, the distillation data and the FLOP count all build on this one reading of a config, so a
Mistral- or Qwen2-style model is masked, trained and charged the same way transformers runs it.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from specpolicy.errors import SpecPolicyError

ATTENTION_TYPES = ("full_attention", "sliding_attention")


def sliding_layers(config: PretrainedConfig) -> tuple[int, int | None]:
    """(how many layers slide, over how many of their last keys), or (0, None) when every layer sees its whole
    prefix. Without `layer_types` (Mistral) a window applies to every layer of a family whose code applies one;
    with them (Qwen2, Gemma) to those typed `sliding_attention`. A model with other kinds of layers (chunked,
    linear attention), whose ALiBi needs a 2D mask (Bloom, Falcon's option), or that places its own window (GPT-Neo)
    is refused."""
    if config.model_type == "bloom" or getattr(config, "alibi", False) is True:  # Falcon's option
        raise SpecPolicyError(f"{config.model_type} with ALiBi builds its position biases from a 2D padding mask, "
                              f"which cannot say where each row's cache ends; specpolicy needs a model that takes a 4D "
                              f"attention mask (RoPE or learned positions, or MPT's ALiBi)")
    if "local" in (getattr(config, "attention_layers", None) or ()):  # GPT-Neo: rows of other lengths decoded wrong
        raise SpecPolicyError(f"{config.model_type}'s local attention layers place their window by the length of the "
                              f"whole cache, not of each row, so a batch of rows of other lengths cannot decode "
                              f"exactly; specpolicy needs a model whose attention takes a 4D mask alone")
    types = getattr(config, "layer_types", None)
    unknown = sorted(set(types or ()) - set(ATTENTION_TYPES))
    if unknown:
        raise SpecPolicyError(f"{config.model_type} has {unknown} attention layers; specpolicy supports "
                              f"{list(ATTENTION_TYPES)} only")
    window = getattr(config, "sliding_window", None)  # Qwen2-MoE writes 0 for none
    if ignored_window(config):  # masking by it decoded other tokens than the model's forward
        return 0, None
    n = config.num_hidden_layers if types is None else types.count("sliding_attention")
    return (n, int(window)) if window and n else (0, None)


def ignored_window(config: PretrainedConfig) -> int | None:
    """A `sliding_window` the config holds and the family's attention code never reads (Llama's config stores the
    key, and a "llamafied" checkpoint may carry it), or None. The engine attends to the whole prefix, as the
    model's forward does; transformers' generate instead crops its cache to the window once past it."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "layer_types", None) is None and not _applies_window(type(config)):
        return int(window)
    return None


@functools.cache
def _applies_window(config_class: type[PretrainedConfig]) -> bool:
    """Whether a family without `layer_types` applies a `sliding_window` its config holds (Mistral's modeling code
    does; Llama's does not), told by the code of the family's causal LM class."""
    try:
        model_class = AutoModelForCausalLM._model_mapping[config_class]
    except KeyError:  # a family transformers does not list: as its config says
        return True
    return "sliding_window" in inspect.getsource(sys.modules[model_class.__module__])


def sliding_window(config: PretrainedConfig) -> int | None:
    """How many of its last keys a sliding-window layer sees, or None when no layer slides."""
    return sliding_layers(config)[1]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4D-ready attention mask from a boolean one: 0 where a query may see a key, the dtype's minimum
    where not. transformers adds a 4D mask to the scores as given, in every attention implementation."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def layer_masks(config: PretrainedConfig, window: int | None, visible: torch.Tensor, behind: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask(s) to pass as `attention_mask`: `visible` [B, 1, W, T] says which keys each query may
    see; sliding-window layers (`window`: `sliding_window(config)`, which the caller has at hand) also drop keys
    `window` or more positions behind it (`behind` [B, 1, W, T], transformers' rule). A model with
    `layer_types` takes a mask per type, one without them a single mask."""
    if window is None:
        return additive_mask(visible, dtype)
    local = additive_mask(visible & (behind < window), dtype)
    if getattr(config, "layer_types", None) is None:
        return local
    return {"full_attention": additive_mask(visible, dtype), "sliding_attention": local}
