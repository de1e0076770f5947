"""Point tests of loop arithmetic: the validation schedule, LoopState and end_epoch."""

from __future__ import annotations

import pytest

from trainkit.bookkeeping import STOP_EARLY, STOP_MAX_EPOCHS, LoopState, end_epoch, resume_loop, should_validate
from trainkit.errors import BookkeepingError


def test_should_validate_every_third_epoch_and_the_last():
    """With 10 epochs and a period of 3, validation runs after epochs 2, 5, 8 and the last one, 9."""
    assert [epoch for epoch in range(10) if should_validate(epoch, 10, 3)] == [2, 5, 8, 9]


def test_should_validate_every_epoch():
    """A period of 1 validates after every epoch."""
    assert all(should_validate(epoch, 4, 1) for epoch in range(4))


def test_should_validate_period_longer_than_the_run():
    """A period longer than the run still validates once, after the last epoch."""
    assert [epoch for epoch in range(3) if should_validate(epoch, 3, 10)] == [2]


@pytest.mark.parametrize(
    ("epoch", "epochs", "every", "match"),
    [
        (-1, 10, 3, "epoch must be an int >= 0"),
        (10, 10, 3, "epoch must be < epochs=10"),
        (0, 0, 3, "epochs must be an int >= 1"),
        (0, 10, 0, "every_n_epochs must be an int >= 1"),
        (0, 10, True, "every_n_epochs must be an int >= 1"),
        (1.0, 10, 3, "epoch must be an int >= 0"),
    ],
)
def test_should_validate_out_of_range_arguments_raise(epoch, epochs, every, match):
    """An epoch outside [0, epochs), a non-positive count or period, or a non-int is an error naming it."""
    with pytest.raises(BookkeepingError, match=match):
        should_validate(epoch, epochs, every)


def test_end_epoch_continues_while_epochs_remain():
    """Closing an epoch before the last advances the epoch and step and asks for another epoch."""
    state, more = end_epoch(LoopState(), epochs=3, early_stop=False, step=4)
    assert more
    assert state == LoopState(epoch=1, step=4, stop_reason=None)
    assert not state.finished


def test_end_epoch_stops_at_max_epochs():
    """Closing the last configured epoch finishes the run with reason max_epochs."""
    state, more = end_epoch(LoopState(epoch=2, step=8), epochs=3, early_stop=False, step=12)
    assert not more
    assert state == LoopState(epoch=3, step=12, stop_reason=STOP_MAX_EPOCHS)
    assert state.finished


def test_end_epoch_stops_early_on_the_verdict():
    """A truthy early-stop verdict finishes the run with reason early_stop."""
    state, more = end_epoch(LoopState(), epochs=10, early_stop=True, step=1)
    assert not more
    assert state.stop_reason == STOP_EARLY


def test_early_stop_at_the_last_epoch_reports_early_stop():
    """When patience runs out at the last epoch, the recorded reason is early_stop, not max_epochs."""
    state, _ = end_epoch(LoopState(epoch=2), epochs=3, early_stop=True, step=0)
    assert state.stop_reason == STOP_EARLY


def test_end_epoch_after_finishing_is_refused():
    """A finished run cannot be advanced again."""
    state, _ = end_epoch(LoopState(), epochs=1, early_stop=False, step=0)
    with pytest.raises(BookkeepingError, match="already finished"):
        end_epoch(state, epochs=5, early_stop=False, step=0)


def test_end_epoch_refuses_a_step_that_goes_backwards():
    """The optimizer step count never decreases."""
    with pytest.raises(BookkeepingError, match="step went backwards from 5 to 4"):
        end_epoch(LoopState(step=5), epochs=3, early_stop=False, step=4)


def test_end_epoch_refuses_non_positive_epochs():
    """The configured number of epochs must be >= 1."""
    with pytest.raises(BookkeepingError, match="epochs must be an int >= 1"):
        end_epoch(LoopState(), epochs=0, early_stop=False, step=0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"epoch": -1}, "LoopState.epoch"),
        ({"step": 1.5}, "LoopState.step"),
        ({"stop_reason": "done"}, "LoopState.stop_reason"),
    ],
)
def test_loop_state_validates_its_fields(fields, match):
    """Counters are ints >= 0 and the stop reason is one of the known reasons or None."""
    with pytest.raises(BookkeepingError, match=match):
        LoopState(**fields)


def test_resume_loop_continues_an_unfinished_run():
    """An unfinished run with epochs left continues unchanged."""
    state = LoopState(epoch=3, step=30)
    assert resume_loop(state, epochs=5) == (state, True)


def test_resume_loop_finishes_a_run_past_a_lowered_epoch_count():
    """An unfinished run that already did the (now lowered) number of epochs finishes with max_epochs."""
    state, more = resume_loop(LoopState(epoch=3), epochs=2)
    assert not more
    assert state.stop_reason == STOP_MAX_EPOCHS


def test_resume_loop_keeps_a_finished_run_finished():
    """A finished run stays finished, even when more epochs are configured now."""
    state = LoopState(epoch=2, stop_reason=STOP_EARLY)
    assert resume_loop(state, epochs=10) == (state, False)
