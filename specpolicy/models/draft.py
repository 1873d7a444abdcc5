"""Draft models built from, or checked against, the target.

Every draft source has `build(target) -> LoadedModel`, so `conf/draft/*.yaml` can swap how the draft
is made without the pipeline knowing: a subset of the target's layers (any indices, sharing its
embedding, final norm and head), or a pretrained model (hub id, HF folder, GGUF; e.g. a distilled draft).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from specpolicy.errors import SpecPolicyError
from specpolicy.models.compat import check_compatible
from specpolicy.models.loading import LoadedModel, PretrainedSource

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer blocks, wherever the family keeps it (model.layers, transformer.h, ...)."""
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return getattr(base, name)
    raise SpecPolicyError(f"cannot find the decoder layers of a {model.config.model_type} model to build a draft")


@dataclass
class LayerSubsetDraft:
    """The target's embedding, final norm and head around a subset of its layers (e.g. [0, 1, -2, -1])."""

    layers: list[int]

    def build(self, target: LoadedModel) -> LoadedModel:
        source = decoder_layers(target.model)
        n = len(source)
        try:
            picked = [source[i] for i in self.layers]
        except IndexError:
            raise SpecPolicyError(f"draft.layers={list(self.layers)} indexes outside the target's {n} layers") from None
        if not picked:
            raise SpecPolicyError("draft.layers is empty; list at least one target layer index")
        config = copy.deepcopy(target.model.config)
        config.num_hidden_layers = len(picked)
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i] for i in self.layers]
        param = next(target.model.parameters())
        draft = AutoModelForCausalLM.from_config(config, dtype=param.dtype).to(param.device)
        prefix = _layer_prefix(target.model, source)
        state = {k: v for k, v in target.model.state_dict().items() if not k.startswith(prefix)}
        for new_idx, layer in enumerate(picked):
            state.update({f"{prefix}{new_idx}.{k}": v for k, v in layer.state_dict().items()})
        draft.load_state_dict(state, strict=True)
        draft.eval().requires_grad_(False)
        indices = [i % n for i in self.layers]
        return LoadedModel(draft, target.tokenizer, f"{target.name}-layers{'_'.join(map(str, indices))}")


def _layer_prefix(model: torch.nn.Module, layers: torch.nn.ModuleList) -> str:
    for name, module in model.named_modules():
        if module is layers:
            return name + "."
    raise AssertionError("decoder layers not found among the model's modules")


@dataclass
class PretrainedDraft:
    """A ready-made draft (e.g. a distilled one), checked against the target before use."""

    source: PretrainedSource

    def build(self, target: LoadedModel) -> LoadedModel:
        draft = self.source.load()
        check_compatible(target, draft)
        return draft
