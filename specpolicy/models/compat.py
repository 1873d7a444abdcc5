"""Target/draft compatibility: speculative decoding is only lossless if both speak the same tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specpolicy.errors import SpecPolicyError
from specpolicy.models.fusion import fuses_features

if TYPE_CHECKING:
    from specpolicy.models.loading import LoadedModel

FIX = ("build the draft from the target (draft=layers or draft=fresh) or pick a draft trained with the target's "
       "tokenizer")


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise a one-line `SpecPolicyError` naming both sides when the pair cannot be used together."""
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if len(t_tok) != len(d_tok) or t_tok.get_vocab() != d_tok.get_vocab():
        raise SpecPolicyError(
            f"draft tokenizer differs from the target's (target {target.name}: {len(t_tok)} tokens, "
            f"draft {draft.name}: {len(d_tok)} tokens); {FIX}"
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        t_id, d_id = getattr(t_tok, attr), getattr(d_tok, attr)
        if t_id != d_id:
            raise SpecPolicyError(f"{attr} differs (target {target.name}: {t_id}, draft {draft.name}: {d_id}); {FIX}")
    t_vocab, d_vocab = target.model.config.vocab_size, draft.model.config.vocab_size
    if t_vocab != d_vocab:
        raise SpecPolicyError(
            f"output vocabulary sizes differ (target {target.name}: {t_vocab}, draft {draft.name}: {d_vocab}); {FIX}"
        )
    if draft.context_length < target.context_length:
        raise SpecPolicyError(
            f"draft context is shorter than the target's (target {target.name}: {target.context_length}, "
            f"draft {draft.name}: {draft.context_length}); use a draft with at least the target's context"
        )
    t_width, d_width = target.model.config.hidden_size, draft.model.config.hidden_size
    if fuses_features(draft.model) and t_width != d_width:
        raise SpecPolicyError(
            f"draft {draft.name} reads the target's features, so its hidden size must be the target's (target "
            f"{target.name}: {t_width}, draft: {d_width}); use the target it was distilled from, or build a fusing "
            f"draft from this target's layers (draft=layers draft_fuse_features=true)"
        )
    t_param, d_param = next(target.model.parameters()), next(draft.model.parameters())
    if (t_param.device, t_param.dtype) != (d_param.device, d_param.dtype):
        raise SpecPolicyError(
            f"target and draft live on different devices/dtypes (target: {t_param.device}/{t_param.dtype}, "
            f"draft: {d_param.device}/{d_param.dtype}); set runtime.device and runtime.dtype once for both"
        )
