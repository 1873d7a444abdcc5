"""Benchmark: `python scripts/bench_engine.py experiment=smollm2_135m [runtime.dtype=bfloat16]`.

Prints and saves JSON with, side by side in one process, interleaved over `bench.repeats` rounds:
  * the engine's `ar` vs `model.generate` tokens/s at each batch size (the baseline must be honest);
  * `static` k with the configured draft vs transformers' assisted generation at batch 1 (and vs the engine's
    `ar`; a draft that fuses the target's features has no assisted generation to compare with).
Each ratio is measured within every round and reported as the median over rounds with its range: on a
shared machine a slow spell hits one round, and a ratio of two totals would still carry it.
"""

import os
import statistics
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.cli import entry, publish
from specpolicy.data import encode_prompts
from specpolicy.decode.engine import check_settings
from specpolicy.errors import check_count, check_counts, fitting_batch_sizes
from specpolicy.eval.hf_baselines import assisted_settings, hf_assisted, hf_generate
from specpolicy.models.fusion import fuses_features
from specpolicy.policy import ArPolicy, StaticPolicy
from specpolicy.stages import load_pair

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


def bench(cfg: DictConfig) -> None:
    for setting in ("batch_sizes", "ks"):
        check_counts(f"bench.{setting}", cfg.bench[setting])
    for setting in ("repeats", "num_prompts"):
        check_count(f"bench.{setting}", cfg.bench[setting])
    check_settings(cfg.engine)
    target, draft = load_pair(cfg, cfg.draft)
    engine = instantiate(cfg.engine)(target.model, draft.model)
    tok, n_new = target.tokenizer, engine.max_new_tokens
    prompts = encode_prompts(tok, instantiate(cfg.data).load()[: cfg.bench.num_prompts], target.context_length, n_new)
    batch_sizes = fitting_batch_sizes("bench.batch_sizes", cfg.bench.batch_sizes, len(prompts),
                                      "raise bench.num_prompts or data.limit")
    eos = target.model.generation_config.eos_token_id
    rounds: list[dict[str, list[float]]] = []  # per round: name -> [tokens, seconds]

    def add(name: str, outputs: list[list[int]], seconds: float) -> None:
        tokens, wall = rounds[-1].setdefault(name, [0, 0.0])
        rounds[-1][name] = [tokens + sum(map(len, outputs)), wall + seconds]

    assisted = not fuses_features(draft.model)
    engine.generate(prompts[:2], StaticPolicy(k=2))  # warm-up
    for _ in range(cfg.bench.repeats):
        rounds.append({})
        for bs in batch_sizes:
            for start in range(0, len(prompts), bs):
                batch = prompts[start : start + bs]
                r = engine.generate(batch, ArPolicy())
                add(f"engine_ar@{bs}", r.outputs, r.stats.wall_s)
                add(f"hf_generate@{bs}", *hf_generate(target.model, batch, n_new, tok.pad_token_id, eos))
        for k in cfg.bench.ks:
            for p in prompts:
                r = engine.generate([p], StaticPolicy(k=k))
                add(f"engine_static_k{k}@1", r.outputs, r.stats.wall_s)
            if assisted:
                add(f"hf_assisted_k{k}@1", *hf_assisted(target.model, draft.model, prompts, n_new, k, eos))
    per_round = [{name: tokens / wall for name, (tokens, wall) in r.items()} for r in rounds]
    rates = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    pairs = {f"engine_ar_vs_hf_generate@{bs}": (f"engine_ar@{bs}", f"hf_generate@{bs}") for bs in batch_sizes}
    pairs.update({f"engine_static_k{k}_vs_hf_assisted@1": (f"engine_static_k{k}@1", f"hf_assisted_k{k}@1")
                  for k in cfg.bench.ks if assisted})
    pairs.update({f"engine_static_k{k}_vs_engine_ar@1": (f"engine_static_k{k}@1", "engine_ar@1") for k in cfg.bench.ks
                  if 1 in batch_sizes})  # plain decoding at batch 1 runs only when asked for
    ratios, ranges = {}, {}
    for key, (a, b) in pairs.items():
        within = [r[a] / r[b] for r in per_round]
        ratios[key], ranges[key] = statistics.median(within), [min(within), max(within)]
    report = {"target": target.name, "draft": draft.name, "device": str(engine.device), "dtype": cfg.runtime.dtype,
              "prompts": len(prompts), "max_new_tokens": n_new, "repeats": cfg.bench.repeats,
              "assisted_settings": {k: assisted_settings(k) for k in cfg.bench.ks},
              "tokens_per_s": rates, "ratios": ratios, "ratio_range": ranges}
    publish(report, cfg.bench.out)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_engine")
def main(cfg: DictConfig) -> None:
    entry(bench, cfg)


if __name__ == "__main__":
    main()
