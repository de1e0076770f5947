"""A torchdata StatefulDataLoader over an IterableDataset whose state holds its pass seed, its position and a
torch.Generator, resumed at an epoch's end: from a SIGTERM at the epoch's last step boundary, and from an epoch-end
checkpoint (``epochs`` raised). The epoch has a short last batch, so torchdata's saved state says its fetcher ended."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import trainers
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, StepTrainer, param_digest
from trainkit.checkpoint.payload import validate_last
from trainkit.errors import CheckpointCorruptError, TrainingInterrupted, UsageError

pytest.importorskip("torchdata.stateful_dataloader")

STREAM = {"epochs": 3, "ckpt": {"every_n_steps": 1}, "loader": "stateful iterable"}
"""Three epochs of 8 batches (30 samples in batches of 4: the last one short), a step checkpoint at every step."""


class SeededPasses(torch.utils.data.IterableDataset):
    """Samples in an order drawn per pass from a generator of its own; its state is the pass's seed, the position in
    it and the generator. A loaded state is kept for the next ``__iter__`` (as a stream reader resumes); with
    ``new_pass_at_end`` a loaded position at the pass's end starts a new pass there, else it resumes that ended pass
    (and yields nothing)."""

    new_pass_at_end = True

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y = x, y
        self.generator = torch.Generator().manual_seed(seed)
        self.pass_seed: int | None = None
        self.position = 0
        self.pending: tuple[int, int] | None = None

    def __iter__(self):
        pending, self.pending = self.pending, None
        if pending is not None and not (self.new_pass_at_end and pending[1] >= len(self.x)):
            self.pass_seed, self.position = pending
        else:
            self.pass_seed, self.position = int(torch.randint(0, 2**62, (1,), generator=self.generator)), 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.pass_seed)).tolist()
        while self.position < len(order):
            index = order[self.position]
            self.position += 1
            yield self.x[index], self.y[index]

    def state_dict(self) -> dict:
        return {"pass_seed": self.pass_seed, "position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.pending = None if state["pass_seed"] is None else (state["pass_seed"], state["position"])


class NaivePasses(SeededPasses):
    new_pass_at_end = False


class StickyPasses(NaivePasses):
    """Keeps the loaded state for every pass: never starts a new one after a resume."""

    def __iter__(self):
        pending = self.pending
        yield from super().__iter__()
        self.pending = pending


class PassesTrainer(StepTrainer):
    dataset_class: type[SeededPasses] = SeededPasses

    def setup(self, ckpt):
        super().setup(ckpt)
        if self.dataset_class is None:  # the helpers' own loader (STREAM's, or the config's)
            return
        from torchdata.stateful_dataloader import StatefulDataLoader

        dataset = self.loader.dataset
        self.passes = self.dataset_class(dataset.x, dataset.y, seed=self.cfg.seed + 11)
        self.loader = StatefulDataLoader(self.passes, batch_size=self.cfg.batch_size)


class NaiveTrainer(PassesTrainer):
    dataset_class = NaivePasses


class StickyTrainer(PassesTrainer):
    dataset_class = StickyPasses


class HelperLoaderTrainer(PassesTrainer):
    dataset_class = None


LOADERS = [
    pytest.param(PassesTrainer, STREAM, id="dataset-starts-a-new-pass-at-its-end"),
    pytest.param(NaiveTrainer, STREAM, id="dataset-resumes-the-ended-pass"),
    pytest.param(HelperLoaderTrainer, {**STREAM, "loader": "stream"}, id="stream-of-batches"),
    pytest.param(HelperLoaderTrainer, {**STREAM, "loader": "stateful"}, id="map-style-StatefulDataLoader"),
]
"""A torchdata StatefulDataLoader over each of the two datasets above; a ShuffledStream of batches (no torchdata,
its order drawn from the global RNG); a map-style StatefulDataLoader shuffling with a registered generator."""


def straight_digest(tmp_path, trainer_class, config) -> tuple[str, int]:
    trainer = trainer_class(make_cfg(tmp_path / "straight", config), 0, 1)
    trainer.train()
    trainer.close()
    return param_digest(trainer.model), trainer.step


def stop_at_the_epochs_last_boundary(out_dir, trainer_class, config=STREAM) -> None:
    """SIGTERM after the last batch of epoch 0 (its last step): the run stops at that step boundary, inside the
    epoch with all 8 batches done, before the loader's iterator ends."""
    trainers.SIGTERM_AT = ("batch", 0, 7)
    try:
        trainer = trainer_class(make_cfg(out_dir, config), 0, 1)
        with pytest.raises(TrainingInterrupted, match=r"stopped after step 4, batch 8 (of 8 )?of epoch 0"):
            trainer.train()
        trainer.close()
    finally:
        trainers.SIGTERM_AT = None


@pytest.mark.parametrize(("trainer_class", "config"), LOADERS)
def test_a_sigterm_at_the_epochs_last_boundary_resumes_every_batch_of_the_next_epochs_bit_identically(
    tmp_path, trainer_class, config
):
    """The resumed epoch 0 has no batch left; epochs 1 and 2 train every batch, as in the straight run (the naive
    dataset kept the loaded ended pass, which torchdata never handed to a pass of its own: its next pass is empty,
    and the epoch's pass is the one after it)."""
    reference, steps = straight_digest(tmp_path, trainer_class, config)
    stop_at_the_epochs_last_boundary(tmp_path / "run", trainer_class, config)
    trainer = trainer_class(make_cfg(tmp_path / "run", config), 0, 1)
    trainer.train()
    trainer.close()
    assert (trainer.step, param_digest(trainer.model)) == (steps, reference)


@pytest.mark.parametrize(("trainer_class", "config"), LOADERS)
def test_epochs_raised_after_a_finished_run_continue_the_loaders_state_bit_identically(tmp_path, trainer_class, config):
    """epochs=1, then epochs=3 on the same folder: the epoch-end checkpoint carries the loader's state (a dataset's
    generator in it, never registered), so the next epochs draw what the straight run drew."""
    reference, steps = straight_digest(tmp_path, trainer_class, config)
    trainer = trainer_class(make_cfg(tmp_path / "run", {**config, "epochs": 1}), 0, 1)
    trainer.train()
    trainer.close()
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["loader_states"] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the raised budget is warned about
        trainer = trainer_class(make_cfg(tmp_path / "run", config), 0, 1)
    trainer.train()
    trainer.close()
    assert (trainer.step, param_digest(trainer.model)) == (steps, reference)


class CrashingInEpoch1(NaiveTrainer):
    """Crashes (standing in for a kill) at the start of epoch 1, before its first batch."""

    def train_epoch(self):
        if self.epoch == 1 and not getattr(self, "resumed_once", False):
            raise Crash
        super().train_epoch()


def test_a_crash_after_an_epoch_end_checkpoint_resumes_the_loaders_state_bit_identically(tmp_path):
    """No step checkpoint after epoch 0's end (every 3 steps: step 3 only): the resume is from epoch 0's end, whose
    checkpoint holds the loader's state, the dataset's generator in it."""
    config = {**STREAM, "ckpt": {"every_n_steps": 3}}
    reference, steps = straight_digest(tmp_path, NaiveTrainer, config)
    trainer = CrashingInEpoch1(make_cfg(tmp_path / "run", config), 0, 1)
    with pytest.raises(Crash):
        trainer.train()
    trainer.close()
    payload = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert (payload["step"], payload["trainkit"], payload["loader_states"] is not None) == (4, None, True)
    trainer = CrashingInEpoch1(make_cfg(tmp_path / "run", config), 0, 1)
    trainer.resumed_once = True
    trainer.train()
    trainer.close()
    assert (trainer.step, param_digest(trainer.model)) == (steps, reference)


def test_a_loader_that_never_starts_a_new_pass_after_a_resume_is_refused_not_trained_as_nothing(tmp_path):
    """The dataset resumes the loaded ended pass at every __iter__: epoch 1 would yield no batch and the run would
    end 'finished' with an epoch missing. It stops there instead, naming the epoch, the loader and the rule."""
    stop_at_the_epochs_last_boundary(tmp_path / "run", StickyTrainer)
    trainer = StickyTrainer(make_cfg(tmp_path / "run", STREAM), 0, 1)
    message = r"epoch 1's pass over the StatefulDataLoader given to progress\(\) yielded no batch.*start a new pass"
    with pytest.raises(UsageError, match=message):
        trainer.train()
    trainer.close()
    assert trainer.step == 4  # nothing trained in epoch 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"rank": 0}, r"last.pt: loader_states must be None or a list with one entry per rank"),
        ([], r"last.pt: loader_states must be None or a list with one entry per rank"),
        ([[1, 2]], r"last.pt: loader_states\[0\] must be a dict of str keys"),
        ([None, None], r"last.pt: loader_states must be a list of 1 entries \(world_size=1, one per rank\)"),
    ],
)
def test_a_hostile_epoch_end_loader_state_is_refused_naming_the_key(tmp_path, value, message):
    trainer = PassesTrainer(make_cfg(tmp_path, {**STREAM, "epochs": 1}), 0, 1)
    trainer.train()
    trainer.close()
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    validate_last(payload, path="last.pt", world_size=1)
    payload["loader_states"] = value
    with pytest.raises(CheckpointCorruptError, match=message):
        validate_last(payload, path="last.pt", world_size=1)


@pytest.mark.ddp
def test_two_ranks_each_continue_their_own_loader_state_from_an_epoch_end_checkpoint(tmp_path):
    """2 gloo ranks under DDP, each with its own stream dataset (its own generator): epochs=1 then epochs=3 on the
    same folder trains what a straight 3-epoch run trains, so each rank got its own loader state back from the
    epoch-end checkpoint (another rank's would change the averaged gradients)."""
    import trainkit

    config = {**STREAM, "dist": {"backend": "gloo", "timeout_s": 60}}
    trainkit.spawn(PassesTrainer, make_cfg(tmp_path / "straight", config), 2)
    trainkit.spawn(PassesTrainer, make_cfg(tmp_path / "run", {**config, "epochs": 1}), 2)
    split = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert len(split["loader_states"]) == 2  # one per rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainkit.spawn(PassesTrainer, make_cfg(tmp_path / "run", config), 2)
    straight = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert resumed["step"] == straight["step"]
    assert all(torch.equal(resumed["model"][key], value) for key, value in straight["model"].items())
