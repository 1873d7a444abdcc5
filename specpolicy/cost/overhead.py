"""The drafting overhead: what a decode step that drafts costs beyond the forwards the profile times.

The latency profile times bare forwards. A step that drafts also samples the draft token, computes the
draft's confidence features, asks the policy, lets the draft read the tokens committed since its last
forward, and settles one more token per row. On a 2-core AVX-512 CPU in bf16, static depth 1 ran 5-9%
slower than the bare forwards predicted at batch 1-4, which turned the cost model's small predicted gains
at batch 2-4 into measured losses. So the profile stage also runs the engine itself at each of the
profile's row counts, drafting one token per step with features (as `goodput` and `learned` draft) and not
drafting, and records how much more the drafting step took than the grid predicts.

The machine's speed drifts between the grid and these runs, and within them: on a 2-core VM in bf16 a plain
step at batch 1 took 23.0-23.5 ms an hour after the grid timed its forward at 19.7 ms. So the correction is
a ratio, the median drafting step over the median plain step, put on the grid's own plain step: the drafting
step the grid should have predicted. That ratio is also what a policy's choice between drafting and not
turns on: the engine's fixed per-step work, which the grid leaves out of both, makes drafting relatively
cheaper, and the correction takes that in. It may be negative (the grid keeps each cell's fastest round),
but a draft position never costs less than nothing, so it stops at minus the draft forward.

One run alternates `BLOCK` steps at depth 1 and `BLOCK` at depth 0, and times a step only where it decodes
at the depth of the step before (so a drafting step's draft reads what steady drafting reads, not the extra
token a plain step left it) with every row in flight and none clamped short by its last tokens, so a slow spell
of the machine lands on both depths alike: separate plain and drafting runs, seconds apart, read -3.1, +0.3
and +8.1 ms at 2 rows in three profiles on a 2-core AVX2 VM, enough to flip `learned` between drafting and
not. Each of `rounds` runs gives a ratio; their median is the one used. It is better posed, still noisy
(docs/notebook/learned_policy.md has the side-by-side spreads).
"""

from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specpolicy.cost.model import CostModel
from specpolicy.cost.profile import LatencyProfile
from specpolicy.decode import Engine
from specpolicy.errors import SpecPolicyError
from specpolicy.policy import StaticPolicy, StepState

WARM_STEPS = 2  # the first steps read the prompts (a fusing draft reads them one step later)
BLOCK = 4  # steps at one depth before switching: (BLOCK - 1) / BLOCK of the steps are timed
MIN_STEPS = 8 * BLOCK  # new tokens per run that leave steady steps of each depth to time


class _AlternatingProbe(StaticPolicy):
    """Depth k for `BLOCK` steps, 0 for `BLOCK`, and so on, reading the draft's features as the goodput-driven
    policies do; notes each step's depth and whether it is timed."""

    reads_features = True

    def __init__(self, k: int, max_new_tokens: int):
        super().__init__(k=k)
        self.max_new_tokens = max_new_tokens

    def reset(self, batch_size: int) -> None:
        self.batch_size, self.depths, self.timed = batch_size, [], []

    def budget(self, state: StepState) -> torch.Tensor:
        step = len(self.depths)
        depth = 0 if (step // BLOCK) % 2 else self.k
        steady = step >= WARM_STEPS and self.depths[-1] == depth
        # the engine clamps a row's depth to its tokens left minus one, and a finished row leaves the batch
        whole = state.rows == self.batch_size and int(state.generated.max()) + self.k < self.max_new_tokens
        self.depths.append(depth)
        self.timed.append(steady and whole)
        return torch.full_like(state.generated, depth)


def step_ratio(step_s: list[float], probe: _AlternatingProbe) -> float:
    """The median timed drafting step over the median timed plain step of one alternating run."""
    steps = step_s[-len(probe.depths):]  # a fusing draft's first step decides nothing (`Engine._step`)
    times = {depth: [s for s, d, t in zip(steps, probe.depths, probe.timed) if t and d == depth]
             for depth in (probe.k, 0)}
    if not all(times.values()):
        raise SpecPolicyError(f"profile.overhead_steps={probe.max_new_tokens} new tokens leave no steady step "
                              f"of each depth to time; use at least {MIN_STEPS}")
    return statistics.median(times[probe.k]) / statistics.median(times[0])


def drafting_overhead(target: PreTrainedModel, draft: PreTrainedModel, profile: LatencyProfile, steps: int,
                      rounds: int = 3, seed: int = 0) -> list[float]:
    """Milliseconds per drafting step beyond the profiled forwards, for each of `profile.rows`, from `rounds`
    alternating runs of `steps` new tokens on random prompts of `profile.context` tokens."""
    if rounds < 1:
        raise SpecPolicyError(f"profile.overhead_rounds must be >= 1 (or profile.overhead_steps=0 to skip), "
                              f"got {rounds}")
    cost = CostModel(profile)
    engine = Engine(target, draft, max_new_tokens=steps, eos_token_id=[])  # no row ends early
    probe = _AlternatingProbe(k=1, max_new_tokens=steps)
    generator = torch.Generator().manual_seed(seed)
    overhead = []
    for rows in tqdm(profile.rows, desc="profile (drafting overhead)"):
        prompts = torch.randint(0, target.config.vocab_size, (rows, profile.context), generator=generator).tolist()
        ratio = statistics.median(step_ratio(engine.generate(prompts, probe).stats.step_s, probe)
                                  for _ in range(rounds))
        drafting = cost.step_ms(rows, 0) * ratio
        overhead.append(max(drafting - cost.step_ms(rows, 1), -cost.forward_ms("draft", rows, 1)))
    return overhead
