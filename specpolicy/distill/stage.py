"""The `distil` pipeline stage: build a draft, distil the target into it, save an HF model folder.

Writes `paths.draft_dir` (`<experiment>/draft/` by default; loadable by `AutoModelForCausalLM` and usable as
transformers' `assistant_model=`) with `metrics.json` inside: validation agreement and expected acceptance before
and after distillation, the draft's cost ratio, and the training wall time. Skipped when
`draft/config.json` exists; a killed run resumes from `last.ckpt` (`distill.ckpt_path=last`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Timer
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel

from specpolicy.atomic import check_replaceable, model_identity, record, settings, written
from specpolicy.cli import check_ckpt_path, checkpoints_of, experiment_logger, finish_run, resumable, run_trainer
from specpolicy.data import TRAINED_ON, Conversation, digests_text, encode_prompts, fitting, without
from specpolicy.distill.module import CACHED_NEEDS_TOP_K, TEST, DistillDataModule, DistillModule
from specpolicy.errors import SpecPolicyError, check_bool, check_count, check_int, check_number, check_trainer
from specpolicy.models import LoadedModel
from specpolicy.models.draft import PretrainedDraft, describe_cost
from specpolicy.models.fusion import fuses_features
from specpolicy.models.loading import save_model
from specpolicy.models.vocab import (
    VOCAB_FILE,
    SubsetHead,
    frequent_tokens,
    restore_full_head,
    subset_of,
    use_subset_head,
    vocab_file_text,
)
from specpolicy.stages import build_draft, load_target

log = logging.getLogger("specpolicy")
TARGET_PROBS = ("cached", "online")
HELD_OUT = ("validation", "test")
DRAFT_MARKER = "config.json"  # what save_pretrained writes: a complete draft folder holds it
# what a draft is made of: a change to any of these makes another draft (see `atomic.settings`)
MADE_WITH = ["target", "draft", "distill", "data.prompts_file", "data.hub_dataset", "data.prompt_field", "trainer",
             "seed"]


def check_distil(cfg: DictConfig) -> None:
    """Settings that would otherwise fail only inside the training loop, or train on NaNs, checked before
    anything loads: the loss temperature divides the logits, the divergence is called once on a two-token
    distribution (so it refuses its own parameters, such as jsd's beta, now), the optimizer is built
    once on a dummy parameter and the data settings once without data."""
    d = cfg.distill
    if d.target_probs not in TARGET_PROBS:
        raise SpecPolicyError(f"distill.target_probs={d.target_probs!r}; choose one of {list(TARGET_PROBS)}")
    if cfg.trainer.get("max_steps", -1) == -1:
        raise SpecPolicyError("distillation runs for a number of steps; set trainer.max_steps to a positive number")
    check_count("trainer.max_steps", cfg.trainer.max_steps)
    if d.target_probs == "cached" and d.data.top_k == 0:
        raise SpecPolicyError(CACHED_NEEDS_TOP_K)
    check_trainer("trainer", cfg.trainer)
    for limit in ("limit_val_batches", "limit_test_batches"):  # the before/after metrics would cover part silently
        value = cfg.trainer.get(limit)
        if value is not None and not (isinstance(value, float) and value == 1.0):  # Lightning: int 1 is one batch
            raise SpecPolicyError(f"trainer.{limit}={value}: distil's metrics.json reports every "
                                  f"held-out prompt; set distill.data.val_prompts / test_prompts to use fewer")
    every = cfg.trainer.get("val_check_interval")  # in batches, within the one epoch of `StepBatchSampler`
    batches = cfg.trainer.max_steps * (cfg.trainer.get("accumulate_grad_batches") or 1)
    if isinstance(every, int) and every > batches and cfg.trainer.get("check_val_every_n_epoch") is not None:
        raise SpecPolicyError(f"trainer.val_check_interval={every} is more batches than trainer.max_steps="
                              f"{cfg.trainer.max_steps} trains; set trainer.val_check_interval={cfg.trainer.max_steps}")
    check_number("distill.temperature", d.temperature, 0, low_open=True, why="it divides the logits")
    if d.target_probs == "cached" and d.temperature != 1:  # tempering reshapes the tail the cache spreads evenly
        raise SpecPolicyError(f"distill.temperature={d.temperature} needs the target's whole distribution, and the "
                              f"cache keeps its top {d.data.top_k} only (at T=2 its even tail would take most of the "
                              f"mass); set distill.target_probs=online, or distill.temperature=1")
    check_number("distill.feature_loss", d.feature_loss, 0, why="a loss weight")
    _check_splits(cfg)
    check_replaceable(cfg.paths.draft_dir, "paths.draft_dir", DRAFT_MARKER)  # found by the save, after the training
    check_bool("distill.freeze_embeddings", d.freeze_embeddings)
    check_bool("distill.data.prompt_loss", d.data.prompt_loss)
    check_count("distill.batch_size", d.batch_size)
    check_count("distill.max_length", d.max_length)
    check_int("distill.unroll", d.unroll, 0)
    uniform = torch.full((1, 2), -math.log(2.0))
    try:
        instantiate(d.loss)(uniform, uniform)
    except TypeError as err:  # a setting of the wrong type, or one this divergence does not take
        raise SpecPolicyError(f"distill.loss: {err}; fix its settings (conf/distill/loss/)") from err
    try:  # torch's optimizers refuse a negative lr, betas outside [0, 1), a string, ... when built
        optimizer = instantiate(d.optimizer)([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as err:
        raise SpecPolicyError(f"distill.optimizer: {err}; fix its settings (e.g. distill.optimizer.lr=3e-4)") from err
    if d.get("scheduler"):  # built as the module builds it, inside fit
        if d.scheduler.get("num_warmup_steps") is not None:  # negative: the schedule would start partway through
            check_int("distill.scheduler.num_warmup_steps", d.scheduler.num_warmup_steps, 0)
        try:
            instantiate(d.scheduler)(optimizer, num_training_steps=cfg.trainer.max_steps)
        except (ValueError, TypeError) as err:
            raise SpecPolicyError(f"distill.scheduler: {err}; fix its settings (e.g. "
                                  f"distill.scheduler.num_warmup_steps=20)") from err
    instantiate(d.data)
    for synthesis in (d.get("synthetic") or {}).values():  # refuses its settings when built, before the target loads
        instantiate(synthesis)
    _check_vocab(d, instantiate(cfg.draft))  # a draft config refuses its own settings when built (nothing loads)
    check_ckpt_path("distill.ckpt_path", d.ckpt_path, checkpoints_of(cfg.get("callbacks")))


def _check_vocab(d: DictConfig, spec: object) -> None:
    """A head over part of the vocabulary, ranked anew (`distill.draft_vocab`) or a saved draft's own (its
    `draft_vocab.json`, which it distils on in), is a frozen copy of the full head's rows: the embedding and head
    must stay frozen for the saved full head to match it. Checked before the responses are generated."""
    size = d.get("draft_vocab")
    if size is not None:  # its upper bound, the vocabulary, is checked once the target loads
        check_count("distill.draft_vocab (or null for the full head)", size)
    saved = spec.vocab if isinstance(spec, PretrainedDraft) else None
    if saved is not None and size not in (None, len(saved)):
        raise SpecPolicyError(f"the draft at {spec.source.path} scores {len(saved)} tokens ({VOCAB_FILE}) and distils "
                              f"on in them; set distill.draft_vocab={len(saved)} or null, or point draft.source.path "
                              f"at a copy of the folder without {VOCAB_FILE} to rank {size} anew")
    if saved is None and size is None:
        return
    if not d.freeze_embeddings:
        what = "distill.draft_vocab" if saved is None else f"a draft with {VOCAB_FILE} ({spec.source.path})"
        raise SpecPolicyError(f"{what} needs distill.freeze_embeddings=true (the draft's embedding and head stay "
                              f"fixed so the saved full head still matches the subset it trained with)")
    if saved is None and d.data.source == "draft" and d.target_probs != "cached":
        raise SpecPolicyError("distill.draft_vocab with distill.data.source=draft ranks tokens by the target's "
                              "top-1 on the draft's responses, which only cached targets keep; set "
                              "distill.target_probs=cached, or distill.data.source=target")


def _check_splits(cfg: DictConfig) -> None:
    """A prompts file whose `split` column lacks a split distil reads (`dev` for validation) was refused after the
    models loaded, as "data.split='validation' is not a split", a setting the user never made."""
    source = instantiate(cfg.data, limit=None)
    needed = ["train", "validation"] + (["test"] if cfg.distill.data.test_prompts != 0 else [])
    if source.splits is not None and (missing := [s for s in needed if s not in source.splits]):
        no_test = "; or set distill.data.test_prompts=0 to report no test metrics" if missing == ["test"] else ""
        raise SpecPolicyError(f"distil reads the {'/'.join(needed)} rows of {source.prompts_file or 'the prompts'}, "
                              f"whose `split` column has no {'/'.join(missing)} (its splits: {source.splits}); name "
                              f"those rows' split {'/'.join(missing)}{no_test}")


def draft_settings(cfg: DictConfig) -> dict:
    """What a distilled draft is made of (`MADE_WITH`): of the target, which model it is, not the dtype, device or
    kernels it runs with elsewhere (distillation loads it in float32), so a bf16 evaluation reuses the draft."""
    made_with = settings(cfg, MADE_WITH)
    return {**made_with, "target": model_identity(made_with["target"])}


def distil(cfg: DictConfig) -> None:
    out = Path(cfg.paths.draft_dir)
    made_with = draft_settings(cfg)
    if written("distil", out, made_with, out / DRAFT_MARKER):
        return
    check_distil(cfg)  # the pipeline checked already; scripts/bench_distill.py calls this stage directly
    d = cfg.distill
    L.seed_everything(cfg.seed, workers=True)
    target = load_target(cfg, "float32")  # fp32 master weights; trainer.precision sets compute
    check_fits(d, target)
    draft = build_draft(cfg.draft, target, "float32")
    for setting, value in (("unroll", d.unroll), ("feature_loss", d.feature_loss)):
        if value and not fuses_features(draft.model):  # feature_loss was accepted and trained nothing
            raise SpecPolicyError(f"distill.{setting}={value} trains a draft that reads the target's features; set "
                                  f"draft_fuse_features=true, or distill.{setting}=0")
    groups = _prompt_groups(cfg, target)
    datamodule = _datamodule(cfg, target, draft, groups)
    vocab = _narrow_head(d, target, draft, datamodule)
    model = _trainable(draft.model, d)
    module = DistillModule(model, target.model, loss=instantiate(d.loss), optimizer=instantiate(d.optimizer),
                           scheduler=instantiate(d.scheduler) if d.get("scheduler") else None,
                           temperature=d.temperature, feature_loss=d.feature_loss, unroll=d.unroll)
    timer = Timer(verbose=False)  # its elapsed time rides in the checkpoints: a resumed run reports the whole
    trainer = _trainer(cfg, timer)
    resumable("distil", trainer, d.ckpt_path, made_with)
    before = _held_out(trainer, module, datamodule)
    with warnings.catch_warnings():  # a resumed run's sampler starts at its step (`StepBatchSampler`): none read twice
        warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable")
        run_trainer(trainer, "fit", module, datamodule=datamodule, ckpt_path=d.ckpt_path)
    train_s = timer.time_elapsed("train")
    if trainer.interrupted or trainer.global_step < trainer.max_steps:
        raise SpecPolicyError(f"distillation stopped at step {trainer.global_step} of {trainer.max_steps}; "
                              f"rerun the same command to resume from the last checkpoint")
    after = _held_out(trainer, module, datamodule)
    if not trainer.is_global_zero:
        return
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # merging drops LoRA's adapters
    merged = model.merge_and_unload() if d.get("lora") else model
    metrics = {"draft": draft.name, "target": target.name, "before": before, "after": after,
               "cost": draft.cost, "draft_vocab": None if vocab is None else len(vocab), "train_seconds": train_s,
               "steps": trainer.global_step, "trainable_parameters": trainable,
               "distill": OmegaConf.to_container(d, resolve=True)}
    trained_on = [c for name, conversations in groups.items() if name not in HELD_OUT for c in conversations]
    # written with the folder, in one atomic save
    files = {"metrics.json": json.dumps(metrics, indent=2), TRAINED_ON: digests_text(trained_on)}
    if vocab is not None:  # a standard HF folder with the full head, and the subset beside it
        restore_full_head(merged, draft.full_head)
        files[VOCAB_FILE] = vocab_file_text(vocab)
    record(out, made_with)  # first: an output without its record would be reused whatever made it
    save_model(out, merged.eval(), target.tokenizer, files)
    log.info("distil: validation agreement %.3f -> %.3f, expected acceptance %.3f -> %.3f, c = %.3f (FLOPs), %.0f s; "
             "saved %s", before["agreement"], after["agreement"], before["expected_acceptance"],
             after["expected_acceptance"], draft.cost["flops_ratio"], train_s, out)
    if "test" in after:
        log.info("distil: test agreement %.3f, expected acceptance %.3f (prompts nothing was tuned on)",
                 after["test"]["agreement"], after["test"]["expected_acceptance"])
    finish_run()


def held_out_metrics(cfg: DictConfig, target: LoadedModel, draft: LoadedModel) -> dict:
    """`distil`'s validation and test metrics for a saved draft, without its training data: for drafts
    distilled before the test split existed, or made elsewhere. scripts/draft_metrics.py prints it."""
    module = DistillModule(draft.model, target.model, loss=instantiate(cfg.distill.loss), optimizer=None,
                           temperature=cfg.distill.temperature)
    trainer = measuring_trainer(cfg)
    return {"draft": draft.name, "target": target.name, "cost": draft.cost,
            **_held_out(trainer, module, _datamodule(cfg, target, draft, _prompt_groups(cfg, target, train=False)))}


def measuring_trainer(cfg: DictConfig) -> L.Trainer:
    """The experiment's Trainer (accelerator, precision, ...) on one device of one node, writing nothing: a saved
    draft's metrics need no data parallelism."""
    return instantiate(cfg.trainer, devices=1, num_nodes=1, strategy="auto", logger=False, callbacks=[],
                       enable_checkpointing=False, enable_model_summary=False, inference_mode=False)


def _held_out(trainer: L.Trainer, module: DistillModule, datamodule: DistillDataModule) -> dict:
    """Validation metrics, with the test set's under "test" when there is one: settings are chosen on the
    validation prompts, so only the test prompts measure a draft on prompts nothing was tuned on."""
    found = run_trainer(trainer, "validate", module, datamodule=datamodule, verbose=False)[0]
    metrics = {k.removeprefix("val/"): float(v) for k, v in found.items()}
    if TEST in datamodule.held_out:
        found = run_trainer(trainer, "test", module, datamodule=datamodule, verbose=False)[0]
        metrics["test"] = {k.removeprefix("test/"): float(v) for k, v in found.items()}
    return metrics


def check_fits(d: DictConfig, target: LoadedModel) -> None:
    """The data settings bounded by the target, checked once it loads and before any response is generated (a
    top_k past the vocabulary failed in torch's topk after all of them were)."""
    vocab = target.model.config.vocab_size
    if d.target_probs == "cached" and d.data.top_k > vocab:
        raise SpecPolicyError(f"distill.data.top_k={d.data.top_k} is more than the target's {vocab} tokens; set "
                              f"distill.data.top_k={min(64, vocab)}")
    if d.data.max_new_tokens >= target.context_length - 1:  # was "every prompt is longer than -2953 tokens"
        raise SpecPolicyError(f"distill.data.max_new_tokens={d.data.max_new_tokens} leaves no room for a prompt in "
                              f"the target's context of {target.context_length}; lower it")


def _narrow_head(d: DictConfig, target: LoadedModel, draft: LoadedModel, datamodule: DistillDataModule
                 ) -> torch.Tensor | None:
    """The tokens the draft's head scores while it trains (FR-Spec), or None for all: a saved draft's own subset
    (applied when it loaded, so a draft that writes its training responses writes them as it will draft), or with
    `distill.draft_vocab` set, that many tokens the target writes most often on the training rows
    (`train_responses`)."""
    vocab, size = subset_of(draft.model), d.get("draft_vocab")
    if vocab is not None or size is None:
        return vocab
    vocab_size = min(target.model.config.vocab_size, draft.model.config.vocab_size)  # ids the draft can score
    if not 0 < size <= vocab_size:
        raise SpecPolicyError(f"distill.draft_vocab={size} must be between 1 and the vocabulary size {vocab_size}, "
                              f"or null to keep the draft's full LM head")
    always = [i for i in target.tokenizer.all_special_ids if i < vocab_size]  # EOS and chat-template tokens
    vocab = frequent_tokens(datamodule.train_responses(), size, vocab_size, always)
    use_subset_head(draft, vocab)
    draft.cost = describe_cost(target, draft)
    return vocab


def _trainable(model: PreTrainedModel, d: DictConfig) -> torch.nn.Module:
    """The draft with what trains switched on: everything, everything but the embedding/head, or LoRA adapters."""
    model = model.train().requires_grad_(True)
    if d.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
        model.get_output_embeddings().requires_grad_(False)
    if d.get("lora"):
        from peft import get_peft_model

        if fuses_features(model):
            raise SpecPolicyError("LoRA would leave a feature-fusing draft's fusion layer untrained; "
                                  "unset distill.lora")

        if not d.freeze_embeddings:  # peft freezes the base model: the embedding and head would not train
            raise SpecPolicyError("LoRA trains adapters only, so the draft's embedding and head stay frozen; set "
                                  "distill.freeze_embeddings=true, or unset distill.lora to train them")
        config = instantiate(d.lora)
        head = model.get_output_embeddings()
        if isinstance(head, SubsetHead):  # peft's all-linear spares the head, not the Linear inside a subset head,
            # whose adapter would be merged into a copy the saved folder drops (`restore_full_head`)
            name = next(n for n, m in model.named_modules() if m is head.subset)
            excluded = config.exclude_modules
            config.exclude_modules = (f"(?:{excluded})|{re.escape(name)}" if isinstance(excluded, str)
                                      else [*(excluded or []), name])
        try:
            model = get_peft_model(model, config)
        except (ValueError, TypeError) as err:  # r=0, a target module the draft lacks, lora_alpha=abc, ...
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise SpecPolicyError(f"distill.lora: {' '.join(str(err).split())[:300]}; fix its settings (the "
                                  f"draft's linear layers: {linear})") from err
    return model


def _prompt_groups(cfg: DictConfig, target: LoadedModel, train: bool = True) -> dict[str, list[Conversation]]:
    """The conversations distillation reads, by group: "validation", "test" (unless distill.data.test_prompts=0),
    and with `train` the train split's prompts and each synthetic set, none of them a held-out prompt; those too
    long for distill.max_length are left out (with a warning)."""
    d = cfg.distill
    data = instantiate(d.data)
    groups = {split: instantiate(cfg.data, split=split, limit=limit).load()
              for split, limit in (("train", data.train_prompts), ("validation", data.val_prompts))
              if train or split != "train"}
    if data.test_prompts != 0:
        try:
            source = instantiate(cfg.data, split="test", limit=None)
            test = source.load()
        except SpecPolicyError as err:
            raise SpecPolicyError(f"{err}; or set distill.data.test_prompts=0 to report no test metrics") from None
        if source.serves_every_split:  # a file without splits: its first rows were the validation prompts too
            test = without(test, groups["validation"], "distil", None)
        if test:
            groups["test"] = test[: data.test_prompts]
        else:
            log.warning("distil: %s has no prompts past the validation ones to test on; no test metrics", source.name)
    held_out = [c for split in HELD_OUT for c in groups.get(split, ())]
    if train:  # before its first words open synthetic prompts
        _keep_apart(groups, "train", held_out)
    for name, synthesis in (d.get("synthetic") or {}).items() if train else ():  # written by the target
        if name in groups:
            raise SpecPolicyError(f"distill.synthetic.{name} clashes with the {name!r} prompts; rename the entry")
        synthesis = instantiate(synthesis)
        groups[name] = synthesis.conversations(target.model, target.tokenizer, cfg.paths.cache_dir, groups["train"])
        _keep_apart(groups, name, held_out)
    if train and not groups["train"]:
        raise SpecPolicyError("every train prompt is also a validation or test prompt (a prompts file without a "
                              "`split` column serves every split); give its rows a `split`: train, validation or test")
    room = target.context_length - data.max_new_tokens
    limit = (f"distill.max_length={d.max_length}" if d.max_length <= room else
             f"the target's context of {target.context_length} less distill.data.max_new_tokens")
    # at least one response token after the prompt
    return {name: fitting(target.tokenizer, conversations, min(d.max_length, room) - 1, f"distil ({name})", limit)
            for name, conversations in groups.items()}


def _datamodule(cfg: DictConfig, target: LoadedModel, draft: LoadedModel,
                groups: dict[str, list[Conversation]]) -> DistillDataModule:
    """The distillation data of `_prompt_groups`; without training groups only the held-out sets."""
    d = cfg.distill
    data = instantiate(d.data)
    tokenizer = target.tokenizer
    prompts = {name: encode_prompts(tokenizer, conversations, target.context_length)  # each fits (`_prompt_groups`)
               for name, conversations in groups.items()}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    val, test = prompts.pop("validation"), prompts.pop("test", [])
    return DistillDataModule(data, target.model, draft.model, prompts, val,
                             cfg.paths.cache_dir, d.batch_size, d.max_length, pad_id,
                             cached_targets=d.target_probs == "cached", seed=cfg.seed, test_prompts=test)


def _keep_apart(groups: dict[str, list], name: str, held_out: list) -> None:
    """Held out stays held out: group `name` without the validation and test prompts."""
    groups[name] = without(groups[name], held_out, "distil",
                           f"{name} prompts are also validation or test prompts; not trained on")


def _trainer(cfg: DictConfig, *extra: L.Callback) -> L.Trainer:
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c] + list(extra)
    logger = experiment_logger(cfg, "distil", checkpoints_of(cfg.get("callbacks")), cfg.distill.ckpt_path) or False
    if logger is False:  # LearningRateMonitor refuses to run without a logger
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.LearningRateMonitor)]
    # the sampler's one epoch is the whole run (`StepBatchSampler`): unset, max_epochs became -1 and the progress
    # bar read "Epoch 0/-2"
    epochs = {} if cfg.trainer.get("max_epochs") is not None else {"max_epochs": 1}
    return instantiate(cfg.trainer, callbacks=callbacks, logger=logger, **epochs)
