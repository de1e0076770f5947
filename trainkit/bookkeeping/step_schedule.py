"""When work falls due at the training loop's step boundaries: a step checkpoint, a step validation, a row, the end
of the step budget.

Pure: stdlib and attrs only. The epoch tracker (:class:`~trainkit.loop.epoch_tracker.EpochTracker`) holds a
:class:`StepSchedule`, compares one number per step boundary with it (its ``due_at``), and only when
something may be due asks :func:`step_due`; it keeps the effects (the ranks' stop vote, the counted batches).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import attrs

from trainkit.bookkeeping._records import is_int
from trainkit.errors import BookkeepingError

__all__ = [
    "StepDue",
    "StepSchedule",
    "next_due",
    "next_step_checkpoint",
    "schedule_from",
    "schedule_saved",
    "step_checkpoint_due",
    "step_due",
]


class StepDue(NamedTuple):
    """What falls due at a step boundary of the training loop (:func:`step_due`)."""

    save: bool
    """A step checkpoint is due (or the ranks stop on a signal, and the loop can be resumed from here)."""
    stop: bool
    """The ranks stop on a signal now."""
    validate: bool
    """A step validation is due (``val.every_n_steps``)."""
    push: bool
    """A row is due (``log_every_n_steps``)."""
    end: bool
    """``max_steps`` is reached: the loop ends here (the run's final validation, save and test follow)."""


def step_checkpoint_due(last_saved_step: int, step: int, every_n_steps: int | None) -> bool:
    """Tell whether a step checkpoint is due at a step boundary.

    Pure. Due when ``step`` has reached a multiple of ``every_n_steps`` that ``last_saved_step`` had not,
    so a counter that jumps past a multiple (two optimizer steps between batches) still saves once.

    :param last_saved_step: The step of the last checkpoint (or where the epoch started).
    :param step: Optimizer steps taken now.
    :param every_n_steps: The period; None means step checkpoints are off.
    :returns: Whether to write ``last.pt`` now.
    :raises BookkeepingError: When ``every_n_steps`` is not None and not an int >= 1.

    >>> [s for s in range(1, 10) if step_checkpoint_due(s - 1, s, 3)]
    [3, 6, 9]
    >>> step_checkpoint_due(5, 7, 3), step_checkpoint_due(6, 8, 3), step_checkpoint_due(0, 9, None)
    (True, False, False)
    """
    due_at = next_step_checkpoint(last_saved_step, every_n_steps)
    return due_at is not None and step >= due_at


def next_step_checkpoint(last_saved_step: int, every_n_steps: int | None) -> int | None:
    """The step count from which the next step checkpoint is due: the next multiple of ``every_n_steps``.

    Pure. ``step_checkpoint_due(last, step, n)`` is ``step >= next_step_checkpoint(last, n)``; a loop that
    reads the threshold once per save compares one int per step instead.

    :param last_saved_step: The step of the last checkpoint (or where the epoch started).
    :param every_n_steps: The period; None means step checkpoints are off.
    :returns: The first step count at which one is due; None when they are off.
    :raises BookkeepingError: When ``every_n_steps`` is not None and not an int >= 1.

    >>> [next_step_checkpoint(saved, 3) for saved in (0, 5, 6)], next_step_checkpoint(6, None)
    ([3, 6, 9], None)
    """
    if every_n_steps is None:
        return None
    if not is_int(every_n_steps) or every_n_steps < 1:
        raise BookkeepingError(f"every_n_steps must be None or an int >= 1, got {every_n_steps!r}")
    return (last_saved_step // every_n_steps + 1) * every_n_steps


def next_due(step: int, every_n_steps: int | None) -> float:
    """The first step after ``step`` that is a multiple of ``every_n_steps``; ``inf`` when never (None).

    Pure: :func:`next_step_checkpoint` as a number a step count is compared with.

    :param step: The optimizer step counter.
    :param every_n_steps: The period, or None.
    :returns: The step, or ``math.inf``.
    :raises BookkeepingError: When ``every_n_steps`` is not None and not an int >= 1.

    >>> next_due(4, 3), next_due(6, 3), next_due(6, None)
    (6, 9, inf)
    """
    due = next_step_checkpoint(step, every_n_steps)
    return math.inf if due is None else due


def _due_at(instance: StepSchedule) -> float:
    return min(instance.ckpt_due, instance.val_due, instance.log_due, instance.max_steps)


@attrs.frozen(kw_only=True)
class StepSchedule:
    """The periods of the work done at step boundaries, and the step from which each falls due next.

    :ivar every_n_steps: ``ckpt.every_n_steps`` (None: no step checkpoints).
    :ivar val_every_n_steps: ``val.every_n_steps`` (None: no step validation).
    :ivar log_every_n_steps: ``log_every_n_steps`` (None: no rows at step boundaries).
    :ivar max_steps: ``max_steps``: the loop ends at that step boundary (``inf``: at its last batch).
    :ivar ckpt_due: The step from which a step checkpoint is due (``inf``: none).
    :ivar val_due: The step from which a step validation is due.
    :ivar log_due: The step from which a row is due.
    :ivar due_at: The first step from which anything above is due: what every step boundary compares with.

    >>> StepSchedule(every_n_steps=4, val_every_n_steps=None, log_every_n_steps=None).due_at
    inf
    >>> schedule_from(StepSchedule(every_n_steps=4, val_every_n_steps=3, log_every_n_steps=None), 0, saving=True).due_at
    3
    """

    every_n_steps: int | None
    val_every_n_steps: int | None
    log_every_n_steps: int | None
    max_steps: float = math.inf
    ckpt_due: float = math.inf
    val_due: float = math.inf
    log_due: float = math.inf
    due_at: float = attrs.field(init=False, default=attrs.Factory(_due_at, takes_self=True))


def schedule_saved(schedule: StepSchedule, step: int, *, saving: bool) -> StepSchedule:
    """The schedule after a step checkpoint holds ``step`` (or the counted loop starts there): the next one is due
    at the next multiple of the period.

    Pure.

    :param schedule: The schedule.
    :param step: The optimizer step counter.
    :param saving: Whether this loop writes step checkpoints (it can resume, and they are on).
    :returns: The schedule with ``ckpt_due`` moved on (``inf`` when not ``saving``).

    >>> schedule = StepSchedule(every_n_steps=4, val_every_n_steps=None, log_every_n_steps=None)
    >>> schedule_saved(schedule, 5, saving=True).ckpt_due, schedule_saved(schedule, 5, saving=False).ckpt_due
    (8, inf)
    """
    ckpt_due = next_due(step, schedule.every_n_steps) if saving else math.inf
    return attrs.evolve(schedule, ckpt_due=ckpt_due)


def schedule_from(schedule: StepSchedule, step: int, *, saving: bool) -> StepSchedule:
    """The schedule of a counted loop that starts at ``step``: every period counted from there.

    Pure.

    :param schedule: The schedule (its periods).
    :param step: The optimizer step counter at the loop's start.
    :param saving: Whether this loop writes step checkpoints.
    :returns: The schedule with every due step counted from ``step``.

    >>> schedule = StepSchedule(every_n_steps=4, val_every_n_steps=3, log_every_n_steps=2, max_steps=20)
    >>> started = schedule_from(schedule, 6, saving=True)
    >>> started.ckpt_due, started.val_due, started.log_due, started.due_at
    (8, 9, 8, 8)
    """
    started = attrs.evolve(
        schedule,
        val_due=next_due(step, schedule.val_every_n_steps),
        log_due=next_due(step, schedule.log_every_n_steps),
    )
    return schedule_saved(started, step, saving=saving)


def step_due(schedule: StepSchedule, step: int, *, stop: bool, saving: bool) -> tuple[StepDue, StepSchedule]:
    """Decide what falls due at a step boundary, and the schedule after it.

    Pure. A step validation and a row fall due from their due steps on (a counter that jumps past one still gets
    it once), and their next due step moves past ``step``; the step budget's end takes the place of a step
    validation and a save (the run's final ones follow it). A save falls due on a stop or from ``ckpt_due`` on,
    only where the loop writes step checkpoints (``saving``); ``ckpt_due`` moves on when the save is done
    (:func:`schedule_saved`).

    :param schedule: The schedule.
    :param step: The optimizer step counter.
    :param stop: Whether the ranks stop on a signal here.
    :param saving: Whether this loop writes step checkpoints.
    :returns: What is due, and the schedule after this boundary.

    >>> schedule = schedule_from(StepSchedule(every_n_steps=4, val_every_n_steps=3, log_every_n_steps=None,
    ...                                       max_steps=6), 0, saving=True)
    >>> due, schedule = step_due(schedule, 3, stop=False, saving=True)
    >>> due
    StepDue(save=False, stop=False, validate=True, push=False, end=False)
    >>> schedule.val_due, schedule.due_at
    (6, 4)
    >>> step_due(schedule, 6, stop=False, saving=True)[0]
    StepDue(save=False, stop=False, validate=False, push=False, end=True)
    """
    end = step >= schedule.max_steps
    validate = step >= schedule.val_due and not end  # the run's final validation follows the end instead
    push = step >= schedule.log_due
    save = saving and (stop or step >= schedule.ckpt_due) and not end
    if validate or push:
        schedule = attrs.evolve(
            schedule,
            val_due=next_due(step, schedule.val_every_n_steps) if validate else schedule.val_due,
            log_due=next_due(step, schedule.log_every_n_steps) if push else schedule.log_due,
        )
    return StepDue(save=save, stop=stop, validate=validate, push=push, end=end), schedule
