"""The step boundaries' schedule against a model that counts period multiples crossed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.bookkeeping.step_schedule import (
    StepDue,
    StepSchedule,
    next_due,
    schedule_from,
    schedule_saved,
    step_due,
)
from trainkit.errors import BookkeepingError

periods = st.none() | st.integers(min_value=1, max_value=7)


def crossed(last: int, step: int, every: int | None) -> bool:
    """Whether a multiple of ``every`` lies in ``(last, step]``: the model of "due since ``last``"."""
    return every is not None and step // every > last // every


SCHEDULES = {
    "every": periods,
    "val_every": periods,
    "log_every": periods,
    "max_steps": st.none() | st.integers(min_value=1, max_value=60),
    "start": st.integers(min_value=0, max_value=20),
}
"""A schedule's settings and the step it starts from, as every property here draws them."""


@given(
    **SCHEDULES,
    moves=st.lists(st.tuples(st.integers(min_value=1, max_value=3), st.booleans()), max_size=40),
    saving=st.booleans(),
)
def test_each_boundary_gets_what_the_periods_crossed_since_it_was_last_done(
    every, val_every, log_every, max_steps, start, moves, saving
):
    """A step validation, a row and a save each fall due once per period multiple crossed since they were last done
    (a counter that jumps past a multiple still gets them once); the step budget's end takes the place of a step
    validation and a save; a stop saves wherever the loop writes step checkpoints."""
    schedule = StepSchedule(
        every_n_steps=every,
        val_every_n_steps=val_every,
        log_every_n_steps=log_every,
        max_steps=math.inf if max_steps is None else max_steps,
    )
    schedule = schedule_from(schedule, start, saving=saving)
    last_val = last_log = last_save = start
    step = start
    for jump, stop in moves:
        step += jump
        due, schedule = step_due(schedule, step, stop=stop, saving=saving)
        end = max_steps is not None and step >= max_steps
        assert due == StepDue(
            save=saving and not end and (stop or crossed(last_save, step, every)),
            stop=stop,
            validate=not end and crossed(last_val, step, val_every),
            push=crossed(last_log, step, log_every),
            end=end,
        )
        if due.validate:
            last_val = step
        if due.push:
            last_log = step
        if due.save:
            last_save = step
            schedule = schedule_saved(schedule, step, saving=saving)


@given(
    **SCHEDULES,
    step=st.integers(min_value=0, max_value=80),
    saving=st.booleans(),
)
def test_nothing_is_due_before_due_at(every, val_every, log_every, max_steps, start, step, saving):
    """Below ``StepSchedule.due_at`` a boundary without a stop has nothing due and leaves the schedule as it
    was: the one comparison the epoch tracker makes at almost every step boundary."""
    schedule = schedule_from(
        StepSchedule(
            every_n_steps=every,
            val_every_n_steps=val_every,
            log_every_n_steps=log_every,
            max_steps=math.inf if max_steps is None else max_steps,
        ),
        start,
        saving=saving,
    )
    due, after = step_due(schedule, step, stop=False, saving=saving)
    if step < schedule.due_at:
        assert not any(due) and after == schedule
    else:
        assert any(due)


def test_a_period_that_is_not_a_positive_int_is_refused():
    with pytest.raises(BookkeepingError, match="every_n_steps must be None or an int >= 1"):
        next_due(3, 0)
    with pytest.raises(BookkeepingError):
        schedule_from(StepSchedule(every_n_steps=None, val_every_n_steps=2.5, log_every_n_steps=None), 0, saving=True)
