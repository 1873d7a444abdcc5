"""The load-aware policies: cost model, goodput rule, depth head, rollout recording."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

import synthetic
from specpolicy.cost.model import CostModel
from specpolicy.cost.profile import LatencyProfile
from specpolicy.decode import Engine
from specpolicy.errors import SpecPolicyError
from specpolicy.models.draft import LayerSubsetDraft
from specpolicy.policy import ConfidencePolicy, EntropyPolicy, OraclePolicy, StaticPolicy, StepState
from specpolicy.policy.baselines import DisableByBatchPolicy, HeuristicPolicy, ThresholdPolicy
from specpolicy.policy.goodput import GoodputPolicy, HeadEstimator, batch_tokens, expected_max_normal
from specpolicy.policy.head import DepthHead, HeadConfig
from specpolicy.policy.lightning import HeadModule, RolloutDataModule
from specpolicy.rollout.collect import COLUMNS, RecordingPolicy
from specpolicy.rollout.features import COLUMN, FEATURE_NAMES, draft_features

pytestmark = pytest.mark.usefixtures("single_thread")


def one_row(remaining: int | None = None, unread: int = 1) -> StepState:
    """One row in flight with 64 context tokens: the step the goodput tests decide on."""
    return StepState(torch.arange(1), torch.zeros(1, dtype=torch.long), 1, 64, remaining, unread)


def test_cost_model_interpolates_between_measured_points() -> None:
    cost = CostModel(synthetic.profile())
    assert cost.forward_ms("target", 4, 3) == pytest.approx(30 + 4 * 3)  # on the grid
    between = cost.forward_ms("target", 4, 3.5)
    assert cost.forward_ms("target", 4, 3) < between < cost.forward_ms("target", 4, 4)
    assert cost.forward_ms("target", 1000, 1) == cost.forward_ms("target", 64, 1)  # clamped, not extrapolated
    assert cost.forward_ms("target", rows=4, tokens=3.5) == between  # by name too, as before its answers were kept
    assert cost.max_useful_depth(1, limit=4) == cost.max_useful_depth(1, 4)
    assert cost.step_ms(8, 0) == pytest.approx(30 + 8)
    assert cost.step_ms(8, 2) == pytest.approx(2 * 0.1 * (30 + 8) + 30 + 8 * 3)


def test_the_drafting_overhead_is_paid_per_draft_position_and_can_call_drafting_off() -> None:
    plain, taxed = CostModel(synthetic.profile()), CostModel(synthetic.profile(overhead_ms=5.0))
    assert taxed.draft_ms(8) == pytest.approx(plain.draft_ms(8) + 5.0)
    assert taxed.step_ms(8, 2) == pytest.approx(plain.step_ms(8, 2) + 2 * 5.0)
    assert taxed.step_ms(8, 0) == plain.step_ms(8, 0)

    def budget(profile) -> int:  # one row, its prior acceptance 0.3: a draft token pays only if cheap
        policy = GoodputPolicy(profile, k=4, prior=0.3, optimism=0.0)
        policy.reset(1)
        return int(policy.budget(one_row()).max())

    assert budget(synthetic.profile()) >= 1
    assert budget(synthetic.profile(overhead_ms=10.0)) == 0


def test_a_long_catch_up_costs_what_as_many_tokens_in_flight_cost() -> None:
    cost = CostModel(synthetic.profile())
    assert cost.catch_up_ms(4, 1) == 0.0
    assert cost.catch_up_ms(4, 5) == pytest.approx(cost.forward_ms("draft", 4, 5) - cost.forward_ms("draft", 4, 1))
    assert cost.catch_up_ms(1, 18) == pytest.approx(cost.forward_ms("draft", 2, 9) - cost.forward_ms("draft", 1, 1))
    two_chunks = 2 * cost.forward_ms("draft", 64, 9)
    assert cost.catch_up_ms(64, 18) == pytest.approx(two_chunks - cost.forward_ms("draft", 64, 1))


def test_drafting_starts_only_where_the_rest_of_the_row_repays_reading_the_prompt() -> None:
    """One row, acceptance 0.2: drafting pays per step (1.2 tokens in 35.1 ms vs 1 in 31 ms) once the draft
    has read the context, but a 100-token prompt to read first (10.5 ms) does not pay back in 4 tokens."""

    def budget(unread: int, remaining: int) -> int:
        policy = GoodputPolicy(synthetic.profile(), k=4, prior=0.2, optimism=0.0)
        policy.reset(1)
        state = one_row(remaining, unread)
        return int(policy.budget(state).max())

    assert budget(unread=1, remaining=4) == 1
    assert budget(unread=100, remaining=4) == 0
    assert budget(unread=100, remaining=1000) == 1


def test_the_cost_model_interpolates_in_log2_rows_and_clamps_outside_the_grid() -> None:
    """Rows in flight fall between the grid's as rows finish: 3 rows sit at log2(3) between 2 and 4 (not
    halfway), tokens linearly; outside the grid the curve is clamped, never extrapolated."""
    cost = CostModel(synthetic.profile(per_token_ms=2.0, fixed_ms=30.0))  # 30 + 2 * rows * tokens
    at = lambda rows, tokens: 30.0 + 2.0 * rows * tokens  # noqa: E731  (on the grid)
    assert cost.forward_ms("target", 4, 3) == pytest.approx(at(4, 3))
    w = np.log2(3) - 1  # weight of the 4-row point
    assert cost.forward_ms("target", 3, 1) == pytest.approx((1 - w) * at(2, 1) + w * at(4, 1))
    assert cost.forward_ms("target", 2, 2.5) == pytest.approx((at(2, 2) + at(2, 3)) / 2)
    assert cost.forward_ms("target", 128, 20) == pytest.approx(at(64, 9))


def test_speculation_stops_where_the_profile_says_it_cannot_pay() -> None:
    cost = CostModel(synthetic.profile(per_token_ms=2.0, draft_share=0.3))
    depths = [cost.max_useful_depth(rows, 8) for rows in synthetic.ROWS]
    assert depths == sorted(depths, reverse=True), depths
    assert depths[0] == 8 and depths[-1] == 0


def test_a_step_in_the_curve_does_not_hide_the_deeper_depths_past_it() -> None:
    """A 3-token forward dearer than a 4-token one (a kernel change, as measured on a CPU): depth 2 pays less
    than depth 1 even with perfect acceptance, depth 3 more. The cap once stopped at that first dip (1)."""
    profile = synthetic.profile(per_token_ms=2.0)
    for row in profile.target_ms:
        row[2] = row[3] * 1.5  # 3 tokens per row
    cost = CostModel(profile)
    assert cost.goodput(1, 2, 3) < cost.goodput(1, 1, 2) < cost.goodput(1, 3, 4)
    assert cost.max_useful_depth(1, 8) == 8 and cost.max_useful_depth(1, 3) == 3


def test_draft_features_from_known_distributions() -> None:
    """What the head is trained on and decides from, on distributions worked out by hand."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    f = draft_features(probs.log(), torch.tensor([0.8, 1.0]), 2, rows=5, tokens=300)
    assert torch.allclose(f[:, COLUMN["top1"]], torch.tensor([0.5, 0.25]))
    entropy = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))  # the -inf logit adds nothing
    assert torch.allclose(f[:, COLUMN["entropy"]], torch.tensor([entropy, math.log(4)]))
    assert torch.allclose(f[:, COLUMN["margin"]], torch.tensor([0.2, 0.0]))
    assert torch.allclose(f[:, COLUMN["cum_top1"]], torch.tensor([0.4, 0.25]))  # carried product x this top1
    assert f[:, [COLUMN["position"], COLUMN["rows"], COLUMN["tokens"]]].tolist() == [[2, 5, 300]] * 2
    one = draft_features(torch.zeros(2, 1), torch.ones(2), 1, rows=2, tokens=9)  # a one-token draft vocabulary:
    assert one[:, COLUMN["margin"]].tolist() == [1.0, 1.0]  # no runner-up (topk(2) failed)


class SeesFeatures(StaticPolicy):
    """Static k that keeps the features of every draft position of every step."""

    reads_features = True

    def reset(self, batch_size: int) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def keep(self, features, tokens, state, position):
        if position == 1:
            self.steps.append([])
        self.steps[-1].append(features.clone())
        return None


def test_the_engine_carries_cum_top1_along_each_draft(tiny_model) -> None:
    """cum_top1 at position i is the product of the row's top1 at positions 1..i of the same step."""
    policy = SeesFeatures(k=3)
    Engine(tiny_model().model, tiny_model(seed=1).model, max_new_tokens=8).generate([[1, 2, 3], [4, 5]], policy)
    assert policy.steps
    for step in policy.steps:
        top1 = torch.stack([f[:, COLUMN["top1"]] for f in step], 1)  # [A, positions]
        cum = torch.stack([f[:, COLUMN["cum_top1"]] for f in step], 1)
        assert torch.allclose(cum, top1.cumprod(1))


def test_the_baselines_decide_as_their_names_say() -> None:
    """Greedy parity cannot see a policy's decisions (any depth gives the same output), so each baseline meets a
    hand-made step: the heuristic's +2 / -1 per row within [min_k, max_k], the thresholds' direction, and
    disable-by-batch's switch at `threshold` rows."""
    def state(rows: int) -> StepState:
        return StepState(torch.arange(rows), torch.zeros(rows, dtype=torch.long), rows, rows * 10)

    heuristic = HeuristicPolicy(initial=2, max_k=4, min_k=1)
    heuristic.reset(3)
    assert heuristic.budget(state(3)).tolist() == [2, 2, 2]
    heuristic.observe(state(3), torch.tensor([2, 2, 2]), torch.tensor([2, 1, 0]))  # all kept / one / none
    assert heuristic.budget(state(3)).tolist() == [4, 1, 1]
    heuristic.observe(state(3), torch.tensor([4, 1, 1]), torch.tensor([4, 0, 0]))
    assert heuristic.budget(state(3)).tolist() == [4, 1, 1]  # clamped at max_k and min_k

    features = torch.zeros(3, len(FEATURE_NAMES))
    features[:, COLUMN["top1"]] = torch.tensor([0.9, 0.5, 0.1])
    features[:, COLUMN["entropy"]] = torch.tensor([0.2, 1.0, 3.0])
    no_tokens = torch.zeros(3, dtype=torch.long)
    assert ConfidencePolicy(k=4, threshold=0.5).keep(features, no_tokens, state(3), 1).tolist() == [True, True, False]
    assert EntropyPolicy(k=4, threshold=1.0).keep(features, no_tokens, state(3), 1).tolist() == [True, True, False]

    switch = DisableByBatchPolicy(k=3, threshold=4)
    assert switch.budget(state(3)).tolist() == [3, 3, 3] and switch.budget(state(4)).tolist() == [0] * 4

    # the oracle compares x_i with the target's token at the row's own position: one token in, x_1 is the 2nd
    oracle = OraclePolicy(k=3)
    oracle.set_reference([[10, 11, 12, 13]])
    oracle.reset(1)
    one_in = StepState(torch.arange(1), torch.tensor([1]), 1, 5)
    assert oracle.keep(None, torch.tensor([11]), one_in, 1).tolist() == [True]
    assert oracle.keep(None, torch.tensor([12]), one_in, 1).tolist() == [False]
    assert oracle.keep(None, torch.tensor([12]), one_in, 2).tolist() == [True]


def drafted_depth(policy: GoodputPolicy, rows: int, top1: float = 0.99) -> int:
    """How deep `policy` drafts a batch of `rows` rows whose draft has top-1 probability `top1` everywhere (the
    features carry the batch load, as the engine's do)."""
    features = torch.zeros(rows, len(FEATURE_NAMES))
    features[:, COLUMN["top1"]] = top1
    features[:, COLUMN["rows"]], features[:, COLUMN["tokens"]] = rows, rows * 64
    policy.reset(rows)
    state = StepState(torch.arange(rows), torch.zeros(rows, dtype=torch.long), rows, rows * 64)
    kept = 0
    for position in range(1, int(policy.budget(state).max()) + 1):
        if not bool(policy.keep(features, torch.zeros(rows, dtype=torch.long), state, position).any()):
            break
        kept = position
    return kept


@pytest.mark.parametrize("estimator", ["confidence", "head"])
def test_mean_depth_falls_with_load_and_reaches_zero(tmp_path: Path, estimator: str) -> None:
    head = HeadEstimator(str(synthetic.head_dir(tmp_path))) if estimator == "head" else None
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=6, estimator=head)
    depth = {rows: drafted_depth(policy, rows) for rows in synthetic.ROWS}
    assert [depth[r] for r in synthetic.ROWS] == sorted(depth.values(), reverse=True), depth
    assert depth[1] > 0 and depth[64] == 0, depth  # a policy that never drafted would pass the line above


def test_a_head_that_expects_less_at_a_higher_load_drafts_less_there(tmp_path: Path) -> None:
    """The estimator moves the depth, not only the cost model: where verifying is nearly free at every load, a
    head whose acceptance falls with rows in flight (0.88 at 1 row, 0.02 at 16) drafts at 1 row and not at 16,
    while the draft's confidence, the same at every load, drafts alike at both."""
    head = DepthHead(HeadConfig(layers=0, features=("rows",), prior=0.9))
    with torch.no_grad():  # logit = 4 - 2 log2(1 + rows)
        head.mlp[-1].weight.fill_(-2.0)
        head.mlp[-1].bias.fill_(4.0)
    head.save(tmp_path)
    flat = synthetic.profile(per_token_ms=0.01, draft_share=0.05)
    learned = GoodputPolicy(flat, k=4, estimator=HeadEstimator(str(tmp_path)))
    confidence = GoodputPolicy(flat, k=4, prior=0.9)
    assert drafted_depth(learned, 1, top1=0.88) > 0 == drafted_depth(learned, 16, top1=0.88)
    assert drafted_depth(confidence, 1, top1=0.88) == drafted_depth(confidence, 16, top1=0.88) > 0


def test_one_confident_row_does_not_widen_a_busy_batch() -> None:
    """The verify pass is as wide as the deepest row, so the batch decides: one confident row drafts on
    alone, but not among 15 hopeless rows whose every token would then cost a wider step."""
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=6, prior=0.9)

    def keeps(top1: list[float]) -> torch.Tensor:
        rows = len(top1)
        policy.reset(rows)
        state = StepState(torch.arange(rows), torch.zeros(rows, dtype=torch.long), rows, rows * 64)
        assert int(policy.budget(state).min()) > 0
        features = torch.zeros(rows, len(FEATURE_NAMES))
        features[:, COLUMN["top1"]] = torch.tensor(top1)
        return policy.keep(features, torch.zeros(rows, dtype=torch.long), state, 1)

    assert keeps([0.99]).all()
    assert keeps([0.99] * 16).all()
    assert not keeps([0.99] + [0.05] * 15).any()


def _steps_of_the_slowest_row(alpha: float, depth: int, rows: int, n: int, trials: int = 2000) -> float:
    """Monte Carlo: steps until every one of `rows` rows has made `n` tokens, drafting `depth` per step,
    each draft accepted with `alpha` until the first rejection (the engine never overshoots `n`)."""
    rng = np.random.default_rng(0)
    made, steps = np.zeros((trials, rows)), np.zeros((trials, rows))
    while (made < n).any():
        accepted = (rng.random((trials, rows, depth)) < alpha).cumprod(-1).sum(-1)
        steps += made < n
        made = np.minimum(made + 1 + accepted, n)
    return float(steps.max(1).mean())


@pytest.mark.parametrize(("alpha", "depth", "rows"), [(0.3, 1, 2), (0.3, 1, 8), (0.8, 4, 8), (0.5, 2, 32)])
def test_batch_tokens_predicts_when_the_slowest_row_finishes(alpha: float, depth: int, rows: int) -> None:
    n = 24
    reach = alpha ** np.arange(depth + 1)
    mean, var = reach.sum(), (reach * (2 * np.arange(depth + 1) + 1)).sum() - reach.sum() ** 2
    simulated = _steps_of_the_slowest_row(alpha, depth, rows, n)
    assert n / batch_tokens(mean, var, rows, n) == pytest.approx(simulated, rel=0.08)
    if rows >= 8:  # the per-row mean alone misses the wait by more than that
        assert n / mean < 0.9 * simulated
    assert batch_tokens(mean, var, 1, n) == batch_tokens(mean, var, rows, None) == mean


def test_expected_max_normal() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-6)
    assert expected_max_normal(8) < expected_max_normal(32) < 2.1


def test_a_batch_waits_for_its_slowest_row() -> None:
    """At 2 rows (k=1 step 37.2 ms vs 32 ms plain) acceptance 0.2 pays per row (1.2 tokens per step) but
    not once the batch waits for the row that drew fewer acceptances; alone, or with an unbounded
    length, or told not to wait, the batch drafts."""

    def budget(rows: int, remaining: int | None, wait: bool = True) -> int:
        policy = GoodputPolicy(synthetic.profile(), k=4, prior=0.2, optimism=0.0, wait_for_slowest=wait)
        policy.reset(rows)
        state = StepState(torch.arange(rows), torch.zeros(rows, dtype=torch.long), rows, rows * 64, remaining)
        return int(policy.budget(state).max())

    assert budget(1, 24) == 1 and budget(2, None) == 1 and budget(2, 24, wait=False) == 1
    assert budget(2, 24) == 0
    assert budget(2, 100_000) == 1


def test_a_drafted_token_is_judged_on_what_verifying_it_costs() -> None:
    """The draft forward behind x_1 is paid whether or not x_1 is verified: at batch 1 (V(1) = 32 ms,
    V(2) = 34 ms, D = 9.6 ms) a token accepted 1 time in 5 is worth verifying when the budget ends there,
    and not when keeping it also pays the draft forward for x_2 (stop at 0.36 with the sunk forward
    left out; 0.05 and 0.28 with it in)."""

    def keeps(k: int, top1: float) -> bool:
        policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=k, prior=0.9)
        policy.reset(1)
        state = one_row()
        assert int(policy.budget(state)) == k
        features = torch.zeros(1, len(FEATURE_NAMES))
        features[:, COLUMN["top1"]] = top1
        return bool(policy.keep(features, torch.zeros(1, dtype=torch.long), state, 1))

    assert keeps(1, 0.2) and not keeps(1, 0.03)
    assert not keeps(3, 0.2) and keeps(3, 0.35)


def test_the_budget_ends_where_the_rows_do() -> None:
    """Two tokens left: the engine drafts at most one, so the policy budgets one and judges x_1 as the last draft
    (kept at 0.2, as with k=1 above), not as a step towards an x_2 that will never be drafted (stopped at 0.2)."""
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=3, prior=0.9)
    policy.reset(1)
    state = one_row(remaining=2)
    assert int(policy.budget(state)) == 1
    features = torch.zeros(1, len(FEATURE_NAMES))
    features[:, COLUMN["top1"]] = 0.2
    assert bool(policy.keep(features, torch.zeros(1, dtype=torch.long), state, 1))


def test_a_row_on_its_last_token_does_not_decide_for_the_rows_that_draft() -> None:
    """The engine drafts nothing for a row with one token left: its confidence (high or low) must neither make the
    batch draft nor stop it."""
    generated = torch.tensor([23, 4])  # of 24: row 0 finishes with this step's bonus token

    def step(top1_of_the_finishing_row: float) -> tuple[int, bool]:
        policy = GoodputPolicy(synthetic.profile(), k=4, prior=0.9, optimism=0.0, wait_for_slowest=False)
        policy.reset(2)
        state = StepState(torch.arange(2), generated, 2, 128, 24 - int(generated.min()))
        depth = int(policy.budget(state).max())
        features = torch.zeros(2, len(FEATURE_NAMES))
        features[:, COLUMN["top1"]] = torch.tensor([top1_of_the_finishing_row, 0.05])
        return depth, bool(policy.keep(features, torch.zeros(2, dtype=torch.long), state, 1).all())

    assert step(1.0) == step(0.05) == (4, False)

    def budget(generated: list[int]) -> int:  # row 0 accepted every draft so far, row 1 none
        policy = GoodputPolicy(synthetic.profile(), k=4, prior=0.3, optimism=0.0, wait_for_slowest=False,
                               strength=1.0)
        policy.reset(2)
        for _ in range(3):
            state = StepState(torch.arange(2), torch.tensor([10, 4]), 2, 128, 20)
            policy.budget(state)
            policy.observe(state, torch.tensor([4, 4]), torch.tensor([4, 0]))
        return int(policy.budget(StepState(torch.arange(2), torch.tensor(generated), 2, 128, 20)).max())

    assert budget([12, 4]) == 4 and budget([23, 4]) == 0  # the confident row's last step: the other's to decide


def test_a_row_that_would_not_draft_checks_with_one_token_only() -> None:
    """A row whose estimate (prior 0.3; batch 1 breaks even at ~0.36) says "do not draft" may still check, where
    an optimistic bound on it pays: with one token, whatever depth that bound would choose, since one token buys
    the evidence."""
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=4, prior=0.3, optimism=3.0)
    policy.reset(1)
    assert int(policy.budget(one_row())) == 1


def test_old_evidence_fades_back_to_the_prior() -> None:
    """With memory < 1 a row's evidence fades each step: a perfect step makes a hopeless row draft, and thirty
    steps on it no longer does."""
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=4, prior=0.05, optimism=0.0,
                           memory=0.5)
    policy.reset(1)
    assert int(policy.budget(one_row())) == 0
    policy.observe(one_row(), torch.tensor([4]), torch.tensor([4]))
    assert int(policy.budget(one_row())) > 0
    for _ in range(30):
        depth = int(policy.budget(one_row()))
    assert depth == 0


def test_the_draft_s_catch_up_is_shared_by_the_steps_left() -> None:
    """After 100 tokens decoded plainly the draft must read them before it drafts again: paid once, shared by
    the steps left in the row (its tokens left over the tokens per step), so it pays with 7 tokens left and not
    with 6 (shared by the tokens left instead, it paid with 6)."""
    def budget(remaining: int) -> int:
        policy = GoodputPolicy(synthetic.profile(), k=4, prior=0.2, optimism=0.0)
        policy.reset(1)
        return int(policy.budget(one_row(remaining, unread=100)))

    assert budget(6) == 0 and budget(7) == 1


def test_engine_follows_the_goodput_rule_per_load(tiny_model) -> None:
    """Through the engine: at batch 1 a row that keeps being accepted learns to draft deep; at batch 64 no
    row drafts at all (not even the first draft forward)."""
    target = tiny_model()
    policy = GoodputPolicy(synthetic.profile(per_token_ms=2.0, draft_share=0.3), k=6,
                           estimator=lambda f: torch.full_like(f[:, 0], 0.95))
    engine = Engine(target.model, target.model, max_new_tokens=32)  # a draft equal to the target: all accepted
    prompts = [[3, 4, 5]] * 64
    assert engine.generate(prompts[:1], policy).stats.mean_depth > 2
    busy = engine.generate(prompts, policy).stats
    assert busy.mean_depth == 0 and busy.draft_forwards == 0


def test_rows_draft_only_when_it_could_pay(tiny_model) -> None:
    """The "draft at all" decision costs no draft forward: a hopeless prior never drafts, an optimistic
    check discovers a perfect draft, and a useless draft is dropped after a check and re-checked rarely."""
    target, other = tiny_model(), tiny_model(seed=1)
    profile = synthetic.profile(per_token_ms=2.0, draft_share=0.3)  # batch 1 breaks even at acceptance ~0.36
    trusting = lambda f: torch.full_like(f[:, 0], 0.95)  # noqa: E731 (keep drafting up to the budget)
    n = 48

    def run(draft, prior: float, estimator=trusting):
        policy = GoodputPolicy(profile, k=4, prior=prior, estimator=estimator, optimism=1.0)  # probes at prior 0.2
        return Engine(target.model, draft.model, max_new_tokens=n).generate([[3, 4, 5]], policy).stats

    assert run(target, prior=0.05).draft_forwards == 0
    assert run(target, prior=0.2).mean_depth > 1.5  # from one token to the cap of 4 as evidence builds
    useless = run(other, prior=0.2)
    assert useless.acceptance_rate < 0.2
    assert 0 < useless.drafted <= n // 8, useless.drafted
    # a draft forward whose token `keep` always refuses is evidence too: such rows stop paying for it
    refused = run(target, prior=0.3, estimator=lambda f: torch.zeros_like(f[:, 0]))
    assert refused.drafted == 0 and 0 < refused.draft_forwards <= n // 4, refused.draft_forwards  # was: every step


@pytest.mark.parametrize("make, message", [
    (lambda: ConfidencePolicy(k=4, threshold=2.0), "top1 is a probability"),
    (lambda: ThresholdPolicy(k=4, threshold=-0.1, feature="margin"), "margin is a probability"),
    (lambda: GoodputPolicy(synthetic.profile(), memory=1.5), "memory must be a number in (0, 1], got 1.5"),
    (lambda: GoodputPolicy(synthetic.profile(), strength=0), "strength must be a number > 0, got 0"),
    (lambda: GoodputPolicy(synthetic.profile(), optimism="abc"), "optimism must be a number >= 0, got 'abc'"),
    (lambda: GoodputPolicy(synthetic.profile(), prior=1.2), "prior (or null) must be a number in [0, 1], got 1.2"),
    (lambda: GoodputPolicy(synthetic.profile(), k=-1), "goodput/learned depth must be an integer >= 0, got -1"),
    (lambda: StaticPolicy(k="abc"), "static depth must be an integer >= 0, got 'abc'"),  # a YAML typo
    (lambda: EntropyPolicy(k=4, threshold=-1.0), "entropy is never negative, so its threshold must be >= 0"),
    (lambda: DisableByBatchPolicy(k=4, threshold=0), "threshold (rows in flight) must be an integer >= 1, got 0"),
    (lambda: HeuristicPolicy(initial=5, min_k=7), "need 0 <= min_k <= initial <= max_k, got min_k=7"),
    (lambda: ConfidencePolicy(k=4, stop_above="no"), "stop_above must be true or false, got 'no'"),  # reversed it
])
def test_policies_refuse_settings_outside_their_range(make, message: str) -> None:
    with pytest.raises(SpecPolicyError, match=re.escape(message)):
        make()
    EntropyPolicy(k=4, threshold=2.0)  # entropy is in nats: above 1 is a real threshold


def test_counts_and_only_counts_go_on_a_log_scale() -> None:
    """One head spans batch 1 and batch 64 because position, rows and tokens enter as log2(1 + x); the draft's
    probabilities enter as they are (a logistic head with weight 1 returns its input's transform)."""
    for name, value, expected in (("tokens", 255.0, 8.0), ("rows", 3.0, 2.0), ("position", 1.0, 1.0),
                                  ("top1", 0.5, 0.5)):
        head = DepthHead(HeadConfig(layers=0, features=(name,))).requires_grad_(False)
        head.mlp[-1].weight.fill_(1.0)
        head.mlp[-1].bias.fill_(0.0)
        features = torch.zeros(1, len(FEATURE_NAMES))
        features[0, COLUMN[name]] = value
        assert float(head(features)) == pytest.approx(expected), name


def test_head_round_trip(tmp_path: Path) -> None:
    head = DepthHead(HeadConfig(hidden=8))
    head.save(tmp_path)
    again = DepthHead.load(tmp_path)
    x = torch.rand(5, len(FEATURE_NAMES)) * 4
    assert torch.equal(head(x), again(x))
    with pytest.raises(SpecPolicyError, match="no trained depth head"):  # one line from entry(), not a traceback
        DepthHead.load(tmp_path / "missing")
    with pytest.raises(SpecPolicyError, match="head.hidden must be an integer >= 1, got 0"):
        HeadConfig(hidden=0)
    with pytest.raises(SpecPolicyError, match=r"head.layers \(0: a logistic regression\) must be an integer >= 0"):
        HeadConfig(layers="abc")
    assert DepthHead(HeadConfig(layers=0))(x).shape == (5,)  # no hidden layer: a logistic regression
    config = (tmp_path / "config.json").read_text()
    for edit in ({"prior": None}, {"prior": 1.5}, {"positions": -2}, {"positions": "3"}):  # failed mid-decoding
        (tmp_path / "config.json").write_text(json.dumps({**json.loads(config), **edit}))
        with pytest.raises(SpecPolicyError, match=f"the depth head at .* is damaged \\(the head's {next(iter(edit))}"):
            DepthHead.load(tmp_path)
    (tmp_path / "config.json").write_text(config)
    weights = (tmp_path / "head.pt").read_bytes()
    for cut in (weights[:100], b""):  # hand-edited or a failing disk (empty: a bare EOFError)
        (tmp_path / "head.pt").write_bytes(cut)
        with pytest.raises(SpecPolicyError, match="the depth head at .* is damaged .*stages=\\[head\\]"):
            DepthHead.load(tmp_path)


def test_a_profile_file_can_be_named_and_loads_past_its_grid_are_named(tmp_path: Path, caplog) -> None:
    """`profile=<the .json>` was looked for inside itself ("no latency profile at x.json/x.json"); batch sizes past
    the profile's rows were priced as its largest row count without a word."""
    from specpolicy.pipeline import _check_profiled_loads

    path = tmp_path / "mine.json"
    synthetic.profile().save(path)
    policy = GoodputPolicy(str(path), device="cpu")
    assert policy.cost.profile.rows == synthetic.ROWS
    with caplog.at_level("WARNING", logger="specpolicy"):
        _check_profiled_loads({"goodput": policy, "static": StaticPolicy(k=2)}, [1, 64, 128, 512])
    assert "eval.policies.goodput prices batch sizes [128, 512] as 64 rows" in caplog.text
    assert "static" not in caplog.text and "other processes" not in caplog.text
    busy = synthetic.profile()
    busy.other_load_cores = 1000.0  # timed beside other jobs: warned about when made, and again whenever reused
    with caplog.at_level("WARNING", logger="specpolicy"):
        _check_profiled_loads({"learned": GoodputPolicy(busy)}, [1])
    assert "eval.policies.learned prices its depths from a latency profile timed while other processes took " \
           "1000.00 CPU cores" in caplog.text


def test_timings_a_busy_machine_explains_are_flagged() -> None:
    """A forward 1.5x slower than one of as many rows and tokens or more, or a drafting correction above a whole
    target forward, is the machine's doing, not the curve's (its kernel steps are far smaller): the profile stage
    warns about them (a profile measured beside a training run read 1189 ms for 2 rows x 7 tokens, 47 for 1 row)."""
    profile = synthetic.profile(overhead_ms=5.0)
    assert profile.outliers() == []
    profile.target_ms[1][6] *= 40  # 2 rows x 7 tokens
    profile.draft_step_overhead_ms[2] = 1000.0  # 4 rows
    found = profile.outliers()
    assert len(found) == 2, found
    assert "target's forward of 2 rows x 7 tokens took 1760.0 ms" in found[0] and "at 4 rows cost 1000.0" in found[1]


def test_the_load_other_processes_put_on_the_cpu_is_measured_and_ours_is_not() -> None:
    """A profile timed beside another job is slow in every cell alike, which `outliers` cannot see: the CPU other
    processes take is measured instead. A busy-looping process is seen as about a core; our own busy loop is not."""
    import os
    import subprocess
    import sys
    import time

    from specpolicy.runtime import OtherLoad

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    with OtherLoad() as ours:
        spin(1.0)
    assert ours.cores < 0.5, str(ours)  # counted, it would read about 1
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        with OtherLoad() as theirs:
            time.sleep(1.0)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert 0.5 < theirs.cores - ours.cores < 1.5, (str(theirs), str(ours))  # one core more, whatever else runs
    assert re.fullmatch(r"\d\.\d\d of \d+ CPU cores", str(theirs))
    cores = os.cpu_count()  # busy: above a tenth of the machine, however large
    assert OtherLoad.too_busy(0.2 * cores) and not OtherLoad.too_busy(0.05 * cores)


def test_a_damaged_profile_is_named_with_its_fix(tmp_path: Path) -> None:
    """A profile whose latencies do not fill its grid failed mid-decode with an IndexError in the cost model."""
    path = tmp_path / "p.json"
    synthetic.profile().save(path)
    assert LatencyProfile.load(path).rows == synthetic.ROWS
    whole = json.loads(path.read_text())
    rows, tokens = len(whole["rows"]), len(whole["tokens"])
    edits = {  # hand edits: a grid in another order was interpolated as if sorted, silently; the rest failed later
        "target_ms do not fill": {"target_ms": whole["target_ms"][:1]}, "draft_ms do not fill": {"draft_ms": 5},
        "rows must be a non-empty list of distinct integers >= 1 in increasing order": {"rows": whole["rows"][::-1]},
        "tokens must be a list": {"tokens": "abc"},
        "its tokens must start at 1": {"tokens": [t + 1 for t in whole["tokens"]]},
        "draft_ms are not all numbers > 0": {"draft_ms": [[0.0] * tokens] * rows},
        "target_ms are not all numbers > 0": {"target_ms": [[None] * tokens] * rows},
        "not one number per row count": {"draft_step_overhead_ms": [1.0]},
        "make a draft position cost less than nothing": {"draft_step_overhead_ms": [-1e6] * rows},
        "other_load_cores is not a number >= 0": {"other_load_cores": "busy"},
    }
    for problem, edit in edits.items():
        path.write_text(json.dumps({**whole, **edit}))
        with pytest.raises(SpecPolicyError, match=f"latency profile .* is damaged; .*: .*{re.escape(problem)}"):
            LatencyProfile.load(path)
    for text in ("{}", "garbage"):
        path.write_text(text)
        with pytest.raises(SpecPolicyError, match="latency profile .* is damaged; delete it and run the profile"):
            LatencyProfile.load(path)


class CountsRejections(StaticPolicy):
    """Static k that counts the (row, step) pairs whose drafts the target cut short."""

    rejections = 0

    def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        self.rejections += int((accepted < drafted).sum())


def test_recording_policy_labels_conditional_acceptance(tiny_model) -> None:
    target = tiny_model()
    draft = LayerSubsetDraft(layers=[0, 1, 2]).build(target)  # agrees with the target now and then
    inner = CountsRejections(k=3)
    recorder = RecordingPolicy(inner)
    engine = Engine(target.model, draft.model, max_new_tokens=10, eos_token_id=[])
    result = engine.generate([[1, 2, 3], [4, 5]], recorder)
    records = torch.cat(recorder.records)
    assert records.shape[1] == len(COLUMNS)
    label, position = records[:, COLUMNS.index("accepted")], records[:, COLUMNS.index("position")]
    assert 0 < int(label.sum()) == result.stats.accepted  # every accepted draft is a positive
    # a row reaches position i only if 1..i-1 were accepted, so the negatives are the first rejections, one per
    # cut-short step: recording every drafted position would add the rejected drafts after them
    assert 0 < inner.rejections and len(records) == result.stats.accepted + inner.rejections
    assert int((position == 1).sum()) == sum(result.stats.drafted_at[:1].tolist())  # position 1: every draft
    assert set(records[:, COLUMNS.index("batch_size")].tolist()) == {2.0}


def test_a_prompt_keeps_its_group_at_every_batch_size(tiny_model) -> None:
    """collect decodes the same prompts from the first at each batch size, one recorder per size. Groups once
    counted decode calls and restarted per size, so a prompt's sequence sat in group 1 at batch 2 and group 2
    at batch 1, on both sides of the head's validation split; now a group is a prompt, the same in every shard."""
    engine = Engine(tiny_model().model, tiny_model(seed=1).model, max_new_tokens=10)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    per_size = {}
    for bs in (1, 2):
        recorder = RecordingPolicy(StaticPolicy(k=3))
        for start in range(0, len(prompts), bs):
            engine.generate(prompts[start : start + bs], recorder)
        records = torch.cat(recorder.records)
        group, label = records[:, COLUMNS.index("group")], records[:, COLUMNS.index("accepted")]
        per_size[bs] = [(int((group == g).sum()), int(label[group == g].sum())) for g in range(len(prompts))]
    assert per_size[1] == per_size[2] and all(n > 0 for n, _ in per_size[1])  # greedy: the same sequence at both


def test_head_learns_acceptance_from_confidence(tmp_path: Path) -> None:
    """On rollouts where acceptance follows top1, the trained head ranks confident positions higher; its Lightning
    checkpoint loads back as the module (the config was saved as a dict, which the module could not read)."""
    g = torch.Generator().manual_seed(0)
    n = 4000
    features = torch.rand(n, len(FEATURE_NAMES), generator=g)
    features[:, COLUMN["rows"]] = torch.randint(1, 64, (n,), generator=g).float()
    label = (torch.rand(n, generator=g) < features[:, COLUMN["top1"]]).float()
    groups = torch.arange(n) // 10
    L.seed_everything(0)
    module = HeadModule(HeadConfig(hidden=16), lr=1e-2)
    trainer = L.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=RolloutDataModule(features, label, groups, batch_size=256))
    assert trainer.callback_metrics["val/loss"] < 0.62  # a constant predictor scores ln 2 = 0.693
    probe = features[:2].clone()
    probe[:] = features.mean(0)  # typical values elsewhere
    probe[:, COLUMN["top1"]] = torch.tensor([0.1, 0.9])
    p = torch.sigmoid(module.head(probe))
    assert p[1] > p[0] + 0.3
    trainer.save_checkpoint(tmp_path / "head.ckpt")
    loaded = HeadModule.load_from_checkpoint(tmp_path / "head.ckpt")
    assert loaded.head.config == module.head.config and torch.equal(loaded.head(probe), module.head(probe))


def test_load_aware_policies_draft_no_deeper_than_their_profile_and_head_know(tmp_path, caplog) -> None:
    """Past the profile's widest verify pass the cost model clamps (every deeper depth priced as that pass), and
    past the rollouts' deepest position the head extrapolates: k is capped at both, with a warning."""
    import dataclasses

    profile = synthetic.profile()
    narrow = dataclasses.replace(profile, tokens=profile.tokens[:4], target_ms=[r[:4] for r in profile.target_ms],
                                 draft_ms=[r[:4] for r in profile.draft_ms])
    DepthHead(HeadConfig(hidden=8, positions=5)).save(tmp_path / "head")
    head = HeadEstimator(str(tmp_path / "head"))
    with caplog.at_level("WARNING", logger="specpolicy"):
        assert GoodputPolicy(profile, k=8).max_depth == 8
        assert not caplog.text
        assert GoodputPolicy(narrow, k=8).max_depth == 3
        assert "k=8 capped at 3: the profile times verify passes of up to 4 tokens" in caplog.text
        assert GoodputPolicy(profile, k=8, estimator=head).max_depth == 5
        assert "capped at 5: the head's rollouts reach draft position 5 (collect.k)" in caplog.text
        assert GoodputPolicy(narrow, k=4, estimator=head).max_depth == 3
    DepthHead(HeadConfig(hidden=8)).save(tmp_path / "old")  # a head saved before it recorded its positions
    assert GoodputPolicy(profile, k=8, estimator=HeadEstimator(str(tmp_path / "old"))).max_depth == 8


def test_the_profile_measures_what_a_drafting_step_costs_beyond_its_forwards(tiny_model, monkeypatch) -> None:
    """The engine's own steps, depth 1 against depth 0, put on the grid's scale: a delay that only drafting
    steps pay (here 50 ms in sampling the draft token) shows up as the ratio of the step times, and nothing
    else does."""
    import time

    import specpolicy.cost.overhead as overhead
    from specpolicy.cost.overhead import drafting_overhead
    from specpolicy.cost.profile import measure
    from specpolicy.decode import sampling

    target = tiny_model()
    draft = LayerSubsetDraft([0, 1]).build(target).model
    profile = measure(target.model, draft, rows=[1, 2], tokens=[1, 2], context=8, repeats=1, dtype="float32")
    with pytest.raises(SpecPolicyError, match="overhead_rounds must be >= 1"):
        drafting_overhead(target.model, draft, profile, steps=32, rounds=0)
    with pytest.raises(SpecPolicyError, match="overhead_steps=4 new tokens leave no steady step"):
        drafting_overhead(target.model, draft, profile, steps=4)
    free = drafting_overhead(target.model, draft, profile, steps=32)
    assert len(free) == 2 and all(abs(ms) < 10 for ms in free), free

    propose = sampling.propose

    def slow_propose(*args, **kwargs):
        time.sleep(0.05)
        return propose(*args, **kwargs)

    monkeypatch.setattr(sampling, "propose", slow_propose)
    profile.draft_step_overhead_ms = drafting_overhead(target.model, draft, profile, steps=32, rounds=1)
    cost = CostModel(profile)
    assert all(cost.step_ms(rows, 1) > 5 * cost.step_ms(rows, 0) for rows in (1, 2))
    result = Engine(target.model, draft, max_new_tokens=5, eos_token_id=[]).generate([[1, 2, 3]], StaticPolicy(k=1))
    assert len(result.stats.step_s) == result.stats.steps
    # a drafting step timed at a hundredth of a plain one (a slow spell of the plain steps): a draft position
    # never costs less than nothing, so the correction stops at minus the draft forward
    monkeypatch.setattr(overhead, "step_ratio", lambda *args: 0.01)
    floor = drafting_overhead(target.model, draft, profile, steps=32, rounds=1)
    assert floor == pytest.approx([-cost.forward_ms("draft", rows, 1) for rows in (1, 2)])


@pytest.mark.parametrize("draft_layers, n", [([0, 1], 32), ([0, 1, 2, 3], 31)])
def test_the_overhead_probe_times_only_steady_steps_of_a_full_batch(tiny_model, draft_layers, n: int) -> None:
    """The probe alternates depth 1 and 0 within one run, so a slow spell of the machine lands on both; it times
    a step only where the step before ran at its depth (a drafting step whose draft reads no more than steady
    drafting leaves it), every row is in flight, and no row's depth was clamped by its last tokens (a draft
    identical to the target moves rows 2 tokens per drafting step: with 31 new tokens one starts at 30)."""
    from specpolicy.cost.overhead import BLOCK, WARM_STEPS, _AlternatingProbe

    target = tiny_model()
    draft = LayerSubsetDraft(draft_layers).build(target).model

    class Seen(_AlternatingProbe):  # what each step's policy calls were told
        def reset(self, batch_size: int) -> None:
            super().reset(batch_size)
            self.seen = []

        def budget(self, state: StepState) -> torch.Tensor:
            self.seen.append([state.rows, state.unread])
            return super().budget(state)

        def observe(self, state: StepState, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
            self.seen[-1].append(drafted.tolist())

    probe = Seen(k=1, max_new_tokens=n)
    stats = Engine(target.model, draft, max_new_tokens=n, eos_token_id=[]).generate([[1, 2, 3], [4, 5]], probe).stats
    seen = probe.seen
    assert len(probe.depths) == len(stats.step_s) == len(seen)
    assert probe.depths[:2 * BLOCK] == [1] * BLOCK + [0] * BLOCK
    timed = [i for i, t in enumerate(probe.timed) if t]
    assert {probe.depths[i] for i in timed} == {0, 1} and len(timed) >= 8
    for i in timed:
        rows, unread, drafted = seen[i]
        assert i >= WARM_STEPS and probe.depths[i - 1] == probe.depths[i]
        assert rows == 2 and drafted == [probe.depths[i]] * 2  # nobody clamped, nobody gone
        if probe.depths[i]:
            assert unread <= 2  # the bonus token and the accepted draft, nothing older
    assert not probe.timed[-1]  # the batch's last steps run short


def test_the_profile_scores_what_each_model_scores_when_decoding(tiny_model, monkeypatch) -> None:
    """A verify pass needs logits at every token it reads; a draft forward of several tokens (its catch-up)
    needs them at the last only, so the draft's grid times that: scoring all of them priced a catch-up of a
    subset-head draft up to a quarter too high."""
    import specpolicy.cost.profile as profile_module

    scored = []
    real = profile_module.forward

    def recorded(model, cache, tokens, starts, kv_len, keep, *args, **kwargs):
        scored.append(keep.tolist())
        return real(model, cache, tokens, starts, kv_len, keep, *args, **kwargs)

    monkeypatch.setattr(profile_module, "forward", recorded)
    model = tiny_model().model
    for score_all, expected in ((True, [[0, 1, 2]] * 2), (False, [[2]] * 2)):
        timer = profile_module.ForwardTimer(model, rows=2, context=8, max_tokens=3, score_all=score_all)
        scored.clear()
        timer(3)
        assert scored == [expected]


def test_goodput_from_python_reads_what_the_pipeline_writes(tmp_path: Path) -> None:
    """Its defaults differed from the sources' and conf/policy/'s: skinny_gemm=False looked for a profile the
    profile stage does not write on a CPU in fp32, and optimism=1.0 probed as the policies did before 0.5 (now
    0.25) was chosen. An estimator given as a path was accepted and failed at the first drafting step."""
    import specpolicy.policy
    from specpolicy.cost.profile import profile_file

    assert specpolicy.policy.GoodputPolicy is GoodputPolicy  # exported beside the others (lazily: an import cycle)
    synthetic.profile().save(profile_file(tmp_path, "cpu", "float32", skinny_gemm=True))  # as the stage names it
    policy = GoodputPolicy(str(tmp_path), device="cpu")
    assert policy.optimism == 0.25 and policy.cost.profile.rows == synthetic.ROWS
    for estimator in (str(tmp_path), HeadEstimator):
        with pytest.raises(SpecPolicyError, match="estimator must map features to acceptance probabilities"):
            GoodputPolicy(synthetic.profile(), estimator=estimator)
    with pytest.raises(SpecPolicyError, match="profile must be the profile stage's folder, a profile's .json"):
        GoodputPolicy(None)
    with pytest.raises(SpecPolicyError, match=r"CostModel takes a LatencyProfile, e.g. CostModel\(LatencyProfile"):
        CostModel(str(tmp_path))
