"""Training-pipeline stages after distillation: profile the hardware, collect rollouts, train the head.

Each reads its inputs from and writes its outputs to the folders `conf/paths/` names (`paths.profile_dir`,
`paths.rollouts_dir`, `head.out_dir`: under `paths.experiment_dir` by default), writes atomically, and is
skipped when its output exists, so `scripts/train.py` can be rerun after an interruption.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import datasets
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specpolicy.atomic import (atomic_path, check_replaceable, identity, made_for, read_record, record, record_path,
                               same_settings, settings, written)
from specpolicy.cli import check_ckpt_path, checkpoints_of, experiment_logger, finish_run, resumable, run_trainer
from specpolicy.cost.overhead import MIN_STEPS, drafting_overhead
from specpolicy.cost.profile import check_grid, measure, profile_file
from specpolicy.data import TRAINED_ON, digests_text, encode_prompts, fitting, trained_on, without
from specpolicy.decode.engine import check_settings
from specpolicy.errors import (
    SpecPolicyError,
    check_count,
    check_counts,
    check_int,
    check_number,
    check_trainer,
    fitting_batch_sizes,
)
from specpolicy.models import LoadedModel, check_compatible
from specpolicy.policy import StaticPolicy
from specpolicy.policy.head import HeadConfig
from specpolicy.policy.lightning import HeadModule, RolloutDataModule
from specpolicy.rollout.collect import COLUMNS, RecordingPolicy
from specpolicy.rollout.features import FEATURE_NAMES
from specpolicy.runtime import OtherLoad

log = logging.getLogger("specpolicy")


def load_target(cfg: DictConfig, dtype: str | None = None) -> LoadedModel:
    """The target, in `dtype` when given, else in runtime.dtype."""
    target = instantiate(cfg.target, **({"dtype": dtype} if dtype else {})).load()
    log.info("target %s: %.1fM parameters, context %d", target.name, target.model.num_parameters() / 1e6,
             target.context_length)
    return target


def load_pair(cfg: DictConfig, draft_cfg: DictConfig, dtype: str | None = None) -> tuple[LoadedModel, LoadedModel]:
    """The target and a draft built from `draft_cfg` (`cfg.trained_draft` after distil, `cfg.draft` to evaluate),
    checked against each other, both in `dtype` when given (distillation's float32), else in runtime.dtype."""
    target = load_target(cfg, dtype)
    draft = build_draft(draft_cfg, target, dtype)
    check_compatible(target, draft)
    return target, draft


def build_draft(draft_cfg: DictConfig, target: LoadedModel, dtype: str | None = None) -> LoadedModel:
    """The draft `draft_cfg` describes, for `target`; a saved one loads in `dtype` when given: distillation measures
    and trains in float32, and a pretrained draft loaded in runtime.dtype (bf16 in smollm2_135m_long) was refused
    beside the float32 target as another dtype."""
    source = {"source": {"dtype": dtype}} if dtype and draft_cfg.get("source") else {}
    return instantiate(draft_cfg, **source).build(target)


def warn_foreign_draft(cfg: DictConfig, draft_cfg: DictConfig, stage: str) -> None:
    """A draft distilled for another target still decodes losslessly (a fair experiment: how well does it
    transfer?), but a stage that used it for this target said nothing."""
    path = draft_cfg.get("source", {}).get("path")
    target = identity(cfg, "target")
    if path and (changed := made_for(stage, Path(path), target)):
        log.warning("%s: the draft at %s was distilled for another target (%s): its acceptance is that of a draft "
                    "made for that one", stage, path, changed)


def made_from_draft(cfg: DictConfig) -> list[Path]:
    """The upstream outputs of a stage that loads `trained_draft`: the distil stage's draft, when it is that."""
    path = cfg.trained_draft.get("source", {}).get("path")
    return [Path(path)] if path else []


def profile(cfg: DictConfig) -> None:
    out = profile_file(Path(cfg.paths.profile_dir), cfg.runtime.device, cfg.runtime.dtype,
                       cfg.runtime.skinny_gemm)
    made_with = settings(cfg, ["target", "trained_draft", "profile"], made_from_draft(cfg))
    if written("profile", out, made_with):
        return
    p = cfg.profile
    rows, tokens = check_profile(cfg)
    target, draft = load_pair(cfg, cfg.trained_draft)
    check_grid_fits(p, target)
    with OtherLoad() as load:
        latency = measure(target.model, draft.model, rows, tokens, p.context, p.repeats, cfg.runtime.dtype)
        if p.overhead_steps:
            latency.draft_step_overhead_ms = drafting_overhead(target.model, draft.model, latency, p.overhead_steps,
                                                               p.overhead_rounds)
            log.info("profile: a drafting step costs %s ms beyond its forwards at %s rows",
                     [round(ms, 1) for ms in latency.draft_step_overhead_ms], list(p.rows))
    latency.other_load_cores = round(load.cores, 3)
    busy = [f"other processes took {load} while it timed"] if load.busy else []
    if odd := busy + latency.outliers():
        log.warning("profile: %s; was the machine busy? Delete %s and profile again on an idle machine, or the "
                    "load-aware policies price their depths from these", "; ".join(odd), out)
    record(out, made_with)  # first: an output without its record would be reused whatever made it
    latency.save(out)
    log.info("profile: saved %s", out)


def check_grid_fits(p: DictConfig, target: LoadedModel) -> None:
    """The grid's positions exist in the target: a RoPE model computes past its context without a word, so a
    profile there timed positions that decoding never reaches."""
    if p.context + max(p.tokens) > target.context_length:
        raise SpecPolicyError(f"profile.context={p.context} plus {max(p.tokens)} new tokens (profile.tokens) exceeds "
                              f"the target's context of {target.context_length}; lower profile.context")


def check_profile(cfg: DictConfig) -> tuple[list[int], list[int]]:
    """The profile settings, checked before any timing; returns the grid (`profile.rows`, `profile.tokens`),
    which must rise because the cost model interpolates on it."""
    p = cfg.profile
    for setting in ("context", "repeats"):
        check_count(f"profile.{setting}", p[setting])
    if p.overhead_steps != 0:  # 0 skips the drafting-overhead runs, and with them their rounds
        if not (isinstance(p.overhead_steps, int) and p.overhead_steps >= MIN_STEPS):  # found after the grid
            raise SpecPolicyError(f"profile.overhead_steps must be 0 (no drafting-overhead runs) or an integer >= "
                                  f"{MIN_STEPS} (a steady run of each depth to time), got {p.overhead_steps!r}")
        check_count("profile.overhead_rounds", p.overhead_rounds)
    return check_grid(p.rows, p.tokens)


ROLLOUTS_MARKER = "dataset_info.json"  # what `save_to_disk` writes: complete rollouts hold it


def check_collect(cfg: DictConfig) -> None:
    """Collection's settings and prompts, before the stages before it run: a prompts file without a `split`
    column (every prompt an evaluation prompt) or a `data.split` typo stopped it after distillation."""
    check_settings(cfg.engine)  # collection decodes with it
    check_counts("collect.batch_sizes", cfg.collect.batch_sizes)
    for setting in ("k", "min_prompts_per_size"):
        check_count(f"collect.{setting}", cfg.collect[setting])
    # the engine drafts no further than a row's last token, so one new token drafts nothing to learn from
    check_int("collect.max_new_tokens (2 or more: the last token is never drafted)", cfg.collect.max_new_tokens, 2)
    _not_evaluated(cfg, instantiate(cfg.data, split="train", limit=None).load(), warn=False)  # collect warns
    check_replaceable(cfg.paths.rollouts_dir, "paths.rollouts_dir", ROLLOUTS_MARKER)  # found by the save


def check_head(cfg: DictConfig) -> None:
    """The head's settings, checked before the stages before it run (a bad lr used to stop the head stage
    in torch's "Invalid learning rate" traceback, after distillation, profiling and collection)."""
    h = cfg.head
    HeadConfig(hidden=h.hidden, layers=h.layers)  # refuses a head that cannot learn
    check_count("head.batch_size", h.batch_size)
    check_number("head.lr", h.lr, 0, low_open=True)
    check_number("head.val_fraction", h.val_fraction, 0, 1, low_open=True, high_open=True)
    check_trainer("head.trainer", h.trainer)
    if h.trainer.get("devices", 1) != 1 or h.trainer.get("strategy", "auto") != "auto":
        raise SpecPolicyError(f"the head trains on one device (it is tiny; each rank would save it): set "
                              f"head.trainer.devices=1 and no head.trainer.strategy, got devices="
                              f"{h.trainer.get('devices')}, strategy={h.trainer.get('strategy', 'auto')}")
    check_ckpt_path("head.ckpt_path", h.ckpt_path, checkpoints_of(h.trainer.get("callbacks")))


def collect(cfg: DictConfig) -> None:
    """Decode training prompts at a fixed maximum depth for each batch size; one shard per batch size,
    so an interrupted collection resumes at the next missing shard.

    The prompts are train prompts the draft was not distilled on (`_unseen_by_draft`): on its own
    it is at its most confident and most often right, and a head trained on that would expect more
    than the draft delivers on new prompts."""
    out = Path(cfg.paths.rollouts_dir)
    made_with = collect_settings(cfg)
    if written("collect", out, made_with, out / ROLLOUTS_MARKER):
        return
    check_collect(cfg)
    c = cfg.collect
    target, draft = load_pair(cfg, cfg.trained_draft)
    engine = instantiate(cfg.engine)(target.model, draft.model, max_new_tokens=c.max_new_tokens)
    conversations = _not_evaluated(cfg, _unseen_by_draft(cfg, instantiate(cfg.data, split="train", limit=None).load()))
    conversations = fitting(target.tokenizer, conversations, target.context_length - c.max_new_tokens, "collect",
                            f"the target's context of {target.context_length} less collect.max_new_tokens")
    prompts = encode_prompts(target.tokenizer, conversations, target.context_length, reserve=c.max_new_tokens)
    sizes = fitting_batch_sizes("collect.batch_sizes", c.batch_sizes, len(prompts),
                                "give data more train prompts, or lower distill.data.train_prompts")
    counts = {bs: min(_prompts_for(bs, c.min_prompts_per_size), len(prompts) // bs * bs) for bs in sizes}
    shards = out.with_name("rollouts_shards")  # an interrupted collection's batch sizes, kept for its rerun
    if shards.exists() and not same_settings("collect", shards, made_with):
        log.info("collect: %s was decoded with other settings; starting over", shards)
        shutil.rmtree(shards)
    record(shards, made_with)
    for bs in tqdm(sizes, desc="collect (batch sizes)"):
        shard = shards / f"bs{bs}"
        if (shard / "dataset_info.json").exists():
            continue
        recorder = RecordingPolicy(StaticPolicy(k=c.k))
        for start in tqdm(range(0, counts[bs], bs), desc=f"batch size {bs}", leave=False):
            engine.generate(prompts[start : start + bs], recorder, first_id=start)
        with atomic_path(shard) as tmp:
            _dataset(torch.cat(recorder.records)).save_to_disk(str(tmp))
    parts = [datasets.load_from_disk(str(shards / f"bs{bs}")) for bs in sizes]
    record(out, made_with)  # first: an output without its record would be reused whatever made it
    with atomic_path(out) as tmp:
        datasets.concatenate_datasets(parts).save_to_disk(str(tmp))
        # the prompts the head will learn from, which evaluate must not score it on
        (tmp / TRAINED_ON).write_text(digests_text(conversations[: max(counts.values())]))
    shutil.rmtree(shards)
    record_path(shards).unlink()
    log.info("collect: %d positions saved to %s", sum(len(p) for p in parts), out)


def collect_settings(cfg: DictConfig) -> dict:
    """What the rollouts (and an interrupted collection's shards) are made with."""
    return settings(cfg, ["target", "trained_draft", "collect", "engine", "runtime.dtype", "data", "seed",
                          "distill.data.train_prompts"], made_from_draft(cfg))


def _prompts_for(batch_size: int, min_prompts: int) -> int:
    """How many prompts collect decodes at `batch_size`: whole batches, at least `min_prompts` in all."""
    return -(-max(batch_size, min_prompts) // batch_size) * batch_size


def _unseen_by_draft(cfg: DictConfig, conversations: list) -> list:
    """`conversations` without those the draft was distilled on: by content where its folder lists them
    (`TRAINED_ON`: right for a draft made elsewhere, or with another `distill.data.train_prompts`, where skipping
    the first `train_prompts` rows left every rollout prompt a distillation prompt), else by that count. Rows past
    the first `train_prompts` come first: those before them that the draft did not train on are the ones distil
    skipped as too long, no sample of the prompts (19 of them were most of the demo's 32 rollout prompts, and the
    rollouts' first-token acceptance fell from 0.23, as on the test prompts, to 0.16)."""
    count = cfg.distill.data.train_prompts
    ordered = conversations if count is None else conversations[count:] + conversations[:count]
    folder = OmegaConf.select(cfg, "trained_draft.source.path")
    if folder and (Path(folder).expanduser() / TRAINED_ON).is_file():
        seen = set(trained_on(folder, ordered))
        unseen, what = [c for i, c in enumerate(ordered) if i not in seen], f"{len(seen)} that {folder} lists"
    else:
        unseen = conversations[count:] if count is not None else []
        what = count if count is not None else "all"
    # batch sizes past every prompt there is are left out anyway (`fitting_batch_sizes`): one of 512 made every
    # batch size decode distillation prompts, with 442 unseen ones to spare
    fit = [bs for bs in cfg.collect.batch_sizes if bs <= len(conversations)] or [1]
    needed = max(_prompts_for(bs, cfg.collect.min_prompts_per_size) for bs in fit)
    if len(unseen) >= needed:
        return unseen
    log.warning("collect: fewer than %d train prompts are left after the %s the draft was distilled on; the "
                "rollouts reuse distillation prompts, where the draft is more often right than on new ones "
                "(lower distill.data.train_prompts to keep some apart)", needed, what)
    return conversations


def _not_evaluated(cfg: DictConfig, conversations: list, warn: bool = True) -> list:
    """Without the prompts evaluate.py decodes (`data` as configured): a prompts file without a `split` column
    serves every split, and a head trained on the evaluation's own sequences would be scored on them."""
    kept = without(conversations, instantiate(cfg.data, limit=None).load(),
                   "collect", "rollout prompts are evaluation prompts; not decoded" if warn else None)
    if not kept:
        raise SpecPolicyError(f"every rollout prompt is also an evaluation prompt (data.split={cfg.data.split}; a "
                              f"prompts file without a `split` column is every split); give its rows a `split`: "
                              f"train, validation or test")
    return kept


def head(cfg: DictConfig) -> None:
    out = Path(cfg.head.out_dir)
    rollouts_dir = Path(cfg.paths.rollouts_dir)
    made_with = settings(cfg, ["head", "seed"], [rollouts_dir])
    if written("head", out, made_with, out / "head.pt"):
        return
    h = cfg.head
    if not (rollouts_dir / "dataset_info.json").exists():
        raise SpecPolicyError(f"no rollouts at {rollouts_dir}; run the collect stage first (stages=[collect,head])")
    rollouts = datasets.load_from_disk(str(rollouts_dir)).with_format("torch")[:]
    if (prompts := len(rollouts["group"].unique())) < 2:  # validation takes whole prompts: none left to train on
        raise SpecPolicyError(f"the rollouts at {rollouts_dir} come from {prompts} prompt(s); the head needs 2 or "
                              f"more (delete them and collect again with more train prompts, or "
                              f"collect.min_prompts_per_size=8)")
    features = torch.stack([rollouts[name].float() for name in FEATURE_NAMES], -1)
    L.seed_everything(cfg.seed, workers=True)
    data = RolloutDataModule(features, rollouts["accepted"].float(), rollouts["group"], h.batch_size, h.val_fraction,
                             cfg.seed)
    position = features[:, FEATURE_NAMES.index("position")]
    first = position == 1
    prior = float(rollouts["accepted"].float()[first].mean()) if bool(first.any()) else 0.5
    config = HeadConfig(hidden=h.hidden, layers=h.layers, prior=prior, positions=int(position.max()))
    module = HeadModule(config, lr=h.lr)
    checkpoints = checkpoints_of(h.trainer.get("callbacks"))
    trainer = instantiate(h.trainer, logger=experiment_logger(cfg, "head", checkpoints, h.ckpt_path) or False)
    resumable("head", trainer, h.ckpt_path, made_with)
    run_trainer(trainer, "fit", module, datamodule=data, ckpt_path=h.ckpt_path)
    out.mkdir(parents=True, exist_ok=True)
    if (rollouts_dir / TRAINED_ON).exists():  # the prompts of its rollouts, which evaluate must not score it on
        shutil.copyfile(rollouts_dir / TRAINED_ON, out / TRAINED_ON)
    # the pair its rollouts decoded, and how (`engine`), for evaluate to compare with what it scores (not compared
    # on a rerun here: "from rollouts" settles that); before head.pt, the output's mark, as every stage records
    pair = {k: v for k, v in (read_record("head", rollouts_dir) or {}).items()
            if k in ("target", "trained_draft", "engine")}
    record(out, {**made_with, **pair})
    module.head.save(out)  # head.pt last
    log.info("head: saved %s (val/loss %.4f)", out, float(trainer.callback_metrics.get("val/loss", float("nan"))))
    finish_run()


def _dataset(records: torch.Tensor) -> datasets.Dataset:
    return datasets.Dataset.from_dict({name: records[:, i].tolist() for i, name in enumerate(COLUMNS)})
