"""Analytic forward FLOPs, and the bookkeeping that puts every FLOP the engine spends into one bucket.

Per token processed, a decoder-only transformer's forward pass costs

    C(ctx) = 2 * N_matmul + 4 * n_layer * d_attn * ctx

where N_matmul counts the weights of every matrix multiply the token goes through (attention
projections, MLP, and the LM head; embedding lookups and norms are not matmuls), each used for one
multiply-add (2 FLOPs), and the attention term is QK^T plus the attention-weighted sum of V, each
2 * d_attn FLOPs per key, over `ctx` keys per layer (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Table 1, which counts the QK^T term; Hoffmann et al. 2022, "Training
Compute-Optimal LLMs", App. F, which counts both). d_attn = n_heads * head_dim. A sliding-window
layer (Mistral, some of Qwen2's or Gemma's) reads only its last `window` keys: min(ctx, window) there.

The engine computes attention over the whole cache buffer up to the longest row, in every layer, with
a mask. The keys a token may see (its prefix, or its window of it) are charged to that token's bucket;
the masked keys it computes against anyway are charged to `padding`. The LM head runs only where logits are
needed (a prompt's last token, each verified draft, each draft position), as in plain decoding, so it is
charged per logit row, not per token read: SmolLM2-135M's 49152 x 576 head is a fifth of its weights, and
charging it for every prompt token overstated a 100-token prefill by a quarter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from specpolicy.models.attention import sliding_layers
from specpolicy.models.fusion import unwrap

BUCKETS = ("useful", "rejected", "padding")


def matmul_params(module: torch.nn.Module) -> float:
    """The weights a token multiplies by: every Linear's (or GPT-2's Conv1D's); of experts stacked as [E, out, in]
    parameters (transformers' mixtures of experts), the share of the E a token is routed through
    (`num_experts_per_tok`); and a router's [E, d] weights. Those stacks were left out: a tiny Mixtral counted
    its attention and LM head only, a seventh of its active weights."""
    total = 0.0
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            total += m.weight.numel()
        elif not isinstance(m, torch.nn.Embedding):
            own = list(m.parameters(recurse=False))
            if stacked := [p for p in own if p.dim() == 3]:  # per-expert biases ([E, out]) are no matmul
                total += sum(p.numel() for p in stacked) * _routed_share(module, stacked[0].shape[0])
            else:
                total += sum(p.numel() for p in own if p.dim() == 2)
    return total


def _routed_share(module: torch.nn.Module, experts: int) -> float:
    """The share of `experts` a token goes through, from the model's config."""
    config = getattr(module, "config", None)
    active = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None)
    if not active:  # not a whole model, or a family that names it otherwise: an upper bound
        return 1.0
    return min(int(active), experts) / experts


@dataclass(frozen=True)
class FlopModel:
    matmul_params: float
    n_layer: int
    d_attn: int
    sliding_layers: int = 0  # of the n_layer, those that read only their last `window` keys
    window: int = 0
    head_params: int = 0  # of the matmul_params, the LM head's (a subset head's, for a draft that has one)

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> FlopModel:
        """Matmul weights counted from the modules (GQA, gated MLPs, tied heads, mixtures of experts)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        sliding, window = sliding_layers(cfg)
        return cls(matmul_params(model), cfg.num_hidden_layers, cfg.num_attention_heads * head_dim, sliding,
                   window or 0, matmul_params(unwrap(model).get_output_embeddings()))

    @property
    def head(self) -> float:
        """FLOPs of one row of logits."""
        return 2.0 * self.head_params

    def per_token(self, ctx: float | torch.Tensor) -> float | torch.Tensor:
        """FLOPs to process one token that attends to `ctx` keys (its prefix), as the model itself runs it."""
        local = ctx.clamp(max=self.window) if isinstance(ctx, torch.Tensor) else min(ctx, self.window)
        keys = (self.n_layer - self.sliding_layers) * ctx + self.sliding_layers * local
        return 2 * self.matmul_params + 4 * self.d_attn * keys

    def slot(self, kv_len: int) -> float:
        """FLOPs of one slot of an engine forward over `kv_len` keys, before the LM head: every layer scores
        every key, masked or not."""
        return 2.0 * (self.matmul_params - self.head_params) + 4.0 * self.n_layer * self.d_attn * kv_len

    def prefix(self, starts: torch.Tensor, n: torch.Tensor, heads: torch.Tensor | int = 0) -> torch.Tensor:
        """FLOPs per row of reading n[b] tokens from position starts[b], each attending to its prefix only, and
        scoring `heads` of them with the LM head: with heads = n, sum over i < n of C(starts + i + 1). Plain
        decoding pays this for the same tokens with one head per token it generates from."""
        first, n = starts.double() + 1, n.double()  # token i of the n sees first + i keys of its prefix
        m = (self.window - first + 1).clamp(min=0).minimum(n)  # in a sliding layer, the first m see them all
        keys = ((self.n_layer - self.sliding_layers) * (n * first + (n - 1) * n / 2)
                + self.sliding_layers * (m * first + (m - 1) * m / 2 + (n - m) * self.window))
        return 2.0 * (self.matmul_params - self.head_params) * n + 4.0 * self.d_attn * keys + self.head * heads

    def buckets(
        self, starts: torch.Tensor, width: int, kv_len: int, useful: torch.Tensor, used: torch.Tensor,
        heads: tuple[torch.Tensor | int, int] = (0, 0),
    ) -> torch.Tensor:
        """FLOPs of one forward of `width` slots per row, split into [useful, rejected, padding].

        Row b's slots [0, useful[b]) read kept tokens, [useful[b], used[b]) tokens later thrown away,
        [used[b], width) nothing (padding). Every slot computes attention over `kv_len` keys; the keys
        beyond its own prefix (or window) are masked, and charged to padding. `heads` = (first, count): the
        LM head scores slots [first[b], first[b] + count), each charged to the bucket of its slot.
        """
        first, count = heads
        scored = lambda lo, hi: (hi.clamp(max=first + count) - lo.clamp(min=first)).clamp(min=0)  # noqa: E731
        read_kept = self.prefix(starts, useful)
        kept = read_kept + self.head * scored(torch.zeros_like(useful), useful)
        thrown = self.prefix(starts, used) - read_kept + self.head * scored(useful, used)
        total = (width * self.slot(kv_len) + count * self.head) * torch.ones_like(kept)
        return torch.stack([kept.sum(), thrown.sum(), (total - kept - thrown).sum()])

    def proposals(self, drafting: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The draft's LM head, one row of logits per row of the batch, charged to the fate of the token it
        proposes: useful where that token was kept, rejected where a drafting row threw it away (the target
        rejected it, or the policy stopped before sending it), padding where the row was not drafting and rode
        along in a forward other rows needed."""
        rows = torch.stack([drafting & kept, drafting & ~kept, ~drafting]).sum(1)
        return self.head * rows.to(torch.float64)
