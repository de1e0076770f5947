"""Early-stopping patience: how many more counted misses a run may take.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trainkit.bookkeeping._records import is_bool_like, is_int, record_from_dict, record_to_dict
from trainkit.errors import BookkeepingError

__all__ = ["PatienceState", "step_patience", "retune_patience"]


def _check_patience(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if not is_int(value):
        raise BookkeepingError(f"PatienceState.patience must be an int >= 1 or None, got {value!r}")
    if value < 1:
        raise BookkeepingError(
            f"PatienceState.patience must be >= 1 or None, got {value!r}; "
            "use 1 to stop at the first counted miss, or None to disable early stopping"
        )


def _check_start(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not is_int(value) or value < 0:
        raise BookkeepingError(f"PatienceState.start_patience must be an int >= 0, got {value!r}")


def _check_remaining(instance: PatienceState, attribute: attrs.Attribute, value: int | None) -> None:
    if instance.patience is None:
        if value is not None:
            raise BookkeepingError(f"PatienceState.remaining must be None when patience is None, got {value!r}")
        return
    if not is_int(value) or not 0 <= value <= instance.patience:
        raise BookkeepingError(
            f"PatienceState.remaining must be an int in [0, patience={instance.patience}], got {value!r}"
        )


@attrs.frozen(kw_only=True)
class PatienceState:
    """Early-stopping counter.

    :ivar patience: Counted misses allowed before stopping (>= 1), or None to never stop early.
    :ivar start_patience: Misses in epochs before this 0-based epoch are not counted.
    :ivar remaining: Counted misses left; starts at ``patience`` and is refilled by an improvement.

    >>> PatienceState(patience=3).remaining
    3
    """

    patience: int | None = attrs.field(default=None, validator=_check_patience)
    start_patience: int = attrs.field(default=0, validator=_check_start)
    remaining: int | None = attrs.field(
        default=attrs.Factory(lambda self: self.patience, takes_self=True), validator=_check_remaining
    )

    @property
    def exhausted(self) -> bool:
        """True once no counted miss is left; always False when early stopping is disabled."""
        return self.patience is not None and self.remaining == 0

    def to_dict(self) -> dict[str, Any]:
        """Return the record as plain JSON-able values with a schema version.

        >>> PatienceState.from_dict(PatienceState(patience=2).to_dict()) == PatienceState(patience=2)
        True
        """
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PatienceState:
        """Rebuild a record written by :meth:`to_dict`.

        :param data: The dict.
        :returns: The record.
        :raises BookkeepingError: On a foreign kind, a newer schema or an invalid field.
        """
        return record_from_dict(cls, data)


def step_patience(state: PatienceState, improved: Any, *, epoch: int | None = None) -> tuple[PatienceState, bool]:
    """Advance the early-stopping counter by one validation outcome.

    Pure. An improvement refills ``remaining`` to ``patience``; a miss takes one off, but only when
    ``epoch`` is None or ``epoch >= start_patience``, and never below 0.

    :param state: The current record; left unchanged.
    :param improved: Whether this validation improved the best (a bool, or a bool-like 0-d tensor).
    :param epoch: The 0-based epoch of this validation; None counts every miss.
    :returns: The next record, and True once patience is exhausted (always False when patience is None).
    :raises BookkeepingError: When ``improved`` is not a bool (None, a number, a string) or ``epoch`` is negative.

    >>> state = PatienceState(patience=2)
    >>> state, stop = step_patience(state, False, epoch=0)
    >>> state.remaining, stop
    (1, False)
    >>> step_patience(state, False, epoch=1)[1]
    True
    """
    if not is_bool_like(improved) or getattr(improved, "ndim", 0) != 0:
        raise BookkeepingError(
            f"step_patience: improved must be a bool, got {improved!r}; pass what save_if_best returned"
        )
    if epoch is not None and (not is_int(epoch) or epoch < 0):
        raise BookkeepingError(f"step_patience: epoch must be an int >= 0 or None, got {epoch!r}")
    if state.patience is None:
        return state, False
    if bool(improved):
        state = attrs.evolve(state, remaining=state.patience)
    elif epoch is None or epoch >= state.start_patience:
        state = attrs.evolve(state, remaining=max(0, state.remaining - 1))
    return state, state.exhausted


def retune_patience(state: PatienceState, *, patience: int | None, start_patience: int) -> tuple[PatienceState, int]:
    """Apply a changed ``patience``/``start_patience`` to a record, keeping the misses already counted.

    Pure. Used when a run resumes with a new ``val.patience`` or ``val.start_patience``: the new values
    apply from the resumed epoch on. The misses counted so far (``patience - remaining``) carry over,
    so ``remaining`` becomes ``max(0, patience - misses)``: a larger patience gives more room, a smaller
    one may leave none, and then the next counted miss stops the run (an improvement still refills it).
    A run that counted nothing (patience was None) starts with the full new patience. Misses before a
    changed ``start_patience`` are not recounted.

    :param state: The record read from the checkpoint; left unchanged.
    :param patience: The new patience (>= 1), or None to stop counting.
    :param start_patience: The new first 0-based epoch whose misses count.
    :returns: The next record, and the number of misses carried over.
    :raises BookkeepingError: When a new value breaks the record's rules.

    >>> state = PatienceState(patience=3, remaining=1)  # two misses counted
    >>> retune_patience(state, patience=5, start_patience=0)
    (PatienceState(patience=5, start_patience=0, remaining=3), 2)
    >>> retune_patience(state, patience=2, start_patience=0)[0].exhausted
    True
    >>> retune_patience(PatienceState(), patience=4, start_patience=1)
    (PatienceState(patience=4, start_patience=1, remaining=4), 0)
    """
    misses = 0 if state.patience is None else state.patience - state.remaining
    if patience is None:
        return PatienceState(patience=None, start_patience=start_patience), misses
    _check_patience(state, attrs.fields(PatienceState).patience, patience)
    remaining = max(0, patience - misses)
    return PatienceState(patience=patience, start_patience=start_patience, remaining=remaining), misses
