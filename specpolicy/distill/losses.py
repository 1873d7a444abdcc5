"""Divergences between the draft's and the target's next-token distributions, as pure functions.

Notation of the speculative-decoding papers: p is the draft, q the target. Every divergence takes
log-probabilities `p_logp`, `q_logp` of shape [N, V] and returns one value per position, [N], so the
caller chooses the reduction and the mask. Which divergence to minimise is a config choice
(`conf/distill/loss/*.yaml`): DistillSpec (Zhou et al., 2024) finds the best one depends on the pair
and the decoding temperature, and that TVD is the quantity speculative decoding actually pays for:
the expected acceptance of one draft token is Σ_v min(p_v, q_v) = 1 − TVD(p, q) (Leviathan et al., 2023).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpolicy.errors import SpecPolicyError
from specpolicy.models.vocab import spread


def log_probs(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Temperature-scaled log-softmax in float32 (bf16 log-softmax over 49k tokens loses the tail)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _kl(a_logp: Tensor, b_logp: Tensor) -> Tensor:
    """KL(a || b) = Σ a (log a − log b), with 0 · log 0 = 0 where a vanishes."""
    a = a_logp.exp()
    return torch.where(a > 0, a * (a_logp - b_logp), 0.0).sum(-1)


def forward_kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """KL(q || p): mode-covering; the classic distillation loss (Hinton et al.), [N]."""
    return _kl(q_logp, p_logp)


def reverse_kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """KL(p || q): mode-seeking; the draft concentrates on the target's likeliest tokens, [N]."""
    return _kl(p_logp, q_logp)


def tvd(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """Total variation distance ½ Σ |p − q| = 1 − Σ min(p, q): one minus the expected acceptance, [N]."""
    return 1.0 - torch.minimum(p_logp.exp(), q_logp.exp()).sum(-1)


def jsd(p_logp: Tensor, q_logp: Tensor, beta: float = 0.5) -> Tensor:
    """Generalised Jensen-Shannon divergence (GKD / DistillSpec), [N].

    JSD(β) = β KL(q || m) + (1 − β) KL(p || m) with m = β q + (1 − β) p. β = 0.5 is the symmetric JSD;
    its gradients approach forward KL as β → 0 and reverse KL as β → 1 (Agarwal et al., 2024).
    """
    if not 0.0 < beta < 1.0:
        raise SpecPolicyError(f"distill.loss.beta (jsd) must be in (0, 1), got {beta}; for the endpoints use "
                              f"distill/loss=forward_kl or reverse_kl")
    m_logp = torch.logsumexp(torch.stack([q_logp + torch.log(torch.tensor(beta)),
                                          p_logp + torch.log(torch.tensor(1.0 - beta))]), dim=0)  # [N, V]
    return beta * _kl(q_logp, m_logp) + (1.0 - beta) * _kl(p_logp, m_logp)


def dense_from_topk(topk_ids: Tensor, topk_logp: Tensor, vocab_size: int, vocab: Tensor | None = None) -> Tensor:
    """Full log-probabilities [N, V] from a cached top-k [N, k], the leftover mass spread evenly over the rest.

    Spreading the tail (rather than dropping it) keeps q > 0 everywhere, so reverse KL and JSD stay
    finite, and leaves the top-k probabilities exactly as the target gave them. With `vocab` (the token
    ids a draft's subset head scores, [n]) the columns are those tokens only, [N, n]: the same values,
    restricted, not renormalised.
    """
    topk_logp = topk_logp.float()
    n, k = topk_ids.shape
    tail_mass = (1.0 - topk_logp.exp().sum(-1, keepdim=True)).clamp_min(1e-8)  # [N, 1]
    tail_logp = (tail_mass / max(vocab_size - k, 1)).log()
    width, cols = vocab_size, topk_ids.long()
    if vocab is not None:  # each token's column in the subset; a spare column `width`, dropped, if outside
        width = len(vocab)
        cols = spread(torch.arange(width, device=cols.device), vocab.to(cols.device), vocab_size, width)[cols]
    out = tail_logp.expand(n, width + 1).clone()  # [N, width + 1]
    return out.scatter_(-1, cols, topk_logp)[:, :width]
