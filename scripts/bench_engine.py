"""Benchmark: `python scripts/bench_engine.py experiment=smollm2_135m draft=distilled [runtime.dtype=bfloat16]`
(the README's tables; the default draft is an undistilled subset of the target's layers).

Prints and saves JSON with, side by side in one process, over `bench.repeats` timed passes:
  * the engine's `ar` vs `model.generate` tokens/s at each batch size (the baseline must be honest);
  * `static` k with the configured draft vs transformers' assisted generation at batch 1 (and vs the engine's
    `ar`; a draft that fuses the target's features has no assisted generation to compare with).
The decoders at a batch size run as evaluate runs its policies (`eval.runner.side_by_side`: warmed up, taking
turns on each batch in an order that rotates from batch to batch and pass to pass, full batches only). Each ratio
is measured within every pass and reported as the geometric mean over passes with its range, and so is each
tokens/s: a ratio is then exactly the quotient of the two speeds printed beside it. (The median did not keep
them consistent, and over the usual two passes it is their mean, which a noisy pass pulls on the ratio and its
inverse alike, so both read above 1.)
"""

import logging
import os
import statistics
from datetime import datetime
from pathlib import Path

import hydra
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import DictConfig

from specpolicy.atomic import check_replaceable
from specpolicy.cli import check_out_dir, entry, publish
from specpolicy.data import encode_prompts
from specpolicy.decode import Engine
from specpolicy.decode.engine import check_settings
from specpolicy.errors import SpecPolicyError, check_count, check_counts, fitting_batch_sizes
from specpolicy.eval.hf_baselines import assisted_settings, hf_decoders, unassistable
from specpolicy.eval.report import EXACT_DTYPES, VIOLATED, is_engine
from specpolicy.eval.runner import Baseline, full_batches, side_by_side, summarise
from specpolicy.models import LoadedModel
from specpolicy.policy import ArPolicy, DepthPolicy, StaticPolicy
from specpolicy.runtime import hardware
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
    check_replaceable(cfg.bench.out, "bench.out")  # a folder's files were deleted by the save
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
    if why:
        log.warning("bench_engine: %s: static k is compared with the engine's ar only", why)
    runs = {bs: side_by_side(engine, full_batches(prompts, bs, "bench.num_prompts"), policies, bs, cfg.bench.repeats,
                             baselines)
            for bs, (policies, baselines) in _decoders(cfg, engine, target, draft, batch_sizes).items()}
    rows = {f"{'engine_' if is_engine(row) else ''}{row['policy']}@{bs}": row
            for bs, group in runs.items() for row in summarise(group)}
    per_pass = {name: _per_pass(row["units"], cfg.bench.repeats) for name, row in rows.items()}
    pairs = {f"engine_ar_vs_hf_generate@{bs}": (f"engine_ar@{bs}", f"hf_generate@{bs}") for bs in runs}
    pairs.update({f"engine_static_k{k}_vs_hf_assisted@1": (f"engine_static_k{k}@1", f"hf_assisted_k{k}@1")
                  for k in cfg.bench.ks if why is None})
    pairs.update({f"engine_static_k{k}_vs_engine_ar@1": (f"engine_static_k{k}@1", "engine_ar@1") for k in cfg.bench.ks})
    ratios, ranges = {}, {}
    for key, (a, b) in pairs.items():
        within = [x / y for x, y in zip(per_pass[a], per_pass[b])]
        ratios[key], ranges[key] = statistics.geometric_mean(within), [min(within), max(within)]
    report = {"target": target.name, "draft": draft.name, "device": str(engine.device), "dtype": cfg.runtime.dtype,
              "skinny_gemm": cfg.runtime.skinny_gemm, "prompts": len(prompts), "max_new_tokens": engine.max_new_tokens,
              "repeats": cfg.bench.repeats,
              "tokens_per_s": {name: statistics.geometric_mean(rates) for name, rates in per_pass.items()},
              "ratios": ratios, "ratio_range": ranges,
              "ratio_of": {key: list(pair) for key, pair in pairs.items()},  # which two tokens_per_s each divides
              "same_as_engine_ar": _same_as_ar(rows, cfg.runtime.dtype), "hardware": hardware(engine.device),
              "other_load_cores": {bs: next(iter(group.values())).other_load_cores for bs, group in runs.items()},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "engine": {"solo_above": engine.solo_above, "max_padding": engine.max_padding},
              "date": datetime.now().isoformat(timespec="seconds")}
    if why is None:
        report["assisted_settings"] = {k: assisted_settings(k) for k in cfg.bench.ks}
    publish(report, cfg.bench.out)


def _per_pass(units: list[list], repeats: int) -> list[float]:
    """A decoder's tokens/s in each timed pass: `side_by_side` appends its units (one per batch) pass by pass."""
    per = len(units) // repeats
    passes = [units[i * per : (i + 1) * per] for i in range(repeats)]
    return [sum(u[0] for u in p) / sum(u[1] for u in p) for p in passes]


def _same_as_ar(rows: dict[str, dict], dtype: str) -> dict[str, float]:
    """Per decoder, the share of prompts on which it wrote what the engine's `ar` wrote at its batch size (from
    `summarise`): a ratio of two decoders that wrote different tokens compares different work. In fp32 an engine
    policy must match on every prompt (`eval.report.lossless`); transformers' kernels and padding may round
    otherwise."""
    same = {name: row["ar_match"] for name, row in rows.items() if row["ar_match"] is not None
            and not name.startswith("engine_ar@")}
    if broken := [name for name, row in rows.items() if row.get("first_mismatch") is not None]:
        if dtype in EXACT_DTYPES:
            log.error("bench_engine: %s: %s wrote other tokens than the engine's greedy ar (%s)", VIOLATED,
                      broken, {name: same[name] for name in broken})
    return same


def _decoders(cfg: DictConfig, engine: Engine, target: LoadedModel, draft: LoadedModel,
              batch_sizes: list[int]) -> dict[int, tuple[dict[str, DepthPolicy], dict[str, Baseline]]]:
    """Per batch size, the engine's policies and transformers' decoders that take turns on each batch: `ar` and
    `model.generate` at each size; at batch 1, which always runs, also static k and assisted generation at the same
    k."""
    assisted = {f"hf_assisted_k{k}": k for k in cfg.bench.ks}
    return {bs: ({"ar": ArPolicy()} | ({f"static_k{k}": StaticPolicy(k=k) for k in cfg.bench.ks} if bs == 1 else {}),
                 hf_decoders(target.model, draft.model, bs, engine.max_new_tokens, target.tokenizer.pad_token_id,
                             engine.eos.tolist(), assisted))
            for bs in sorted({1, *batch_sizes})}


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_engine")
def main(cfg: DictConfig) -> None:
    entry(bench, cfg)


if __name__ == "__main__":
    main()
