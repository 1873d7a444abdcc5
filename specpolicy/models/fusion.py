"""Drafts that read the target's features as well as tokens (EAGLE, Li et al. 2024).

A draft made of a few target layers sees only tokens, and on SmolLM2-135M it plateaus at ~0.35 greedy
agreement however much data it gets. The target's last hidden state at position j-1 already encodes
most of what token j+1 will be, and the verify pass computes it anyway. A fusing draft's input at
token j is `proj([embed(x_j); f_{j-1}])`, where f_{j-1} is the target's final (post-norm) hidden state
at the previous position, or, while drafting past the committed tokens, the draft's own last hidden
state there: it predicts the target's next feature and scores tokens with the target's head.

The draft stays a standard HF causal LM with one extra submodule, `feature_fusion`, and a config flag,
so it saves as an HF folder and loads through `PretrainedSource`; it is not usable as transformers'
`assistant_model=`, which has no way to pass it features.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

FLAG = "fuse_target_features"  # in config.json: the folder holds a fusing draft


class FeatureFusion(torch.nn.Module):
    """[token embedding; target feature] -> the draft's input, one linear map. It starts by passing the
    embedding through and ignoring the feature, i.e. as the draft without fusion; distillation teaches it
    to read the feature (the gradient of the zero block is not zero)."""

    def __init__(self, hidden: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        with torch.no_grad():
            self.proj.weight.zero_()[:, :hidden].copy_(torch.eye(hidden, dtype=dtype))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([embeds, features.to(embeds.dtype)], -1))


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The HF model inside a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fuses_features(model: torch.nn.Module | None) -> bool:
    return model is not None and isinstance(getattr(unwrap(model), "feature_fusion", None), FeatureFusion)


def attach_fusion(model: PreTrainedModel) -> PreTrainedModel:
    """Give `model` a fusion layer (saved with its weights by `save_pretrained`) and flag its config."""
    param = next(model.parameters())
    model.feature_fusion = FeatureFusion(model.config.hidden_size, param.dtype).to(param.device)
    setattr(model.config, FLAG, True)
    return model


def load_fusion(model: PreTrainedModel, folder: str | Path) -> None:
    """After `from_pretrained` (which drops the weights its family class does not know): rebuild the
    fusion layer of a flagged folder and read its weights from the folder's safetensors files."""
    from safetensors.torch import load_file

    if not getattr(model.config, FLAG, False):
        return
    attach_fusion(model)
    prefix = "feature_fusion."
    state = {k.removeprefix(prefix): v for f in sorted(Path(folder).glob("*.safetensors"))
             for k, v in load_file(f).items() if k.startswith(prefix)}
    model.feature_fusion.load_state_dict(state)


def model_inputs(model: torch.nn.Module, tokens: torch.Tensor, features: torch.Tensor | None) -> dict:
    """Keyword inputs of `model.base_model` for `tokens` [B, W]; a fusing draft also needs `features`
    [B, W, d], the feature each token reads (the target's at the previous position). A draft of fewer rows than
    its target (`vocab.draft_ids`) reads an id past them, which only a padding row of the target's head could
    write, as its last row: the target still decides every token."""
    hf = unwrap(model)
    tokens = tokens.clamp(max=hf.get_input_embeddings().weight.shape[0] - 1)  # peft's has no num_embeddings
    if not fuses_features(hf):
        return {"input_ids": tokens}
    if features is None:
        raise ValueError("a feature-fusing draft needs the target's features for every token it reads")
    return {"inputs_embeds": hf.feature_fusion(hf.get_input_embeddings()(tokens), features)}


def timing_features(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """What a fusing draft reads beside `tokens` [B, W] in a timed forward (any values cost the same);
    None for any other model."""
    if not fuses_features(model):
        return None
    hf = unwrap(model)
    return torch.zeros(*tokens.shape, hf.config.hidden_size, dtype=hf.dtype, device=tokens.device)


def shift(hidden: torch.Tensor) -> torch.Tensor:
    """Target hidden states [B, L, d] -> the feature each token reads: f_{j-1} at j, zeros at 0."""
    return torch.nn.functional.pad(hidden, (0, 0, 1, 0))[:, :-1]
