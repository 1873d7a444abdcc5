"""Run several depth policies side by side on the same prompts and batches, as gpt-fast measures:
warm-up outside the timed region, device-synchronised timing (inside the engine), policies interleaved
batch by batch in an order that rotates from batch to batch and pass to pass, so machine noise and
drift hit all of them alike, and speedup as a ratio of totals. Decoders outside the engine (transformers'
`generate`, the honesty baselines) join the same rotation: timed in a pass of their own after the
policies, `hf_generate` once read 1.06x `ar` where an interleaved benchmark read 0.99x."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from specpolicy.decode import DecodeStats, Engine
from specpolicy.errors import SpecPolicyError, check_count
from specpolicy.eval.interval import ratio_interval
from specpolicy.policy import DepthPolicy, OraclePolicy
from specpolicy.runtime import OtherLoad

log = logging.getLogger("specpolicy")

# a decoder outside the engine: one batch of prompts -> (generated ids per prompt, device-synchronised seconds)
Baseline = Callable[[list[list[int]]], tuple[list[list[int]], float]]


@dataclass
class BaselineRun:
    """A baseline's timings: it has no drafts or FLOP buckets, only tokens, seconds and outputs."""
    policy: str
    batch_size: int
    units: list[tuple[int, float, int]] = field(default_factory=list)  # (tokens, seconds, batch) per batch and pass
    outputs: list[list[int]] = field(default_factory=list)
    other_load_cores: float | None = None  # CPU other processes took while it was timed (runtime.OtherLoad)

    def add(self, outputs: list[list[int]], seconds: float, batch: int, keep_outputs: bool) -> None:
        self.units.append((sum(map(len, outputs)), seconds, batch))
        if keep_outputs:
            self.outputs.extend(outputs)

    def summary(self, ar_tokens_per_s: float | None) -> dict:
        return _timing(self, ar_tokens_per_s)


@dataclass
class PolicyRun:
    policy: str
    batch_size: int
    upper_bound: bool = False  # knows the target's output (oracle): a bound, not a method
    kind: str = ""  # the policy's class, so reports can find e.g. the best static depth
    stats: list[DecodeStats] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)  # which batch each of `stats` decoded
    outputs: list[list[int]] = field(default_factory=list)
    other_load_cores: float | None = None

    @property
    def units(self) -> list[tuple[int, float, int]]:
        return [(s.tokens, s.wall_s, b) for s, b in zip(self.stats, self.batches)]

    def summary(self, ar_tokens_per_s: float | None) -> dict:
        total = DecodeStats.total(self.stats)
        by_load = zip(total.depth_at_load.tolist(), total.steps_at_load.tolist())
        return {
            **_timing(self, ar_tokens_per_s),
            "acceptance_rate": total.acceptance_rate if total.drafted else None,  # undefined: nothing drafted
            "mean_accepted": total.mean_accepted,
            "mean_depth": total.mean_depth, "target_forwards": total.target_forwards,
            "draft_forwards": total.draft_forwards, "flops": total.flops_dict(), "upper_bound": self.upper_bound,
            "kind": self.kind, "policy_ms_per_step": 1e3 * total.policy_s / max(total.steps, 1),
            "drafted_at": total.drafted_at.tolist(), "accepted_at": total.accepted_at.tolist(),
            "reached_at": total.reached_at.tolist(),
            # mean depth by rows in flight: {rows: mean drafted tokens per row-step}
            "depth_by_load": {r: d / n for r, (d, n) in enumerate(by_load) if n},
        }


Run = PolicyRun | BaselineRun


def _timing(run: Run, ar_tokens_per_s: float | None) -> dict:
    """Totals and speedup of any decoder, with its per-unit timings kept for intervals (`eval.interval`)."""
    tokens, wall = sum(u[0] for u in run.units), sum(u[1] for u in run.units)
    tps = tokens / wall if wall else 0.0
    return {"policy": run.policy, "batch_size": run.batch_size, "tokens": tokens, "wall_s": wall, "tokens_per_s": tps,
            "speedup": tps / ar_tokens_per_s if ar_tokens_per_s else None, "units": [list(u) for u in run.units],
            "other_load_cores": run.other_load_cores}


def side_by_side(
    engine: Engine, prompts: list[list[int]], policies: dict[str, DepthPolicy], batch_size: int, repeats: int = 1,
    baselines: dict[str, Baseline] | None = None,
) -> dict[str, Run]:
    """Decode `prompts` in batches of `batch_size` with every policy and baseline, `repeats` timed passes
    (outputs are kept from the first). A decoder that always ran first would take the machine's drifts alone
    (`ar`, first in every batch, once measured 8-16% slower than `disable_by_batch` doing its very work), so
    the order rotates. Only full batches are decoded: a smaller last batch would be reported as this batch size.
    Each run records the CPU other processes took meanwhile (`runtime.OtherLoad`): rotation shares out a
    neighbour's cost, so ratios survive it better than speeds, but a burst can still land on one decoder."""
    check_count("eval.repeats", repeats)
    if not isinstance(policies, dict) or not all(isinstance(p, DepthPolicy) for p in policies.values()):
        raise SpecPolicyError(f"policies must map names to DepthPolicy instances, e.g. {{'static_k2': "
                              f"StaticPolicy(k=2)}}, got {policies!r:.80}")  # a class was decoded as a baseline
    prompts = full_batches(prompts, batch_size, "eval.num_prompts")
    if not prompts:
        raise SpecPolicyError(f"batch size {batch_size} is larger than the prompts given: no full batch to decode")
    baselines = baselines or {}
    if clash := sorted(set(policies) & set(baselines)):
        raise SpecPolicyError(f"a baseline has a policy's name: {clash}")
    decoders: dict[str, DepthPolicy | Baseline] = {**policies, **baselines}
    fresh = lambda: {name: _new_run(name, d, batch_size) for name, d in decoders.items()}  # noqa: E731
    # warm-up, untimed, at every batch size (allocator, kernels, caches): every decoder runs the first batch once
    _decode_batch(engine, prompts[:batch_size], 0, decoders, _order(decoders, 0), fresh())
    runs = dict(sorted(fresh().items(), key=lambda item: item[0] != "ar"))  # reports list ar first
    starts = range(0, len(prompts), batch_size)
    with OtherLoad() as load:
        for rep in range(repeats):
            for i, start in enumerate(tqdm(starts, desc=f"batch size {batch_size} ({len(runs)} decoders, pass "
                                                        f"{rep + 1}/{repeats})", unit="batch")):
                _decode_batch(engine, prompts[start : start + batch_size], i, decoders, _order(decoders, rep + i),
                              runs, keep_outputs=rep == 0)
    if load.busy:
        log.warning("batch size %d: other processes took %s while it decoded: its timings are a busy machine's",
                    batch_size, load)
    for run in runs.values():
        run.other_load_cores = round(load.cores, 3)
    return runs


def full_batches(prompts: list[list[int]], batch_size: int, setting: str) -> list[list[int]]:
    """The prompts that fill whole batches of `batch_size`, with a warning naming those left out: a smaller last
    batch would be reported as this batch size."""
    if left := len(prompts) % batch_size:
        log.warning("batch size %d: the last %d of %d prompts fill no batch and are left out (%s a multiple of every "
                    "batch size decodes them all)", batch_size, left, len(prompts), setting)
        prompts = prompts[:-left]
    return prompts


def rotated(names: list[str], shift: int) -> list[str]:
    """`names` rotated by `shift`: decoders that take turns in a batch, so none always runs first."""
    shift %= max(len(names), 1)
    return names[shift:] + names[:shift]


def _new_run(name: str, decoder: DepthPolicy | Baseline, batch_size: int) -> Run:
    if isinstance(decoder, DepthPolicy):
        return PolicyRun(name, batch_size, upper_bound=isinstance(decoder, OraclePolicy), kind=type(decoder).__name__)
    return BaselineRun(name, batch_size)


def _order(decoders: dict[str, DepthPolicy | Baseline], shift: int) -> list[str]:
    """The decoders rotated by `shift`; those that need `ar`'s outputs of the batch (the oracle) last."""
    plain = [name for name, decoder in decoders.items() if not isinstance(decoder, OraclePolicy)]
    return rotated(plain, shift) + [name for name in decoders if name not in plain]


def _decode_batch(engine: Engine, batch: list[list[int]], index: int, decoders: dict[str, DepthPolicy | Baseline],
                  names: list[str], runs: dict[str, Run], keep_outputs: bool = True) -> None:
    """Decode `batch` (the `index`-th of a pass) with each of `names` in turn."""
    reference: list[list[int]] = []
    for name in names:
        decoder, run = decoders[name], runs[name]
        if isinstance(run, BaselineRun):
            run.add(*decoder(batch), index, keep_outputs)
            continue
        if isinstance(decoder, OraclePolicy):
            if "ar" not in decoders:
                raise SpecPolicyError("the oracle needs the target's greedy outputs: add `ar` to eval.policies")
            decoder.set_reference(reference)
        result = engine.generate(batch, decoder, first_id=index * len(batch))  # each prompt its own random stream
        reference = result.outputs if name == "ar" else reference
        run.stats.append(result.stats)
        run.batches.append(index)
        if keep_outputs:
            run.outputs.extend(result.outputs)


def summarise(runs: dict[str, Run]) -> list[dict]:
    """One row per decoder. Greedy fp32 decoding must be lossless, so an engine policy's `first_mismatch` with
    `ar` is a bug, reported loudly; a baseline's outputs (other kernels, padded batches) get only `ar_match`,
    the share of prompts with `ar`'s output, which is also what bf16 reports (a k-token pass rounds differently).
    Each speedup comes with its 95% paired-bootstrap interval over the batches, passes kept together
    (`eval.interval`)."""
    ar = runs.get("ar")
    ar_tps = ar.summary(None)["tokens_per_s"] if ar else None
    rows = []
    for run in runs.values():
        row = run.summary(ar_tps)
        row["speedup_interval"] = ratio_interval(run.units, ar.units) if ar and run is not ar else None
        same = [a == b for a, b in zip(ar.outputs, run.outputs)] if ar else []
        if isinstance(run, PolicyRun):
            row["first_mismatch"] = same.index(False) if False in same else None
        row["ar_match"] = sum(same) / len(same) if same else None
        rows.append(row)
    return rows

