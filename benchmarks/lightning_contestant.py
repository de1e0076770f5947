"""``overhead.py``'s Lightning contestant: the same workload through ``lightning.pytorch`` (when installed).

Lightning runs with everything the feature does not need turned off; the null workload (no backward) goes
through manual optimization, since Lightning's automatic path calls backward itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import lightning_missing
from benchmarks.workloads import Workload

TORCH_VERSION_AT_START = torch.__version__
"""torch's version when the benchmark started: a Lightning whose import replaced torch is not compared."""

_LIGHTNING: dict[str, Any] = {}
LIGHTNING_NOTES = {
    "off": "enable_progress_bar/logger/enable_checkpointing/enable_model_summary off, num_sanity_val_steps=0",
    "tqdm": "enable_progress_bar=True with Lightning's default TQDMProgressBar(refresh_rate=1): redraws every step",
    "wandb": "WandbLogger(offline=True), self.log('train/loss') every step (log_every_n_steps=1), wandb.finish()",
    "ckpt": "ModelCheckpoint(monitor='val/loss', save_top_k=1, save_last=True): best file + last file per epoch; "
    "Lightning writes without fsync and keeps no in-memory best snapshot",
}


def lightning_available() -> str | None:
    """Import Lightning; returns None when usable, else the reason it is skipped."""
    if _LIGHTNING:
        return None
    why = lightning_missing()
    if why is not None:
        return why
    import lightning.pytorch as pl

    if torch.__version__ != TORCH_VERSION_AT_START:
        return f"lightning changed torch ({TORCH_VERSION_AT_START} -> {torch.__version__})"
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class LitModule(pl.LightningModule):
        def __init__(self, wl: Workload, feature: str) -> None:
            super().__init__()
            self.wl = wl
            self.feature = feature
            self.net = wl.build_model()
            self.last_loss = torch.zeros(())
            self.last_val = float("nan")
            # a loss without backward (the null workload) cannot go through Lightning's automatic optimization,
            # which calls backward itself: the step goes through Lightning's optimizer wrapper by hand instead
            self.automatic_optimization = wl.backward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.wl.loss_fn(self.net(x), y)
            if not self.automatic_optimization:
                optimizer = self.optimizers()
                optimizer.zero_grad(set_to_none=True)
                optimizer.step()
            if self.feature == "wandb":
                self.log("train/loss", loss, on_step=True, on_epoch=False)
            self.last_loss = loss
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = self.wl.loss_fn(self.net(x), y)
            self.last_val = loss.item()
            if self.feature == "ckpt":
                self.log("val/loss", loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.wl.make_optimizer(self.net)

    _LIGHTNING.update(pl=pl, LitModule=LitModule)
    return None


class _OneBatch:
    """The whole validation set as one batch (a list would be read as several dataloaders)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch = (x, y)

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([self.batch])


def lightning_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    pl = _LIGHTNING["pl"]
    module = _LIGHTNING["LitModule"](wl, feature)
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=wl.epochs,
        default_root_dir=str(tmp),
        enable_progress_bar=feature == "tqdm",
        enable_model_summary=False,
        enable_checkpointing=feature == "ckpt",
        logger=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        check_val_every_n_epoch=1,
    )
    logger = None
    if feature == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # mode="offline" reaches wandb.init itself: Lightning's offline=True only sets WANDB_MODE, which W&B reads
        # once per process, so after another contestant's run W&B would start this one online (and ask to log in)
        logger = WandbLogger(offline=True, mode="offline", save_dir=str(tmp), project="trainkit-bench")
        kwargs.update(logger=logger, log_every_n_steps=1)
    if feature == "ckpt":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs["callbacks"] = [
            ModelCheckpoint(
                dirpath=str(tmp),
                filename="best",
                monitor="val/loss",
                mode="min",
                save_top_k=1,
                save_last=True,
                enable_version_counter=False,
            )
        ]
    trainer = pl.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=wl.train_loader(), val_dataloaders=_OneBatch(wl.x_val, wl.y_val))
    if logger is not None:
        logger.experiment.finish()
        os.environ.pop("WANDB_MODE", None)  # set by offline=True; the other contestants state their mode themselves
    return module.net, (module.last_loss, module.last_val, None)
