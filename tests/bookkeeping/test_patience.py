"""Point tests of early-stopping patience: one test per rule of PatienceState and step_patience."""

from __future__ import annotations

import pytest

from trainkit.bookkeeping import PatienceState, step_patience
from trainkit.errors import BookkeepingError


def run(state: PatienceState, outcomes, epochs=None):
    """Feed improvement outcomes one by one; return the final record and the list of stop verdicts."""
    stops = []
    for index, improved in enumerate(outcomes):
        epoch = None if epochs is None else epochs[index]
        state, stop = step_patience(state, improved, epoch=epoch)
        stops.append(stop)
    return state, stops


def test_remaining_starts_at_patience():
    """A new record has all of its patience left."""
    assert PatienceState(patience=3).remaining == 3


def test_patience_zero_is_refused_with_a_hint():
    """patience=0 is refused, and the message suggests 1 or None instead."""
    with pytest.raises(BookkeepingError, match="patience must be >= 1 or None") as info:
        PatienceState(patience=0)
    assert "use 1" in str(info.value) and "None" in str(info.value)


@pytest.mark.parametrize("patience", [-1, 1.5, True, "3"])
def test_patience_must_be_a_positive_int(patience):
    """Negative, fractional, bool and string patience values are refused."""
    with pytest.raises(BookkeepingError, match="patience"):
        PatienceState(patience=patience)


def test_patience_three_stops_at_the_third_consecutive_miss():
    """With patience=3 the stop verdict is False, False, then True at the third counted miss."""
    state, stops = run(PatienceState(patience=3), [False, False, False], epochs=[0, 1, 2])
    assert stops == [False, False, True]
    assert state.remaining == 0 and state.exhausted


def test_patience_one_stops_at_the_first_miss():
    """With patience=1 the first counted miss stops the run."""
    _, stops = run(PatienceState(patience=1), [False], epochs=[0])
    assert stops == [True]


def test_improvement_refills_patience():
    """An improvement resets the count of misses, so misses must be consecutive to stop."""
    state, stops = run(PatienceState(patience=2), [False, True, False, True, False], epochs=[0, 1, 2, 3, 4])
    assert stops == [False] * 5
    assert state.remaining == 1


def test_misses_before_start_patience_are_not_counted():
    """Misses at epochs below start_patience leave patience untouched; the one at start_patience counts."""
    state, stops = run(PatienceState(patience=1, start_patience=3), [False, False, False], epochs=[0, 1, 2])
    assert stops == [False, False, False]
    assert state.remaining == 1
    _, stop = step_patience(state, False, epoch=3)
    assert stop


def test_epoch_none_counts_every_miss():
    """Without an epoch every miss counts, even when start_patience is set."""
    state, stops = run(PatienceState(patience=2, start_patience=10), [False, False])
    assert stops == [False, True]


def test_improved_none_is_refused():
    """improved=None (a forgotten return value) is refused rather than taken as a miss."""
    with pytest.raises(BookkeepingError, match="improved must be a bool, got None"):
        step_patience(PatienceState(patience=2), None, epoch=0)


@pytest.mark.parametrize("epoch", [-1, 1.0, True])
def test_invalid_epoch_is_refused(epoch):
    """The epoch passed to step_patience must be an int >= 0 or None."""
    with pytest.raises(BookkeepingError, match="epoch"):
        step_patience(PatienceState(patience=2), False, epoch=epoch)


def test_remaining_never_goes_below_zero():
    """Misses after exhaustion keep remaining at 0 and the verdict True."""
    state, stops = run(PatienceState(patience=2), [False] * 5, epochs=list(range(5)))
    assert stops == [False, True, True, True, True]
    assert state.remaining == 0


def test_patience_none_never_stops():
    """With patience=None the verdict is always False and the record never changes."""
    state = PatienceState(patience=None)
    new, stops = run(state, [False] * 10, epochs=list(range(10)))
    assert stops == [False] * 10
    assert new == state and new.remaining is None and not new.exhausted


def test_input_record_is_left_unchanged():
    """step_patience returns a new record and leaves the one it was given as it was."""
    state = PatienceState(patience=2)
    new, _ = step_patience(state, False, epoch=0)
    assert state.remaining == 2 and new.remaining == 1


@pytest.mark.parametrize(("patience", "remaining"), [(2, 3), (2, -1), (None, 1)])
def test_remaining_must_fit_patience(patience, remaining):
    """A record cannot hold more patience than configured, less than none, or a count when disabled."""
    with pytest.raises(BookkeepingError, match="remaining"):
        PatienceState(patience=patience, remaining=remaining)


def test_start_patience_must_be_non_negative():
    """start_patience is a 0-based epoch, so it cannot be negative."""
    with pytest.raises(BookkeepingError, match="start_patience"):
        PatienceState(patience=2, start_patience=-1)


@pytest.mark.parametrize("verdict", ["False", 1, 0.0])
def test_non_bool_verdicts_are_refused(verdict):
    """A string or number passed as the improvement verdict is refused rather than read as truthy."""
    with pytest.raises(BookkeepingError, match="improved must be a bool"):
        step_patience(PatienceState(patience=2), verdict)
