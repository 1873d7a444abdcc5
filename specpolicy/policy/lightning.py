"""Training the depth head with Lightning: rollouts in, a calibrated acceptance estimator out."""

from __future__ import annotations

from dataclasses import asdict

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from specpolicy.policy.head import DepthHead, HeadConfig


class HeadModule(L.LightningModule):
    """Binary cross-entropy on P(accept position i | accepted 1..i-1); one step function for train/val."""

    def __init__(self, config: HeadConfig | dict, lr: float = 3e-3):
        """`config` as a dict: what `load_from_checkpoint` passes back from the saved hyperparameters."""
        super().__init__()
        if isinstance(config, dict):
            config = HeadConfig.from_dict(config)
        self.save_hyperparameters({"config": asdict(config), "lr": lr})
        self.head = DepthHead(config)
        self.lr = lr

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        features, label = batch
        logits = self.head(features)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
        p = torch.sigmoid(logits)
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/brier", ((p - label) ** 2).mean())
        self.log(f"{stage}/accuracy", ((p > 0.5).float() == label).float().mean())
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)  # a few hundred weights: no decay


class RolloutDataModule(L.LightningDataModule):
    """Rollout rows split by prompt (`group`), so validation never sees a sequence the head trained on, at any
    batch size."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, batch_size: int = 1024,
                 val_fraction: float = 0.2, seed: int = 0):
        super().__init__()
        unique = groups.unique()
        order = unique[torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))]
        val_groups = order[: max(1, int(len(order) * val_fraction))]
        is_val = torch.isin(groups, val_groups)
        self.train_set = TensorDataset(features[~is_val], labels[~is_val])
        self.val_set = TensorDataset(features[is_val], labels[is_val])
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size)
