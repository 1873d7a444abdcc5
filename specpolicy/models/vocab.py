"""A draft LM head over a frequency-ranked subset of the vocabulary (FR-Spec, Zhao et al. 2025).

A small draft shares the target's 49k-row LM head, and that one matmul is ~0.2 of the target's per-token
FLOPs on SmolLM2-135M: no draft that keeps it can cost less. Most of those rows are tokens the target
hardly ever writes, so the draft scores only the `size` tokens most frequent in the target's own
responses to the training prompts; the target still verifies over the full vocabulary, so decoding stays
lossless, and a draft token outside the subset is simply never proposed.

The subset is a property of how the draft runs, not of its weights: the saved draft folder is a standard
HF model with its full head (so `AutoModelForCausalLM` and `assistant_model=` keep working) plus
`draft_vocab.json`, which `PretrainedDraft` applies when it loads the folder.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import PretrainedConfig

from specpolicy.models.fusion import unwrap
from specpolicy.models.loading import LoadedModel
from specpolicy.models.skinny import SkinnyLinear, use_skinny_gemm

VOCAB_FILE = "draft_vocab.json"


class SubsetHead(torch.nn.Module):
    """Scores `token_ids` only; `forward` returns full-vocabulary logits (−inf elsewhere) so every caller,
    from the decode engine to transformers' assisted generation, sees an ordinary LM head."""

    def __init__(self, full_head: torch.nn.Module, token_ids: torch.Tensor):
        super().__init__()
        self.vocab_size, width = full_head.weight.shape
        bias = getattr(full_head, "bias", None)  # most LMs have none; some (e.g. GPT-J, Phi-2) do
        self.subset = torch.nn.Linear(width, len(token_ids), bias=bias is not None, device=full_head.weight.device,
                                      dtype=full_head.weight.dtype).requires_grad_(False)
        self.subset.weight.copy_(full_head.weight.detach()[token_ids])
        if bias is not None:
            self.subset.bias.copy_(bias.detach()[token_ids])
        if isinstance(full_head, SkinnyLinear):  # score the subset the way the full head scored the vocabulary
            use_skinny_gemm(self.subset)
        self.register_buffer("token_ids", token_ids.to(full_head.weight.device), persistent=False)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the subset, [..., size], in the order of `token_ids`."""
        return self.subset(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return spread(self.scores(hidden), self.token_ids, self.vocab_size, float("-inf"))


def spread(values: torch.Tensor, token_ids: torch.Tensor, vocab_size: int, fill: float) -> torch.Tensor:
    """Values over a subset [..., n], in the order of its `token_ids`, laid out over the whole vocabulary
    [..., vocab_size] with `fill` elsewhere (-inf for logits, 0 for probabilities)."""
    return values.new_full((*values.shape[:-1], vocab_size), fill).index_copy_(-1, token_ids, values)


def frequent_tokens(responses: Iterable[list[int]], size: int, vocab_size: int,
                    always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` token ids the draft keeps: `always` (EOS, chat-template tokens) first, then by count in
    `responses`, then by id (BPE merge order, a rough proxy for corpus frequency) to fill the rest."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} tokens must be in 1..{vocab_size}")
    counts = Counter(t for r in responses for t in r)
    ranked = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common()), *range(vocab_size)]))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def use_subset_head(draft: LoadedModel, token_ids: torch.Tensor) -> None:
    """Swap the draft's LM head for a `SubsetHead` and say so in its name; the full head stays in
    `draft.full_head`, for `restore_full_head` (a tied head costs nothing to keep: it is the embedding)."""
    draft.full_head = draft.model.get_output_embeddings()
    draft.model.set_output_embeddings(SubsetHead(draft.full_head, token_ids))
    draft.name += f"-vocab{len(token_ids)}"


def restore_full_head(model: torch.nn.Module, full: torch.nn.Module) -> None:
    """Put the full head back (before saving an HF folder). The subset head is frozen, so nothing is lost."""
    model.set_output_embeddings(full)


def scorer(model: torch.nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
    """What scores `model`'s hidden states over the tokens it can write, as its own forward does (`rescale`), and
    the token id of each score (None: the whole vocabulary, in id order). A `SubsetHead` scores its subset only, so
    a caller that works in the subset's own index (the decode engine drafting, distillation's loss) never builds,
    reads or softmaxes [..., 49k] logits that are -inf outside it."""
    hf = unwrap(model)
    head = hf.get_output_embeddings()
    score, ids = (head.scores, head.token_ids) if isinstance(head, SubsetHead) else (head, None)
    return (lambda hidden: rescale(hf.config, score(hidden))), ids


def rescale(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """What a family's `ForCausalLM.forward` (transformers 5.x) does to its LM head's output, op for op: callers that
    run the head alone would otherwise sample from, and distil towards, other distributions (greedy is unaffected).
    Granite divides by `logits_scaling` (MiniCPM3 divides the hidden states, the same for a linear head; HyperCLOVA X
    multiplies), Cohere multiplies by `logit_scale` (MPT's config has one that its forward ignores), Gemma 2-4 cap
    with tanh at `final_logit_softcapping`."""
    if (scaling := getattr(config, "logits_scaling", None)) not in (None, 1):
        logits = logits * scaling if config.model_type == "hyperclovax" else logits / scaling
    if (scale := getattr(config, "logit_scale", None)) not in (None, 1) and config.model_type != "mpt":
        logits = logits * scale
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def subset_of(model: torch.nn.Module) -> torch.Tensor | None:
    """The token ids a model's head scores, or None when it scores the whole vocabulary."""
    return scorer(model)[1]


def logits_width(model: torch.nn.Module) -> int:
    """Logits per position that the model's forward returns: its LM head's rows, or a `SubsetHead`'s whole
    vocabulary (a subset draft decodes alone when it writes its own distillation data)."""
    head = unwrap(model).get_output_embeddings()
    return head.vocab_size if isinstance(head, SubsetHead) else head.weight.shape[0]


def draft_ids(draft: torch.nn.Module, target_vocab: int) -> torch.Tensor | None:
    """The target's token id of each score the draft gives, in the order it gives them: its subset's (`SubsetHead`),
    or its first `d` where its vocabulary is smaller (d < `target_vocab`): one tokenizer's models padded to other
    sizes (Qwen2.5-0.5B has 151936 rows, -7B 152064) draft in the ids they share. None: the whole vocabulary."""
    ids = subset_of(draft)
    rows = unwrap(draft).config.vocab_size
    if ids is None and rows < target_vocab:
        ids = torch.arange(rows, device=next(draft.parameters()).device)
    return ids


def vocab_file_text(token_ids: torch.Tensor) -> str:
    return json.dumps({"token_ids": token_ids.tolist()})


def load_vocab(folder: str | Path) -> torch.Tensor | None:
    """The subset saved beside a draft, or None (a full-vocabulary draft, or a hub id)."""
    path = Path(folder).expanduser() / VOCAB_FILE  # as the model itself loads (`PretrainedSource`)
    if not path.is_file():
        return None
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)
