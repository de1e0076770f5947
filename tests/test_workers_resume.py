"""Exact resume with DataLoader workers: the sample order of every epoch after a resume is the uninterrupted run's.

A persistent-workers loader draws its workers' base seed from torch's global generator once, the first
time it is iterated; a resumed process iterates it for the first time at a later epoch, so without care
that draw shifts the generator and the resumed epochs shuffle differently.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, TinyTrainer, param_digest


class LoaderTrainer(TinyTrainer):
    """TinyTrainer whose shuffled loader (global-generator permutation) has workers; it records each epoch's order."""

    workers = 2
    persistent = True
    crash_at: int | None = None

    def setup(self, ckpt):
        super().setup(ckpt)
        ids = torch.arange(len(self.train_set)).float().unsqueeze(1)
        x, y = self.train_set.tensors
        self.loader = DataLoader(
            TensorDataset(x, y, ids),
            batch_size=self.cfg.batch_size,
            shuffle=True,
            num_workers=self.workers,
            persistent_workers=self.persistent,
        )

    def train_epoch(self):
        if self.epoch == self.crash_at:
            raise Crash
        self.model.train()
        first = []
        for x, y, ids in self.progress(self.loader):
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            first.append(float(ids[0]))
        # the order is in metrics.jsonl, which a resumed run must reproduce bit for bit
        self.log({f"order/{i}": value for i, value in enumerate(first)})
        self.log({"train/loss": loss.detach()})


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_resume_with_workers_shuffles_as_the_uninterrupted_run(tmp_path, workers, persistent):
    """Crash at epoch 2, resume: the resumed epochs' order, metrics.jsonl and weights are the uninterrupted run's."""
    kwargs = dict(epochs=4)
    flavour = {"workers": workers, "persistent": persistent}
    reference_trainer = type("Ref", (LoaderTrainer,), flavour)(make_cfg(tmp_path / "ref", **kwargs))
    reference_trainer.train()
    reference_trainer.close()

    dying = type("Dying", (LoaderTrainer,), {**flavour, "crash_at": 2})(make_cfg(tmp_path / "run", **kwargs))
    with pytest.raises(Crash):
        dying.train()
    dying.close()
    resumed = type("Resumed", (LoaderTrainer,), flavour)(make_cfg(tmp_path / "run", **kwargs))
    resumed.train()
    resumed.close()

    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    assert param_digest(resumed.model) == param_digest(reference_trainer.model)


class GeneratorLoaderTrainer(LoaderTrainer):
    """The loader shuffles with a generator of its own (as PyTorch's reproducibility notes recommend)."""

    workers = 0
    persistent = False
    register_generator = True

    def setup(self, ckpt):
        super().setup(ckpt)
        self.generator = torch.Generator().manual_seed(1234)
        self.loader = DataLoader(
            self.loader.dataset,
            batch_size=self.cfg.batch_size,
            shuffle=True,
            generator=self.generator,
            num_workers=self.workers,
            persistent_workers=self.persistent,
        )
        if self.register_generator:
            self.add_checkpoint_items(loader_generator=self.generator)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)])
def test_a_registered_loader_generator_resumes_its_shuffle(tmp_path, workers, persistent):
    """A DataLoader's own generator, registered with add_checkpoint_items, is restored: the resume is exact; with
    persistent workers too (starting them must not draw from that generator, or the resumed shuffles shift)."""
    kwargs = dict(epochs=4)
    flavour = {"workers": workers, "persistent": persistent}
    reference = type("Ref", (GeneratorLoaderTrainer,), flavour)(make_cfg(tmp_path / "ref", **kwargs))
    reference.train()
    reference.close()
    dying = type("Dying", (GeneratorLoaderTrainer,), {**flavour, "crash_at": 2})(make_cfg(tmp_path / "run", **kwargs))
    with pytest.raises(Crash):
        dying.train()
    dying.close()
    resumed = type("Resumed", (GeneratorLoaderTrainer,), flavour)(make_cfg(tmp_path / "run", **kwargs))
    assert torch.equal(resumed.generator.get_state(), resumed.checkpoint_items["loader_generator"].get_state())
    resumed.train()
    resumed.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    assert param_digest(resumed.model) == param_digest(reference.model)


def test_an_unregistered_loader_generator_is_warned_about_once(tmp_path):
    """progress() on a loader with its own generator that is not registered warns once, naming the fix."""
    unregistered = type("Unregistered", (GeneratorLoaderTrainer,), {"register_generator": False})
    trainer = unregistered(make_cfg(tmp_path, epochs=2))
    with pytest.warns(RuntimeWarning, match=r"add_checkpoint_items\(loader_generator=generator\)") as caught:
        trainer.train()
    trainer.close()
    (warned,) = [w for w in caught if "torch.Generator of its own" in str(w.message)]
    assert warned.filename == __file__
    registered = GeneratorLoaderTrainer(make_cfg(tmp_path / "registered", epochs=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        registered.train()
    registered.close()


class DistributedSamplerTrainer(LoaderTrainer):
    """The loader draws from a DistributedSampler that is not handed to add_samplers(); set by hand if asked."""

    workers, persistent = 0, False
    set_epoch_by_hand = False

    def setup(self, ckpt):
        from torch.utils.data import DistributedSampler

        super().setup(ckpt)
        dataset = self.loader.dataset
        self.own_sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=self.cfg.seed)
        self.loader = DataLoader(dataset, batch_size=self.cfg.batch_size, sampler=self.own_sampler)

    def train_epoch(self):
        if self.set_epoch_by_hand:
            self.own_sampler.set_epoch(self.epoch)
        super().train_epoch()


def test_a_distributed_sampler_nobody_sets_the_epoch_of_is_warned_about(tmp_path):
    """A DistributedSampler not handed to add_samplers() shuffles every epoch the same way: progress() says so once."""
    trainer = DistributedSamplerTrainer(make_cfg(tmp_path, epochs=3))
    with pytest.warns(RuntimeWarning, match=r"nothing calls its set_epoch\(\).*self.add_samplers\(sampler\)") as caught:
        trainer.train()
    trainer.close()
    (warned,) = [w for w in caught if "set_epoch" in str(w.message)]
    assert warned.filename == __file__  # it points at the line that called progress()


@pytest.mark.parametrize("how", ["add_samplers", "by hand"])
def test_a_sampler_whose_epoch_is_set_is_not_warned_about(tmp_path, how):
    """Handed to add_samplers(), or the DDP idiom sampler.set_epoch(epoch) in train_epoch(): no warning."""
    if how == "by hand":
        trainer = type("ByHand", (DistributedSamplerTrainer,), {"set_epoch_by_hand": True})(
            make_cfg(tmp_path, epochs=3)
        )
    else:
        trainer = TinyTrainer(make_cfg(tmp_path, epochs=3))  # its DistributedSampler goes to add_samplers()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train()
    trainer.close()


def test_a_new_loader_is_checked_even_where_a_freed_one_lived(tmp_path):
    """The once-per-loader check remembers loaders, not ids: a new loader at a freed one's address is checked."""
    import gc

    trainer = GeneratorLoaderTrainer(make_cfg(tmp_path, epochs=1))
    dataset = trainer.loader.dataset
    for _ in range(5):  # a registered generator: nothing to say; then the loader is freed
        fine = DataLoader(dataset, batch_size=8, shuffle=True, generator=trainer.generator)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            trainer.progress(fine)
        del fine
        gc.collect()
        unregistered = DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator())
        with pytest.warns(RuntimeWarning, match="torch.Generator of its own"):
            trainer.progress(unregistered)
        del unregistered
        gc.collect()
    trainer.progress([1, 2, 3])  # a plain list passes through unchecked
    trainer.close()
