"""Run several depth policies side by side on the same prompts and batches, as gpt-fast measures:
warm-up outside the timed region, device-synchronised timing (inside the engine), policies interleaved
batch by batch so machine noise hits all of them alike, and speedup as a ratio of totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpolicy.decode import DecodeStats, Engine
from specpolicy.policy import DepthPolicy, OraclePolicy


@dataclass
class PolicyRun:
    policy: str
    batch_size: int
    stats: list[DecodeStats] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, ar_tokens_per_s: float | None) -> dict:
        tokens = sum(s.tokens for s in self.stats)
        wall = sum(s.wall_s for s in self.stats)
        drafted, accepted = sum(s.drafted for s in self.stats), sum(s.accepted for s in self.stats)
        row_steps = sum(s.row_steps for s in self.stats)
        flops = {k: sum(s.flops_dict()[k] for s in self.stats) for k in self.stats[0].flops_dict()}
        tps = tokens / wall if wall else 0.0
        return {
            "policy": self.policy, "batch_size": self.batch_size, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tps, "speedup": tps / ar_tokens_per_s if ar_tokens_per_s else None,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted": (accepted + row_steps) / row_steps, "mean_depth": drafted / row_steps,
            "target_forwards": sum(s.target_forwards for s in self.stats),
            "draft_forwards": sum(s.draft_forwards for s in self.stats),
            "flops": flops,
        }


def side_by_side(
    engine: Engine, prompts: list[list[int]], policies: dict[str, DepthPolicy], batch_size: int, warmup: int = 1
) -> dict[str, PolicyRun]:
    """Decode `prompts` in batches of `batch_size` with every policy; `ar` first in each batch (it is the
    reference for speedup, for losslessness checks and for the oracle)."""
    names = sorted(policies, key=lambda n: n != "ar")
    for name in names[:warmup and len(names)]:
        engine.generate(prompts[:batch_size], policies[name])  # warm-up: allocator, kernels, caches
    runs = {name: PolicyRun(name, batch_size) for name in names}
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        for name in names:
            policy = policies[name]
            if isinstance(policy, OraclePolicy):
                policy.set_reference(runs["ar"].outputs[start : start + batch_size])
            result = engine.generate(batch, policy)
            runs[name].stats.append(result.stats)
            runs[name].outputs.extend(result.outputs)
    return runs


def summarise(runs: dict[str, PolicyRun]) -> list[dict]:
    ar = runs.get("ar")
    ar_tps = ar.summary(None)["tokens_per_s"] if ar else None
    rows = [run.summary(ar_tps) for run in runs.values()]
    for row in rows:  # greedy decoding must be lossless: any difference from ar is a bug, reported loudly
        outputs = runs[row["policy"]].outputs
        row["first_mismatch"] = next((i for i, (a, b) in enumerate(zip(ar.outputs, outputs)) if a != b), None) if ar else None
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
