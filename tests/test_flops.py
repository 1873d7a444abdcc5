"""FLOP accounting: the analytic count per token, and the engine's buckets against what it really ran."""

from __future__ import annotations

import pytest
import torch

import specpolicy.decode.engine as engine_module
from specpolicy.cost.flops import BUCKETS, FlopModel
from specpolicy.decode import Engine
from specpolicy.models.draft import LayerSubsetDraft
from specpolicy.policy import ArPolicy, ConfidencePolicy, HeuristicPolicy, OraclePolicy, StaticPolicy

pytestmark = pytest.mark.usefixtures("single_thread")

N = 10
PROMPT_LENGTHS = (1, 20, 7, 3, 13, 2)


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def drafts(target):
    return {"partial": LayerSubsetDraft(layers=[0, 1, 2]).build(target).model,
            "same": LayerSubsetDraft(layers=[0, 1, 2, 3]).build(target).model,
            "fused": LayerSubsetDraft(layers=[0, 1, 2, 3], fuse_features=True).build(target).model}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def decode(target, draft, prompts, policy, eos=(), n=N):
    # solo_above=8: prompts 20 and 13 are read alone, the others batched
    return Engine(target.model, draft, max_new_tokens=n, eos_token_id=list(eos), solo_above=8,
                  max_padding=0.0).generate(prompts, policy)


# ---------------------------------------------------------------- the analytic model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_per_token_matches_a_hand_count(tiny_model, model_type: str, tied: bool) -> None:
    model = tiny_model(model_type, tie_word_embeddings=tied).model
    d, ff, layers, heads, kv_heads, vocab = 64, 128, 4, 4, 2, 260
    head_dim = d // heads
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d  # q, k, v, o
    mlp = 3 * d * ff  # gate, up, down
    matmul = layers * (attention + mlp) + vocab * d  # + LM head, counted once even when tied to the embedding
    flops = FlopModel.from_model(model)
    assert (flops.matmul_params, flops.n_layer, flops.d_attn) == (matmul, layers, heads * head_dim)
    assert flops.head_params == vocab * d and flops.head == 2 * vocab * d
    for ctx in (1, 17, 300):
        assert flops.per_token(ctx) == 2 * matmul + 4 * layers * heads * head_dim * ctx


SLIDING = {  # windows of 6 keys, shorter than the prompts and outputs below
    "mistral": {"sliding_window": 6},  # every layer slides
    "qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2},  # layers 2 and 3 slide
}


@pytest.mark.parametrize("family, sliding", [("mistral", 4), ("qwen2", 2)])
def test_sliding_window_layers_read_at_most_their_window(tiny_model, family: str, sliding: int) -> None:
    flops = FlopModel.from_model(tiny_model(family, **SLIDING[family]).model)
    assert (flops.sliding_layers, flops.window) == (sliding, 6)
    per_key = 4 * flops.d_attn
    for ctx in (1, 6, 7, 300):
        attention = per_key * ((4 - sliding) * ctx + sliding * min(ctx, 6))
        assert flops.per_token(ctx) == 2 * flops.matmul_params + attention
    body = flops.matmul_params - flops.head_params  # a slot's LM head is charged only where it runs
    assert flops.slot(300) == 2 * body + per_key * 4 * 300  # the engine scores masked keys too


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_prefix_is_a_sum_of_per_token_costs(tiny_model, family: str) -> None:
    flops = FlopModel.from_model(tiny_model(family, **SLIDING.get(family, {})).model)
    starts, n = torch.tensor([0, 5, 11, 2, 0]), torch.tensor([4, 0, 7, 9, 1])  # some cross the window
    expected = [sum(flops.per_token(s + i + 1) for i in range(k)) for s, k in zip(starts.tolist(), n.tolist())]
    assert flops.prefix(starts, n, n).tolist() == pytest.approx(expected, rel=1e-12)  # every token scored
    unscored = [e - k * flops.head for e, k in zip(expected, n.tolist())]
    assert flops.prefix(starts, n).tolist() == pytest.approx(unscored, rel=1e-12)


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_through(tiny_model) -> None:
    """transformers stacks experts as [E, out, in] parameters and routes each token through num_experts_per_tok
    of them: those stacks (and the router) were not Linear modules, and were left out."""
    model = tiny_model("mixtral", num_local_experts=4, num_experts_per_tok=2).model
    layers, d, ffn, vocab = model.config.num_hidden_layers, model.config.hidden_size, model.config.intermediate_size, \
        model.config.vocab_size
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # attention, LM head
    experts = layers * 2 * (2 * ffn * d + d * ffn)  # 2 of 4 experts: gate+up [2 ffn, d] and down [d, ffn]
    router = layers * 4 * d
    assert FlopModel.from_model(model).matmul_params == dense + experts + router
    assert dense < experts and FlopModel.from_model(model).head_params == vocab * d


# ---------------------------------------------------------------- the engine's buckets


class ForwardRecorder:
    """Wraps the engine's forward to record (model, rows, width, keys, logit rows) of every forward it really runs."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = engine_module.forward

        def recorded(model, cache, tokens, starts, kv_len, keep, max_position, **kwargs):  # keys it scores:
            self.calls.append((model, tokens.shape[0], tokens.shape[1], min(kv_len, cache.capacity), keep.shape[1]))
            return real(model, cache, tokens, starts, kv_len, keep, max_position, **kwargs)

        monkeypatch.setattr(engine_module, "forward", recorded)

    def flops(self) -> float:
        """Every slot of every forward attends to all kv_len keys in every layer (masked or not); the LM head
        scores the `keep` positions only."""
        models = {id(m): FlopModel.from_model(m) for m, *_ in self.calls}
        return sum(b * (w * models[id(m)].slot(kv) + k * models[id(m)].head) for m, b, w, kv, k in self.calls)


POLICIES = {
    "ar": ArPolicy,
    "static3": lambda: StaticPolicy(k=3),
    "heuristic": lambda: HeuristicPolicy(initial=2, max_k=6),
    "confidence": lambda: ConfidencePolicy(k=4, threshold=0.25),  # rows stop at different positions
    "confidence_all_stop": lambda: ConfidencePolicy(k=4, threshold=0.99),  # every row stops at position 1
}


@pytest.mark.parametrize("draft", ["partial", "same", "fused"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_buckets_add_up_to_what_the_forwards_computed(target, drafts, prompts, monkeypatch, policy, draft) -> None:
    recorder = ForwardRecorder(monkeypatch)
    stats = decode(target, drafts[draft], prompts, POLICIES[policy]()).stats
    assert bool((stats.flops >= 0).all()), dict(zip(BUCKETS, stats.flops.tolist()))
    totals = stats.flops_dict()
    assert totals["total"] == pytest.approx(sum(totals[b] for b in BUCKETS), rel=1e-12)
    assert totals["total"] == pytest.approx(recorder.flops(), rel=1e-9), \
        f"{policy}: buckets {dict(zip(BUCKETS, stats.flops.tolist()))} vs forwards {recorder.flops():.6g}"


@pytest.mark.parametrize("policy", ["ar", "static3"])
def test_buckets_add_up_when_a_row_read_alone_sets_the_longest_start(target, drafts, prompts, monkeypatch,
                                                                     policy) -> None:
    """One new token: the 20-token prompt, read alone, starts the step's forward 19 keys in, and the 7-token one
    widens it past the cache's capacity, which caps the keys scored; they were charged uncapped."""
    recorder = ForwardRecorder(monkeypatch)
    stats = decode(target, drafts["partial"], prompts, POLICIES[policy](), n=1).stats
    assert stats.flops_dict()["total"] == pytest.approx(recorder.flops(), rel=1e-9)


class UnevenBudgets(StaticPolicy):
    """Row 0 may draft one token, row 1 two: row 0 rides along while the draft reads x_1 for row 1."""

    def budget(self, state):
        return torch.where(state.row_ids == 0, 1, 2)


def test_a_row_that_rides_along_wastes_nothing_of_an_identical_draft(target, drafts) -> None:
    """Its proposal of x_2, which it was never going to send, was charged as rejected: padding, as the rows that
    do not draft at all."""
    stats = decode(target, drafts["same"], [[5, 6, 7], [8, 9]], UnevenBudgets(k=2)).stats
    assert stats.acceptance_rate == 1.0 and stats.flops[1] == 0


def test_a_draft_no_row_keeps_is_not_verified(target, drafts, monkeypatch) -> None:
    """Every step drafts x_1 and stops there: the target reads only the committed token, as in plain decoding.
    Each proposal the policy looked at and dropped is a thrown-away draft head row (it was counted useful)."""
    recorder = ForwardRecorder(monkeypatch)
    stats = decode(target, drafts["partial"], [[42]], ConfidencePolicy(k=4, threshold=0.999)).stats
    assert stats.drafted == 0 and stats.draft_forwards > 0
    assert [w for m, _, w, *_ in recorder.calls if m is target.model] == [1] * N
    useful, rejected, padding = stats.flops.tolist()
    assert rejected == pytest.approx(stats.draft_forwards * FlopModel.from_model(drafts["partial"]).head)
    assert padding == 0


class RowZeroRidesAlong(StaticPolicy):
    """Row 0 has no budget; row 1 drafts one token."""

    def budget(self, state):
        return (state.row_ids == 1).long()


class RowZeroDropsItsDraft(StaticPolicy):
    """Row 0 may draft one token when row 1 does, and its policy drops the proposal before the target sees it:
    the draft runs exactly when it runs for `RowZeroRidesAlong`."""

    def budget(self, state):
        row_1 = state.row_ids == 1
        drafts = bool(row_1.any()) and int(state.generated[row_1].max()) < N - 1  # its last token drafts none
        return torch.full_like(state.row_ids, int(drafts))

    def keep(self, features, tokens, state, position):
        return state.row_ids == 1


def test_a_draft_head_row_goes_with_the_token_it_proposes(target, drafts) -> None:
    """The same forwards, the same outputs: row 0's proposals are padding when it had no budget (it rode along in
    the draft forwards row 1 needed) and rejected when its policy dropped them; both were counted useful."""
    head = FlopModel.from_model(drafts["partial"]).head
    along, dropped = (decode(target, drafts["partial"], [[5, 6, 7], [8, 9]], policy(k=1))
                      for policy in (RowZeroRidesAlong, RowZeroDropsItsDraft))
    assert along.outputs == dropped.outputs and along.stats.draft_forwards == dropped.stats.draft_forwards
    (u1, r1, p1), (u2, r2, p2) = along.stats.flops.tolist(), dropped.stats.flops.tolist()
    assert u1 == pytest.approx(u2) and r2 - r1 == pytest.approx(p1 - p2)
    assert r2 - r1 == pytest.approx(head * along.stats.draft_forwards)


class OnlyTheShallowRowGoesOn(StaticPolicy):
    """Row 0 may draft 3 tokens but stops at x_1; row 1 keeps x_1 but may draft only that one."""

    def budget(self, state):
        return torch.where(state.row_ids == 0, 3, 1)

    def keep(self, features, tokens, state, position):
        return state.row_ids != 0


def test_the_draft_does_not_read_a_token_no_row_drafts_past(target, drafts) -> None:
    """Once no row that keeps x_i may draft x_{i+1}, the draft stops: at most one draft forward per step (its
    catch-up, which proposes x_1; none on a row's last token), not a second one that reads x_1 for nobody."""
    stats = decode(target, drafts["partial"], [[5, 6, 7], [8, 9]], OnlyTheShallowRowGoesOn(k=3)).stats
    assert stats.drafted > 0 and stats.draft_forwards <= stats.target_forwards


def test_identical_draft_rejects_nothing_under_greedy(target, drafts, prompts) -> None:
    stats = decode(target, drafts["same"], prompts, StaticPolicy(k=3)).stats
    useful, rejected, padding = stats.flops.tolist()
    assert stats.acceptance_rate == 1.0
    assert rejected == 0 and useful > 0 and padding > 0  # ragged prompts pad


def test_a_fusing_draft_wastes_what_it_reads_again(target, drafts, prompts) -> None:
    """A fusing draft reads its drafts with its own hidden state and, once kept, again with the target's: the
    first reads are waste even when every draft is kept (they were counted useful, and the rereads too)."""
    plain = decode(target, drafts["same"], prompts, StaticPolicy(k=3)).stats
    fused = decode(target, drafts["fused"], prompts, StaticPolicy(k=3)).stats
    assert plain.flops[1] == 0 and fused.flops[1] > 0


def test_weak_draft_wastes_flops(target, drafts, prompts) -> None:
    """Rejected drafts cost the target their verify slots, not only the draft its forwards: with the draft's
    FLOPs counted as nothing, the target's alone are rejected."""
    engine = Engine(target.model, drafts["partial"], max_new_tokens=N, eos_token_id=[])
    engine.d_flops = FlopModel(matmul_params=0.0, n_layer=0, d_attn=0)
    stats = engine.generate(prompts, StaticPolicy(k=3)).stats
    assert stats.acceptance_rate < 1.0 and stats.flops[1] > 0


def test_plain_decoding_at_batch_one_is_all_useful(target) -> None:
    """A 1-token prompt at batch 1: no masked key anywhere, so the run costs exactly ar_flops."""
    stats = decode(target, None, [[42]], ArPolicy()).stats
    useful, rejected, padding = stats.flops.tolist()
    assert rejected == 0 and padding == 0
    assert useful == pytest.approx(stats.ar_flops, rel=1e-12)
    assert stats.flops_dict()["total"] == pytest.approx(stats.ar_flops, rel=1e-12)


def test_plain_decoding_pads_only_the_causal_half_of_the_prefill(target, prompts) -> None:
    """A P-token prefill computes P x P scores of which P(P-1)/2 are masked: that, and only that, is padding."""
    prompt = prompts[1]
    P = len(prompt)
    flops = FlopModel.from_model(target.model)
    stats = decode(target, None, [prompt], ArPolicy()).stats
    useful, rejected, padding = stats.flops.tolist()
    assert rejected == 0
    assert useful == pytest.approx(stats.ar_flops, rel=1e-12)
    assert padding == pytest.approx(4 * flops.n_layer * flops.d_attn * P * (P - 1) / 2, rel=1e-12)


def plain_decoding(flops: FlopModel, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Plain decoding reads the prompt (token j attends to j + 1 keys), then every new token but the last, and
    scores with the LM head the prompt's last token and each new one it reads."""
    return sum(flops.per_token(ctx) - (flops.head if ctx < len(prompt) else 0)
               for prompt, out in zip(prompts, outputs) for ctx in range(1, len(prompt) + len(out)))


@pytest.mark.parametrize("policy", ["ar", "static3", "heuristic", "oracle"])
def test_ar_equivalent_counts_plain_decodings_tokens(target, drafts, prompts, policy) -> None:
    ar = decode(target, None, prompts, ArPolicy())
    eos = ar.outputs[0][3]  # stops some rows early
    ar = decode(target, None, prompts, ArPolicy(), eos=[eos])
    if policy == "oracle":
        chosen = OraclePolicy(k=4)
        chosen.set_reference(ar.outputs)
    else:
        chosen = POLICIES[policy]()
    result = decode(target, drafts["partial"], prompts, chosen, eos=[eos])
    assert result.outputs == ar.outputs
    expected = plain_decoding(FlopModel.from_model(target.model), prompts, result.outputs)
    assert any(len(out) < N for out in result.outputs)
    assert result.stats.ar_flops == pytest.approx(expected, rel=1e-12)
    assert result.stats.flops_dict()["ar_equivalent"] == result.stats.ar_flops


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_models_are_charged_what_they_compute_and_read(tiny_model, monkeypatch, family) -> None:
    """The engine scores every key in every layer; a sliding layer's keys outside its window are padding, and
    plain decoding (which reads only the window) is charged min(ctx, window) keys there."""
    target = tiny_model(family, **SLIDING[family])
    draft = LayerSubsetDraft(layers=[0, -1]).build(target).model
    prompts = [[7] * 20, [3, 9, 4], list(range(5, 18))]
    ar = decode(target, None, prompts, ArPolicy())
    recorder = ForwardRecorder(monkeypatch)
    result = decode(target, draft, prompts, StaticPolicy(k=3))
    assert result.outputs == ar.outputs
    assert result.stats.flops_dict()["total"] == pytest.approx(recorder.flops(), rel=1e-9)
    flops = FlopModel.from_model(target.model)
    expected = plain_decoding(flops, prompts, ar.outputs)
    assert result.stats.ar_flops == pytest.approx(expected, rel=1e-12)
    assert ar.stats.ar_flops == pytest.approx(expected, rel=1e-12)
    full_attention = FlopModel(flops.matmul_params, flops.n_layer, flops.d_attn, head_params=flops.head_params)
    assert expected < plain_decoding(full_attention, prompts, ar.outputs)
