"""Point tests of best-score tracking: one test per rule of BestState and save_if_best."""

from __future__ import annotations

import pytest

from trainkit.bookkeeping import BestState, best_metric_key, save_if_best
from trainkit.errors import BookkeepingError


class FakeScalar:
    """A 0-d tensor stand-in: a torch-free object that converts with float()."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


def test_first_finite_score_improves():
    """The first finite score improves an empty record and is recorded with its epoch."""
    state, improved = save_if_best(BestState(minimize=True), 0.5, epoch=3)
    assert improved
    assert (state.score, state.epoch) == (0.5, 3)


@pytest.mark.parametrize("minimize", [True, False])
def test_tie_does_not_improve(minimize):
    """A score equal to the best does not improve, in either direction."""
    state, _ = save_if_best(BestState(minimize=minimize), 1.0, epoch=0)
    new, improved = save_if_best(state, 1.0, epoch=1)
    assert not improved
    assert new.epoch == 0


@pytest.mark.parametrize(("minimize", "score"), [(True, 0.75), (False, 1.25)])
def test_gain_of_exactly_min_delta_does_not_improve(minimize, score):
    """Beating the best by exactly min_delta does not count; beating it by more does."""
    state, _ = save_if_best(BestState(minimize=minimize, min_delta=0.25), 1.0, epoch=0)
    assert not save_if_best(state, score, epoch=1)[1]
    beyond = score - 0.25 if minimize else score + 0.25
    assert save_if_best(state, beyond, epoch=1)[1]


@pytest.mark.parametrize("minimize", [True, False])
def test_better_score_improves_in_the_record_direction(minimize):
    """Lower improves when minimizing and higher improves when maximizing, never the other way."""
    state, _ = save_if_best(BestState(minimize=minimize), 1.0, epoch=0)
    lower, higher = save_if_best(state, 0.5)[1], save_if_best(state, 1.5)[1]
    assert (lower, higher) == ((True, False) if minimize else (False, True))


@pytest.mark.parametrize("score", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("has_best", [False, True])
def test_non_finite_never_improves_and_returns_the_same_record(score, has_best):
    """NaN and +-inf never improve, with or without a best yet, and return the very same record object."""
    state = BestState(minimize=True)
    if has_best:
        state, _ = save_if_best(state, 1.0, epoch=0)
    new, improved = save_if_best(state, score, epoch=1, metrics={"loss": score})
    assert not improved
    assert new is state


def test_zero_score_is_a_real_best():
    """0.0 is a finite score like any other, not a missing one."""
    state, improved = save_if_best(BestState(), 0.0, epoch=0)
    assert improved and state.score == 0.0
    assert not save_if_best(state, -1.0, epoch=1)[1]


def test_scalar_objects_convert_with_float():
    """A torch-free 0-d scalar stand-in (anything with __float__) is accepted and stored as a Python float."""
    state, improved = save_if_best(BestState(), FakeScalar(0.25), epoch=0, metrics={"acc": FakeScalar(0.5)})
    assert improved
    assert type(state.score) is float and state.score == 0.25
    assert type(state.metrics["best/val/acc"]) is float


def test_numpy_scalars_convert_with_float():
    """numpy scalars are accepted as scores and metric values and stored as Python floats."""
    np = pytest.importorskip("numpy")
    state, improved = save_if_best(BestState(), np.float32(0.5), epoch=0, metrics={"acc": np.float64(0.75)})
    assert improved
    assert type(state.score) is float and state.score == 0.5
    assert type(state.metrics["best/val/acc"]) is float
    assert not save_if_best(state, np.float64("nan"))[1]


@pytest.mark.parametrize("score", [True, False])
def test_bool_score_is_refused(score):
    """A bool is not a score, although Python treats it as an int."""
    with pytest.raises(BookkeepingError, match="score must be a real number"):
        save_if_best(BestState(), score)


@pytest.mark.parametrize("score", [None, "0.5", [0.5]])
def test_non_numeric_score_is_refused(score):
    """None, strings and containers are refused with an error naming the score."""
    with pytest.raises(BookkeepingError, match="score"):
        save_if_best(BestState(), score)


def test_metrics_are_recorded_under_best_val_prefix():
    """Metric names with a val/ prefix, without one, or already under best/val/ all land under best/val/."""
    metrics = {"val/acc": 0.9, "loss": 0.1, "best/val/f1": 0.8}
    state, _ = save_if_best(BestState(), 0.9, epoch=0, metrics=metrics)
    assert dict(state.metrics) == {"best/val/acc": 0.9, "best/val/loss": 0.1, "best/val/f1": 0.8}
    assert best_metric_key("val/acc") == best_metric_key("acc") == "best/val/acc"


def test_metrics_are_replaced_on_improvement_and_kept_otherwise():
    """An improvement replaces the recorded metrics wholesale; a miss leaves them as they were."""
    state, _ = save_if_best(BestState(), 0.5, epoch=0, metrics={"acc": 0.5, "old": 1.0})
    missed, _ = save_if_best(state, 0.4, epoch=1, metrics={"acc": 0.4})
    assert dict(missed.metrics) == {"best/val/acc": 0.5, "best/val/old": 1.0}
    improved, _ = save_if_best(state, 0.6, epoch=2, metrics={"acc": 0.6})
    assert dict(improved.metrics) == {"best/val/acc": 0.6}


def test_metrics_are_read_only():
    """The recorded metrics mapping cannot be changed in place, and neither can the record."""
    state, _ = save_if_best(BestState(), 0.5, epoch=0, metrics={"acc": 0.5})
    with pytest.raises(TypeError):
        state.metrics["best/val/acc"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        state.score = 1.0  # type: ignore[misc]


def test_caller_metrics_dict_is_copied():
    """Changing the caller's metrics dict afterwards does not change the record."""
    metrics = {"acc": 0.5}
    state, _ = save_if_best(BestState(), 0.5, epoch=0, metrics=metrics)
    metrics["acc"] = 0.0
    assert state.metrics["best/val/acc"] == 0.5


def test_input_record_is_left_unchanged():
    """save_if_best returns a new record and leaves the one it was given as it was."""
    state = BestState(minimize=True)
    new, _ = save_if_best(state, 0.5, epoch=0)
    assert state == BestState(minimize=True)
    assert new is not state


@pytest.mark.parametrize("min_delta", [-0.1, float("nan"), float("inf"), True])
def test_invalid_min_delta_is_refused(min_delta):
    """min_delta must be a finite float >= 0."""
    with pytest.raises(BookkeepingError, match="min_delta"):
        BestState(min_delta=min_delta)


@pytest.mark.parametrize("score", [float("nan"), float("inf")])
def test_record_cannot_hold_a_non_finite_best(score):
    """A BestState built directly cannot hold a NaN or infinite best score."""
    with pytest.raises(BookkeepingError, match="BestState.score must be finite"):
        BestState(score=score)


@pytest.mark.parametrize("epoch", [-1, 1.0, True])
def test_invalid_epoch_is_refused(epoch):
    """The epoch recorded with a best must be an int >= 0 or None."""
    with pytest.raises(BookkeepingError, match="epoch"):
        save_if_best(BestState(), 0.5, epoch=epoch)


def test_minimize_must_be_a_bool():
    """The direction is a bool, not a truthy value such as the string "min"."""
    with pytest.raises(BookkeepingError, match="minimize"):
        BestState(minimize="min")  # type: ignore[arg-type]


def test_numpy_bool_score_is_refused():
    """A numpy bool is not a score, like a Python bool."""
    numpy = pytest.importorskip("numpy")
    with pytest.raises(BookkeepingError, match="real number"):
        save_if_best(BestState(), numpy.bool_(True))
