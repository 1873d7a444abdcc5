"""The drafting overhead: what a decode step that drafts costs beyond the forwards the profile times.

The latency profile times bare forwards. A step that drafts also samples the draft token, computes the
draft's confidence features, asks the policy, lets the draft read the tokens committed since its last
forward, and settles one more token per row. On a 2-core AVX-512 CPU in bf16, static depth 1 ran 5-9%
slower than the bare forwards predicted at batch 1-4, which turned the cost model's small predicted gains
at batch 2-4 into measured losses. So the profile stage also runs the engine itself at each of the
profile's row counts, once at depth 0 and once drafting one token per step with features (as `goodput` and
`learned` draft), and records how much more the drafting step took than the grid predicts: the
difference of the median step times minus the difference of the predicted ones. It may be negative:
the grid keeps each cell's fastest round, and on the same VM at batch 1 a drafting step took 1.0 ms
less than the grid's 6.4 ms (median of three runs of 48 steps). But a draft position never costs less
than nothing, so the correction stops at minus the draft forward. With 12 timed steps the correction at
4 rows ranged over 0.1-6.3 ms in three runs, with 48 over 4.5-5.1 ms.
"""

from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specpolicy.cost.model import CostModel
from specpolicy.cost.profile import LatencyProfile
from specpolicy.decode import Engine
from specpolicy.policy import ArPolicy, StaticPolicy

WARM_STEPS = 2  # the first steps read the prompts (a fusing draft reads them one step later)


class _DraftingProbe(StaticPolicy):
    """Depth 1 at every step, reading the draft's features as the goodput-driven policies do."""

    reads_features = True


def drafting_overhead(target: PreTrainedModel, draft: PreTrainedModel, profile: LatencyProfile, steps: int,
                      seed: int = 0) -> list[float]:
    """Milliseconds per drafting step beyond the profiled forwards, for each of `profile.rows`; `steps`
    timed steps per run, after `WARM_STEPS`, on random prompts of `profile.context` tokens."""
    cost = CostModel(profile)
    engine = Engine(target, draft, max_new_tokens=steps + WARM_STEPS, eos_token_id=[])  # no row ends early
    generator = torch.Generator().manual_seed(seed)
    overhead = []
    for rows in tqdm(profile.rows, desc="profile (drafting overhead)"):
        prompts = torch.randint(0, target.config.vocab_size, (rows, profile.context), generator=generator).tolist()
        plain, drafting = (_median_step_ms(engine, prompts, policy) for policy in (ArPolicy(), _DraftingProbe(k=1)))
        predicted = cost.step_ms(rows, 1) - cost.step_ms(rows, 0)
        overhead.append(max(drafting - plain - predicted, -cost.forward_ms("draft", rows, 1)))
    return overhead


def _median_step_ms(engine: Engine, prompts: list[list[int]], policy: StaticPolicy | ArPolicy) -> float:
    return 1e3 * statistics.median(engine.generate(prompts, policy).stats.step_s[WARM_STEPS:])
