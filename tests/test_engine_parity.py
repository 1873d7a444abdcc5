"""Greedy speculative decoding is plain greedy decoding: every policy, batch size, family and EOS pattern.

The reference is transformers' own `generate` at batch 1, so a bug shared by the engine's speculative
and plain paths (the cache, the masks, positions) is caught too, not only a speculative-vs-plain mismatch.
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import synthetic
from conftest import DEVICE, TINY
from specpolicy.decode import DecodeResult, DecodeStats, Engine
from specpolicy.decode.engine import check_settings
from specpolicy.errors import SpecPolicyError
from specpolicy.models import LoadedModel, RandomInitSource
from specpolicy.models.attention import sliding_window
from specpolicy.models.draft import LayerSubsetDraft
from specpolicy.models.vocab import SubsetHead
from specpolicy.policy import (
    ArPolicy,
    ConfidencePolicy,
    DepthPolicy,
    DisableByBatchPolicy,
    EntropyPolicy,
    HeuristicPolicy,
    OraclePolicy,
    StaticPolicy,
    StepState,
)
from specpolicy.policy.goodput import GoodputPolicy, HeadEstimator
from specpolicy.rollout.collect import COLUMNS, RecordingPolicy

pytestmark = pytest.mark.usefixtures("single_thread")

N = 12  # max_new_tokens of the main runs
PROMPT_LENGTHS = (1, 20, 7, 3, 13, 2, 17, 9)  # ragged, batch 8
NO_EOS: tuple[int, ...] = ()
SOLO = 8  # rows with more unseen tokens read them alone: prompts 20, 13, 17, 9 do, the others are batched
# (all 8 rows' prompts padded together would be 58% padding; `max_padding=0` keeps the count exact anyway)

# Thresholds sit inside the tiny models' feature ranges (top1 ~0.1-0.5, entropy ~2.2-3.9 nats), so
# rows stop at different positions; the draft with layers [0, 1, 2] agrees with the target ~20% of the time.
POLICIES: dict[str, Callable[[], DepthPolicy]] = {
    "ar": ArPolicy,
    "static1": lambda: StaticPolicy(k=1),
    "static3": lambda: StaticPolicy(k=3),
    # batch 8 starts plain and drafts once an early EOS takes a row out (threshold 3 never drafted at batch 8)
    "disable_by_batch": lambda: DisableByBatchPolicy(k=3, threshold=8),
    "heuristic": lambda: HeuristicPolicy(initial=2, max_k=6),
    "confidence": lambda: ConfidencePolicy(k=4, threshold=0.25),
    "entropy": lambda: EntropyPolicy(k=4, threshold=3.2),
    "oracle": lambda: OraclePolicy(k=4),
    # load-aware policies on a synthetic memory-bound profile: rows draft when their estimate pays
    "goodput": lambda: GoodputPolicy(synthetic.profile(), k=4),
    "learned": lambda: GoodputPolicy(synthetic.profile(), k=4,
                                     estimator=HeadEstimator(str(synthetic.head_dir(Path(tempfile.mkdtemp()))))),
}
# name: (target layers, fuses the target's features); "fused" reads features the target computed in an
# earlier verify pass, so it checks that those stay aligned with the tokens as rows accept and roll back.
# Its fusion layer mixes in 0.05 x the feature (it starts at 0): enough to change ~90% of its proposals.
DRAFTS = {"partial": ([0, 1, 2], False), "same": ([0, 1, 2, 3], False), "fused": ([0, 1, 2, 3], True)}


@dataclass
class Case:
    """One family's target, drafts, prompts, and the transformers-generate references (cached)."""

    target: LoadedModel
    drafts: dict[str, LoadedModel]
    prompts: list[list[int]]
    eos: int = -1  # chosen so several rows stop early, at different steps
    early: list[int] = field(default_factory=list)  # rows that stop early, earliest first
    _refs: dict = field(default_factory=dict)

    def reference(self, row: int, eos: tuple[int, ...], n: int) -> list[int]:
        key = (row, eos, n)
        if key not in self._refs:
            self._refs[key] = self.generate(self.prompts[row], eos, n)
        return self._refs[key]

    def generate(self, prompt: list[int], eos: tuple[int, ...], n: int) -> list[int]:
        """The target's own greedy continuation of `prompt` (`model.generate`), uncached."""
        out = self.target.model.generate(
            torch.tensor([prompt], device=DEVICE), max_new_tokens=n, do_sample=False, eos_token_id=list(eos),
            pad_token_id=self.target.tokenizer.pad_token_id,
        )
        return out[0, len(prompt):].tolist()

    def run(self, policy: str | DepthPolicy, draft: str, rows: list[int], eos: tuple[int, ...], n: int) -> DecodeResult:
        policy = POLICIES[policy]() if isinstance(policy, str) else policy
        if isinstance(policy, OraclePolicy):
            policy.set_reference([self.reference(r, eos, n) for r in rows])
        engine = Engine(self.target.model, self.drafts[draft].model, max_new_tokens=n, eos_token_id=list(eos),
                        solo_above=SOLO, max_padding=0.0)
        return engine.generate([self.prompts[r] for r in rows], policy)

    def read_alone(self, rows: list[int]) -> int:
        """Target forwards spent reading prompts alone (only in a batch: one row has nothing to pad against)."""
        return sum(len(self.prompts[r]) > SOLO for r in rows) if len(rows) > 1 else 0


def pick_eos(refs: list[list[int]]) -> tuple[int, list[int]]:
    """A token that some row first emits at its 3rd-5th position, stopping the most rows at distinct steps."""
    best, best_score = None, (-1, -1)
    for token in set(sum(refs, [])):
        first = {r: ref.index(token) for r, ref in enumerate(refs) if token in ref[: len(ref) - 1]}
        if not any(2 <= i <= 4 for i in first.values()):
            continue
        score = (len(set(first.values())), len(first))
        if score > best_score:
            best, best_score = token, score
    assert best is not None, "no token to use as EOS; change the prompts' seed"
    first = {r: ref.index(best) for r, ref in enumerate(refs) if best in ref[: len(ref) - 1]}
    return best, sorted(first, key=first.get)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_model) -> Case:
    target = tiny_model(request.param)
    drafts = {name: LayerSubsetDraft(layers, fuse).build(target) for name, (layers, fuse) in DRAFTS.items()}
    weight = drafts["fused"].model.feature_fusion.proj.weight
    with torch.no_grad():
        weight[:, weight.shape[0]:] = 0.05 * torch.eye(weight.shape[0], device=DEVICE)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    case = Case(target, drafts, prompts)
    case.eos, case.early = pick_eos([case.reference(r, NO_EOS, N) for r in range(len(prompts))])
    assert len(case.early) >= 2, "the EOS token should stop several rows early"
    return case


def settings(case: Case, draft: str) -> list[tuple[list[int], tuple[int, ...], int]]:
    """(rows, eos, max_new_tokens): batch 1, 3 and 8 with rows stopping early, no EOS, and 1 new token.

    The identical draft (every draft accepted: bonus tokens, EOS inside the accepted drafts) and the fused
    one run the batched settings only, to keep the suite fast.
    """
    eos, first = (case.eos,), case.early[0]
    everyone = list(range(len(case.prompts)))
    three = [first, case.early[-1], *(r for r in everyone if r not in case.early)][:3]
    if draft != "partial":
        return [(three, eos, N), (everyone, eos, N), (everyone, eos, 1)]
    return [([first], eos, N), (three, eos, N), (everyone, eos, N), (everyone, NO_EOS, N), (everyone, eos, 1)]


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_output_equals_transformers_generate(case: Case, policy: str, draft: str) -> None:
    """...and the draft is used: a policy that stopped drafting would pass the parity check as plain decoding
    (load-aware policies may rightly not draft at batch 8, so the check is over every setting)."""
    drafted = []
    for rows, eos, n in settings(case, draft):
        result = case.run(policy, draft, rows, eos, n)
        expected = [case.reference(r, eos, n) for r in rows]
        assert result.outputs == expected, f"{policy}/{draft}: rows={rows} eos={eos} max_new_tokens={n}"
        drafted.append(result.stats.drafted)
    assert (sum(drafted) > 0) == (policy != "ar"), drafted
    if policy == "disable_by_batch":  # (everyone, eos, N): plain at 8 rows, drafting once a row has finished
        assert drafted[-2 if draft != "partial" else 2] > 0, drafted


def test_a_subset_head_model_decodes_alone_as_generate(case: Case) -> None:
    """A draft that scores part of the vocabulary (`SubsetHead`) writes its own distillation data as the engine's
    only model: its scores come in the subset's order and must be mapped back to token ids (they were read as ids)."""
    model = copy.deepcopy(case.drafts["partial"].model)
    vocab = torch.arange(1, model.config.vocab_size, 3)  # not a prefix of the ids: order and id differ
    model.set_output_embeddings(SubsetHead(model.get_output_embeddings(), vocab))
    rows = [0, 1, 2]
    result = Engine(model, max_new_tokens=N, eos_token_id=[]).generate([case.prompts[r] for r in rows], ArPolicy())
    for r, out in zip(rows, result.outputs):
        prompt = torch.tensor([case.prompts[r]], device=DEVICE)
        expected = model.generate(prompt, max_new_tokens=N, do_sample=False, eos_token_id=[],
                                  pad_token_id=case.target.tokenizer.pad_token_id)
        assert out == expected[0, prompt.shape[1]:].tolist()
        assert set(out) <= set(vocab.tolist())


def test_early_eos_rows_stop_at_different_steps(case: Case) -> None:
    """Guards the parity test's coverage: EOS really ends rows early, and not all at once."""
    lengths = [len(case.reference(r, (case.eos,), N)) for r in case.early]
    assert min(lengths) <= 5 and len(set(lengths)) >= 2 and max(lengths) < N


@pytest.mark.parametrize("policy", ["static3", "heuristic"])
def test_greedy_parity_at_the_context_limit(tiny_model, policy: str) -> None:
    """Prompt + max_new_tokens == context: padding slots past the last position must not break real ones."""
    target = tiny_model("llama", max_position_embeddings=32)
    draft = LayerSubsetDraft(layers=[0, 1, 2]).build(target)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 4, 13)]
    case = Case(target, {"partial": draft}, prompts)
    rows = [0, 1, 2]
    assert case.run(policy, "partial", rows, NO_EOS, N).outputs == [case.reference(r, NO_EOS, N) for r in rows]


class AlternatingPolicy(DepthPolicy):
    """Depth 0 for every row on every third step; otherwise 4 for rows whose (row id + step) is even, else 0.

    So the draft skips steps (all rows, or some rows) and must catch up on what it did not read.
    """

    max_depth = 4

    def reset(self, batch_size: int) -> None:
        self.step, self.budgets = 0, []

    def budget(self, state: StepState) -> torch.Tensor:
        deep = (state.row_ids + self.step) % 2 == 0
        depth = torch.where(deep, 4, 0) if self.step % 3 != 2 else torch.zeros_like(state.row_ids)
        self.step += 1
        self.budgets.append(depth)
        return depth


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_skipped_steps_keep_the_draft_cache_fresh(case: Case, draft: str) -> None:
    everyone = list(range(len(case.prompts)))
    for eos in ((case.eos,), NO_EOS):
        policy = AlternatingPolicy()
        result = case.run(policy, draft, everyone, eos, N)
        assert result.outputs == [case.reference(r, eos, N) for r in everyone], f"eos={eos}"
        depths = torch.cat(policy.budgets)
        assert bool((depths == 0).any()) and bool((depths == 4).any())
        if draft == "same" and eos == NO_EOS:  # a stale draft cache would make the identical draft disagree
            assert result.stats.drafted > 0
            assert result.stats.acceptance_rate == 1.0


class LooselyTyped(DepthPolicy):
    """A policy written quickly: float budgets, a Python int, and 0/1 longs for `keep` (each one a torch error
    mid-decode: gather's dtype two steps on, 'int' has no clamp, or a Long that cannot cast to Bool)."""

    max_depth = 3

    def budget(self, state: StepState):
        return 2 if int(state.generated.min()) % 2 else torch.full_like(state.generated, 2.5, dtype=torch.float)

    def keep(self, features, tokens, state: StepState, position: int):
        return (state.row_ids % 2 == 0).long() if position == 2 else None


def test_a_loosely_typed_policy_decodes_as_generate(case: Case) -> None:
    everyone = list(range(len(case.prompts)))
    result = case.run(LooselyTyped(), "partial", everyone, NO_EOS, N)
    assert result.outputs == [case.reference(r, NO_EOS, N) for r in everyone] and result.stats.drafted > 0



class StopsOnce(DepthPolicy):
    """Stops odd rows at x_1 and has no opinion after (None), or says "go on" (all true): the same decisions."""

    max_depth = 3

    def __init__(self, explicit: bool):
        self.explicit = explicit

    def budget(self, state: StepState) -> torch.Tensor:
        return torch.where(state.row_ids % 2 == 0, 2, 3)

    def keep(self, features, tokens, state: StepState, position: int) -> torch.Tensor | None:
        if position == 1:
            return state.row_ids % 2 == 0
        return torch.ones_like(state.row_ids, dtype=torch.bool) if self.explicit else None


def test_a_keep_with_no_opinion_after_stopping_rows_drafts_no_further(case: Case) -> None:
    """After `keep` stopped the deepest rows, a later None skipped the check of who still drafts: the draft read a
    token for no row and the target verified a column nobody sent."""
    everyone = list(range(len(case.prompts)))
    mixed, explicit = (case.run(StopsOnce(explicit), "partial", everyone, NO_EOS, N) for explicit in (False, True))
    assert mixed.outputs == explicit.outputs == [case.reference(r, NO_EOS, N) for r in everyone]
    assert mixed.stats.draft_forwards == explicit.stats.draft_forwards
    assert mixed.stats.flops.tolist() == explicit.stats.flops.tolist()


# ---------------------------------------------------------------- stats


@pytest.mark.parametrize("policy", ["ar", "static3", "heuristic", "confidence"])
def test_stats_are_consistent(case: Case, policy: str) -> None:
    everyone = list(range(len(case.prompts)))
    for eos in (NO_EOS, (case.eos,)):
        result = case.run(policy, "partial", everyone, eos, N)
        outputs, stats = result.outputs, result.stats
        assert stats.tokens == sum(map(len, outputs))
        # each row-step keeps its accepted drafts + 1 token, except the step that keeps an EOS among its drafts:
        # it ends there, and counts neither a bonus token nor the drafts after the EOS
        ended = sum(1 for r in outputs if r and r[-1] in eos)
        assert stats.accepted + stats.row_steps - ended <= stats.tokens <= stats.accepted + stats.row_steps
        assert stats.mean_accepted == pytest.approx(stats.tokens / stats.row_steps)
        assert int(stats.drafted_at.sum()) == stats.drafted and int(stats.accepted_at.sum()) == stats.accepted
        assert bool((stats.drafted_at[1:] <= stats.drafted_at[:-1]).all()), stats.drafted_at
        assert bool((stats.accepted_at[1:] <= stats.accepted_at[:-1]).all()), stats.accepted_at
        assert bool((stats.accepted_at <= stats.reached_at).all())
        assert bool((stats.reached_at <= stats.drafted_at).all())
        assert stats.reached_at[:1].equal(stats.drafted_at[:1])
        assert bool((stats.reached_at[1:] <= stats.accepted_at[:-1]).all())
        assert stats.target_forwards >= max(map(len, outputs)) / (stats.max_depth + 1)
    if policy == "ar":
        assert stats.drafted == 0 and stats.draft_forwards == 0
        assert stats.target_forwards == max(map(len, outputs)) + case.read_alone(everyone)  # one token per step


def test_static_with_identical_draft_keeps_every_draft(case: Case) -> None:
    everyone = list(range(len(case.prompts)))
    stats = case.run("static3", "same", everyone, NO_EOS, N).stats
    assert stats.acceptance_rate == 1.0
    steps = stats.target_forwards - case.read_alone(everyone)
    assert steps == -(-N // 4)  # k + 1 = 4 tokens per step
    assert stats.mean_accepted == pytest.approx(N / steps)


def test_the_target_itself_as_its_draft_keeps_every_draft(case: Case) -> None:
    """One model object in both roles (a sanity run: acceptance must read 1.0) keeps two caches and two read
    counters: a solo read advances its role's counter, whichever object reads."""
    everyone = list(range(len(case.prompts)))
    engine = Engine(case.target.model, case.target.model, max_new_tokens=N, eos_token_id=[case.eos],
                    solo_above=SOLO, max_padding=0.0)
    result = engine.generate([case.prompts[r] for r in everyone], StaticPolicy(k=3))
    assert result.outputs == [case.reference(r, (case.eos,), N) for r in everyone]
    assert result.stats.drafted > 0 and result.stats.acceptance_rate == 1.0


def test_drafts_after_a_kept_eos_are_neither_kept_nor_rejected(case: Case) -> None:
    """An identical draft proposes the EOS the target writes, and drafts on past it; the row ends at the EOS, so
    the drafts after it are no evidence against the draft: acceptance stays 1 and tau counts no bonus token."""
    everyone = list(range(len(case.prompts)))
    recorder = RecordingPolicy(StaticPolicy(k=3))
    result = case.run(recorder, "same", everyone, (case.eos,), N)
    stats = result.stats
    assert stats.tokens < stats.accepted + stats.row_steps  # some row kept its EOS among the drafts
    assert stats.drafted > 0 and stats.acceptance_rate == 1.0, (stats.accepted, stats.drafted)
    assert stats.mean_accepted * stats.row_steps == pytest.approx(stats.tokens)
    assert bool(torch.cat(recorder.records)[:, COLUMNS.index("accepted")].eq(1).all())


def test_a_kept_eos_ends_the_evidence_where_the_row_ends(tiny_model) -> None:
    """Three drafts, the 2nd an EOS the target keeps, the 3rd one it would reject: the row ends at the EOS, so
    its policy hears of 2 drafts, both kept, not of a rejection (an identical draft, above, never rejects after
    its EOS, so this step is built by hand)."""
    class Heard(DepthPolicy):
        def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
            self.heard = drafted.tolist(), accepted.tolist()

    engine, policy = Engine(tiny_model().model), Heard()
    state = StepState(torch.arange(1, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), 1, 3)
    three, two = (torch.tensor([n], device=DEVICE) for n in (3, 2))
    engine._observe(policy, state, True, DecodeStats(max_depth=3, batch_size=1), three, three, two, two, two == 2)
    assert policy.heard == ([2], [2])


@pytest.mark.parametrize("eos", ["none", "early"])
def test_oracle_with_identical_draft_is_never_rejected(case: Case, eos: str) -> None:
    everyone = list(range(len(case.prompts)))
    stats = case.run("oracle", "same", everyone, NO_EOS if eos == "none" else (case.eos,), N).stats
    assert stats.drafted > 0
    assert stats.acceptance_rate == 1.0, (stats.accepted, stats.drafted)
    if eos == "none":  # it drafts every token the target keeps, up to k=4: 5 tokens per step, as static k=4 would
        assert stats.target_forwards - case.read_alone(everyone) == -(-N // 5)


def test_oracle_never_sends_a_rejected_token(case: Case) -> None:
    """With a weak draft the oracle drafts less, but whatever it drafts is the target's own continuation."""
    everyone = list(range(len(case.prompts)))
    stats = case.run("oracle", "partial", everyone, NO_EOS, N).stats
    assert 0 < stats.drafted == stats.accepted


class FirstProposals(StaticPolicy):
    """Static k that records, per step and row, the committed length and the draft's first proposal."""

    def reset(self, batch_size: int) -> None:
        self.seen: list[tuple[int, int, int]] = []  # (row, tokens generated, proposed token)

    def keep(self, features, x_i: torch.Tensor, state: StepState, i: int):
        if i == 1:
            self.seen += zip(state.row_ids.tolist(), state.generated.tolist(), x_i.tolist())
        return super().keep(features, x_i, state, i)


def test_fused_draft_proposes_what_it_trains_on(case: Case) -> None:
    """The engine feeds a fusing draft the same features distillation trains it with: its first proposal
    at every step equals its prediction on the finished sequence with the target's shifted hidden states
    (a feature off by one position, or a stale one after a rollback, changes the proposals)."""
    from specpolicy.distill.data import hidden_states, masked_logits

    fused, target = case.drafts["fused"].model, case.target.model
    everyone = list(range(len(case.prompts)))
    policy = FirstProposals(k=3)
    result = case.run(policy, "fused", everyone, NO_EOS, N)
    assert 0 < result.stats.accepted < result.stats.drafted  # rollbacks happen
    rows = {}
    for r in everyone:
        seq = torch.tensor([case.prompts[r] + result.outputs[r]], device=DEVICE)
        batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": torch.ones_like(seq).bool()}
        with torch.no_grad():
            batch["features"] = hidden_states(target, batch)
            rows[r] = masked_logits(fused, batch).argmax(-1)  # [L]: the prediction at each position
    assert len(policy.seen) > len(everyone)
    for r, generated, proposed in policy.seen:
        assert proposed == int(rows[r][len(case.prompts[r]) + generated - 1]), (r, generated)


class Observed(StaticPolicy):
    """Static k that keeps what each step it observes drafted per row."""

    def reset(self, batch_size: int) -> None:
        self.drafted: list[torch.Tensor] = []

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        self.drafted.append(drafted.clone())


def test_the_prefill_step_of_a_fusing_draft_is_not_observed(case: Case) -> None:
    """A fusing draft cannot draft before the target has read the prompts, so the engine zeroed the first
    step's budget after the policy had set it, and the policy then observed nothing drafted: goodput counted
    a failure for every row, the heuristic a fully accepted step (+2). Now the policy sees no such step."""
    policy = Observed(k=2)
    case.run(policy, "fused", list(range(len(case.prompts))), NO_EOS, N)
    assert bool((policy.drafted[0] > 0).all())


class SeenLengths(StaticPolicy):
    """Static k that records what each step tells it: fewest tokens generated, `remaining`, `unread`."""

    def reset(self, batch_size: int) -> None:
        self.seen: list[tuple[int, int | None, int]] = []

    def budget(self, state: StepState) -> torch.Tensor:
        self.seen.append((int(state.generated.min()), state.remaining, state.unread))
        return super().budget(state)


def test_policies_see_what_the_slowest_row_and_the_draft_still_need(case: Case) -> None:
    """`remaining`: tokens the furthest-behind row may still make; `unread`: the draft's backlog, the whole
    longest prompt at first, then at most the k=2 tokens a step commits beyond what the draft read."""
    policy = SeenLengths(k=2)
    case.run(policy, "partial", list(range(len(case.prompts))), NO_EOS, N)
    assert policy.seen[0] == (0, N, max(map(len, case.prompts))) and len(policy.seen) > 1
    assert all(remaining == N - fewest for fewest, remaining, _ in policy.seen)
    assert all(1 <= unread <= 2 for *_, unread in policy.seen[1:])


@pytest.mark.parametrize("policy", ["ar", "static3"])
def test_backlogs_that_barely_differ_are_read_in_one_padded_pass(case: Case, policy: str) -> None:
    """Prompts of 20 and 18 tokens (10% padding together): with `max_padding=0.3` the first pass reads both,
    with 0 each is read alone first; both decode exactly what `model.generate` does."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 18)]
    expected = [case.generate(p, NO_EOS, N) for p in prompts]
    forwards = {}
    for padding in (0.0, 0.3):
        engine = Engine(case.target.model, case.drafts["partial"].model, max_new_tokens=N, eos_token_id=[],
                        solo_above=SOLO, max_padding=padding)
        result = engine.generate(prompts, POLICIES[policy]())
        assert result.outputs == expected, padding
        forwards[padding] = result.stats.target_forwards
    assert forwards[0.0] == forwards[0.3] + 2


@pytest.mark.parametrize("family, config", [
    ("mistral", {"sliding_window": 6}),  # no layer types: every layer slides
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),  # layers 2-3 slide
])
def test_sliding_window_layers_decode_as_generate(tiny_model, family: str, config: dict) -> None:
    """Prompts and outputs longer than the window: the engine's own masks must slide as transformers' do
    (they did not: every row of both families decoded differently from `model.generate`)."""
    target = tiny_model(family, **config)
    draft = LayerSubsetDraft(layers=[0, -1]).build(target)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 5, 13)]
    engine = Engine(target.model, draft.model, max_new_tokens=14, eos_token_id=[], solo_above=SOLO)
    refs = [target.model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=14, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for rows in ([0], [0, 1, 2]):
        for policy in (ArPolicy(), StaticPolicy(k=3)):
            assert engine.generate([prompts[r] for r in rows], policy).outputs == [refs[r] for r in rows]


def test_a_sliding_window_the_attention_ignores_is_not_applied(tiny_model, caplog) -> None:
    """Llama's config stores `sliding_window` and its attention never reads it: the engine masked every layer by it
    and decoded other tokens than the model's forward. (transformers' generate crops its cache to it instead: a
    third answer, which the warning names.)"""
    target = tiny_model("llama", sliding_window=6)
    plain = tiny_model("llama")  # the same weights without the key: what the forward computes, cache or not
    prompts = [list(range(3, 23)), [5, 6, 7]]
    refs = [plain.model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=14, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    with caplog.at_level("WARNING", logger="specpolicy"):
        engine = Engine(target.model, target.model, max_new_tokens=14, eos_token_id=[])
    assert "sets sliding_window=6, which llama's attention does not read" in caplog.text
    for policy in (ArPolicy(), StaticPolicy(k=3)):
        assert engine.generate(prompts, policy).outputs == refs


def test_attention_layers_the_masks_cannot_express_are_refused(tiny_model) -> None:
    target = tiny_model("qwen2")
    config = copy.deepcopy(target.model.config)
    config.layer_types = ["full_attention", "linear_attention"] * 2
    with pytest.raises(SpecPolicyError, match=r"qwen2 has \['linear_attention'\] attention layers"):
        sliding_window(config)


@pytest.mark.parametrize("settings, message", [
    ({"max_new_tokens": 0}, "engine.max_new_tokens must be an integer >= 1, got 0"),
    ({"temperature": "abc"}, "engine.temperature must be a number >= 0, got 'abc'"),
    ({"top_p": 0}, "engine.top_p must be a number in (0, 1], got 0"),
    ({"seed": 1.5}, "engine.seed must be an integer, got 1.5"),
    ({"solo_above": 0}, "engine.solo_above must be an integer >= 1, got 0"),  # would read empty backlogs alone
    ({"max_padding": 1.5}, "engine.max_padding must be a number in [0, 1], got 1.5"),
])
def test_engine_refuses_settings_that_cannot_decode(tiny_model, settings: dict, message: str) -> None:
    """The pipelines run the same check on `cfg.engine` before any model loads (keys it does not know pass)."""
    with pytest.raises(SpecPolicyError, match=re.escape(message)):
        check_settings({"_target_": "specpolicy.decode.Engine", **settings})
    with pytest.raises(SpecPolicyError, match=re.escape(message)):
        Engine(tiny_model().model, **settings)


def test_engine_refuses_what_it_cannot_decode(tiny_model) -> None:
    """Each of `Engine._check`'s refusals, as one SpecPolicyError (a prompt past the context used to reach the
    models as an index error)."""
    target = tiny_model()
    context = target.model.config.max_position_embeddings
    plain = Engine(target.model, max_new_tokens=4)
    with pytest.raises(SpecPolicyError, match="every prompt needs at least one token"):
        plain.generate([[1, 2], []], ArPolicy())
    with pytest.raises(SpecPolicyError, match="StaticPolicy drafts up to 2 tokens but no draft model is set"):
        plain.generate([[1, 2]], StaticPolicy(k=2))
    with pytest.raises(SpecPolicyError, match="OraclePolicy is defined for greedy decoding only"):
        Engine(target.model, target.model, max_new_tokens=4, temperature=0.5).generate([[1, 2]], OraclePolicy(k=2))
    with pytest.raises(SpecPolicyError, match=f"a prompt of {context - 3} tokens \\+ max_new_tokens=4 exceeds"):
        plain.generate([[1] * (context - 3)], ArPolicy())
    assert len(plain.generate([[1] * (context - 4)], ArPolicy()).outputs[0]) == 4  # exactly the context fits


@pytest.mark.parametrize("prompts, policy, message", [
    ([[1, 999]], ArPolicy(), "prompt token 999 is not an id of the target's vocabulary (0..259)"),
    ([[1, -1]], ArPolicy(), "prompt token -1 is not an id"),
    ([1, 2, 3], ArPolicy(), "prompts must be a list of token-id lists"),
    (torch.tensor([[[1, 2]]]), ArPolicy(), "prompts must be a list of token-id lists"),
    ((p for p in [[1, 2]]), ArPolicy(), "prompts must be a list of token-id lists"),  # was "at least one token"
    ([], ArPolicy(), "no prompts to decode"),
    ([[1, 2]], ArPolicy, "policy must be a DepthPolicy instance"),
    ([[1, 2], [3]], "oracle", "the oracle's reference holds 1 outputs for a batch of 2 prompts"),
])
def test_engine_refuses_misuse_from_a_notebook(tiny_model, prompts, policy, message: str) -> None:
    """Easy slips when calling the engine directly, each one SpecPolicyError (they were index or type errors
    from inside torch, or, for a stale oracle reference, an IndexError mid-decode)."""
    target = tiny_model()
    if policy == "oracle":
        policy = OraclePolicy(k=2)
        policy.set_reference([[5, 6]])
    with pytest.raises(SpecPolicyError, match=re.escape(message)):
        Engine(target.model, target.model, max_new_tokens=2).generate(prompts, policy)
    with pytest.raises(SpecPolicyError, match="pass target.model, not the LoadedModel"):
        Engine(target)
    with pytest.raises(SpecPolicyError, match="Engine's target must be a transformers causal LM"):
        Engine("gpt2")  # was "'str' object has no attribute 'generation_config'"
    with pytest.raises(SpecPolicyError, match="eos_token_id must be a token id or a list of them, got '</s>'"):
        Engine(target.model, eos_token_id="</s>")
    with pytest.raises(SpecPolicyError, match="first_id must be an integer >= 0, got 1.5"):
        Engine(target.model, max_new_tokens=2, temperature=0.7).generate([[1, 2]], ArPolicy(), first_id=1.5)
    engine = Engine(target.model, max_new_tokens=2, eos_token_id=[np.int64(7)])  # numpy ids are ids
    assert engine.generate([torch.tensor([1, 2])], ArPolicy()).outputs == engine.generate([[1, 2]], ArPolicy()).outputs
    both = engine.generate([[1, 2], [3, 4]], ArPolicy()).outputs  # a [B, T] tensor of ids was refused as text
    assert engine.generate(torch.tensor([[1, 2], [3, 4]]), ArPolicy()).outputs == both


def test_a_draft_of_fewer_vocabulary_rows_drafts_in_the_ids_both_have(tiny_model) -> None:
    """One tokenizer's models padded to other sizes (Qwen2.5-0.5B: 151936 rows, -7B: 152064) were refused. The
    draft proposes among its rows; an id past them (here the random target writes some, and a prompt has some)
    it reads as its last row, and the target still decides every token."""
    target = tiny_model("qwen2", vocab_size=320).model
    draft = tiny_model("qwen2", seed=1, vocab_size=300, num_hidden_layers=2).model
    prompts = [[5, 9, 3], list(range(20, 31)), [310, 315, 2, 8, 9, 10, 11]]
    refs = [target.generate(torch.tensor([p], device=DEVICE), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert any(t >= 300 for ref in refs for t in ref)
    engine = Engine(target, draft, max_new_tokens=12, eos_token_id=[])
    for policy in (ArPolicy(), StaticPolicy(k=3), ConfidencePolicy(k=3, threshold=0.01)):
        result = engine.generate(prompts, policy)
        assert result.outputs == refs and (result.stats.drafted > 0) == (policy.max_depth > 0)


def test_engine_refuses_a_draft_of_another_vocabulary_or_shorter_context(tiny_model) -> None:
    """`check_compatible` needs tokenizers; the engine, given models alone, checks what they tell."""
    target = tiny_model()
    with pytest.raises(SpecPolicyError, match=r"vocabulary sizes differ \(target llama: 260, draft llama: 400\)"):
        Engine(target.model, tiny_model(vocab_size=400).model)
    with pytest.raises(SpecPolicyError, match=r"draft context is shorter than the target's \(target llama: 512, draft"):
        Engine(target.model, tiny_model(max_position_embeddings=16).model)


def test_a_multimodal_model_is_refused_by_name(tiny_model) -> None:
    """Gemma 3 from 4B up loads as a conditional-generation model whose language settings sit in text_config: an
    AttributeError on vocab_size with a draft, "cannot tell the context length" without one."""
    text = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    model = RandomInitSource("gemma3", {"text_config": {**text, "vocab_size": 260}}, device=str(DEVICE)).load().model
    for draft in (None, model):
        with pytest.raises(SpecPolicyError, match="gemma3 is a multimodal model .* load its language model alone"):
            Engine(model, draft)


@pytest.mark.parametrize("model_type, config", [("bloom", {}), ("falcon", {"alibi": True}), ("rwkv", {}),
                                                ("gpt_neo", {"attention_types": [[["global", "local"], 2]]})])
def test_models_the_engine_cannot_steer_are_refused(model_type: str, config: dict) -> None:
    """Bloom and Falcon's ALiBi build their biases from a 2D mask (crashes at batch 2); RWKV takes the cache and
    ignores it, and GPT-Neo's local layers place their window by the whole cache's length (wrong outputs,
    silently)."""
    model = RandomInitSource(model_type, {**TINY, **config}, device=str(DEVICE)).load().model
    with pytest.raises(SpecPolicyError, match="ALiBi builds its position biases|did not use the engine's KV cache|"
                                              "local attention layers place their window"):
        Engine(model, max_new_tokens=2).generate([[1, 2], [3]], ArPolicy())
