"""Run several depth policies side by side on the same prompts and batches, as gpt-fast measures:
warm-up outside the timed region, device-synchronised timing (inside the engine), policies interleaved
batch by batch in an order that rotates from batch to batch and pass to pass, so machine noise and
drift hit all of them alike, and speedup as a ratio of totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm.auto import tqdm

from specpolicy.decode import DecodeStats, Engine
from specpolicy.errors import SpecPolicyError
from specpolicy.policy import DepthPolicy, OraclePolicy


@dataclass
class PolicyRun:
    policy: str
    batch_size: int
    upper_bound: bool = False  # knows the target's output (oracle): a bound, not a method
    kind: str = ""  # the policy's class, so reports can find e.g. the best static depth
    stats: list[DecodeStats] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, ar_tokens_per_s: float | None) -> dict:
        tokens = sum(s.tokens for s in self.stats)
        wall = sum(s.wall_s for s in self.stats)
        drafted, accepted = sum(s.drafted for s in self.stats), sum(s.accepted for s in self.stats)
        row_steps = sum(s.row_steps for s in self.stats)
        flops = {k: sum(s.flops_dict()[k] for s in self.stats) for k in self.stats[0].flops_dict()}
        summed = lambda name: [sum(x) for x in zip(*(getattr(s, name).tolist() for s in self.stats))]  # noqa: E731
        tps = tokens / wall if wall else 0.0
        return {
            "policy": self.policy, "batch_size": self.batch_size, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tps, "speedup": tps / ar_tokens_per_s if ar_tokens_per_s else None,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted": (accepted + row_steps) / row_steps, "mean_depth": drafted / row_steps,
            "target_forwards": sum(s.target_forwards for s in self.stats),
            "draft_forwards": sum(s.draft_forwards for s in self.stats),
            "flops": flops, "upper_bound": self.upper_bound, "kind": self.kind,
            "policy_ms_per_step": 1e3 * sum(s.policy_s for s in self.stats) / max(sum(s.steps for s in self.stats), 1),
            "drafted_at": summed("drafted_at"), "accepted_at": summed("accepted_at"),
            # mean depth by rows in flight: {rows: mean drafted tokens per row-step}
            "depth_by_load": {r: d / n for r, (d, n) in enumerate(zip(summed("depth_at_load"), summed("steps_at_load")))
                              if n},
        }


def side_by_side(
    engine: Engine, prompts: list[list[int]], policies: dict[str, DepthPolicy], batch_size: int, repeats: int = 1
) -> dict[str, PolicyRun]:
    """Decode `prompts` in batches of `batch_size` with every policy, `repeats` timed passes (outputs are
    kept from the first). A policy that always ran first would take the machine's drifts alone (`ar`, first
    in every batch, once measured 8-16% slower than `disable_by_batch` doing its very work), so the order rotates."""
    if repeats < 1:
        raise SpecPolicyError(f"eval.repeats must be >= 1, got {repeats}")
    runs = {name: PolicyRun(name, batch_size, upper_bound=isinstance(policy, OraclePolicy), kind=type(policy).__name__)
            for name, policy in sorted(policies.items(), key=lambda item: item[0] != "ar")}  # reports list ar first
    # warm-up, untimed, at every batch size (allocator, kernels, caches): every policy runs the first batch once
    _decode_batch(engine, prompts[:batch_size], policies, _order(policies, 0), {n: PolicyRun(n, batch_size) for n in runs})
    starts = range(0, len(prompts), batch_size)
    for rep in range(repeats):
        for i, start in enumerate(tqdm(starts, desc=f"batch size {batch_size} ({len(runs)} policies, pass {rep + 1}"
                                                    f"/{repeats})", unit="batch")):
            _decode_batch(engine, prompts[start : start + batch_size], policies, _order(policies, rep + i), runs,
                          keep_outputs=rep == 0)
    return runs


def _order(policies: dict[str, DepthPolicy], shift: int) -> list[str]:
    """The policies rotated by `shift`; those that need `ar`'s outputs of the batch (the oracle) last."""
    plain = [name for name, policy in policies.items() if not isinstance(policy, OraclePolicy)]
    shift %= max(len(plain), 1)
    return plain[shift:] + plain[:shift] + [name for name in policies if name not in plain]


def _decode_batch(engine: Engine, batch: list[list[int]], policies: dict[str, DepthPolicy], names: list[str],
                  runs: dict[str, PolicyRun], keep_outputs: bool = True) -> None:
    reference: list[list[int]] = []
    for name in names:
        policy = policies[name]
        if isinstance(policy, OraclePolicy):
            if "ar" not in policies:
                raise SpecPolicyError("the oracle needs the target's greedy outputs: add `ar` to eval.policies")
            policy.set_reference(reference)
        result = engine.generate(batch, policy)
        reference = result.outputs if name == "ar" else reference
        runs[name].stats.append(result.stats)
        if keep_outputs:
            runs[name].outputs.extend(result.outputs)


def summarise(runs: dict[str, PolicyRun]) -> list[dict]:
    ar = runs.get("ar")
    ar_tps = ar.summary(None)["tokens_per_s"] if ar else None
    rows = [run.summary(ar_tps) for run in runs.values()]
    for row in rows:  # greedy fp32 decoding must be lossless: any difference from ar is a bug, reported loudly
        outputs = runs[row["policy"]].outputs
        same = [a == b for a, b in zip(ar.outputs, outputs)] if ar else []
        row["first_mismatch"] = same.index(False) if False in same else None
        row["ar_match"] = sum(same) / len(same) if same else None  # what bf16 reports instead (rounding differs)
    return rows


def format_table(rows: list[dict]) -> str:
    head = "| policy | batch | tokens | tok/s | speedup | accept | tau | depth | FLOPs vs AR | = AR output |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        f = r["flops"]
        same = "yes" if r["first_mismatch"] is None else f"NO, prompt {r['first_mismatch']}"
        lines.append(
            f"| {r['policy']} | {r['batch_size']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup'] or 0:.2f}x | {r['acceptance_rate']:.2f} | {r['mean_accepted']:.2f} | "
            f"{r['mean_depth']:.2f} | {f['total'] / f['ar_equivalent']:.2f}x | {same} |"
        )
    return "\n".join(lines)
