"""Loop arithmetic: when to validate, where a run stands, and why it stopped.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trainkit.bookkeeping._records import is_int, record_from_dict, record_to_dict
from trainkit.errors import BookkeepingError

__all__ = [
    "should_validate",
    "validates_at_epoch_end",
    "planned_steps",
    "LoopState",
    "end_epoch",
    "resume_loop",
    "STOP_EARLY",
    "STOP_MAX_EPOCHS",
    "STOP_MAX_STEPS",
]

STOP_EARLY = "early_stop"
"""Stop reason: ``val_epoch()`` returned a truthy verdict (patience exhausted)."""
STOP_MAX_EPOCHS = "max_epochs"
"""Stop reason: the last configured epoch ran."""
STOP_MAX_STEPS = "max_steps"
"""Stop reason: ``max_steps`` optimizer steps were taken."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if type(value) is int and value >= minimum:  # the common case, decided without a call (runs every epoch)
        return
    if not is_int(value) or value < minimum:
        raise BookkeepingError(f"{name} must be an int >= {minimum}, got {value!r}")


def should_validate(epoch: int, epochs: int | None, every_n_epochs: int) -> bool:
    """Tell whether the 0-based ``epoch`` ends with a validation.

    Pure. True every ``every_n_epochs`` epochs and at the last epoch (none is last when ``epochs`` is None: a run
    measured in steps, whose last validation :func:`validates_at_epoch_end` decides).

    :param epoch: The 0-based epoch index, in ``[0, epochs)``.
    :param epochs: The total number of epochs (>= 1), or None.
    :param every_n_epochs: The validation period (>= 1).
    :returns: ``(epoch + 1) % every_n_epochs == 0 or epoch == epochs - 1``.
    :raises BookkeepingError: When an argument is out of range.

    >>> [e for e in range(10) if should_validate(e, 10, 3)]
    [2, 5, 8, 9]
    >>> [e for e in range(10) if should_validate(e, None, 3)]
    [2, 5, 8]
    """
    if epochs is not None:
        _check_int("epochs", epochs, 1)
    _check_int("every_n_epochs", every_n_epochs, 1)
    _check_int("epoch", epoch, 0)
    if epochs is not None and epoch >= epochs:
        raise BookkeepingError(f"epoch must be < epochs={epochs}, got {epoch!r}")
    return (epoch + 1) % every_n_epochs == 0 or epoch == (epochs or 0) - 1


def validates_at_epoch_end(
    epoch: int,
    step: int,
    *,
    epochs: int | None,
    every_n_epochs: int,
    max_steps: int | None = None,
    every_n_steps: int | None = None,
    validated_at: int | None = None,
    stopped_early: bool = False,
) -> bool:
    """Tell whether the epoch ``epoch``, ending at optimizer step ``step``, ends with a validation.

    Pure. It does when :func:`should_validate` says so, when the run ends here by reaching ``max_steps`` (its
    last validation), or when a step validation (every ``every_n_steps`` steps) fell due at its last batch, where
    no step boundary follows; never twice at one step: not when the loop validated at ``step`` already
    (``validated_at``), and not after a step validation's early-stop verdict ended the epoch (``stopped_early``).

    :param epoch: The 0-based epoch that ends.
    :param step: The optimizer steps taken so far.
    :param epochs: ``epochs`` (None: the run is measured in steps).
    :param every_n_epochs: ``val.every_n_epochs``.
    :param max_steps: ``max_steps``, or None.
    :param every_n_steps: ``val.every_n_steps``, or None.
    :param validated_at: The step of the last validation inside the epoch's loop, or None.
    :param stopped_early: Whether a step validation's verdict stopped the run inside the epoch.
    :returns: Whether to call ``val_epoch()`` now.
    :raises BookkeepingError: When an argument is out of range.

    >>> validates_at_epoch_end(0, 100, epochs=None, every_n_epochs=5, max_steps=100)
    True
    >>> validates_at_epoch_end(0, 100, epochs=None, every_n_epochs=5, max_steps=100, validated_at=100)
    False
    >>> validates_at_epoch_end(1, 60, epochs=9, every_n_epochs=5, every_n_steps=20)
    True
    """
    _check_int("step", step, 0)
    if stopped_early or validated_at == step:
        return False
    by_steps = every_n_steps is not None and step > 0 and step % every_n_steps == 0
    ending = max_steps is not None and step >= max_steps
    return ending or by_steps or should_validate(epoch, epochs, every_n_epochs)


def planned_steps(*, epochs: int | None, max_steps: int | None, steps_per_epoch: int | None = None) -> int:
    """The run's planned length in optimizer steps: what a learning-rate schedule is sized from.

    Pure. ``max_steps`` when it is set and ``epochs`` is not; ``epochs * steps_per_epoch`` when only ``epochs``
    is; the smaller of the two when both are (the first reached ends the run).

    :param epochs: ``epochs``, or None.
    :param max_steps: ``max_steps``, or None.
    :param steps_per_epoch: Optimizer steps per epoch (``len(loader) // accumulation``); needed with ``epochs``.
    :returns: The planned number of optimizer steps.
    :raises BookkeepingError: When neither budget is set, or ``epochs`` is set without ``steps_per_epoch``.

    >>> planned_steps(epochs=None, max_steps=5000)
    5000
    >>> planned_steps(epochs=3, max_steps=None, steps_per_epoch=100), planned_steps(epochs=3, max_steps=250,
    ...     steps_per_epoch=100)
    (300, 250)
    """
    if max_steps is not None:
        _check_int("max_steps", max_steps, 1)
    if epochs is None:
        if max_steps is None:
            raise BookkeepingError("planned_steps needs epochs or max_steps, got neither")
        return max_steps
    _check_int("epochs", epochs, 1)
    if steps_per_epoch is None:
        if max_steps is not None:
            raise BookkeepingError(
                f"planned_steps: with epochs={epochs} and max_steps={max_steps} the run ends at the first reached, "
                "which needs steps_per_epoch (optimizer steps per epoch: len(loader) // accumulation)"
            )
        raise BookkeepingError(
            f"planned_steps: epochs={epochs} counts epochs; pass steps_per_epoch (optimizer steps per epoch: "
            "len(loader) // accumulation) to count them in steps"
        )
    _check_int("steps_per_epoch", steps_per_epoch, 1)
    by_epochs = epochs * steps_per_epoch
    return by_epochs if max_steps is None else min(by_epochs, max_steps)


def _check_counter(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    _check_int(f"LoopState.{attribute.name}", value, 0)


def _check_reason(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value not in (None, STOP_EARLY, STOP_MAX_EPOCHS, STOP_MAX_STEPS):
        raise BookkeepingError(
            f"LoopState.stop_reason must be None, {STOP_EARLY!r}, {STOP_MAX_EPOCHS!r} or {STOP_MAX_STEPS!r}, "
            f"got {value!r}"
        )


@attrs.frozen(kw_only=True)
class LoopState:
    """Where a run stands between epochs.

    :ivar epoch: The 0-based index of the next epoch to run (the number of epochs completed).
    :ivar step: Optimizer steps taken so far.
    :ivar stop_reason: Why the run finished (``"early_stop"``, ``"max_epochs"`` or ``"max_steps"``), None while
        it runs.
    :ivar last_validated: Whether the last completed epoch ended with a validation (True before the
        first epoch, and in checkpoints written before this field existed).
    :ivar in_epoch: Whether the record was taken inside epoch ``epoch``, at a step boundary: a step checkpoint's,
        or a run that ended there (``max_steps``, or a step validation's early stop); ``epoch`` is then the epoch
        in progress, and the checkpoint holds its position.

    >>> LoopState().finished
    False
    """

    epoch: int = attrs.field(default=0, validator=_check_counter)
    step: int = attrs.field(default=0, validator=_check_counter)
    stop_reason: str | None = attrs.field(default=None, validator=_check_reason)
    last_validated: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    in_epoch: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def finished(self) -> bool:
        """True once the run has stopped, early, at its last epoch or at ``max_steps``."""
        return self.stop_reason is not None

    @property
    def current_epoch(self) -> int:
        """The epoch a trainer shows as ``epoch``: the one in progress (or next), or after a finished run the last
        one that ran.

        >>> LoopState(epoch=3).current_epoch, LoopState(epoch=3, stop_reason="max_epochs").current_epoch
        (3, 2)
        >>> LoopState(epoch=0, step=50, stop_reason="max_steps", in_epoch=True).current_epoch
        0
        """
        return self.epoch - 1 if self.finished and not self.in_epoch and self.epoch > 0 else self.epoch

    def to_dict(self) -> dict[str, Any]:
        """Return the record as plain JSON-able values with a schema version.

        >>> LoopState.from_dict(LoopState(epoch=2).to_dict())
        LoopState(epoch=2, step=0, stop_reason=None, last_validated=True, in_epoch=False)
        """
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoopState:
        """Rebuild a record written by :meth:`to_dict`.

        :param data: The dict.
        :returns: The record.
        :raises BookkeepingError: On a foreign kind, a newer schema or an invalid field.
        """
        return record_from_dict(cls, data)


def end_epoch(
    state: LoopState,
    *,
    epochs: int | None,
    early_stop: bool,
    step: int,
    validated: bool = True,
    max_steps: int | None = None,
    in_epoch: bool = False,
) -> tuple[LoopState, bool]:
    """Close the epoch ``state.epoch`` and decide whether another one runs.

    Pure. The run finishes early on ``early_stop``, at ``max_steps`` steps, or after ``epochs`` epochs, the
    first reached.

    :param state: The record of the epoch that just ran; left unchanged.
    :param epochs: The configured number of epochs (None: the run is measured in steps).
    :param early_stop: The epoch's early-stop verdict.
    :param step: Optimizer steps taken so far (never less than ``state.step``).
    :param validated: Whether the epoch ended with a validation.
    :param max_steps: The configured number of optimizer steps, or None.
    :param in_epoch: Whether the epoch's loop ended at a step boundary before its last batch (``max_steps``, or an
        early stop there): the record stays in that epoch (``LoopState.in_epoch``), which a raised budget
        continues from its position.
    :returns: The next record, and whether another epoch runs.
    :raises BookkeepingError: When the run had already finished, ``step`` went backwards, neither budget is set,
        or the loop ended inside the epoch although the run goes on.

    >>> state, more = end_epoch(LoopState(), epochs=2, early_stop=False, step=5, validated=False)
    >>> state, more
    (LoopState(epoch=1, step=5, stop_reason=None, last_validated=False, in_epoch=False), True)
    >>> end_epoch(state, epochs=2, early_stop=False, step=10)
    (LoopState(epoch=2, step=10, stop_reason='max_epochs', last_validated=True, in_epoch=False), False)
    >>> end_epoch(LoopState(), epochs=None, max_steps=7, early_stop=False, step=7, in_epoch=True)[0]
    LoopState(epoch=0, step=7, stop_reason='max_steps', last_validated=True, in_epoch=True)
    """
    if state.finished:
        raise BookkeepingError(f"end_epoch: the run already finished ({state.stop_reason})")
    if epochs is None and max_steps is None:
        raise BookkeepingError("end_epoch needs epochs or max_steps, got neither")
    if epochs is not None:
        _check_int("epochs", epochs, 1)
    if max_steps is not None:
        _check_int("max_steps", max_steps, 1)
    if step < state.step:
        raise BookkeepingError(f"end_epoch: step went backwards from {state.step} to {step!r}")
    epoch = state.epoch if in_epoch else state.epoch + 1
    if early_stop:
        reason: str | None = STOP_EARLY
    elif max_steps is not None and step >= max_steps:
        reason = STOP_MAX_STEPS
    elif epochs is not None and epoch >= epochs:
        reason = STOP_MAX_EPOCHS
    else:
        reason = None
    if in_epoch and reason is None:
        raise BookkeepingError(
            f"end_epoch: epoch {state.epoch}'s loop ended at step {step}, inside the epoch, but the run goes on"
        )
    new = LoopState(epoch=epoch, step=step, stop_reason=reason, last_validated=bool(validated), in_epoch=in_epoch)
    return new, not new.finished


def resume_loop(
    state: LoopState, *, epochs: int | None, max_steps: int | None = None, early_stop_lifted: bool = False
) -> tuple[LoopState, bool]:
    """Reconcile a loop record read from a checkpoint with the configured budget (``epochs``, ``max_steps``).

    Pure. The rules, in order:

    - a run that has already done ``epochs`` epochs or ``max_steps`` steps (the budget was lowered, or the run
      reached it) finishes now, or stays finished; an unfinished one finishes as ``"max_epochs"`` or
      ``"max_steps"``, and when its last epoch ended without a validation (``state.last_validated`` is False;
      always so for a record taken inside an epoch), the caller validates before finishing, since the end of a
      run is always validated;
    - a run that finished at its budget (``"max_epochs"``, ``"max_steps"``) is extended when the budget was raised
      above it; one that ended inside an epoch continues from there;
    - a run that stopped early stays stopped, unless ``early_stop_lifted`` (its stopping rule, e.g. a
      larger ``val.patience``, now allows more) and the budget leaves room; then it continues.

    :param state: The record from the checkpoint; left unchanged.
    :param epochs: The configured number of epochs (None: the run is measured in steps).
    :param max_steps: The configured number of optimizer steps, or None.
    :param early_stop_lifted: Whether the rule that stopped the run early no longer stops it.
    :returns: The record to continue from, and whether the run goes on.
    :raises BookkeepingError: When neither budget is set.

    >>> resume_loop(LoopState(epoch=3), epochs=5)
    (LoopState(epoch=3, step=0, stop_reason=None, last_validated=True, in_epoch=False), True)
    >>> resume_loop(LoopState(epoch=3), epochs=2)
    (LoopState(epoch=3, step=0, stop_reason='max_epochs', last_validated=True, in_epoch=False), False)
    >>> resume_loop(LoopState(epoch=3, stop_reason="max_epochs"), epochs=5)[1]
    True
    >>> resume_loop(LoopState(epoch=3, stop_reason="early_stop"), epochs=5)[1]
    False
    >>> resume_loop(LoopState(epoch=3, stop_reason="early_stop"), epochs=5, early_stop_lifted=True)[1]
    True
    >>> resume_loop(LoopState(epoch=0, step=80, in_epoch=True), epochs=None, max_steps=50)[0].stop_reason
    'max_steps'
    >>> resume_loop(LoopState(epoch=0, step=50, stop_reason="max_steps", in_epoch=True), epochs=None,
    ...     max_steps=90)
    (LoopState(epoch=0, step=50, stop_reason=None, last_validated=True, in_epoch=True), True)
    """
    if epochs is None and max_steps is None:
        raise BookkeepingError("resume_loop needs epochs or max_steps, got neither")
    if epochs is not None:
        _check_int("epochs", epochs, 1)
    if max_steps is not None:
        _check_int("max_steps", max_steps, 1)
    if epochs is not None and state.epoch >= epochs:
        if state.finished:
            return state, False
        # an epoch in progress beyond the budget is not trained further: the record counts the epochs completed
        return attrs.evolve(state, stop_reason=STOP_MAX_EPOCHS, in_epoch=False), False
    if max_steps is not None and state.step >= max_steps:
        if state.finished:
            return state, False
        validated = state.last_validated and not state.in_epoch
        return attrs.evolve(state, stop_reason=STOP_MAX_STEPS, last_validated=validated), False
    if state.stop_reason == STOP_EARLY and not early_stop_lifted:
        return state, False
    return attrs.evolve(state, stop_reason=None), True
