"""The Hydra tasks behind scripts/train.py and scripts/evaluate.py.

Stages read their inputs from and write their outputs to `conf/paths/`'s folders, so each can be
rerun alone and is skipped when its output exists.
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from specpolicy import stages
from specpolicy.atomic import identity, made_for, read_record
from specpolicy.cli import check_out_dir, experiment_logger, finish_run, job_overrides, per_job
from specpolicy.cost.profile import profile_file
from specpolicy.data import TRAINED_ON, Conversation, PromptSource, encode_prompts, trained_on
from specpolicy.decode import Engine
from specpolicy.decode.engine import check_settings
from specpolicy.distill.stage import check_distil, distil
from specpolicy.errors import SpecPolicyError, check_bool, check_count, check_counts, check_int, fitting_batch_sizes
from specpolicy.eval.hf_baselines import hf_decoders, unassistable
from specpolicy.eval.report import write_report
from specpolicy.eval.runner import Baseline, side_by_side, summarise
from specpolicy.models import LoadedModel
from specpolicy.policy import DepthPolicy, OraclePolicy
from specpolicy.policy.goodput import DraftConfidence, GoodputPolicy, HeadEstimator
from specpolicy.runtime import OtherLoad, check_runtime, hardware

log = logging.getLogger("specpolicy")


def prepare(cfg: DictConfig) -> None:
    """Load the target once, so a GGUF source is converted and cached before any timed work."""
    stages.load_target(cfg)


STAGES: dict[str, Callable[[DictConfig], None]] = {
    "prepare": prepare, "distil": distil, "profile": stages.profile, "collect": stages.collect, "head": stages.head,
}

CHECKS: dict[str, Callable[[DictConfig], object]] = {"distil": check_distil, "profile": stages.check_profile,
                                                     "collect": stages.check_collect, "head": stages.check_head}


def train(cfg: DictConfig) -> None:
    if not isinstance(cfg.stages, ListConfig):  # `stages=distil` was read as the letters d, i, s, ...
        raise SpecPolicyError(f"stages must be a list, e.g. 'stages=[{cfg.stages}]', got {cfg.stages!r}")
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise SpecPolicyError(f"unknown stage(s) {unknown} in stages=; choose from {list(STAGES)}")
    if not cfg.stages:
        log.warning("train: stages=[] runs nothing; list some of %s", list(STAGES))
    check_int("seed", cfg.seed)
    check_runtime(cfg.runtime)
    for stage in cfg.stages:  # a setting that would fail a later stage fails now, not after a distillation
        CHECKS.get(stage, lambda _: None)(cfg)
    if {"profile", "collect"} & set(cfg.stages):  # the stages that decode with the trained draft
        stages.warn_foreign_draft(cfg, cfg.trained_draft, "train")
    torch.manual_seed(cfg.seed)
    for stage in cfg.stages:
        if rank_zero_only.rank and stage != "distil":  # a rank that distillation's DDP launched: it trains only
            continue
        log.info("stage %s", stage)
        STAGES[stage](cfg)


def evaluate(cfg: DictConfig) -> None:
    """Every policy in `eval.policies` at every batch size in `eval.batch_sizes`, side by side on the same
    prompts, plus transformers' own decoding as honesty baselines; writes the report to `eval.out_dir`."""
    check_int("seed", cfg.seed)
    check_runtime(cfg.runtime)
    check_eval_settings(cfg.eval)
    check_settings(cfg.engine)
    chosen = eval_policies(cfg)
    check_made_for(cfg, chosen)
    source = instantiate(cfg.data)
    conversations = source.load()  # a bad prompts file fails before any model loads
    if cfg.eval.num_prompts is not None and len(conversations) < cfg.eval.num_prompts:
        log.warning("evaluate: eval.num_prompts=%d but data (split=%s) has %d prompts; decoding those",
                    cfg.eval.num_prompts, cfg.data.split, len(conversations))
    conversations = conversations[: cfg.eval.num_prompts]
    check_held_out(cfg, source, conversations, chosen)
    batch_sizes = fitting_batch_sizes("eval.batch_sizes", cfg.eval.batch_sizes, len(conversations),
                                      "raise eval.num_prompts or data.limit, or give data.prompts_file more prompts")
    target, draft = stages.load_pair(cfg, cfg.draft)
    engine = instantiate(cfg.engine)(target.model, draft.model)
    prompts = encode_prompts(target.tokenizer, conversations, target.context_length, reserve=engine.max_new_tokens)
    # after the models: a wrong model path is the problem to report, not the artefacts a policy reads
    policies = {name: instantiate(policy) for name, policy in chosen.items()}
    _check_profiled_loads(policies, batch_sizes)
    _check_sampling(engine, policies)
    _explain_baselines(cfg, engine, draft, batch_sizes)
    logger = experiment_logger(cfg)  # before the decoding it logs: a logger that cannot start fails first
    rows, outputs = [], []
    for bs in batch_sizes:
        log.info("evaluate: batch size %d, %d policies, %d prompts", bs, len(policies), len(prompts))
        # side_by_side warms up at every batch size: when it warmed up only at the first, `ar` (first in the
        # only batch at batch 32) measured 57 tok/s against 72-79 tok/s for policies doing the same work
        baselines = hf_baselines(cfg, engine, target, draft, bs)
        runs = side_by_side(engine, prompts, policies, bs, cfg.eval.repeats, baselines)
        rows += summarise(runs)
        outputs += [{"policy": name, "batch_size": bs, "prompt_index": i, "prompt_ids": prompts[i], "output_ids": out,
                     "text": target.tokenizer.decode(out, skip_special_tokens=True)}
                    for name, run in runs.items() for i, out in enumerate(run.outputs)]
    meta = {"device": str(engine.device), "hardware": hardware(engine.device), "target": target.name,
            "draft": draft.name, "dtype": cfg.runtime.dtype, "temperature": engine.temperature,
            "top_p": engine.top_p, "seed": engine.seed, "max_new_tokens": engine.max_new_tokens,
            "num_prompts": len(prompts), "overrides": job_overrides(),
            "date": datetime.now().isoformat(timespec="seconds")}
    report = write_report(per_job(cfg.eval.out_dir), meta, rows, outputs, logger)
    finish_run(logger)
    print(report.read_text().split("![")[0])
    print(f"report: {report} (and report.html, report.json, outputs.jsonl beside it)")


def check_held_out(cfg: DictConfig, source: PromptSource, conversations: list[Conversation],
                   policies: dict[str, DictConfig]) -> None:
    """Refuse to score a draft, or a policy's depth head, on prompts it was trained on, known by content from its
    folder's `TRAINED_ON` file: a prompts file without a `split` column is every split (distil held out only its
    first rows), a copy of the file has another path, and another data set may share prompts. data.split=train
    or all asks for training prompts on purpose: then how many were trained on is warned, and where no folder
    lists its prompts, that they may be (a hub dataset's train split was warned about whatever it held)."""
    asked = cfg.data.split in ("train", "all") and not source.serves_every_split
    trained = {"the draft": cfg.draft.get("source", {}).get("path"),
               **{f"the depth head of eval.policies.{name}": OmegaConf.select(policy, "estimator.path")
                  for name, policy in policies.items()}}
    listed = [path for path in trained.values() if path and (Path(path).expanduser() / TRAINED_ON).is_file()]
    if asked and not listed:
        log.warning("evaluate: data.split=%s decodes prompts the draft was distilled on and the head's rollouts came "
                    "from: acceptance and speedups will be optimistic; data.split=test is held out", cfg.data.split)
    for what, path in trained.items():
        seen = trained_on(path, conversations) if path else []
        if seen and asked:
            log.warning("evaluate: %d of the %d prompts (data.split=%s) are prompts %s at %s was trained on: its "
                        "results on them are optimistic; data.split=test is held out", len(seen), len(conversations),
                        cfg.data.split, what, path)
        elif seen:
            fewer = f"set eval.num_prompts={seen[0]}, or " if seen[0] else ""
            held_out = ("a `split` column in the file, test for the rows to evaluate" if source.serves_every_split
                        else "data.split=test")  # a file without the column is every split, test too
            raise SpecPolicyError(f"{len(seen)} of the {len(conversations)} prompts evaluate would decode "
                                  f"({source.name}, split={cfg.data.split}) are prompts {what} at {path} was trained "
                                  f"on (the first: prompt {seen[0]}), where its results are optimistic; {fewer}decode "
                                  f"prompts it never trained on ({held_out}, or another data.prompts_file)")


def check_eval_settings(eval_cfg: DictConfig) -> None:
    """Refuse batch sizes, prompt counts and repeats that cannot decode before any model loads (`eval.batch_sizes=[0]`
    used to end in the engine's "every prompt needs at least one token", `[2.5]` in a slicing TypeError)."""
    check_counts("eval.batch_sizes", eval_cfg.batch_sizes)
    check_bool("eval.hf_baselines", eval_cfg.hf_baselines)
    check_out_dir("eval.out_dir", eval_cfg.out_dir)  # found only after decoding
    check_count("eval.repeats", eval_cfg.repeats)
    if eval_cfg.num_prompts is not None:  # null: the whole split
        check_count("eval.num_prompts", eval_cfg.num_prompts)
    if eval_cfg.hf_baselines:  # 0 draft tokens would time assisted generation drafting nothing
        check_count("eval.hf_assisted_k", eval_cfg.hf_assisted_k)


def eval_policies(cfg: DictConfig) -> dict[str, DictConfig]:
    """The policies evaluate decodes with, from their configs, before any model loads: those `eval.only` names (one
    override where picking a few took a `=null` for each of the rest), all when it is null; at a temperature above 0
    the greedy-only ones (the oracle) are left out; an oracle needs `ar`; and something must decode. Each of
    these was found only after the models loaded and a warm-up ran, or as "write_report got no runs"."""
    if not isinstance(cfg.eval.policies, DictConfig):  # null: an AttributeError; a list: Hydra's merge error first
        raise SpecPolicyError(f"eval.policies must map run names to policies (conf/evaluate.yaml), got "
                              f"{cfg.eval.policies!r}; to decode a few, set eval.only=[ar,...], or drop one with "
                              f"eval.policies.NAME=null")
    policies = {name: policy for name, policy in cfg.eval.policies.items() if policy is not None}
    if (only := cfg.eval.get("only")) is not None:
        names = list(only) if OmegaConf.is_list(only) else [str(only)]
        if unknown := [name for name in names if name not in policies]:
            raise SpecPolicyError(f"eval.only names {unknown}, not among eval.policies ({', '.join(policies)}); "
                                  f"pick from those, or add one (e.g. '+policy@eval.policies.NAME=static')")
        policies = {name: policy for name, policy in policies.items() if name in names}  # in the rotation's order
    if "ar" not in policies:
        log.warning("evaluate: %s no `ar`: no speedups, and no check that greedy outputs are lossless",
                    "eval.policies has" if only is None else "eval.only names")
    kinds = {name: _policy_class(name, policy) for name, policy in policies.items()}
    sampled = cfg.engine.temperature > 0
    if sampled and (greedy := [name for name, kind in kinds.items() if kind.greedy_only]):
        log.warning("evaluate: temperature %s samples, so %s (greedy only) are left out", cfg.engine.temperature,
                    greedy)
        policies = {name: policy for name, policy in policies.items() if name not in greedy}
    if (oracles := [name for name in policies if issubclass(kinds[name], OraclePolicy)]) and "ar" not in policies:
        raise SpecPolicyError(f"eval.policies {oracles} need the target's greedy outputs, which `ar` decodes: keep "
                              f"eval.policies.ar{' and name it in eval.only' if only is not None else ''}")
    if not policies and not cfg.eval.hf_baselines:  # transformers' baselines sample as the engine would
        left_out = " once the greedy-only ones are left out" if sampled else ""
        raise SpecPolicyError(f"evaluate has nothing to decode: eval.policies is empty{left_out} and "
                              f"eval.hf_baselines=false; keep at least one policy (e.g. eval.policies.ar)")
    return policies


def check_made_for(cfg: DictConfig, policies: dict[str, DictConfig]) -> None:
    """Evaluating another target or draft with an experiment's outputs ran without a word. A draft distilled for
    another target still decodes losslessly (a fair experiment: how well does it transfer?), and so does a policy
    whose latency profile timed another draft or whose depth head learned another pair's acceptance: warnings. A
    latency profile of another target prices every decision of `goodput` and `learned` wrong, so that stops."""
    stages.warn_foreign_draft(cfg, cfg.draft, "evaluate")
    target = identity(cfg, "target")
    draft = identity(cfg, "draft")
    for name, policy in policies.items():
        if policy.get("profile"):
            path = profile_file(policy.profile, cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.skinny_gemm)
            if changed := made_for("evaluate", path, target):
                raise SpecPolicyError(f"eval.policies.{name} reads the latency profile {path}, measured for another "
                                      f"target ({changed}); run scripts/train.py for this target with its own "
                                      f"experiment_name, or set eval.policies.{name}=null")
            if changed := made_for("evaluate", path, draft, "trained_draft"):
                log.warning("evaluate: eval.policies.%s reads the latency profile %s, which timed another draft "
                            "(%s): it prices drafting at that draft's cost", name, path, changed)
        head = OmegaConf.select(policy, "estimator.path")
        for role, model in (("target", target), ("trained_draft", draft)) if head else ():
            if changed := made_for("evaluate", Path(head), model, role):
                log.warning("evaluate: the depth head of eval.policies.%s at %s learned the acceptance of another "
                            "%s (%s)", name, head, "target" if role == "target" else "draft", changed)


def _check_sampling(engine: Engine, policies: dict[str, DepthPolicy]) -> None:
    """A goodput policy's acceptance estimates and costs were measured for one way of drawing tokens: a head from
    greedy rollouts scored a sampled evaluation (where acceptance is min(1, q/p), not an argmax match) silently."""
    now = _warp(engine.temperature, engine.top_p)
    for name, policy in policies.items():
        if not isinstance(policy, GoodputPolicy):
            continue
        why = []
        if isinstance(policy.estimator, HeadEstimator):
            old = (read_record("evaluate", Path(policy.estimator.path)) or {}).get("engine")  # `stages.head`
            if isinstance(old, dict) and (was := _warp(old.get("temperature", 0), old.get("top_p", 1))) != now:
                why.append(f"its depth head learned acceptance from rollouts decoded at {was} (collect rollouts at "
                           f"these engine settings to train one for them)")
        elif isinstance(policy.estimator, DraftConfidence) and engine.temperature > 0:
            why.append("it takes the draft's top-1 probability for greedy acceptance, which sampling's is not")
        if engine.temperature > 0:
            why.append("its latency profile timed greedy drafting steps, without a softmax (or top-p's sort) over "
                       "the vocabulary at each draft position")
        if why:
            log.warning("evaluate: eval.policies.%s decodes at %s, but %s", name, now, "; and ".join(why))


def _warp(temperature: float, top_p: float) -> str:
    return "greedy decoding" if temperature == 0 else f"temperature {temperature}, top_p {top_p}"


def _check_profiled_loads(policies: dict[str, DepthPolicy], batch_sizes: list[int]) -> None:
    """The cost model clamps past its profile's largest row count: a [1, 4] grid priced 64 rows as 4, silently. And
    a profile is made once and reused: one timed beside another job was warned about only when it was made."""
    for name, policy in policies.items():
        if not isinstance(policy, GoodputPolicy):
            continue
        profile = policy.cost.profile
        if past := [bs for bs in batch_sizes if bs > profile.rows[-1]]:
            log.warning("evaluate: eval.policies.%s prices batch sizes %s as %d rows, the most its latency profile "
                        "timed (profile.rows); profile those loads for it to see them", name, past, profile.rows[-1])
        if profile.other_load_cores is not None and OtherLoad.too_busy(profile.other_load_cores):
            log.warning("evaluate: eval.policies.%s prices its depths from a latency profile timed while other "
                        "processes took %.2f CPU cores; profile again on an idle machine (delete the profile, "
                        "stages=[profile])", name, profile.other_load_cores)


def _policy_class(name: str, policy: DictConfig) -> type[DepthPolicy]:
    target = policy.get("_target_") if isinstance(policy, DictConfig) else None
    try:
        kind = get_class(target) if target else None
    except (ImportError, ValueError) as err:  # hydra's message (several lines) names what it could not import
        why = " ".join(str(err).split())
        raise SpecPolicyError(f"eval.policies.{name}: cannot import {target!r} ({why}); use a policy config from "
                              f"conf/policy/") from err
    if not (isinstance(kind, type) and issubclass(kind, DepthPolicy)):
        raise SpecPolicyError(f"eval.policies.{name} is not a depth policy (_target_: {target}); use a policy "
                              f"config from conf/policy/")
    return kind


def _explain_baselines(cfg: DictConfig, engine: Engine, draft: LoadedModel, batch_sizes: list[int]) -> None:
    """Say which of transformers' baselines `eval.hf_baselines=true` cannot run here, and why (`hf_baselines`)."""
    if not cfg.eval.hf_baselines:
        return
    if why := unassistable(engine.target, draft.model):
        log.warning("evaluate: hf_assisted is left out: %s", why)
    elif 1 not in batch_sizes:
        log.warning("evaluate: hf_assisted runs at batch 1 only, which eval.batch_sizes leaves out")


def hf_baselines(cfg: DictConfig, engine: Engine, target: LoadedModel, draft: LoadedModel,
                 bs: int) -> dict[str, Baseline]:
    """transformers' generate at this batch size, and assisted generation at batch 1 (not with a draft that fuses
    the target's features, which `assistant_model=` cannot give it), sampling as the engine does."""
    if not cfg.eval.hf_baselines:
        return {}
    return hf_decoders(target.model, draft.model, bs, engine.max_new_tokens, target.tokenizer.pad_token_id,
                       engine.eos.tolist(), {"hf_assisted": cfg.eval.hf_assisted_k}, engine.temperature, engine.top_p)
