"""Small trainers for ``trainkit certify``: one whose resume is exact, and one per planted defect.

certify imports them by ``MODULE:Class`` in its child processes, so they live in an importable module. Each
defect is the smallest change to :class:`CleanTrainer` that breaks an exact resume in one of the ways certify's
causes list.
"""

from __future__ import annotations

import os
import random

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainkit


def _data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator))


class CleanTrainer(trainkit.BaseTrainer):
    """An MLP with dropout on a shuffled loader, everything registered: resumes exactly (12 batches an epoch)."""

    def setup(self, ckpt):
        self.model = self.make_ddp(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.7)
        self.data = _data()
        self.sampler = DistributedSampler(self.data, num_replicas=self.world_size, rank=self.rank, seed=self.cfg.seed)
        self.add_samplers(self.sampler)
        self.loader = DataLoader(self.data, batch_size=8 // self.world_size, sampler=self.sampler)
        self.val_loader = DataLoader(self.data, batch_size=32)
        self.epoch_loss = trainkit.RunningMean()
        self.register()

    def register(self):
        self.add_checkpoint_items(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, epoch_loss=self.epoch_loss
        )

    def loss(self, x, y, index):
        return nn.functional.mse_loss(self.model(x), y)

    def batches(self):
        return enumerate(self.progress(self.loader), start=self.first_batch)

    def train_epoch(self):
        self.model.train()
        for index, (x, y) in self.batches():
            loss = self.loss(x, y, index)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.epoch_loss.add(loss.detach())
        self.log({"train/loss": self.epoch_loss.take()})

    def val_epoch(self):
        self.model.eval()
        total, count = torch.zeros(()), 0
        with torch.no_grad():
            for x, y in self.val_loader:  # a loader iterated directly: validation is not training
                total += nn.functional.mse_loss(self.model(x), y, reduction="sum")
                count += len(y)
        loss = self.reduce_mean(total, count)
        self.log({"val/loss": loss})
        return self.step_patience(self.save_if_best(loss, {"val/loss": loss}))


class UnregisteredScheduler(CleanTrainer):
    """Planted: the LR scheduler is never registered, so a resume restarts its schedule."""

    def register(self):
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer, epoch_loss=self.epoch_loss)


class OwnRandom(CleanTrainer):
    """Planted: input noise drawn from a ``random.Random`` of the trainer's own, which no checkpoint holds."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.noise = random.Random(0)

    def loss(self, x, y, index):
        return super().loss(x + self.noise.gauss(0.0, 0.1), y, index)


_AUGMENT = random.Random(0)
"""A module-level generator: no scan of the trainer's attributes reaches it, nor does any checkpoint."""


class NoisyData(TensorDataset):
    """A dataset that adds noise from :data:`_AUGMENT` to each sample it hands out."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x + _AUGMENT.gauss(0.0, 0.1), y


class HiddenRandom(CleanTrainer):
    """Planted: augmentation drawn from a module-level ``random.Random`` in the dataset's ``__getitem__``."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.loader = DataLoader(NoisyData(*self.data.tensors), batch_size=8, sampler=self.sampler)


class LoaderOutsideProgress(CleanTrainer):
    """Planted: a second shuffled loader zipped with the epoch's, iterated without ``progress()``."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.extra_loader = DataLoader(self.data, batch_size=8 // self.world_size, shuffle=True)

    def batches(self):
        extra = iter(self.extra_loader)
        for index, (x, y) in super().batches():
            extra_x, extra_y = next(extra)
            yield index, (torch.cat([x, extra_x]), torch.cat([y, extra_y]))


class Nondeterministic(CleanTrainer):
    """Planted: a loss term scaled by bits from ``os.urandom``, as a non-deterministic kernel would differ."""

    def loss(self, x, y, index):
        jitter = 1.0 + int.from_bytes(os.urandom(2), "little") / 2**20
        return super().loss(x, y, index) * jitter


class LocalState(CleanTrainer):
    """Planted: a loss scale decayed batch by batch in a local variable of ``train_epoch()``."""

    def train_epoch(self):
        self.model.train()
        scale = 1.0
        for index, (x, y) in self.batches():
            loss = self.loss(x, y, index) * scale
            scale *= 0.8
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.epoch_loss.add(loss.detach())
        self.log({"train/loss": self.epoch_loss.take()})
