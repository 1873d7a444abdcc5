"""Analytic forward FLOPs, and the bookkeeping that puts every FLOP the engine spends into one bucket.

Per token processed, a decoder-only transformer's forward pass costs

    C(ctx) = 2 * N_matmul + 4 * n_layer * d_attn * ctx

where N_matmul counts the weights of every matrix multiply the token goes through (attention
projections, MLP, and the LM head; embedding lookups and norms are not matmuls), each used for one
multiply-add (2 FLOPs), and the attention term is QK^T plus the attention-weighted sum of V, each
2 * d_attn FLOPs per key, over `ctx` keys per layer (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Table 1, which counts the QK^T term; Hoffmann et al. 2022, "Training
Compute-Optimal LLMs", App. F, which counts both). d_attn = n_heads * head_dim.

The engine computes attention over the whole cache buffer up to the longest row, with a mask. The
keys a token may see (its prefix) are charged to that token's bucket; the masked keys it computes
against anyway are charged to `padding`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

BUCKETS = ("useful", "rejected", "padding")


@dataclass(frozen=True)
class FlopModel:
    matmul_params: int
    n_layer: int
    d_attn: int

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> FlopModel:
        """Matmul weights counted from the modules (exact for any family: GQA, gated MLPs, tied heads)."""
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(matmul, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)

    def per_token(self, ctx: float | torch.Tensor) -> float | torch.Tensor:
        """FLOPs to process one token that attends to `ctx` keys."""
        return 2 * self.matmul_params + 4 * self.n_layer * self.d_attn * ctx

    def prefix(self, starts: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """FLOPs per row of reading n[b] tokens from position starts[b], each attending to its prefix only:
        sum over i < n of C(starts + i + 1). This is also what plain decoding pays for the same tokens."""
        s, n = starts.double(), n.double()
        seen = n * (s + 1) + (n - 1) * n / 2
        return 2.0 * self.matmul_params * n + 4.0 * self.n_layer * self.d_attn * seen

    def buckets(
        self, starts: torch.Tensor, width: int, kv_len: int, useful: torch.Tensor, used: torch.Tensor
    ) -> torch.Tensor:
        """FLOPs of one forward of `width` slots per row, split into [useful, rejected, padding].

        Row b's slots [0, useful[b]) read kept tokens, [useful[b], used[b]) tokens later thrown away,
        [used[b], width) nothing (padding). Every slot computes attention over `kv_len` keys; the keys
        beyond its own prefix are masked, and charged to padding.
        """
        kept = self.prefix(starts, useful)
        thrown = self.prefix(starts, used) - kept
        total = width * self.per_token(float(kv_len)) * torch.ones_like(kept)
        return torch.stack([kept.sum(), thrown.sum(), (total - kept - thrown).sum()])
