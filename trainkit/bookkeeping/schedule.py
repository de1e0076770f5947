"""Loop arithmetic: when to validate, where a run stands, and why it stopped.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trainkit.bookkeeping._records import is_int, record_from_dict, record_to_dict
from trainkit.errors import BookkeepingError

__all__ = ["should_validate", "LoopState", "end_epoch", "resume_loop", "STOP_EARLY", "STOP_MAX_EPOCHS"]

STOP_EARLY = "early_stop"
"""Stop reason: ``val_epoch()`` returned a truthy verdict (patience exhausted)."""
STOP_MAX_EPOCHS = "max_epochs"
"""Stop reason: the last configured epoch ran."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if type(value) is int and value >= minimum:  # the common case, decided without a call (runs every epoch)
        return
    if not is_int(value) or value < minimum:
        raise BookkeepingError(f"{name} must be an int >= {minimum}, got {value!r}")


def should_validate(epoch: int, epochs: int, every_n_epochs: int) -> bool:
    """Tell whether the 0-based ``epoch`` ends with a validation.

    Pure. True every ``every_n_epochs`` epochs and at the last epoch.

    :param epoch: The 0-based epoch index, in ``[0, epochs)``.
    :param epochs: The total number of epochs (>= 1).
    :param every_n_epochs: The validation period (>= 1).
    :returns: ``(epoch + 1) % every_n_epochs == 0 or epoch == epochs - 1``.
    :raises BookkeepingError: When an argument is out of range.

    >>> [e for e in range(10) if should_validate(e, 10, 3)]
    [2, 5, 8, 9]
    """
    _check_int("epochs", epochs, 1)
    _check_int("every_n_epochs", every_n_epochs, 1)
    _check_int("epoch", epoch, 0)
    if epoch >= epochs:
        raise BookkeepingError(f"epoch must be < epochs={epochs}, got {epoch!r}")
    return (epoch + 1) % every_n_epochs == 0 or epoch == epochs - 1


def _check_counter(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    _check_int(f"LoopState.{attribute.name}", value, 0)


def _check_reason(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value not in (None, STOP_EARLY, STOP_MAX_EPOCHS):
        raise BookkeepingError(
            f"LoopState.stop_reason must be None, {STOP_EARLY!r} or {STOP_MAX_EPOCHS!r}, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class LoopState:
    """Where a run stands between epochs.

    :ivar epoch: The 0-based index of the next epoch to run (the number of epochs completed).
    :ivar step: Optimizer steps taken so far.
    :ivar stop_reason: Why the run finished (``"early_stop"`` or ``"max_epochs"``), None while it runs.
    :ivar last_validated: Whether the last completed epoch ended with a validation (True before the
        first epoch, and in checkpoints written before this field existed).

    >>> LoopState().finished
    False
    """

    epoch: int = attrs.field(default=0, validator=_check_counter)
    step: int = attrs.field(default=0, validator=_check_counter)
    stop_reason: str | None = attrs.field(default=None, validator=_check_reason)
    last_validated: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @property
    def finished(self) -> bool:
        """True once the run has stopped, early or at its last epoch."""
        return self.stop_reason is not None

    def to_dict(self) -> dict[str, Any]:
        """Return the record as plain JSON-able values with a schema version.

        >>> LoopState.from_dict(LoopState(epoch=2).to_dict())
        LoopState(epoch=2, step=0, stop_reason=None, last_validated=True)
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
    state: LoopState, *, epochs: int, early_stop: bool, step: int, validated: bool = True
) -> tuple[LoopState, bool]:
    """Close the epoch ``state.epoch`` and decide whether another one runs.

    Pure.

    :param state: The record of the epoch that just ran; left unchanged.
    :param epochs: The configured number of epochs.
    :param early_stop: The epoch's early-stop verdict.
    :param step: Optimizer steps taken so far (never less than ``state.step``).
    :param validated: Whether the epoch ended with a validation.
    :returns: The next record, and whether another epoch runs.
    :raises BookkeepingError: When the run had already finished, or ``step`` went backwards.

    >>> state, more = end_epoch(LoopState(), epochs=2, early_stop=False, step=5, validated=False)
    >>> state, more
    (LoopState(epoch=1, step=5, stop_reason=None, last_validated=False), True)
    >>> end_epoch(state, epochs=2, early_stop=False, step=10)
    (LoopState(epoch=2, step=10, stop_reason='max_epochs', last_validated=True), False)
    """
    if state.finished:
        raise BookkeepingError(f"end_epoch: the run already finished ({state.stop_reason})")
    _check_int("epochs", epochs, 1)
    if step < state.step:
        raise BookkeepingError(f"end_epoch: step went backwards from {state.step} to {step!r}")
    epoch = state.epoch + 1
    reason = STOP_EARLY if early_stop else STOP_MAX_EPOCHS if epoch >= epochs else None
    new = LoopState(epoch=epoch, step=step, stop_reason=reason, last_validated=bool(validated))
    return new, not new.finished


def resume_loop(state: LoopState, *, epochs: int, early_stop_lifted: bool = False) -> tuple[LoopState, bool]:
    """Reconcile a loop record read from a checkpoint with the configured number of epochs.

    Pure. The rules, in order:

    - an unfinished run below ``epochs`` continues;
    - an unfinished run that has already done ``epochs`` epochs (``epochs`` was lowered) finishes now,
      as ``"max_epochs"``; when its last epoch ended without a validation (``state.last_validated`` is
      False), the caller validates that epoch before finishing, since the last epoch of a run is
      always validated;
    - a run that finished at its last epoch (``"max_epochs"``) is extended when ``epochs`` was raised
      above the epochs it ran, and stays finished otherwise;
    - a run that stopped early stays stopped, unless ``early_stop_lifted`` (its stopping rule, e.g. a
      larger ``val.patience``, now allows more epochs) and ``epochs`` leaves room; then it continues.

    :param state: The record from the checkpoint; left unchanged.
    :param epochs: The configured number of epochs.
    :param early_stop_lifted: Whether the rule that stopped the run early no longer stops it.
    :returns: The record to continue from, and whether another epoch runs.

    >>> resume_loop(LoopState(epoch=3), epochs=5)
    (LoopState(epoch=3, step=0, stop_reason=None, last_validated=True), True)
    >>> resume_loop(LoopState(epoch=3), epochs=2)
    (LoopState(epoch=3, step=0, stop_reason='max_epochs', last_validated=True), False)
    >>> resume_loop(LoopState(epoch=3, stop_reason="max_epochs"), epochs=5)[1]
    True
    >>> resume_loop(LoopState(epoch=3, stop_reason="early_stop"), epochs=5)[1]
    False
    >>> resume_loop(LoopState(epoch=3, stop_reason="early_stop"), epochs=5, early_stop_lifted=True)[1]
    True
    """
    _check_int("epochs", epochs, 1)
    if state.epoch >= epochs:
        if state.finished:
            return state, False
        return attrs.evolve(state, stop_reason=STOP_MAX_EPOCHS), False
    if state.stop_reason == STOP_EARLY and not early_stop_lifted:
        return state, False
    return attrs.evolve(state, stop_reason=None), True
