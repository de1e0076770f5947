"""trainkit.sample_generator in a dataset knows the epoch under self.progress() in train_epoch(): with step
checkpoints on or off, with or without workers (persistent ones too), the same per-sample draws; elsewhere it
refuses, saying what to do."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.slow import SLOW
from tests.helpers.trainers import TinyTrainer


class Augmented(Dataset):
    """Each sample with a per-sample noise drawn from trainkit.sample_generator, returned beside its index."""

    def __init__(self, x: torch.Tensor, seed: int) -> None:
        self.x, self.seed = x, seed

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        noise = torch.randn(2, generator=trainkit.sample_generator(self.seed, index))
        return self.x[index], int(index), noise


class AugmentTrainer(TinyTrainer):
    """Records every sample's noise per (epoch, index); validation reads the loader outside progress()."""

    workers = 0
    persistent = False

    def setup(self, ckpt):
        super().setup(ckpt)
        x, _ = self.train_set.tensors
        options = {"num_workers": self.workers, "persistent_workers": self.persistent}
        self.loader = DataLoader(Augmented(x, self.cfg.seed), batch_size=self.cfg.batch_size, shuffle=True, **options)
        self.drawn: dict[tuple[int, int], list[float]] = {}
        self.outside: list[str] = []

    def train_epoch(self):
        for _, indices, noise in self.progress(self.loader):
            for index, row in zip(indices.tolist(), noise.tolist(), strict=True):
                self.drawn[(self.epoch, index)] = row
            self.optimizer.step()  # a step per batch: the counted loop has step boundaries

    def val_epoch(self):
        try:  # the same loader outside progress(): its batches carry no epoch, even from a persistent worker
            next(iter(self.loader))
        except ValueError as error:
            self.outside.append(str(error))
        return None


def draws(tmp_path, name, *, every_n_steps=None, workers=0, persistent=False):
    trainer = type(name, (AugmentTrainer,), {"workers": workers, "persistent": persistent})(
        make_cfg(tmp_path / name, epochs=2, n_samples=160, ckpt={"every_n_steps": every_n_steps})
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.timeout(180)
def test_the_draws_are_the_same_with_step_checkpoints_on_or_off_with_or_without_workers(tmp_path):
    """Every sample of every epoch gets the noise sample_generator(seed, index, epoch=epoch) gives, whether the
    loop is counted (ckpt.every_n_steps) or not, with 0 or 2 workers, persistent or not: each setting by default,
    every pairing under TRAINKIT_SLOW=1."""
    settings = [(2, 0, False), (None, 2, False), (2, 2, True)]
    if SLOW:
        settings = [(every, *loader) for every in (None, 2) for loader in ((0, False), (2, False), (2, True))]
    runs = {
        (every, workers, persistent): draws(
            tmp_path, f"r{every}{workers}{persistent}", every_n_steps=every, workers=workers, persistent=persistent
        )
        for every, workers, persistent in settings
    }
    reference = runs[(2, 0, False)].drawn
    assert len(reference) == 2 * 96  # two epochs of the 96 training samples
    for key, trainer in runs.items():
        assert trainer.drawn == reference, key
    expected = {
        (epoch, index): torch.randn(2, generator=trainkit.sample_generator(0, index, epoch=epoch)).tolist()
        for epoch, index in reference
    }
    assert reference == expected
    assert reference[(0, 5)] != reference[(1, 5)]  # the epoch is part of the seed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, persistent", [(0, False), (2, True)])
def test_outside_progress_the_index_carries_no_epoch_and_the_error_says_what_to_do(tmp_path, workers, persistent):
    """A loader iterated outside progress() after a tagged epoch (in its process, or by its persistent workers)
    does not inherit that epoch: sample_generator refuses, naming progress() and epoch=."""
    trainer = draws(tmp_path, "outside", workers=workers, persistent=persistent)
    assert len(trainer.outside) == 2
    assert all("self.progress()" in message and "pass epoch=" in message for message in trainer.outside)
    with pytest.raises(ValueError, match="carries no epoch"):
        trainkit.sample_generator(0, 3)
