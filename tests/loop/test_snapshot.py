"""The best-model snapshot: exact, never aliased, and never written into a tensor somebody else holds.

The oracle is ``copy.deepcopy(model.state_dict())`` taken at each ``save_if_best`` call.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit.loop.weight_snapshot import WeightSnapshot


def fill(module: nn.Module, value: float) -> None:
    with torch.no_grad():
        for tensor in module.state_dict().values():
            tensor.fill_(value)


def assert_equal_state(actual, expected) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# ---------------------------------------------------------------------------------- WeightSnapshot alone


@pytest.mark.parametrize("big_buffer", [False, True])
def test_private_snapshot_is_refilled_in_place(big_buffer):
    """While nobody was handed the snapshot, the next take copies into the same tensors, large ones included."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    if big_buffer:  # above the foreach limit: copied on its own
        model.register_buffer("big", torch.arange(3 * 2**20, dtype=torch.float32))
    snapshot = WeightSnapshot()
    first = snapshot.take(model.state_dict())
    pointers = {key: value.data_ptr() for key, value in first.items()}
    fill(model, 2.5)
    second = snapshot.take(model.state_dict())
    assert {key: value.data_ptr() for key, value in second.items()} == pointers
    assert_equal_state(second, model.state_dict())
    assert all(second[k].data_ptr() != v.data_ptr() for k, v in model.state_dict().items())


def test_handed_out_snapshot_is_never_written_again():
    """After hand_out() the next take allocates new tensors and the handed-out ones keep their values."""
    model = nn.Linear(3, 2)
    snapshot = WeightSnapshot()
    snapshot.take(model.state_dict())
    held = snapshot.hand_out()
    kept = copy.deepcopy(held)
    fill(model, 7.0)
    new = snapshot.take(model.state_dict())
    assert_equal_state(held, kept)
    assert all(new[k].data_ptr() != held[k].data_ptr() for k in held)
    assert_equal_state(new, model.state_dict())


def test_replaced_snapshot_is_not_private_unless_said():
    """A snapshot set from outside (a user's dict, a loaded file) is not refilled in place; a private one is."""
    model = nn.Linear(3, 2)
    theirs = {key: value.clone() for key, value in model.state_dict().items()}
    snapshot = WeightSnapshot()
    snapshot.replace(theirs)
    fill(model, 3.0)
    assert snapshot.take(model.state_dict())["weight"].data_ptr() != theirs["weight"].data_ptr()
    assert not torch.equal(theirs["weight"], model.weight)

    ours = {key: value.clone() for key, value in model.state_dict().items()}
    snapshot.replace(ours, private=True)
    fill(model, 4.0)
    assert snapshot.take(model.state_dict())["weight"].data_ptr() == ours["weight"].data_ptr()


def test_slot_that_no_longer_fits_gets_a_new_tensor():
    """A tensor whose dtype or shape changed between takes is snapshotted into a new tensor, exactly."""
    model = nn.Linear(2, 2)
    model.register_buffer("extra", torch.arange(3 * 2**20, dtype=torch.float32))
    snapshot = WeightSnapshot()
    snapshot.take(model.state_dict())
    model.extra = torch.zeros(5, dtype=torch.float64)
    taken = snapshot.take(model.state_dict())
    assert taken["extra"].dtype == torch.float64 and torch.equal(taken["extra"], torch.zeros(5, dtype=torch.float64))


def test_extra_state_is_deep_copied():
    """A non-tensor state-dict entry (a module's extra state) is copied, not shared."""

    class WithExtra(nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.note = {"seen": [1]}

        def get_extra_state(self):
            return self.note

        def set_extra_state(self, state):
            self.note = state

    model = WithExtra()
    taken = WeightSnapshot().take(model.state_dict())
    model.note["seen"].append(2)
    assert taken["_extra_state"] == {"seen": [1]}


# ---------------------------------------------------------------------------------- rollback patterns


class Tracker:
    """Drives save_if_best with ever better scores and checks best_model against a deepcopy oracle."""

    def __init__(self, tmp_path):
        self.trainer = TinyTrainer(make_cfg(tmp_path, ckpt={"enable": False}))
        self.score = 100.0

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    def improve(self) -> None:
        oracle = copy.deepcopy(self.model.state_dict())
        self.score -= 1.0
        self.trainer.epoch += 1
        assert self.trainer.save_if_best(self.score)
        assert_equal_state(self.model.state_dict(), oracle)  # the live model is untouched
        best = self.trainer.best_model
        assert_equal_state(best, oracle)  # and the snapshot is exactly the model at the call
        live = {t.data_ptr() for t in self.model.state_dict().values()}
        assert not live & {t.data_ptr() for t in best.values()}

    def close(self) -> None:
        self.trainer.close()


@pytest.fixture
def tracker(tmp_path):
    made = Tracker(tmp_path)
    yield made
    made.close()


def test_rollback_with_assign_true_then_improve_keeps_the_live_weights(tracker):
    """The issue's repro: 1.0 best, 2.0 best, 99.0, rollback with assign=True, set 5.0, improve: 5.0 stays 5.0."""
    fill(tracker.model, 1.0)
    tracker.improve()
    fill(tracker.model, 2.0)
    tracker.improve()
    fill(tracker.model, 99.0)
    tracker.model.load_state_dict(tracker.trainer.best_model, assign=True)
    assert all(torch.all(v == 2.0) for v in tracker.model.state_dict().values())
    fill(tracker.model, 5.0)
    tracker.improve()
    assert all(torch.all(v == 5.0) for v in tracker.model.state_dict().values())
    assert all(torch.all(v == 5.0) for v in tracker.trainer.best_model.values())


def test_rollback_without_assign_then_improve(tracker):
    """A copying rollback (load_state_dict without assign) followed by training and improvements stays exact."""
    fill(tracker.model, 1.0)
    tracker.improve()
    fill(tracker.model, 50.0)
    tracker.model.load_state_dict(tracker.trainer.best_model)
    fill(tracker.model, 3.0)
    tracker.improve()
    fill(tracker.model, 4.0)
    tracker.improve()


def test_best_model_handed_to_another_module_is_never_overwritten(tracker):
    """A module that took best_model's tensors (assign=True) keeps its weights through later improvements."""
    fill(tracker.model, 1.0)
    tracker.improve()
    other = copy.deepcopy(tracker.trainer.model)
    other.load_state_dict(tracker.trainer.best_model, assign=True)
    expected = copy.deepcopy(other.state_dict())
    for value in (2.0, 3.0, 4.0):
        fill(tracker.model, value)
        tracker.improve()
    assert_equal_state(other.state_dict(), expected)


def test_weights_replaced_or_parameters_recreated_between_improvements(tracker):
    """New .data, a re-created layer, re-registered parameters: each improvement still snapshots exactly."""
    fill(tracker.model, 1.0)
    tracker.improve()
    with torch.no_grad():
        tracker.model[0].weight.data = torch.full((32, 8), 7.0)
    tracker.improve()
    tracker.model[3] = nn.Linear(32, 1)
    tracker.improve()
    tracker.model[0].weight = nn.Parameter(torch.randn(32, 8))
    tracker.improve()
    fill(tracker.model, 0.5)
    tracker.improve()


def test_improvements_nobody_reads_between_stay_exact(tmp_path):
    """With nobody reading best_model between improvements (the refill-in-place path), each one is exact."""
    trainer = TinyTrainer(make_cfg(tmp_path, ckpt={"enable": False}))
    try:
        for epoch, value in enumerate((1.0, 2.0, 3.0)):
            fill(trainer.model, value)
            trainer.epoch = epoch
            assert trainer.save_if_best(10.0 - epoch)
        oracle = copy.deepcopy(trainer.model.state_dict())
        assert_equal_state(trainer.best_model, oracle)
    finally:
        trainer.close()
