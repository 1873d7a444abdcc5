"""Lightning wrappers: the draft learns the frozen target's next-token distributions.

`DistillModule` trains the draft; its validation measures what speculative decoding pays for:
greedy top-1 agreement with the target and the expected acceptance of one draft token, 1 − TVD(p, q).
`DistillDataModule` generates and caches the data (rank 0, `prepare_data`) and feeds it through a
sampler whose batch at step s depends only on (seed, s), so a run resumed from `last.ckpt` sees
exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import datasets
import torch
import torch.nn.functional as F
from lightning import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, Sampler
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from specpolicy.distill.data import (DistillData, collate_rows, featurize, hidden_states, masked_logits,
                                     unrolled_hidden_states)
from specpolicy.distill.losses import dense_from_topk, log_probs, tvd
from specpolicy.errors import SpecPolicyError
from specpolicy.models.fusion import fuses_features
from specpolicy.models.vocab import draft_ids

VAL, TEST = "validation", "test"  # held-out sets: settings are chosen on VAL; TEST is only reported
METRICS = ("loss", "agreement", "expected_acceptance")
Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p_logp [N, V], q_logp [N, V]) -> [N]


class DistillModule(LightningModule):
    """Trains `draft` (full or LoRA) to match the frozen `target`; only the draft is saved in checkpoints."""

    def __init__(self, draft: PreTrainedModel, target: PreTrainedModel, loss: Divergence,
                 optimizer: Callable, scheduler: Callable | None = None, temperature: float = 1.0,
                 feature_loss: float = 0.0, unroll: int = 0):
        """`feature_loss`: weight of a fusing draft's hidden-state regression onto the target's (EAGLE's
        main loss), added to the divergence; its own next features are what the draft reads while drafting.
        `unroll`: a fusing draft also trains at draft positions 2..1+unroll, reading its own states
        (`unrolled_hidden_states`), each position's divergence added to the loss."""
        super().__init__()
        self.draft = draft
        # Not a submodule: the frozen target stays out of every checkpoint, the optimizer and DDP's sync.
        object.__setattr__(self, "target", target.eval().requires_grad_(False))
        self.loss_fn, self.temperature, self.feature_loss, self.unroll = loss, temperature, feature_loss, unroll
        self.make_optimizer, self.make_scheduler = optimizer, scheduler
        self.eval_metrics = torch.nn.ModuleDict({stage: torch.nn.ModuleDict({k: MeanMetric() for k in METRICS})
                                                 for stage in ("val", "test")})

    def _place_target(self) -> None:
        """The target is no submodule, so Lightning does not move it: it follows the draft to its device."""
        self.target.to(self.device)

    on_fit_start = on_validation_start = on_test_start = _place_target

    def _distributions(self, batch: dict[str, torch.Tensor], passes: int = 1) -> tuple:
        """At the response positions: draft logits and target log-probs (temperature 1) over the tokens the
        draft scores, [N, V] or [N, n] with a subset head (the target's restricted, not renormalised), the
        target's top-1 token [N], for a fusing draft the smooth-L1 distance of its final hidden states from
        the target's (else None), and its logits at draft positions 2..`passes` ([N, V] each, same rows).
        A fusing draft reads the target's features: cached with the training data, else (held-out sets,
        `target_probs=online`) from the same target pass as the target's logits."""
        target_hidden = None
        fuses = fuses_features(self.draft)
        if fuses and "features" not in batch:
            with torch.no_grad():
                target_hidden = hidden_states(self.target, batch)
            batch = {**batch, "features": target_hidden}
        if passes > 1:
            hiddens = unrolled_hidden_states(self.draft, batch, passes)
        else:
            hiddens = [hidden_states(self.draft, batch)]
        hidden = hiddens[0]
        p_logits = masked_logits(self.draft, batch, hidden)
        later = [masked_logits(self.draft, batch, h) for h in hiddens[1:]]
        mask = batch["loss_mask"]
        regression = F.smooth_l1_loss(hidden[mask], batch["features"][mask].to(hidden.dtype)) if fuses else None
        vocab = draft_ids(self.draft, self.target.config.vocab_size)
        if "topk_ids" in batch:  # cached when the data was generated; top-k sorted, so column 0 is the argmax
            q_logp = dense_from_topk(batch["topk_ids"], batch["topk_logp"], self.target.config.vocab_size, vocab)
            return p_logits, q_logp, batch["topk_ids"][:, 0].long(), regression, later
        with torch.no_grad():  # on the fly
            full = log_probs(masked_logits(self.target, batch, target_hidden))
        return p_logits, full if vocab is None else full[:, vocab], full.argmax(-1), regression, later

    def _loss(self, p_logits: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
        """Mean divergence over response tokens; the target renormalised over the draft's tokens at temperature
        T (exact on the cached top-k, tail approximated)."""
        T = self.temperature
        return self.loss_fn(log_probs(p_logits, T), log_probs(q_logp, T)).mean()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        p_logits, q_logp, _, regression, later = self._distributions(batch, 1 + self.unroll)
        loss = self._loss(p_logits, q_logp)
        self.log("train/loss", loss, prog_bar=True)
        position = torch.arange(batch["input_ids"].shape[1], device=q_logp.device).expand_as(batch["loss_mask"])
        position = position[batch["loss_mask"]]  # [N]: pass m is defined from position m - 1 on
        for m, logits in enumerate(later, start=2):
            valid = position >= m - 1
            if not valid.any():  # only positions too early for this depth: nothing to train
                continue
            term = self._loss(logits[valid], q_logp[valid])
            self.log(f"train/loss_position{m}", term)
            loss = loss + term
        if regression is not None and self.feature_loss:
            self.log("train/feature_loss", regression)
            loss = loss + self.feature_loss * regression
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        p_logits, q_logp, q_top1, _, _ = self._distributions(batch)
        vocab = draft_ids(self.draft, self.target.config.vocab_size)
        p_top1 = p_logits.argmax(-1)
        n = p_logits.shape[0]
        values = {
            "loss": self._loss(p_logits, q_logp),
            "agreement": ((p_top1 if vocab is None else vocab[p_top1]) == q_top1).float().mean(),
            # sampling at T = 1; p is 0 outside the draft's tokens, so the restricted q is the whole overlap
            "expected_acceptance": (1.0 - tvd(log_probs(p_logits), q_logp)).mean(),
        }
        for name, value in values.items():  # token-weighted over the whole set, summed across ranks
            metric = self.eval_metrics[stage][name]
            metric.update(value, n)
            self.log(f"{stage}/{name}", metric, prog_bar=name == "agreement")

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        optimizer = self.make_optimizer([p for p in self.draft.parameters() if p.requires_grad])
        if self.make_scheduler is None:
            return optimizer
        scheduler = self.make_scheduler(optimizer, num_training_steps=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepBatchSampler(Sampler[list[int]]):
    """Batches [start, steps): batch s takes slice s of a permutation seeded by (seed, epoch of s).

    `len` is the whole run (`steps` batches: optimizer steps times `accumulate_grad_batches`), so Lightning's
    progress counters, restored from a checkpoint, line up with the batches this sampler still has to yield.
    Under DDP each rank takes every world-th row of the global batch.
    """

    def __init__(self, n: int, batch_size: int, steps: int, seed: int, start: int = 0, rank: int = 0, world: int = 1):
        self.global_batch = batch_size * world
        if n < self.global_batch:
            raise SpecPolicyError(f"{n} training sequences cannot fill a batch of {batch_size} x {world} ranks; "
                                  f"raise distill.data.train_prompts or lower distill.batch_size")
        self.n, self.steps, self.seed, self.start, self.rank, self.world = n, steps, seed, start, rank, world
        self.per_epoch = n // self.global_batch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.steps):
            epoch, i = divmod(step, self.per_epoch)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            yield perm[i * self.global_batch:(i + 1) * self.global_batch][self.rank::self.world].tolist()


CACHED_NEEDS_TOP_K = ("distill.target_probs=cached needs distill.data.top_k > 0 (the target's log-probs it keeps "
                      "per position); set distill.data.top_k=64, or distill.target_probs=online to compute them on "
                      "the fly")


class DistillDataModule(LightningDataModule):
    """Train rows from `data.source`; validation and test rows from the target's greedy responses to
    held-out prompts (`test_prompts` may be empty: then there is no test set).

    `train_prompts` are named groups (the prompt set's train split, synthetic prompts), each generated
    and cached on its own, so adding or resizing one group does not regenerate the others. A draft that
    fuses the target's features gets them cached beside each group's cached targets (`featurize`).
    """

    def __init__(self, data: DistillData, target: PreTrainedModel, draft: PreTrainedModel,
                 train_prompts: dict[str, list[list[int]]], val_prompts: list[list[int]], cache_dir: str | Path,
                 batch_size: int, max_length: int, pad_id: int, cached_targets: bool, seed: int = 0,
                 test_prompts: list[list[int]] = ()):
        super().__init__()
        self.data, self.target, self.draft = data, target, draft
        self.prompts = {name: p for name, p in train_prompts.items() if p}
        self.held_out = {VAL: val_prompts, **({TEST: list(test_prompts)} if test_prompts else {})}
        self.cache_dir, self.batch_size, self.seed = cache_dir, batch_size, seed
        self.top_k = data.top_k if cached_targets else 0
        if cached_targets and not data.top_k:  # also checked by check_distil, before the target loads
            raise SpecPolicyError(CACHED_NEEDS_TOP_K)
        self.features = fuses_features(draft) and cached_targets
        if fuses_features(draft) and data.source == "draft":
            raise SpecPolicyError("a draft that fuses the target's features cannot write responses on its own; "
                                  "set distill.data.source=target")
        self.collate = partial(collate_rows, pad_id=pad_id, max_length=max_length)
        self._paths: dict[str, Path] = {}
        self.sets: dict[str, datasets.Dataset] = {}

    def _build(self) -> dict[str, Path]:
        """Paths of every group's dataset, generated if missing; fixed at first call (later the draft has trained)."""
        if not self._paths:
            generator = self.target if self.data.source == "target" else self.draft
            held_out = replace(self.data, source="target", temperature=0.0, samples_per_prompt=1, prompt_loss=False)
            self._paths = {name: self.data.build(self.target, generator, prompts, self.top_k, self.cache_dir, name)
                           for name, prompts in self.prompts.items()}
            if self.features:
                self._paths |= {f"{name}-features": featurize(self.target, self._paths[name], self.data.batch_size,
                                                              f"target features of {name}") for name in self.prompts}
            for name, prompts in self.held_out.items():
                self._paths[name] = held_out.build(self.target, self.target, prompts, 0, self.cache_dir, name)
        return self._paths

    def _load(self) -> dict[str, datasets.Dataset]:
        """{"train": every training group's rows, concatenated; "validation" and "test": the held-out rows}."""
        paths = self._build()
        train = [datasets.load_from_disk(str(paths[name])) for name in self.prompts]
        if self.features:  # one more column, row for row
            train = [datasets.concatenate_datasets([rows, datasets.load_from_disk(str(paths[f"{name}-features"]))],
                                                   axis=1) for rows, name in zip(train, self.prompts)]
        return {**({"train": datasets.concatenate_datasets(train)} if train else {}),
                **{name: datasets.load_from_disk(str(paths[name])) for name in self.held_out}}

    def prepare_data(self) -> None:
        self._build()

    def train_responses(self) -> list[list[int]]:
        """What the target writes on the training rows (generated if missing), which a draft vocabulary is ranked
        by: its own responses, or, where the draft wrote them (`source=draft`), its cached top-1 at each position."""
        rows = self._load()["train"]
        if self.data.source == "target":
            return [ids[n:] for ids, n in zip(rows["input_ids"], rows["prompt_len"])]
        # `check_distil` asks for cached targets; with `prompt_loss` they start in the prompt: its response's are last
        return [[top[0] for top in topk[len(topk) - (len(ids) - n):]]
                for ids, n, topk in zip(rows["input_ids"], rows["prompt_len"], rows["topk_ids"])]

    def setup(self, stage: str) -> None:
        self.sets = self._load()

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        per_step = t.accumulate_grad_batches  # checkpoints fall on optimizer steps: whole accumulations
        sampler = StepBatchSampler(len(self.sets["train"]), self.batch_size, t.max_steps * per_step, self.seed,
                                   start=t.global_step * per_step, rank=t.global_rank, world=t.world_size)
        return DataLoader(self.sets["train"], batch_sampler=sampler, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets[VAL], batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.sets[TEST], batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)
