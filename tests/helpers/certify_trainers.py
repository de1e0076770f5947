"""Small trainers for ``trainkit certify``: one whose resume is exact, and one per planted defect.

certify imports them by ``MODULE:Class`` in its child processes, so they live in an importable module. Each
defect is the smallest change to :class:`CleanTrainer` that breaks an exact resume in one of the ways certify's
causes list.
"""

from __future__ import annotations

import os
import random
import time

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


class SlowTrainer(CleanTrainer):
    """The clean trainer at 0.2 s a batch: no run of it ends within a fraction of a second, however warm the host."""

    def loss(self, x, y, index):
        time.sleep(0.2)
        return super().loss(x, y, index)


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


class NoisyStream(torch.utils.data.IterableDataset):
    """A stream of ``length`` samples a pass, each with noise from the dataset's own ``torch.Generator`` (made once:
    each pass draws new noise). Its ``state_dict()`` holds the generator's state and its pass's the position: a
    ``StatefulDataLoader`` saves and loads both with its own."""

    def __init__(self, length: int = 32, seed: int = 5) -> None:
        self.x, self.y = _data(length).tensors
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return _StreamPass(self)

    def draw(self, index: int):
        return self.x[index] + 0.1 * torch.randn(self.x.shape[1], generator=self.gen), self.y[index]

    def state_dict(self):
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])


class _StreamPass:
    """One pass over a :class:`NoisyStream`, with its position as its state."""

    def __init__(self, data: NoisyStream) -> None:
        self.data, self.position = data, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= len(self.data.x):
            raise StopIteration
        self.position += 1
        return self.data.draw(self.position - 1)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class CountingStream(NoisyStream):
    """Planted: a counter of the samples served, kept on the dataset and left out of its ``state_dict()``, that
    shifts each sample: a resume counts from 0 again."""

    def __init__(self, length: int = 32, seed: int = 5) -> None:
        super().__init__(length, seed)
        self.served = 0

    def draw(self, index: int):
        self.served += 1
        x, y = super().draw(index)
        return x + 0.01 * self.served, y


class ReplayedStream(NoisyStream):
    """Planted: no state of its own, so a ``StatefulDataLoader`` resumes it by replaying the pass from a dataset the
    resumed process made afresh: its generator starts from its seed again. Exact inside the first pass (the replay
    draws what the first pass drew); from the second pass on, it draws the first pass's noise again."""

    def __iter__(self):
        for index in range(len(self.x)):
            yield self.draw(index)

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


class StreamTrainer(CleanTrainer):
    """A stream trainer: torchdata's ``StatefulDataLoader`` over a :class:`NoisyStream` (16 steps a pass, no length),
    everything else registered; the dataset's generator is covered by the loader's state."""

    stream_class: type = NoisyStream

    def setup(self, ckpt):
        from torchdata.stateful_dataloader import StatefulDataLoader

        super().setup(ckpt)
        self.data = self.stream_class()
        self.loader = StatefulDataLoader(self.data, batch_size=2)
        del self.sampler  # no sampler: the stream's own order


class CountingStreamTrainer(StreamTrainer):
    """Planted: :class:`CountingStream`'s counter."""

    stream_class = CountingStream


class ReplayedStreamTrainer(StreamTrainer):
    """Planted: :class:`ReplayedStream`, whose generator a resume makes afresh."""

    stream_class = ReplayedStream
