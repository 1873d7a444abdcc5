"""Benchmark: `python scripts/bench_engine.py experiment=smollm2_135m draft=distilled [runtime.dtype=bfloat16]`
(the README's tables; the default draft is an undistilled subset of the target's layers).

Prints and saves JSON with, side by side in one process, interleaved over `bench.repeats` rounds:
  * the engine's `ar` vs `model.generate` tokens/s at each batch size (the baseline must be honest);
  * `static` k with the configured draft vs transformers' assisted generation at batch 1 (and vs the engine's
    `ar`; a draft that fuses the target's features has no assisted generation to compare with).
Every decoder is warmed up at every batch size, the decoders take turns on each batch in an order that rotates
from batch to batch and round to round (as evaluate does), and only full batches are timed. Each ratio is
measured within every round and reported as the geometric mean over rounds with its range, and so is each
tokens/s: a ratio is then exactly the quotient of the two speeds printed beside it. (The median did not keep
them consistent, and over the usual two rounds it is their mean, which a noisy round pulls on the ratio and its
inverse alike, so both read above 1.)
"""

import logging
import os
import statistics
from datetime import datetime
from functools import partial
from pathlib import Path

import hydra
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.cli import check_out_dir, entry, publish
from specpolicy.data import encode_prompts
from specpolicy.decode import Engine
from specpolicy.decode.engine import check_settings
from specpolicy.errors import SpecPolicyError, check_count, check_counts, fitting_batch_sizes
from specpolicy.eval.hf_baselines import assisted_settings, hf_assisted, hf_generate, unassistable
from specpolicy.eval.report import EXACT_DTYPES, VIOLATED
from specpolicy.eval.runner import Baseline, full_batches, rotated
from specpolicy.models import LoadedModel
from specpolicy.pipeline import hardware
from specpolicy.policy import ArPolicy, DepthPolicy, StaticPolicy
from specpolicy.stages import load_pair

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))
log = logging.getLogger("specpolicy")


def bench(cfg: DictConfig) -> None:
    for setting in ("batch_sizes", "ks"):
        check_counts(f"bench.{setting}", cfg.bench[setting])
    for setting in ("repeats", "num_prompts"):
        check_count(f"bench.{setting}", cfg.bench[setting])
    check_settings(cfg.engine)
    check_out_dir("bench.out", Path(cfg.bench.out).parent)  # found by the save, after all the decoding
    if cfg.engine.temperature:  # transformers' side decodes greedily: a sampled engine would not be comparable
        raise SpecPolicyError(f"bench_engine compares greedy decoding; set engine.temperature=0 (got "
                              f"{cfg.engine.temperature})")
    target, draft = load_pair(cfg, cfg.draft)
    engine = instantiate(cfg.engine)(target.model, draft.model)
    prompts = encode_prompts(target.tokenizer, instantiate(cfg.data).load()[: cfg.bench.num_prompts],
                             target.context_length, engine.max_new_tokens)
    batch_sizes = fitting_batch_sizes("bench.batch_sizes", cfg.bench.batch_sizes, len(prompts),
                                      "raise bench.num_prompts or data.limit")
    why = unassistable(target.model, draft.model)
    assisted = why is None
    if why:
        log.warning("bench_engine: %s: static k is compared with the engine's ar only", why)
    groups = _decoders(cfg, engine, target, draft, batch_sizes, assisted)
    rounds: list[dict[str, list[float]]] = []  # per round: name -> [tokens, seconds]
    outputs: dict[str, list[list[int]]] = {}  # the first round's, to check that every decoder wrote ar's
    batches = {bs: full_batches(prompts, bs, "bench.num_prompts") for bs in groups}  # once: it warns per size
    for bs, group in groups.items():  # warm-up, untimed: every decoder at every batch size
        for decode in group.values():
            decode(prompts[:bs])
    for rep in range(cfg.bench.repeats):
        rounds.append({})
        for bs, group in groups.items():
            for i, start in enumerate(range(0, len(batches[bs]), bs)):
                for name in rotated(list(group), rep + i):  # none always runs first, into a slow spell
                    written, seconds = group[name](batches[bs][start : start + bs])
                    tokens, wall = rounds[-1].get(name, (0, 0.0))
                    rounds[-1][name] = [tokens + sum(map(len, written)), wall + seconds]
                    if rep == 0:
                        outputs.setdefault(name, []).extend(written)
    per_round = [{name: tokens / wall for name, (tokens, wall) in r.items()} for r in rounds]
    rates = {name: statistics.geometric_mean(r[name] for r in per_round) for name in per_round[0]}
    pairs = {f"engine_ar_vs_hf_generate@{bs}": (f"engine_ar@{bs}", f"hf_generate@{bs}") for bs in batch_sizes}
    pairs.update({f"engine_static_k{k}_vs_hf_assisted@1": (f"engine_static_k{k}@1", f"hf_assisted_k{k}@1")
                  for k in cfg.bench.ks if assisted})
    pairs.update({f"engine_static_k{k}_vs_engine_ar@1": (f"engine_static_k{k}@1", "engine_ar@1") for k in cfg.bench.ks
                  if 1 in batch_sizes})  # plain decoding at batch 1 runs only when asked for
    ratios, ranges = {}, {}
    for key, (a, b) in pairs.items():
        within = [r[a] / r[b] for r in per_round]
        ratios[key], ranges[key] = statistics.geometric_mean(within), [min(within), max(within)]
    report = {"target": target.name, "draft": draft.name, "device": str(engine.device), "dtype": cfg.runtime.dtype,
              "skinny_gemm": cfg.runtime.skinny_gemm, "prompts": len(prompts), "max_new_tokens": engine.max_new_tokens,
              "repeats": cfg.bench.repeats, "tokens_per_s": rates, "ratios": ratios, "ratio_range": ranges,
              "ratio_of": {key: list(pair) for key, pair in pairs.items()},  # which two tokens_per_s each divides
              "same_as_engine_ar": _same_as_ar(outputs, cfg.runtime.dtype), "hardware": hardware(engine.device),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "engine": {"solo_above": engine.solo_above, "max_padding": engine.max_padding},
              "date": datetime.now().isoformat(timespec="seconds")}
    if assisted:
        report["assisted_settings"] = {k: assisted_settings(k) for k in cfg.bench.ks}
    publish(report, cfg.bench.out)


def _same_as_ar(outputs: dict[str, list[list[int]]], dtype: str) -> dict[str, float]:
    """Per decoder, the share of prompts on which it wrote what the engine's `ar` wrote at its batch size: a ratio
    of two decoders that wrote different tokens compares different work. In fp32 an engine policy must match on
    every prompt (`eval.report.lossless`); transformers' kernels and padding may round otherwise."""
    same = {}
    for name, written in outputs.items():
        ar = outputs.get(f"engine_ar@{name.rsplit('@', 1)[1]}")
        if ar is not None and not name.startswith("engine_ar@"):
            same[name] = sum(a == b for a, b in zip(ar, written)) / len(ar)
    if broken := [name for name, share in same.items() if name.startswith("engine_") and share < 1]:
        if dtype in EXACT_DTYPES:
            log.error("bench_engine: %s: %s wrote other tokens than the engine's greedy ar (%s)", VIOLATED,
                      broken, {name: same[name] for name in broken})
    return same


def _decoders(cfg: DictConfig, engine: Engine, target: LoadedModel, draft: LoadedModel, batch_sizes: list[int],
              assisted: bool) -> dict[int, dict[str, Baseline]]:
    """Per batch size, the decoders that take turns on each batch: the engine's `ar` and `model.generate` at each
    size; at batch 1 also static k and assisted generation at the same k."""
    n, eos, pad = engine.max_new_tokens, target.model.generation_config.eos_token_id, target.tokenizer.pad_token_id

    def policy(p: DepthPolicy) -> Baseline:
        def decode(batch: list[list[int]]) -> tuple[list[list[int]], float]:
            result = engine.generate(batch, p)
            return result.outputs, result.stats.wall_s
        return decode

    groups: dict[int, dict[str, Baseline]] = {
        bs: {f"engine_ar@{bs}": policy(ArPolicy()),
             f"hf_generate@{bs}": lambda batch: hf_generate(target.model, batch, n, pad, eos)}
        for bs in batch_sizes}
    single = groups.setdefault(1, {})
    for k in cfg.bench.ks:
        single[f"engine_static_k{k}@1"] = policy(StaticPolicy(k=k))
        if assisted:
            single[f"hf_assisted_k{k}@1"] = partial(hf_assisted, target.model, draft.model, max_new_tokens=n, k=k,
                                                    eos_id=eos)
    return groups


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_engine")
def main(cfg: DictConfig) -> None:
    entry(bench, cfg)


if __name__ == "__main__":
    main()
