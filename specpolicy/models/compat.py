"""Target/draft compatibility: speculative decoding is only lossless if both speak the same tokens."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specpolicy.errors import SpecPolicyError
from specpolicy.models.fusion import fuses_features
from specpolicy.models.loading import context_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specpolicy.models.loading import LoadedModel

log = logging.getLogger("specpolicy")
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
    # the same tokens, other special ones (a base model drafting for its instruct sibling ends text, not turns):
    # lossless still, as the engine reads the target's prompts and stops at the target's EOS; this was refused
    differ = [f"{attr} {getattr(t_tok, attr)} vs {getattr(d_tok, attr)}" for attr in
              ("eos_token_id", "bos_token_id", "pad_token_id") if getattr(t_tok, attr) != getattr(d_tok, attr)]
    if differ:
        log.warning("the draft %s has the target's tokens but other special ones (target vs draft: %s); decoding "
                    "stops at the target's end tokens, so outputs are unchanged", draft.name, ", ".join(differ))
    check_models(target.model, draft.model, target.name, draft.name)


def check_models(target: PreTrainedModel, draft: PreTrainedModel, t_name: str | None = None,
                 d_name: str | None = None) -> None:
    """What the models alone tell (`Engine` checks these, as it gets no tokenizers): no draft token the target
    lacks, enough context, the target's width for a draft that reads its features, one device and dtype. A draft
    of fewer rows drafts in the ids both have (`vocab.draft_ids`): Qwen2.5-0.5B for -7B, one tokenizer padded to
    151936 and 152064 rows."""
    # first: `context_length` refuses a multimodal config, which has no vocab_size
    t_context, d_context = context_length(target.config), context_length(draft.config)
    t_name = t_name or target.config.name_or_path or target.config.model_type
    d_name = d_name or draft.config.name_or_path or draft.config.model_type
    t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
    if d_vocab > t_vocab:
        raise SpecPolicyError(f"output vocabulary sizes differ (target {t_name}: {t_vocab}, draft {d_name}: "
                              f"{d_vocab}): the draft could propose ids the target does not have; {FIX}")
    if d_context < t_context:
        raise SpecPolicyError(f"draft context is shorter than the target's (target {t_name}: {t_context}, draft "
                              f"{d_name}: {d_context}); use a draft with at least the target's context")
    t_width, d_width = target.config.hidden_size, draft.config.hidden_size
    if fuses_features(draft) and t_width != d_width:
        raise SpecPolicyError(
            f"draft {d_name} reads the target's features, so its hidden size must be the target's (target "
            f"{t_name}: {t_width}, draft: {d_width}); use the target it was distilled from, or build a fusing "
            f"draft from this target's layers (draft=layers draft_fuse_features=true)"
        )
    t_param, d_param = next(target.parameters()), next(draft.parameters())
    if (t_param.device, t_param.dtype) != (d_param.device, d_param.dtype):
        raise SpecPolicyError(
            f"target and draft live on different devices/dtypes (target: {t_param.device}/{t_param.dtype}, "
            f"draft: {d_param.device}/{d_param.dtype}); set runtime.device and runtime.dtype once for both"
        )
