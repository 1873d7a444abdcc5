"""The features a depth policy sees at each draft position: ONE definition, used by the decode engine
and by rollout collection, so a head trained on rollouts sees exactly what it will see when decoding.

Per row and draft position (from the draft's temperature-1 distribution over the next token):
  top1      probability of the draft's most likely token
  entropy   entropy of the draft distribution (nats)
  margin    top-1 minus top-2 probability
  cum_top1  product of top1 along the draft so far (a crude P(all accepted so far))
  position  1-based position in the draft
Per step, the batch load:
  rows      rows in flight (unfinished sequences in the batch)
  tokens    tokens in flight: the context (KV) tokens of all rows in flight
"""

from __future__ import annotations

import torch

FEATURE_NAMES = ("top1", "entropy", "margin", "cum_top1", "position", "rows", "tokens")
COLUMN = {name: i for i, name in enumerate(FEATURE_NAMES)}


def draft_features(
    logits: torch.Tensor, cum_top1: torch.Tensor, position: int, rows: int, tokens: int
) -> torch.Tensor:
    """logits [B, V], cum_top1 [B] (product of top1 before this position) -> features [B, F]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top2 = p.topk(min(2, p.shape[-1]), dim=-1).values  # [B, 2]; a one-token draft vocabulary has no runner-up:
    top2 = torch.nn.functional.pad(top2, (0, 2 - top2.shape[-1]))  # margin = top1
    entropy = -(p * logp).nan_to_num().sum(-1)
    B = logits.shape[0]
    const = lambda v: torch.full((B,), float(v), device=logits.device)  # noqa: E731
    columns = [top2[:, 0], entropy, top2[:, 0] - top2[:, 1], cum_top1 * top2[:, 0], const(position),
               const(rows), const(tokens)]
    return torch.stack(columns, dim=-1)
