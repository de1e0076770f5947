"""``overhead.py``'s workloads: the data, initial weights and loop shape every contestant of a group shares.

``tiny`` (an MLP on scikit-learn's digits), ``medium`` (a compute-bound MLP on synthetic data) and the engine
section's null workload (a batch of one, no forward, no backward), and the :class:`Outcome` by which the
contestants prove they did the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from benchmarks.settings import LR, SEED, Settings


class _Batches(Dataset):
    """Indexed by a whole batch of indices at once (with ``batch_size=None``): one gather per batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


@dataclass
class Workload:
    """Data, initial weights and the loop's shape; identical for every contestant."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    batch_size: int
    epochs: int
    make_net: Callable[[], nn.Module]
    init_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # the loss of a batch from the model's output; every contestant's loop calls it (bound to a local first)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    make_dataset: Callable[[torch.Tensor, torch.Tensor], Dataset] = _Batches
    samples_per_epoch: int | None = None  # the sampler's num_samples; None: every training sample once
    backward: bool = True  # False: the loss needs no backward (the null workload), every loop skips it

    def __post_init__(self) -> None:
        torch.manual_seed(SEED)
        self.init_state = {k: v.clone() for k, v in self.make_net().state_dict().items()}

    def build_model(self) -> nn.Module:
        net = self.make_net()
        net.load_state_dict(self.init_state)
        return net

    @staticmethod
    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(module.parameters(), lr=LR)

    def train_loader(self) -> DataLoader:
        """A real DataLoader with its own seeded generator: the same batch order for every contestant."""
        generator = torch.Generator().manual_seed(SEED)
        indices = RandomSampler(range(len(self.x_train)), num_samples=self.samples_per_epoch, generator=generator)
        sampler = BatchSampler(indices, self.batch_size, False)
        return DataLoader(self.make_dataset(self.x_train, self.y_train), batch_size=None, sampler=sampler)

    def val_loss(self, model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            value = self.loss_fn(model(self.x_val), self.y_val).item()
        model.train()
        return value

    @property
    def steps(self) -> int:
        return self.epochs * -(-(self.samples_per_epoch or len(self.x_train)) // self.batch_size)


def tiny_workload(s: Settings) -> Workload:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    x, y = x[perm], y[perm]
    n_train = 1437
    return Workload(
        name="tiny",
        x_train=x[:n_train].contiguous(),
        y_train=y[:n_train].contiguous(),
        x_val=x[n_train:].contiguous(),
        y_val=y[n_train:].contiguous(),
        batch_size=64,
        epochs=s.tiny_epochs,
        make_net=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
    )


def medium_workload(s: Settings) -> Workload:
    gen = torch.Generator().manual_seed(SEED)
    n, n_val, d_in, width, classes = s.medium_samples, 512, 256, 1024, 10
    x = torch.randn(n + n_val, d_in, generator=gen)
    teacher = torch.randn(d_in, classes, generator=gen)
    y = (x @ teacher).argmax(dim=1)

    def make_net() -> nn.Module:
        layers: list[nn.Module] = []
        dim = d_in
        for _ in range(4):
            layers += [nn.Linear(dim, width), nn.ReLU()]
            dim = width
        layers.append(nn.Linear(width, classes))
        return nn.Sequential(*layers)

    return Workload(
        name="medium",
        x_train=x[:n].contiguous(),
        y_train=y[:n].contiguous(),
        x_val=x[n:].contiguous(),
        y_val=y[n:].contiguous(),
        batch_size=128,
        epochs=s.medium_epochs,
        make_net=make_net,
    )


class _NoWork(nn.Module):
    """The null workload's model: one parameter (for the optimizer to hold), and a forward that returns its input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _output_is_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The null workload's loss: the model's (0-dim) output itself, so no loss function runs."""
    return out


class _OneSample(Dataset):
    """Batches of one sample each, kept as 0-dim tensors in lists: a batch costs a list lookup, no gather."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = list(x.unbind()), list(y.unbind())

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        (i,) = index
        return self.x[i], self.y[i]


@dataclass
class NullWorkload(Workload):
    """The training loop with the model's work taken out: a batch of one, no forward, no backward.

    What is left per step is what every loop pays around the model: the ``DataLoader``'s next batch, the
    model's call (it returns its input, the "loss"), ``zero_grad`` and an ``optimizer.step()`` of SGD over one
    parameter without a gradient (the call, its hooks and trainkit's step counter, no arithmetic): about
    30 us on this 2-core host, a few tens of microseconds anywhere. This host's speed wanders by 10-20 % from
    one run to the next, so the noise on a per-step estimate is a share of the raw step's own cost: the
    smaller that cost, the finer the engine's cost can be resolved.
    """

    @staticmethod
    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=LR)


def null_workload(epochs: int, batches: int) -> NullWorkload:
    """The null workload at one run length.

    Each epoch draws ``batches`` of ``batches + 1`` training samples (``RandomSampler(num_samples=...)``): the
    sampler then draws its one permutation at the epoch's first batch and nothing after its last. With every
    sample once and batches of one, ``RandomSampler`` draws a second, unused permutation when it is asked for a
    batch past the last one, which a hand-written loop does and Lightning does only every other epoch: the
    batch orders would part ways from the second epoch on.

    :param epochs: Epochs per run.
    :param batches: Batches (optimizer steps) per epoch.
    :returns: The workload; its name carries the shape (the config caches are keyed by name).
    """
    gen = torch.Generator().manual_seed(SEED)
    x = torch.rand(batches + 2, generator=gen)
    y = torch.zeros(batches + 2, dtype=torch.int64)
    return NullWorkload(
        name=f"null-{epochs}x{batches}",
        x_train=x[: batches + 1].contiguous(),
        y_train=y[: batches + 1].contiguous(),
        x_val=x[batches + 1],
        y_val=y[batches + 1],
        batch_size=1,
        epochs=epochs,
        make_net=_NoWork,
        loss_fn=_output_is_loss,
        make_dataset=_OneSample,
        samples_per_epoch=batches,
        backward=False,
    )


@dataclass
class Outcome:
    """What a contestant computed: compared across contestants to prove they did the same work."""

    train_loss: float
    val_loss: float
    digest: str
    improvements: int | None = None
    files: tuple[str, ...] = ()

    def key(self) -> tuple[Any, ...]:
        return (self.train_loss, self.val_loss, self.digest)
