"""Each divergence against a direct computation from its definition, on small random distributions."""

import math

import pytest
import torch

from specpolicy.distill import losses

V = 7


def _dists(seed: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 2, torch.randn(n, V, generator=g) * 2  # draft, target logits


def _direct_kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_divergences_match_their_definitions(seed, temperature):
    p_logits, q_logits = _dists(seed)
    p_logp, q_logp = losses.log_probs(p_logits, temperature), losses.log_probs(q_logits, temperature)
    for row in range(p_logits.shape[0]):
        p = torch.softmax(p_logits[row].double() / temperature, -1).tolist()
        q = torch.softmax(q_logits[row].double() / temperature, -1).tolist()
        m = [0.3 * b + 0.7 * a for a, b in zip(p, q)]  # beta = 0.3 weighs the target
        expected = {
            "forward_kl": _direct_kl(q, p),
            "reverse_kl": _direct_kl(p, q),
            "tvd": 0.5 * sum(abs(a - b) for a, b in zip(p, q)),
            "jsd": 0.3 * _direct_kl(q, m) + 0.7 * _direct_kl(p, m),
        }
        got = {
            "forward_kl": losses.forward_kl(p_logp, q_logp)[row],
            "reverse_kl": losses.reverse_kl(p_logp, q_logp)[row],
            "tvd": losses.tvd(p_logp, q_logp)[row],
            "jsd": losses.jsd(p_logp, q_logp, beta=0.3)[row],
        }
        for name in expected:
            assert got[name].item() == pytest.approx(expected[name], abs=1e-5), name


def test_tvd_is_one_minus_overlap_and_half_l1():
    p_logits, q_logits = _dists(3, n=50)
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    got = losses.tvd(p.log(), q.log())
    torch.testing.assert_close(got, 1 - torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(got, 0.5 * (p - q).abs().sum(-1))


def test_symmetric_jsd_and_zero_at_equality():
    p_logits, q_logits = _dists(4)
    p_logp, q_logp = losses.log_probs(p_logits), losses.log_probs(q_logits)
    torch.testing.assert_close(losses.jsd(p_logp, q_logp), losses.jsd(q_logp, p_logp))
    assert (losses.jsd(p_logp, q_logp) <= math.log(2) + 1e-6).all()
    for fn in (losses.forward_kl, losses.reverse_kl, losses.tvd, losses.jsd):
        assert fn(q_logp, q_logp).abs().max() < 1e-6, fn.__name__


def test_divergences_handle_zero_probabilities_and_give_gradients():
    q_logp = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]]))
    p_logits = torch.zeros(1, 4, requires_grad=True)
    fkl = losses.forward_kl(losses.log_probs(p_logits), q_logp)
    assert fkl.item() == pytest.approx(math.log(2), abs=1e-6)  # Σ q log(q/p) = log(0.5/0.25)
    fkl.sum().backward()
    assert torch.isfinite(p_logits.grad).all()


def test_dense_from_topk_keeps_topk_and_spreads_the_tail():
    _, q_logits = _dists(5, n=3)
    q_logp = losses.log_probs(q_logits)
    top = q_logp.topk(3, -1)
    dense = losses.dense_from_topk(top.indices, top.values, V)
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(dense.gather(-1, top.indices), top.values)
    full = q_logp.topk(V, -1)
    torch.testing.assert_close(losses.dense_from_topk(full.indices, full.values, V), q_logp, atol=1e-4, rtol=0)


def test_dense_from_topk_restricted_to_a_draft_vocabulary_keeps_the_same_values():
    _, q_logits = _dists(6, n=4)
    top = losses.log_probs(q_logits).topk(5, -1)
    vocab = torch.tensor([6, 0, 3, 1])  # any order; some top-k tokens fall outside
    full = losses.dense_from_topk(top.indices, top.values, V)
    torch.testing.assert_close(losses.dense_from_topk(top.indices, top.values, V, vocab), full[:, vocab])
