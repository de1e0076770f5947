"""The defects a probe of the API page and of everyday user patterns found; one test (or more) per item.

Each test is named after its item of the correctness issue and failed before the fix.
"""

from __future__ import annotations

import copy
import warnings

import attrs
import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, TinyConfig, TinyTrainer, dying, param_digest
from trainkit.run.read_metrics import read_metrics


def load(path):
    return torch.load(path, weights_only=True)


def same_weights(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------- 3. resume from a path


def test_resume_from_a_path_keeps_the_best_weights(tmp_path, capsys):
    """ckpt.resume=<path> reads best.pt beside that checkpoint: same best_model and test result as an
    uninterrupted run, and the new out_dir gets best.pt and the metrics history, complete on its own."""
    kwargs = dict(epochs=4, scripted_scores=(3.0, 1.0, 2.0, 2.5), test={"enable": True})
    reference = TinyTrainer(make_cfg(tmp_path / "ref", **kwargs))
    expected = reference.train()
    with pytest.raises(Crash):
        dying(3)(make_cfg(tmp_path / "a", **kwargs)).train()
    before = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir() if p.is_file()}
    resumed = TinyTrainer(make_cfg(tmp_path / "b", ckpt={"resume": str(tmp_path / "a" / "last.pt")}, **kwargs))
    assert same_weights(resumed.best_model, reference.best_model)
    assert resumed.train() == expected
    assert same_weights(load(tmp_path / "b" / "best.pt")["model"], load(tmp_path / "ref" / "best.pt")["model"])
    assert (tmp_path / "b" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    after = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir() if p.is_file()}
    assert after == before  # the folder resumed from is only read
    # and a later auto-resume of the new folder finds its own best.pt
    again = TinyTrainer(make_cfg(tmp_path / "b", **kwargs))
    assert same_weights(again.best_model, reference.best_model)


# ---------------------------------------------------------------------------------- 4. test() and last.pt


def test_final_last_pt_holds_the_final_weights_with_test_enabled(tmp_path):
    """With test.enable the final last.pt holds the last epoch's weights (not the best), while the model is left
    holding the best weights it was tested on (as Keras' restore_best_weights and HF's load_best_model_at_end do)."""
    seen = {}

    class Recording(TinyTrainer):
        def train_epoch(self):
            super().train_epoch()
            seen["last"] = copy.deepcopy(self.model.state_dict())
            seen["training"] = self.model.training

        def test_epoch(self):
            seen["tested"] = param_digest(self.model)
            return super().test_epoch()

    trainer = Recording(make_cfg(tmp_path, scripted_scores=(2.0, 1.0, 3.0, 4.0), test={"enable": True}))
    trainer.train()
    last = load(tmp_path / "last.pt")["model"]
    best = load(tmp_path / "best.pt")["model"]
    assert same_weights(last, seen["last"]) and not same_weights(last, best)
    assert same_weights(trainer.model.state_dict(), best)
    assert same_weights(trainer.best_model, best)
    assert seen["tested"] == param_digest(trainer.model)  # test ran on the best weights, which stay loaded


# ---------------------------------------------------------------------------------- 5. patience on resume

MISSES = (5.0, 4.0, 4.5, 4.6, 4.7, 4.8, 4.9, 5.0, 5.1, 5.2)  # minimized: epoch 1 is the best, then misses


@pytest.mark.parametrize(("new_patience", "stopped_after"), [(2, 3), (3, 4), (5, 6), (None, 9)])
def test_changed_patience_on_resume_applies_keeping_counted_misses(tmp_path, new_patience, stopped_after):
    """Resuming with a new val.patience applies it from the resumed epoch on, keeping the misses counted.

    Epochs 0-2 ran with patience 3 (one miss counted, at epoch 2); the resumed run stops once the misses
    from epoch 2 on reach the new patience, and the warning says so.
    """
    kwargs = dict(epochs=10, scripted_scores=MISSES)
    with pytest.raises(Crash):
        dying(3)(make_cfg(tmp_path, val={"patience": 3}, **kwargs)).train()
    if new_patience == 3:
        resumed = TinyTrainer(make_cfg(tmp_path, val={"patience": new_patience}, **kwargs))
    else:
        with pytest.warns(RuntimeWarning, match=r"val.patience 3 -> .*applied from epoch 3 on, keeping the 1 miss"):
            resumed = TinyTrainer(make_cfg(tmp_path, val={"patience": new_patience}, **kwargs))
    resumed.train()
    assert resumed.epochs_trained[-1] == stopped_after
    assert resumed.patience_state.patience == new_patience


def test_changed_min_delta_on_resume_applies_to_later_comparisons(tmp_path):
    """A new val.min_delta keeps the recorded best and applies to every later comparison."""
    scores = (5.0, 4.0, 3.9, 3.4, 3.3)
    with pytest.raises(Crash):
        dying(2)(make_cfg(tmp_path, epochs=5, scripted_scores=scores)).train()
    with pytest.warns(RuntimeWarning, match=r"val.min_delta 0.0 -> 0.5: later scores must beat the best \(4.0"):
        resumed = TinyTrainer(make_cfg(tmp_path, epochs=5, scripted_scores=scores, val={"min_delta": 0.5}))
    resumed.train()
    assert resumed.best_state.min_delta == 0.5
    assert (resumed.best_state.score, resumed.best_state.epoch) == (3.4, 3)  # 3.9 no longer counts


def test_changed_start_patience_on_resume_applies(tmp_path):
    """A raised val.start_patience on resume stops counting the misses of the epochs before it."""
    kwargs = dict(epochs=10, scripted_scores=MISSES)
    with pytest.raises(Crash):
        dying(3)(make_cfg(tmp_path, val={"patience": 2}, **kwargs)).train()
    with pytest.warns(RuntimeWarning, match=r"val.start_patience 0 -> 6"):
        resumed = TinyTrainer(make_cfg(tmp_path, val={"patience": 2, "start_patience": 6}, **kwargs))
    resumed.train()
    assert resumed.epochs_trained[-1] == 6  # 1 miss kept, the next counted miss is epoch 6


# ---------------------------------------------------------------------------------- 6. extending a run


def test_raising_epochs_extends_a_finished_run(tmp_path, capsys):
    """epochs=3 -> epochs=5 on the same out_dir trains 2 more epochs, bit-identical to a 5-epoch run."""
    reference = TinyTrainer(make_cfg(tmp_path / "ref", epochs=5))
    expected = reference.train()
    TinyTrainer(make_cfg(tmp_path / "run", epochs=3)).train()
    capsys.readouterr()
    extended = TinyTrainer(make_cfg(tmp_path / "run", epochs=5))
    assert "finished after 3 epochs; epochs=5 extends it by 2" in capsys.readouterr().err
    assert extended.train() == expected
    assert extended.epochs_trained == [3, 4]
    assert param_digest(extended.model) == param_digest(reference.model)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    assert load(tmp_path / "run" / "last.pt")["loop"]["stop_reason"] == "max_epochs"


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_tested_run_that_is_extended_continues_from_the_last_epochs_weights(tmp_path, fmt):
    """With test.enable, test() leaves the best weights in the model, yet a run extended from epochs=3 to 5 continues
    from the last epoch's weights in last.pt: its weights and trained rows are bit-identical to a 5-epoch run's; a
    rerun of the finished run, which only returns its results, leaves the best weights loaded too."""
    scores = (2.0, 1.0, 3.0, 4.0, 5.0)  # the best is epoch 1: testing it puts other weights in the model
    cfg = {"scripted_scores": scores, "test": {"enable": True}, "ckpt": {"format": fmt}}
    reference = TinyTrainer(make_cfg(tmp_path / "ref", epochs=5, **cfg))
    expected = reference.train()
    TinyTrainer(make_cfg(tmp_path / "run", epochs=3, **cfg)).train()
    extended = TinyTrainer(make_cfg(tmp_path / "run", epochs=5, **cfg))
    assert extended.train() == expected
    assert param_digest(extended.model) == param_digest(reference.model)  # both hold the best (epoch 1) weights
    def trained_rows(out):  # the 3-epoch run was tested when it finished: its test row is the one difference
        return [row for row in read_metrics(out) if not any(key.startswith("test/") for key in row)]

    assert trained_rows(tmp_path / "run") == trained_rows(tmp_path / "ref")
    if fmt == "file":
        ref_last, run_last = load(tmp_path / "ref" / "last.pt"), load(tmp_path / "run" / "last.pt")
        assert same_weights(run_last["model"], ref_last["model"])
        assert not same_weights(run_last["model"], load(tmp_path / "run" / "best.pt")["model"])
    again = TinyTrainer(make_cfg(tmp_path / "run", epochs=5, **cfg))
    assert param_digest(again.model) != param_digest(reference.model)  # restored: the last epoch's weights
    assert again.train() == expected
    assert param_digest(again.model) == param_digest(reference.model)


def test_early_stopped_run_continues_only_when_its_rule_allows(tmp_path, capsys):
    """A run that patience stopped stays stopped with more epochs; a larger patience lets it continue."""
    kwargs = dict(scripted_scores=MISSES)
    first = TinyTrainer(make_cfg(tmp_path, epochs=10, val={"patience": 2}, **kwargs))
    first.train()
    assert first.epochs_trained[-1] == 3
    capsys.readouterr()
    same = TinyTrainer(make_cfg(tmp_path, epochs=10, val={"patience": 2}, **kwargs))
    same.train()
    assert same.epochs_trained == []
    assert "stopped early after 4 epochs and stays stopped" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match="val.patience 2 -> 4"):
        more = TinyTrainer(make_cfg(tmp_path, epochs=10, val={"patience": 4}, **kwargs))
    assert "val.patience=4 allows more, so it continues" in capsys.readouterr().err
    more.train()
    assert more.epochs_trained == [4, 5]  # misses at 2, 3 kept; 4 and 5 exhaust patience 4
    assert more.patience_state.exhausted


def test_early_stop_by_the_subclass_own_rule_stays_stopped(tmp_path, capsys):
    """A run that val_epoch() stopped by a rule of its own (patience not exhausted) is never reopened."""

    class StopsAtTwo(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return self.epoch == 1

    StopsAtTwo(make_cfg(tmp_path, epochs=5)).train()
    capsys.readouterr()
    again = StopsAtTwo(make_cfg(tmp_path, epochs=8))
    again.train()
    assert again.epochs_trained == []
    assert "stays stopped" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- 7. lowered epochs


def test_lowering_epochs_still_validates_the_last_epoch(tmp_path, capsys):
    """A run resumed with epochs below where it stood validates its last epoch before finishing."""
    kwargs = dict(val={"every_n_epochs": 3})
    with pytest.raises(Crash):
        dying(5)(make_cfg(tmp_path, epochs=10, **kwargs)).train()  # epochs 0-4 ran; only epoch 2 validated
    capsys.readouterr()
    resumed = TinyTrainer(make_cfg(tmp_path, epochs=3, **kwargs))
    assert "validating epoch 4 and finishing" in capsys.readouterr().err
    result = resumed.train()
    assert resumed.epochs_trained == [] and resumed.epochs_validated == [4]
    last = load(tmp_path / "last.pt")["loop"]
    assert last["stop_reason"] == "max_epochs" and last["last_validated"] is True
    assert "val/loss" in result
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"trainer/epoch": 4' in rows[-1] and "val/loss" in rows[-1]


# ---------------------------------------------------------------------------------- 8. falsey verdicts


@pytest.mark.parametrize(
    "verdict",
    [
        None,
        False,
        0,
        0.0,
        "",
        [],
        {},
        (),
        np.float64(0.0),
        np.bool_(False),
        np.array(0),
        torch.tensor(0.0),
        torch.tensor(False),
        torch.zeros(1),
    ],
    ids=repr,
)
def test_every_falsey_verdict_means_go_on(tmp_path, verdict):
    """val_epoch() returning any falsey value ("False (or falsey)") trains on, without a warning."""

    class Falsey(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return verdict

    trainer = Falsey(make_cfg(tmp_path, epochs=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train()
    assert trainer.epochs_trained == [0, 1]


@pytest.mark.parametrize("verdict", [True, np.bool_(True), torch.tensor(True), np.array(True)], ids=repr)
def test_bool_verdicts_of_any_library_stop(tmp_path, verdict):
    """numpy's and torch's True (numpy 2 names its type bool) stop training like Python's True."""

    class Stops(TinyTrainer):
        def val_epoch(self):
            super().val_epoch()
            return verdict

    trainer = Stops(make_cfg(tmp_path, epochs=3))
    trainer.train()
    assert trainer.epochs_trained == [0]


# ---------------------------------------------------------------------------------- 9. the record names


def test_subclass_may_use_best_state_and_patience_state_names(tmp_path):
    """A trainer that never tracks a best may keep its own best_state/patience_state; saves and the summary work."""

    class OwnNames(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.best_state = {"mine": 1}
            self.patience_state = 3

        def val_epoch(self):
            self.epochs_validated.append(self.epoch)
            return False

    trainer = OwnNames(make_cfg(tmp_path, epochs=2))
    trainer.train()
    assert trainer.best_state == {"mine": 1} and trainer.patience_state == 3
    last = load(tmp_path / "last.pt")
    assert last["best"] is None and last["patience"] is None
    resumed = OwnNames(make_cfg(tmp_path, epochs=3))
    resumed.train()
    assert resumed.best_state == {"mine": 1}


def test_engine_records_survive_a_subclass_attribute_of_the_same_name(tmp_path):
    """A subclass that tracks a best and also sets best_state for itself keeps its value; the engine's wins in files."""

    class Shadowing(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.best_state = "mine"

    trainer = Shadowing(make_cfg(tmp_path, epochs=2, scripted_scores=(2.0, 1.0)))
    trainer.train()
    assert trainer.best_state == "mine"
    assert load(tmp_path / "last.pt")["best"]["score"] == 1.0


# ---------------------------------------------------------------------------------- 10. torch.compile


class CompiledTrainer(TinyTrainer):
    """TinyTrainer whose model is torch.compile'd when cfg.lr says so (eager backend: no codegen)."""

    compile_model = False

    def make_ddp(self, module, find_unused_parameters=False):
        wrapped = super().make_ddp(module, find_unused_parameters)
        # compiled before TinyTrainer.setup registers it: the registered model is the compiled one
        return torch.compile(wrapped, backend="eager") if self.compile_model else wrapped


def compiled(flag: bool):
    return type("Compiled" if flag else "Plain", (CompiledTrainer,), {"compile_model": flag})


@pytest.mark.parametrize(("first", "second"), [(True, False), (False, True)])
def test_torch_compile_toggled_between_save_and_resume(tmp_path, first, second):
    """A checkpoint saved with torch.compile on resumes with it off and the other way round, best.pt included."""
    kwargs = dict(epochs=3, scripted_scores=(2.0, 1.0, 3.0), test={"enable": True})
    reference = TinyTrainer(make_cfg(tmp_path / "ref", **kwargs))
    expected = reference.train()

    class Dying(compiled(first)):
        def train_epoch(self):
            if self.epoch == 2:
                raise Crash
            super().train_epoch()

    with pytest.raises(Crash):
        Dying(make_cfg(tmp_path / "run", **kwargs)).train()
    saved = load(tmp_path / "run" / "last.pt")
    assert not any("_orig_mod" in key for key in saved["model"])
    assert not any("_orig_mod" in key for key in load(tmp_path / "run" / "best.pt")["model"])
    resumed = compiled(second)(make_cfg(tmp_path / "run", **kwargs))
    assert resumed.train() == pytest.approx(expected)
    assert same_weights(resumed.best_model, reference.best_model)


# ---------------------------------------------------------------------------------- 11. train/eval modes


class ForgetsTrainMode(TinyTrainer):
    """Calls model.eval() in validation and never model.train() again: from epoch 1 on it trains in eval mode."""

    def train_epoch(self):
        self.epochs_trained.append(self.epoch)
        for x, y in self.loader:
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.log({"train/loss": loss.detach()})


def test_module_train_eval_mode_survives_a_resume(tmp_path):
    """Each registered module's train/eval flags are saved and restored, so a resume stays exact."""
    reference = ForgetsTrainMode(make_cfg(tmp_path / "ref", epochs=3, dropout=0.5))
    reference.train()

    class Dying(ForgetsTrainMode):
        def train_epoch(self):
            if self.epoch == 2:
                raise Crash
            super().train_epoch()

    with pytest.raises(Crash):
        Dying(make_cfg(tmp_path / "run", epochs=3, dropout=0.5)).train()
    assert load(tmp_path / "run" / "last.pt")["training_modes"]["model"][""] is False
    resumed = ForgetsTrainMode(make_cfg(tmp_path / "run", epochs=3, dropout=0.5))
    assert not resumed.model.training and not resumed.model[2].training
    resumed.train()
    assert param_digest(resumed.model) == param_digest(reference.model)


# ---------------------------------------------------------------------------------- 13. ckpt.enable=false


def test_ckpt_disabled_never_auto_resumes(tmp_path):
    """A run with ckpt.enable=false ignores an old last.pt in out_dir and trains from scratch."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=2, ckpt={"enable": False}))
    assert trainer.epoch == 0 and trainer.best_model is None
    trainer.train()
    assert trainer.epochs_trained == [0, 1]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_ckpt_disabled_still_resumes_from_a_named_path(tmp_path):
    """ckpt.resume=<path> is honoured with ckpt.enable=false: the run reads it and writes nothing."""
    with pytest.raises(Crash):
        dying(1)(make_cfg(tmp_path / "a", epochs=3)).train()
    trainer = TinyTrainer(
        make_cfg(tmp_path / "b", epochs=3, ckpt={"enable": False, "resume": str(tmp_path / "a" / "last.pt")})
    )
    trainer.train()
    assert trainer.epochs_trained == [1, 2]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


# ---------------------------------------------------------------------------------- 14. exact keys


@attrs.frozen(kw_only=True)
class PrefixConfig(TinyConfig):
    """User keys that start like run-control keys."""

    epochs_warmup: int = 0
    log_temperature: float = 1.0
    testing_mode: bool = False


class PrefixTrainer(TinyTrainer):
    config_class = PrefixConfig


def test_changed_config_check_matches_exact_keys(tmp_path):
    """User keys such as epochs_warmup or log_temperature are reported when they change on resume."""
    PrefixTrainer(make_cfg(tmp_path, epochs=2)).train()
    with pytest.warns(RuntimeWarning) as record:
        PrefixTrainer(make_cfg(tmp_path, epochs=3, epochs_warmup=5, log_temperature=0.5, testing_mode=True))
    message = " ".join(str(w.message) for w in record)
    assert "epochs_warmup: 0 -> 5" in message
    assert "log_temperature: 1.0 -> 0.5" in message
    assert "testing_mode: False -> True" in message
    assert "epochs:" not in message  # the engine's own run-control keys stay quiet


# ---------------------------------------------------------------------------------- 2. plain values of libraries


class LibraryState:
    """A registered item whose state holds what common libraries' state dicts hold."""

    def __init__(self) -> None:
        self.state = {
            "count": np.int64(3),
            "scale": np.float64(0.5),
            "flag": np.bool_(True),
            "history": np.arange(6, dtype=np.float32).reshape(2, 3),
            "window": slice(2, 10, 2),
            "shape": torch.Size([4, 5]),
            "dtype": torch.float16,
            "nested": {"ids": [np.int32(7), (1, 2)], "mask": np.array([True, False])},
        }

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_numpy_values_and_slices_in_a_registered_item_save_and_resume(tmp_path):
    """numpy scalars and arrays, slices, torch.Size and dtypes resume as they were; nothing is called corrupt."""

    class WithLibraryState(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.library = LibraryState()
            self.add_checkpoint_items(library=self.library)

    class Dying(WithLibraryState):
        def train_epoch(self):
            if self.epoch == 2:
                raise Crash
            super().train_epoch()

    with pytest.raises(Crash):
        Dying(make_cfg(tmp_path)).train()
    saved = copy.deepcopy(LibraryState().state)
    resumed = WithLibraryState(make_cfg(tmp_path))
    assert resumed.epoch == 2  # from last.pt itself, not one epoch back
    assert not (tmp_path / "last.corrupt.pt").exists()
    state = resumed.library.state
    assert type(state["count"]) is np.int64 and state["count"] == 3
    assert type(state["flag"]) is np.bool_ and type(state["scale"]) is np.float64
    assert np.array_equal(state["history"], saved["history"]) and state["history"].dtype == np.float32
    assert state["window"] == slice(2, 10, 2) and state["shape"] == torch.Size([4, 5])
    assert state["dtype"] is torch.float16 and np.array_equal(state["nested"]["mask"], [True, False])
    resumed.train()


def test_a_value_that_would_not_load_is_refused_at_save_time(tmp_path):
    """A state holding a numpy Generator is refused at the save, naming the item and key path; last.pt stays."""
    from trainkit import CheckpointUnsafeError

    class Sampler:
        def __init__(self):
            self.rng = None

        def state_dict(self):
            return {"rng": {"gen": self.rng}}

        def load_state_dict(self, state):
            pass

    sampler = Sampler()

    class WithSampler(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.add_checkpoint_items(sampler=sampler)

        def train_epoch(self):
            super().train_epoch()
            if self.epoch == 1:
                sampler.rng = np.random.default_rng(0)

    trainer = WithSampler(make_cfg(tmp_path, epochs=3))
    with pytest.raises(
        CheckpointUnsafeError, match=r"'sampler' holds a numpy.random.*Generator at sampler\['rng'\]\['gen'\]"
    ):
        trainer.train()
    assert load(tmp_path / "last.pt")["epoch"] == 1
