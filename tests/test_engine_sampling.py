"""Speculative sampling keeps the target's distribution exactly, and the test is strong enough to see a wrong rule.

With an 8-token vocabulary the exact joint distribution of 3 generated tokens (512 outcomes) is a few
direct target forwards away; thousands of independent rows (each row has its own seed) give the
empirical joint, and a chi-square test compares them. Depth 2 with 3 new tokens exercises the first
draft position, the second, and the bonus token.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import DEVICE
from specpolicy.decode import Engine, sampling
from specpolicy.models.draft import LayerSubsetDraft
from specpolicy.models.vocab import SubsetHead
from specpolicy.policy import ArPolicy, ConfidencePolicy, DepthPolicy, StaticPolicy

pytestmark = pytest.mark.usefixtures("single_thread")

V, NEW, ROWS = 8, 3, 5000
PROMPT = [1, 2, 3]
# initializer_range 0.1 keeps the tiny models' distributions broad; a draft with another seed then
# agrees with the target about half the time, so acceptance, rejection and bonus tokens all happen.
# Two layers halve the cost of the 5000-row runs; nothing here depends on depth.
SMALL_VOCAB = dict(
    vocab_size=V, bos_token_id=5, pad_token_id=6, eos_token_id=7, initializer_range=0.1, num_hidden_layers=2,
)
WARPS = [(1.0, 1.0), (0.7, 0.8)]  # (temperature, top_p)


@pytest.fixture(scope="module")
def models(tiny_model):
    return tiny_model("llama", seed=0, **SMALL_VOCAB).model, tiny_model("llama", seed=1, **SMALL_VOCAB).model


@pytest.fixture(scope="module")
def subset_models(models):
    """The draft scores 6 of the 8 tokens (`SubsetHead`), so it proposes in the subset's index: the engine must
    map its tokens and distributions back to the vocabulary before the rejection rule compares them."""
    draft = copy.deepcopy(models[1])  # the fixture's models are shared: never modified
    draft.set_output_embeddings(SubsetHead(draft.get_output_embeddings(), torch.arange(1, 7)))
    return models[0], draft


@pytest.fixture(scope="module")
def fewer_rows_models(models, tiny_model):
    """The draft has 6 vocabulary rows to the target's 8 (`vocab.draft_ids`): its distributions are padded to the
    target's vocabulary with zeros before the rejection rule compares them."""
    return models[0], tiny_model("llama", seed=1, **{**SMALL_VOCAB, "vocab_size": 6, "pad_token_id": 0,
                                                     "bos_token_id": 1, "eos_token_id": 2}).model


def exact_joint(model, prompt: list[int], n: int, temperature: float, top_p: float) -> torch.Tensor:
    """P(t_1..t_n) under the target with the engine's warping, flattened as t_1 * V^(n-1) + ... + t_n."""
    seqs, joint = torch.tensor([prompt], device=DEVICE), torch.ones(1, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        for _ in range(n):
            q = sampling.probs(model(seqs).logits[:, -1].float(), temperature, top_p).double()  # [S, V]
            joint = (joint[:, None] * q).reshape(-1)
            nexts = torch.arange(V, device=DEVICE).repeat(len(seqs))[:, None]
            seqs = torch.cat([seqs.repeat_interleave(V, 0), nexts], 1)
    return joint.cpu()


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 are pooled into one so the chi-square law holds."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def sampled_joint(models, temperature: float, top_p: float, seed: int = 0,
                  policy: DepthPolicy | None = None) -> tuple[torch.Tensor, float]:
    target, draft = models
    engine = Engine(target, draft, max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=seed, eos_token_id=[])
    result = engine.generate([PROMPT] * ROWS, policy or StaticPolicy(k=2))
    out = torch.tensor(result.outputs)  # [ROWS, NEW]: no EOS, so every row is full length
    index = (out * V ** torch.arange(NEW - 1, -1, -1)).sum(1)
    return torch.bincount(index, minlength=V**NEW), result.stats.acceptance_rate


@pytest.mark.parametrize("pair", ["models", "subset_models", "fewer_rows_models"])
@pytest.mark.parametrize(("temperature", "top_p"), WARPS)
def test_sampling_keeps_the_target_distribution(request, pair: str, temperature: float, top_p: float) -> None:
    models = request.getfixturevalue(pair)
    counts, acceptance = sampled_joint(models, temperature, top_p)
    assert 0.2 < acceptance < 0.9, "the draft should be accepted only partly, or the test proves little"
    p_value = chi_square_p(counts, exact_joint(models[0], PROMPT, NEW, temperature, top_p))
    assert p_value > 1e-3, f"empirical joint differs from the target's (chi-square p={p_value:.2e})"


@pytest.mark.parametrize(("temperature", "top_p"), WARPS)
def test_sampling_keeps_the_target_distribution_when_rows_stop_at_different_positions(
        models, temperature: float, top_p: float) -> None:
    """A policy that stops each row after the draft position where its confidence falls (threshold 0.3: about
    1.2 of up to 3 drafts per step here): the rule must hold for whatever prefix a row sends."""
    counts, acceptance = sampled_joint(models, temperature, top_p, policy=ConfidencePolicy(k=3, threshold=0.3))
    assert 0.2 < acceptance < 0.9
    p_value = chi_square_p(counts, exact_joint(models[0], PROMPT, NEW, temperature, top_p))
    assert p_value > 1e-3, f"empirical joint differs from the target's (chi-square p={p_value:.2e})"


@pytest.fixture(scope="module")
def fused_models(tiny_model):
    """An EAGLE-style draft (`models.fusion`): the target's first layer reading the target's hidden states, with
    the fusion weights of the features made non-zero so that they change what it drafts."""
    target = tiny_model("llama", seed=0, **SMALL_VOCAB)
    draft = LayerSubsetDraft([0], fuse_features=True).build(target).model
    with torch.no_grad():
        weight = draft.feature_fusion.proj.weight
        weight[:, weight.shape[0]:] = 0.3 * torch.eye(weight.shape[0])
    return target.model, draft


@pytest.mark.parametrize(("temperature", "top_p"), WARPS)
def test_a_fused_draft_keeps_the_target_distribution(fused_models, temperature: float, top_p: float) -> None:
    counts, acceptance = sampled_joint(fused_models, temperature, top_p)
    assert 0.2 < acceptance < 0.9
    p_value = chi_square_p(counts, exact_joint(fused_models[0], PROMPT, NEW, temperature, top_p))
    assert p_value > 1e-3, f"empirical joint differs from the target's (chi-square p={p_value:.2e})"


def test_sampling_keeps_the_target_distribution_up_to_eos_beside_ragged_rows(models) -> None:
    """Rows that end at EOS mid-step, beside batch mates whose long prompts are read alone (`solo_above`) and
    short ones: the outputs, cut at EOS, follow the target's law of sequences cut at EOS."""
    eos, long_prompt = 4, [4, 0, 1, 1, 2, 3] * 5
    engine = Engine(*models, max_new_tokens=NEW, temperature=1.0, seed=0, eos_token_id=[eos])
    outputs = engine.generate([PROMPT, long_prompt, [2]] * ROWS, StaticPolicy(k=2)).outputs[::3]
    padded = torch.tensor([out + [eos] * (NEW - len(out)) for out in outputs])  # after EOS, EOS: one cell per prefix
    assert (padded[:, 0] == eos).any() and (padded[:, -1] != eos).any()
    full = torch.arange(V**NEW)[:, None] // V ** torch.arange(NEW - 1, -1, -1) % V  # [V^NEW, NEW] every sequence
    cut = torch.where((full == eos).long().cummax(1).values.bool(), eos, full)  # every token after the first EOS
    index = lambda seqs: (seqs * V ** torch.arange(NEW - 1, -1, -1)).sum(1)  # noqa: E731
    expected = torch.zeros(V**NEW, dtype=torch.float64).index_add_(0, index(cut),
                                                                   exact_joint(models[0], PROMPT, NEW, 1.0, 1.0))
    p_value = chi_square_p(torch.bincount(index(padded), minlength=V**NEW), expected)
    assert p_value > 1e-3, f"empirical joint differs from the target's (chi-square p={p_value:.2e})"


def accept_always(draft_tokens, p, q, n_draft, seeds, index):
    """Wrong: keep every draft token, then a bonus token from q."""
    n_acc = n_draft
    q_next = q.gather(1, n_acc[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)
    return n_acc, sampling.sample(q_next, sampling.uniform(seeds, index + n_acc, sampling.RESIDUAL))


def make_residual_from_q(accept):
    """Wrong: the right acceptance test, but the correction token is drawn from q instead of norm(max(0, q - p))."""

    def wrong(draft_tokens, p, q, n_draft, seeds, index):
        n_acc, _ = accept(draft_tokens, p, q, n_draft, seeds, index)
        q_next = q.gather(1, n_acc[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)
        return n_acc, sampling.sample(q_next, sampling.uniform(seeds, index + n_acc, sampling.RESIDUAL))

    return wrong


@pytest.mark.parametrize("rule", ["accept_always", "residual_from_q"])
@pytest.mark.parametrize(("temperature", "top_p"), WARPS)
def test_the_test_rejects_a_wrong_acceptance_rule(models, monkeypatch, rule: str, temperature: float,
                                                 top_p: float) -> None:
    wrong = accept_always if rule == "accept_always" else make_residual_from_q(sampling.accept)
    monkeypatch.setattr(sampling, "accept", wrong)
    counts, _ = sampled_joint(models, temperature, top_p)
    p_value = chi_square_p(counts, exact_joint(models[0], PROMPT, NEW, temperature, top_p))
    assert p_value < 1e-6, f"a wrong rule ({rule}) passed the distribution test (p={p_value:.2e})"


def test_seeds_reproduce(models) -> None:
    target, draft = models
    run = lambda seed: Engine(target, draft, max_new_tokens=6, temperature=1.0, seed=seed, eos_token_id=[]) \
        .generate([PROMPT, [4, 0], [2]] * 4, StaticPolicy(k=3)).outputs  # noqa: E731
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_a_rows_sample_does_not_depend_on_the_other_rows(models) -> None:
    """Counter-based randomness: row r's tokens depend on its seed and prompt, not on its batch mates."""
    target, draft = models
    run = lambda prompts: Engine(target, draft, max_new_tokens=6, temperature=1.0, seed=5, eos_token_id=[]) \
        .generate(prompts, StaticPolicy(k=3)).outputs  # noqa: E731
    alone, crowded = run([PROMPT]), run([PROMPT, [4, 0, 1, 1, 2, 3], [2]])
    assert alone[0] == crowded[0]


def test_a_policy_that_keeps_no_draft_samples_what_plain_decoding_samples(models) -> None:
    """Every row stops at x_1, so every step verifies no draft: the bonus token is plain decoding's, same stream."""
    engine = Engine(*models, max_new_tokens=6, temperature=1.0, seed=3, eos_token_id=[])
    prompts = [PROMPT, [4, 0], [2]]
    stopped = engine.generate(prompts, ConfidencePolicy(k=3, threshold=0.999))
    assert stopped.stats.drafted == 0 and stopped.stats.draft_forwards > 0
    assert stopped.outputs == engine.generate(prompts, ArPolicy()).outputs


def test_a_residual_with_no_mass_samples_from_the_target(monkeypatch) -> None:
    """Where the draft's distribution covers the target's everywhere (q <= p, equal up to rounding), a rejection
    has probability ~0 and max(0, q - p) has no mass to sample from: the row samples q itself. Forced here with a
    uniform of 1 - 1e-12, which rejects a draft token whose q / p is 1 - 1e-9."""
    monkeypatch.setattr(sampling, "uniform", lambda seeds, index, stream: torch.full(index.shape, 1 - 1e-12,
                                                                                     dtype=torch.float64))
    p = torch.tensor([[[0.0, 1.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0 - 1e-9], [0.0, 1.0]]], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.long)
    n_acc, token = sampling.accept(torch.tensor([[1]]), p, q, torch.tensor([1]), zero, zero)
    assert n_acc.tolist() == [0] and token.tolist() == [1]


def test_chi_square_p_value_matches_tables() -> None:
    """60/40 heads in 100 fair flips: chi-square 4.0 on 1 df, p = 0.0455; 10 cells off by 10 each: p from tables."""
    assert math.isclose(chi_square_p(torch.tensor([60, 40]), torch.tensor([0.5, 0.5])), 0.0455003, rel_tol=1e-5)
    counts = torch.tensor([110, 90] * 5)  # chi-square 10 * 100 / 100 = 10.0 on 9 df
    assert math.isclose(chi_square_p(counts, torch.full((10,), 0.1)), 0.3504852, rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_with_mass_top_p(dtype) -> None:
    """`nucleus_floor` bisects on a threshold instead of sorting the vocabulary: it must keep what the sorted rule
    keeps (the most likely tokens until their mass reaches top_p), up to rounding where that mass is top_p within
    1e-5 (float32 sums in another order), and tied tokens together."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 1000, dtype=torch.float64) * 3, -1)
    p[:, :10] = p[:, 10:20]  # ties
    p = (p / p.sum(-1, keepdim=True)).to(dtype)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        kept = sampling.probs(p.log(), 1.0, top_p) > 0
        sorted_p, order = p.double().sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens, in float64
        unsort = lambda t: torch.zeros_like(t).scatter(-1, order, t)  # noqa: E731
        expected, close = unsort(before < top_p), unsort((before - top_p).abs() < 1e-5)
        tied = expected[:, :10] | expected[:, 10:20]  # sorting kept one of a tied pair at the boundary: keep both
        expected[:, :10], expected[:, 10:20] = tied, tied
        assert torch.equal(kept[~close], expected[~close]), top_p
    # at the boundary itself, with masses that sum exactly: a token after others that hold top_p is not kept
    exact = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=dtype)
    for top_p, n in ((0.5, 1), (0.75, 2), (0.8, 4)):  # the two 0.125s are tied: kept or dropped together
        assert int((sampling.probs(exact.log(), 1.0, top_p) > 0).sum()) == n, top_p


def test_the_warped_distribution_is_temperature_then_the_smallest_top_p_set() -> None:
    """The chi-square test compares the engine with `sampling.probs` itself, so a warping bug would sit on both
    sides of it; here `probs` meets distributions worked out by hand."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], dtype=torch.float64)
    assert torch.allclose(sampling.probs(p.log(), 1.0), p)
    hot = p.sqrt() / p.sqrt().sum(-1, keepdim=True)  # T = 2: p^(1/2), renormalised
    assert torch.allclose(sampling.probs(p.log(), 2.0), hot)
    # top-p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it, so those two remain, renormalised
    expected = torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.0, 0.0, 0.375, 0.625]], dtype=torch.float64)
    assert torch.allclose(sampling.probs(p.log(), 1.0, top_p=0.7), expected)
    assert torch.allclose(sampling.probs(p.log(), 1.0, top_p=0.4), torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]],
                                                                                   dtype=torch.float64))
    # near zero, the greedy limit: logits / T overflowed to inf below T ~ 1e-38, and the softmax gave NaN
    assert torch.equal(sampling.probs(p.log().float(), 1e-40), torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]]))
