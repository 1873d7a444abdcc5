"""The drafting overhead: what a decode step that drafts costs beyond the forwards the profile times.

The latency profile times bare forwards. A step that drafts also samples the draft token, computes the
draft's confidence features, asks the policy, lets the draft read the tokens committed since its last
forward, and settles one more token per row. On a 2-core AVX-512 CPU in bf16, static depth 1 ran 5-9%
slower than the bare forwards predicted at batch 1-4, which turned the cost model's small predicted gains
at batch 2-4 into measured losses. So the profile stage also runs the engine itself at each of the
profile's row counts, once at depth 0 and once drafting one token per step with features (as `goodput` and
`learned` draft), and records how much more the drafting step took than the grid predicts.

The machine's speed drifts between the grid and these runs, and between runs: on a 2-core VM in bf16 a
plain step at batch 1 took 23.0-23.5 ms an hour after the grid timed its forward at 19.7 ms, so the
difference of the step times (5.3-6.1 ms in six rounds) read 1.0-1.7 ms of overhead that was mostly the
drift scaling the draft forward and the wider verify. The runs therefore alternate for `rounds` rounds, each
round gives the ratio of the median drafting step to the median plain step, and the median ratio, put on
the grid's own plain step, is the drafting step the grid should have predicted (0.4 ms over it at batch 1
with those six rounds). That ratio is also what a policy's choice between drafting and not turns on: the
engine's fixed per-step work, which the grid leaves out of both, makes drafting relatively cheaper, and the
correction takes that in. It may be negative (the grid keeps each cell's fastest round), but a draft
position never costs less than nothing, so it stops at minus the draft forward. With 12 timed steps the
correction at 4 rows ranged over 0.1-6.3 ms in three runs, with 48 over 4.5-5.1 ms.
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
from specpolicy.policy import ArPolicy, StaticPolicy

WARM_STEPS = 2  # the first steps read the prompts (a fusing draft reads them one step later)


class _DraftingProbe(StaticPolicy):
    """Depth 1 at every step, reading the draft's features as the goodput-driven policies do."""

    reads_features = True


def drafting_overhead(target: PreTrainedModel, draft: PreTrainedModel, profile: LatencyProfile, steps: int,
                      rounds: int = 3, seed: int = 0) -> list[float]:
    """Milliseconds per drafting step beyond the profiled forwards, for each of `profile.rows`, from `rounds` runs
    of each policy on random prompts of `profile.context` tokens. Each run makes `steps` + `WARM_STEPS` new
    tokens and times its steps after the first `WARM_STEPS`: a drafting run keeps up to two tokens a step, so it
    times between `steps` / 2 and `steps` of them, and its last may not draft (one token left), which their
    median shrugs off."""
    if rounds < 1:
        raise SpecPolicyError(f"profile.overhead_rounds must be >= 1 (or profile.overhead_steps=0 to skip), "
                              f"got {rounds}")
    cost = CostModel(profile)
    engine = Engine(target, draft, max_new_tokens=steps + WARM_STEPS, eos_token_id=[])  # no row ends early
    generator = torch.Generator().manual_seed(seed)
    overhead = []
    for rows in tqdm(profile.rows, desc="profile (drafting overhead)"):
        prompts = torch.randint(0, target.config.vocab_size, (rows, profile.context), generator=generator).tolist()
        policies = ArPolicy(), _DraftingProbe(k=1)
        ratios = []
        for r in range(rounds):  # alternating which runs first, so a drift within the round favours neither
            order = (0, 1) if r % 2 == 0 else (1, 0)
            step = {i: statistics.median(engine.generate(prompts, policies[i]).stats.step_s[WARM_STEPS:])
                    for i in order}
            ratios.append(step[1] / step[0])
        drafting = cost.step_ms(rows, 0) * statistics.median(ratios)
        overhead.append(max(drafting - cost.step_ms(rows, 1), -cost.forward_ms("draft", rows, 1)))
    return overhead
