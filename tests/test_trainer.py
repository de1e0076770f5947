"""BaseTrainer's loop, best-model selection, early stopping and checkpoints, on a real tiny model on CPU."""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import pytest
import torch
from torch import nn

from tests.helpers.checkpoint_files import flip_bit_in_tensor_data
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, TinyTrainer, dying, param_digest
from trainkit import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    HookNotImplementedError,
    RegistryError,
    UsageError,
)
from trainkit.bookkeeping import RESERVED_NAMES
from trainkit.trainer import BaseTrainer


def test_validation_schedule_every_3_of_10(tmp_path):
    """epochs=10 with val.every_n_epochs=3 validates after epochs 2, 5, 8 and 9, and trains every epoch."""
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=10, val={"every_n_epochs": 3}, ckpt={"enable": False}))
    trainer.train()
    assert trainer.epochs_validated == [2, 5, 8, 9]
    assert trainer.epochs_trained == list(range(10))


def test_early_stopping_stops_at_the_third_counted_miss(tmp_path):
    """With patience=3 the run stops after the third consecutive miss, and records why."""
    scores = (5.0, 4.0, 4.5, 4.0, 4.2, 9.0, 1.0, 1.0)
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=8, scripted_scores=scores, val={"patience": 3}))
    trainer.train()
    assert trainer.epochs_trained == [0, 1, 2, 3, 4]
    assert trainer.best_state.score == 4.0 and trainer.best_state.epoch == 1
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert last["loop"]["stop_reason"] == "early_stop" and last["epoch"] == 5


def test_start_patience_ignores_early_misses(tmp_path):
    """Misses before val.start_patience are not counted, so the stop comes later."""
    scores = (5.0, 6.0, 6.0, 6.0, 6.0, 6.0)
    trainer = TinyTrainer(
        make_cfg(tmp_path, epochs=6, scripted_scores=scores, val={"patience": 2, "start_patience": 3})
    )
    trainer.train()
    assert trainer.epochs_trained == [0, 1, 2, 3, 4]


def test_non_finite_scores_never_become_the_best(tmp_path):
    """NaN and inf scores are misses: the best stays the last finite improvement."""
    scores = (float("nan"), 3.0, float("-inf"), float("nan"))
    trainer = TinyTrainer(make_cfg(tmp_path, scripted_scores=scores, val={"patience": 5}))
    trainer.train()
    assert trainer.best_state.score == 3.0 and trainer.best_state.epoch == 1
    assert trainer.patience_state.remaining == 3


def test_best_pt_loads_weights_only_and_holds_the_best_weights(tmp_path):
    """best.pt loads with weights_only=True and holds the best epoch's weights and record."""
    scores = (3.0, 1.0, 2.0, 2.5)
    trainer = TinyTrainer(make_cfg(tmp_path, scripted_scores=scores))
    trainer.train()
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["best"]["score"] == 1.0 and best["best"]["epoch"] == 1 and best["epoch"] == 1
    assert best["best"]["metrics"] == {"best/val/loss": 1.0}
    for key, value in trainer.best_model.items():
        assert torch.equal(best["model"][key], value)
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert not all(torch.equal(best["model"][k], v) for k, v in last["model"].items())


def _replace_weight_data(trainer):
    with torch.no_grad():
        trainer.model[0].weight.data = torch.full((32, 8), 7.0)


def _swap_submodule(trainer):
    trainer.model[3] = nn.Linear(32, 1)


def _add_buffer(trainer):
    trainer.model.register_buffer("extra", torch.arange(4.0))


def _replace_snapshot_entry(trainer):
    trainer.best_model["0.bias"] = torch.zeros(32)


def _transpose_in_place(trainer):
    weight = trainer.model[0].weight
    weight.data = weight.data.t()  # the same memory, read with another shape


@pytest.mark.parametrize(
    "change", [_replace_weight_data, _swap_submodule, _add_buffer, _replace_snapshot_entry, _transpose_in_place]
)
def test_best_model_snapshot_follows_weights_replaced_between_improvements(tmp_path, change):
    """The snapshot copies before it re-reads the model; weights swapped out since the last improvement
    (new tensors, a new submodule, a new buffer, a snapshot entry the user replaced, the same memory
    under another shape) still end up in the snapshot, exactly and not aliased to the live weights."""
    trainer = TinyTrainer(make_cfg(tmp_path, ckpt={"enable": False}))
    trainer.epoch = 0
    assert trainer.save_if_best(3.0)
    change(trainer)
    trainer.epoch = 1
    assert trainer.save_if_best(2.0)
    state = trainer.model.state_dict()
    assert list(trainer.best_model) == list(state)
    for key, value in state.items():
        assert torch.equal(trainer.best_model[key], value), key
        assert trainer.best_model[key].data_ptr() != value.data_ptr() or value.numel() == 0, key
    with torch.no_grad():
        for value in trainer.model.parameters():
            value.add_(1.0)
    trainer.epoch = 2
    assert trainer.save_if_best(1.0)  # the plan rebuilt after the change is followed too
    assert all(torch.equal(trainer.best_model[k], v) for k, v in trainer.model.state_dict().items())


def test_reset_best_tracking_lets_go_of_the_snapshot(tmp_path):
    """After reset_best_tracking() nothing in the trainer keeps the old snapshot's buffers alive."""
    trainer = TinyTrainer(make_cfg(tmp_path, ckpt={"enable": False}))
    trainer.epoch = 0
    assert trainer.save_if_best(3.0)
    buffer = weakref.ref(trainer.best_model["0.weight"])
    trainer.reset_best_tracking()
    gc.collect()
    assert buffer() is None


def test_test_uses_best_weights_not_last(tmp_path):
    """test() reloads the best epoch's weights into the model before calling test_epoch()."""
    seen = {}

    class Recording(TinyTrainer):
        def train_epoch(self):
            super().train_epoch()
            seen["last"] = param_digest(self.model)

        def test_epoch(self):
            seen["digest"] = param_digest(self.model)
            return super().test_epoch()

    trainer = Recording(make_cfg(tmp_path, scripted_scores=(2.0, 1.0, 3.0, 4.0), test={"enable": True}))
    result = trainer.train()
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    expected = TinyTrainer(make_cfg(tmp_path / "other", ckpt={"enable": False}))
    expected.model.load_state_dict(best["model"])
    assert seen["digest"] == param_digest(expected.model) != seen["last"]
    assert "test/loss" in result and result["best/val/loss"] == 1.0


def test_ckpt_disabled_writes_nothing_yet_best_and_early_stop_work(tmp_path):
    """With ckpt.enable=false no file is written, but best_model, test() and early stopping still work."""
    out = tmp_path / "run"
    trainer = TinyTrainer(
        make_cfg(
            out,
            epochs=6,
            scripted_scores=(1.0, 2.0, 2.0, 2.0, 2.0, 2.0),
            val={"patience": 2},
            ckpt={"enable": False},
            test={"enable": True},
        )
    )
    result = trainer.train()
    assert not out.exists() or not any(out.iterdir())
    assert trainer.epochs_trained == [0, 1, 2] and trainer.best_model is not None
    assert "test/loss" in result


@pytest.mark.parametrize("crash_epoch", range(5))
def test_resume_after_any_epoch_is_bit_identical(tmp_path, crash_epoch):
    """A run killed at any epoch (or in test) and resumed ends with identical weights, optimizer state and metrics."""
    cfg_kwargs = dict(epochs=4, val={"patience": 3, "every_n_epochs": 2}, test={"enable": True})
    reference = TinyTrainer(make_cfg(tmp_path / "ref", **cfg_kwargs))
    expected = reference.train()
    expected_last = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)

    out = tmp_path / "resumed"
    where = "test_epoch" if crash_epoch == 4 else "train_epoch"
    with pytest.raises(Crash):
        dying(crash_epoch, where)(make_cfg(out, **cfg_kwargs)).train()
    resumed = TinyTrainer(make_cfg(out, **cfg_kwargs))
    assert resumed.epoch == min(crash_epoch, 3)
    assert resumed.train() == expected
    assert resumed.epochs_trained == list(range(crash_epoch, 4))
    last = torch.load(out / "last.pt", weights_only=True)
    for key in expected_last["model"]:
        assert torch.equal(last["model"][key], expected_last["model"][key])
    assert str(last["optimizer"]) == str(expected_last["optimizer"])
    assert param_digest(resumed.model) == param_digest(reference.model)
    ref_rows = (tmp_path / "ref" / "metrics.jsonl").read_text()
    assert (out / "metrics.jsonl").read_text() == ref_rows


@pytest.mark.parametrize("epochs", [4, 3])
def test_resuming_a_finished_run_does_no_more_epochs(tmp_path, epochs):
    """A run resumed from a finished run's checkpoint with the same (or fewer) epochs returns its final
    metrics without training (raising epochs extends it: test_raising_epochs_extends_a_finished_run)."""
    first = TinyTrainer(make_cfg(tmp_path, test={"enable": True})).train()
    again = TinyTrainer(make_cfg(tmp_path, epochs=epochs, test={"enable": True}))
    assert again.train() == first
    assert again.epochs_trained == []


def test_failing_checkpoint_write_leaves_previous_intact(tmp_path):
    """An exception inside a state_dict() during a save raises and leaves last.pt byte-identical and no temp file."""

    class Fragile:
        fail = False

        def state_dict(self):
            if self.fail:
                raise OSError("injected write failure")
            return {"ok": 1}

        def load_state_dict(self, state):
            pass

    fragile = Fragile()

    class WithFragile(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.add_checkpoint_items(fragile=fragile)

        def train_epoch(self):
            if (tmp_path / "last.pt").exists():  # what the epoch's save starts from: nothing writes it before then
                snapshots.append((tmp_path / "last.pt").read_bytes())
            super().train_epoch()
            fragile.fail = self.epoch == 2

    snapshots = []
    trainer = WithFragile(make_cfg(tmp_path))
    with pytest.raises(OSError, match="injected write failure"):
        trainer.train()
    assert (tmp_path / "last.pt").read_bytes() == snapshots[-1]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert {"best.pt", "last.pt", "last.prev.pt", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}


def test_corrupted_last_pt_is_a_clear_error_and_nothing_is_overwritten(tmp_path):
    """A bit flip in last.pt's tensor data is detected before unpickling, named, and the file is left as it is."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    (tmp_path / "last.prev.pt").unlink()
    path = tmp_path / "last.pt"
    flip_bit_in_tensor_data(path)
    corrupted = path.read_bytes()
    with pytest.raises(CheckpointCorruptError, match="last.pt.*CRC"):
        TinyTrainer(make_cfg(tmp_path, epochs=3))
    assert path.read_bytes() == corrupted


def test_corrupted_last_pt_falls_back_to_the_previous_one(tmp_path):
    """Auto-resume from a corrupted last.pt warns naming both files and resumes from last.prev.pt."""
    with pytest.raises(Crash):
        dying(2)(make_cfg(tmp_path, epochs=3)).train()
    flip_bit_in_tensor_data(tmp_path / "last.pt")
    corrupted = (tmp_path / "last.pt").read_bytes()
    with pytest.warns(
        RuntimeWarning, match=r"last.pt is corrupted.*resuming from the previous checkpoint .*last.prev.pt"
    ):
        trainer = TinyTrainer(make_cfg(tmp_path, epochs=3))
    assert trainer.epoch == 1
    assert (tmp_path / "last.corrupt.pt").read_bytes() == corrupted
    trainer.train()
    assert trainer.epochs_trained == [1, 2]


def test_explicit_corrupted_path_is_an_error(tmp_path):
    """A corrupted checkpoint named by ckpt.resume is an error, with no fallback."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    flip_bit_in_tensor_data(tmp_path / "last.pt")
    with pytest.raises(CheckpointCorruptError, match="CRC"):
        TinyTrainer(make_cfg(tmp_path, ckpt={"resume": str(tmp_path / "last.pt")}))


def test_truncated_last_pt_is_a_clear_error(tmp_path):
    """A truncated last.pt is reported as truncated, naming the file."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    (tmp_path / "last.prev.pt").unlink()
    path = tmp_path / "last.pt"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CheckpointCorruptError, match="last.pt is truncated"):
        TinyTrainer(make_cfg(tmp_path))


@pytest.mark.parametrize(
    "field, value, message",
    [("schema_version", 99, "schema version 99")],
)
def test_resume_from_an_incompatible_checkpoint_is_refused(tmp_path, field, value, message):
    """A checkpoint from a newer trainkit is a mismatch error naming what differs (an epoch's end resumes on any
    world size; the refusals of a mid-epoch one: tests/distributed/test_elastic_resume.py)."""
    TinyTrainer(make_cfg(tmp_path, epochs=1)).train()
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    payload[field] = value
    torch.save(payload, tmp_path / "last.pt")
    with pytest.raises(CheckpointMismatchError, match=message):
        TinyTrainer(make_cfg(tmp_path))


def test_resume_with_changed_config_warns_and_flipped_direction_fails(tmp_path):
    """A changed computing key warns naming it; a flipped val.minimize with a recorded best is an error."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    with pytest.warns(RuntimeWarning, match=r"lr: 0.05 -> 0.1"):
        TinyTrainer(make_cfg(tmp_path, epochs=3, lr=0.1))
    with pytest.raises(CheckpointMismatchError, match="val.minimize"):
        TinyTrainer(make_cfg(tmp_path, epochs=3, val={"minimize": False}))


def test_explicit_resume_path_must_exist(tmp_path):
    """ckpt.resume set to a missing path is an error naming it."""
    with pytest.raises(CheckpointError, match="nope.pt"):
        TinyTrainer(make_cfg(tmp_path, ckpt={"resume": str(tmp_path / "nope.pt")}))


def test_resume_never_starts_fresh(tmp_path):
    """ckpt.resume=never ignores an existing last.pt and trains from epoch 0."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=2, ckpt={"resume": "never"}))
    assert trainer.epoch == 0
    trainer.train()
    assert trainer.epochs_trained == [0, 1]


def test_tracking_attributes_exist_only_after_first_use(tmp_path):
    """best_state/patience_state appear on first use; best_model and best_metrics always exist."""
    trainer = TinyTrainer(make_cfg(tmp_path))
    assert not hasattr(trainer, "best_state") and not hasattr(trainer, "patience_state")
    assert trainer.best_model is None and trainer.best_metrics == {}
    assert trainer.get_best_pbar_metrics() == {}
    trainer.reset_best_tracking(minimize=False)
    assert trainer.best_state.minimize is False and trainer.patience_state.patience is None


def test_reset_best_tracking_pins_the_direction(tmp_path):
    """reset_best_tracking(minimize=...) overrides val.minimize for save_if_best."""
    trainer = TinyTrainer(make_cfg(tmp_path, ckpt={"enable": False}))
    trainer.reset_best_tracking(minimize=False)
    assert trainer.save_if_best(1.0) and trainer.save_if_best(2.0) and not trainer.save_if_best(1.5)
    assert trainer.get_best_pbar_metrics() == {}
    trainer.save_if_best(3.0, {"val/acc": 0.9})
    assert trainer.get_best_pbar_metrics() == {"acc": 0.9}


def test_step_patience_outside_validation_or_twice_is_refused(tmp_path):
    """step_patience() is only valid once per validation, inside val_epoch()."""
    trainer = TinyTrainer(make_cfg(tmp_path))
    with pytest.raises(UsageError, match="inside val_epoch"):
        trainer.step_patience(False)

    class Twice(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return self.step_patience(False)

    with pytest.raises(UsageError, match="already called"):
        Twice(make_cfg(tmp_path / "twice")).train()


@pytest.mark.parametrize("verdict", [torch.ones(3, dtype=torch.bool), torch.zeros(2), torch.zeros(0)])
def test_val_epoch_must_return_a_verdict(tmp_path, verdict):
    """val_epoch() returning a value whose truth is ambiguous (a multi-element or empty tensor) is a UsageError."""

    class ReturnsTensor(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return verdict

    with pytest.raises(UsageError, match="ambiguous"):
        ReturnsTensor(make_cfg(tmp_path)).train()


def test_val_epoch_returning_a_truthy_score_stops_with_a_warning(tmp_path):
    """A truthy non-bool (a score returned by mistake) stops training, as its truth says, and warns why."""

    class ReturnsScore(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return 0.5

    trainer = ReturnsScore(make_cfg(tmp_path))
    with pytest.warns(RuntimeWarning, match="truthy"):
        trainer.train()
    assert trainer.epochs_trained == [0]


def test_missing_test_epoch_names_the_hook(tmp_path):
    """test.enable without a test_epoch() override raises HookNotImplementedError naming the hook."""

    class NoTest(TinyTrainer):
        test_epoch = BaseTrainer.test_epoch

    with pytest.raises(HookNotImplementedError, match="test_epoch"):
        NoTest(make_cfg(tmp_path, test={"enable": True})).train()


def test_registering_twice_or_reserved_names_is_refused(tmp_path):
    """add_checkpoint_items refuses a name registered twice and names reserved by the engine."""
    trainer = TinyTrainer(make_cfg(tmp_path))
    with pytest.raises(RegistryError, match="'model' is already registered"):
        trainer.add_checkpoint_items(model=trainer.model)
    with pytest.raises(RegistryError, match="'epoch' is reserved"):
        trainer.add_checkpoint_items(epoch=3)


def test_engine_keys_in_last_pt_are_all_reserved(tmp_path):
    """Every top-level key the engine writes is reserved, so no user item can collide with it."""
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=1))
    trainer.train()
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    assert set(payload) - {"model", "optimizer"} <= RESERVED_NAMES


def test_step_counts_optimizer_steps(tmp_path):
    """self.step advances once per optimizer.step() of the first registered optimizer."""
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=2, ckpt={"enable": False}))
    trainer.train()
    batches = math.ceil(int(0.6 * 320) / 32)
    assert trainer.step == 2 * batches


def test_stale_temp_files_are_cleaned_up(tmp_path):
    """Temp files left by a killed save (their writer is gone) are removed when the next run starts."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp_path.mkdir(exist_ok=True)
    leftover = tmp_path / f".last.pt.{int(dead.stdout)}.0.tmp"
    leftover.write_bytes(b"partial")
    TinyTrainer(make_cfg(tmp_path))
    assert not leftover.exists()


def test_mapping_config_is_validated(tmp_path):
    """A mapping with a typo is refused by the trainer's own config class, naming the closest key."""
    from trainkit import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        TinyTrainer(make_cfg(tmp_path, lrr=0.1))


def test_no_warnings_on_a_clean_run(tmp_path):
    """A plain run and its resume emit no warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
        TinyTrainer(make_cfg(tmp_path, epochs=2)).train()


@pytest.mark.parametrize("body", ["step = 0", "epoch = 0", "def step(self, batch):\n        return batch"])
def test_a_subclass_that_defines_step_or_epoch_is_refused_when_made(body):
    """step and epoch are the position part's, read by the loop through BaseTrainer's properties: a subclass's own
    (a class-level default, a method named step) would hide them, and the run would record and save step 0 (its
    journal's trainer/step all 0, no step checkpoint, a resume from step 0). Refused naming the attribute; a subclass
    that only sets them, or annotates them, is fine."""
    name = body.removeprefix("def ").split()[0].split("(")[0]
    with pytest.raises(TypeError, match=f"Hiding defines '{name}' .*hides BaseTrainer.{name}"):
        exec(f"class Hiding(TinyTrainer):\n    {body}\n", {"TinyTrainer": TinyTrainer})

    class Annotated(TinyTrainer):
        step: int
        epoch: int

    assert Annotated.step is BaseTrainer.step
