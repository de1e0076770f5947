"""Best-score tracking: which validation result is the best so far.

Pure: stdlib and attrs only. The trainer snapshots weights when :func:`save_if_best` says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from trainkit.bookkeeping._records import (
    as_float,
    is_int,
    is_real,
    read_only_floats,
    record_from_dict,
    record_to_dict,
)
from trainkit.errors import BookkeepingError

__all__ = ["BestState", "save_if_best", "best_metric_key", "retune_min_delta"]

BEST_PREFIX = "best/val/"


def best_metric_key(name: str) -> str:
    """Return the ``best/val/*`` key under which a validation metric is recorded.

    Pure.

    :param name: A metric name, with or without a ``val/`` or ``best/val/`` prefix.
    :returns: The name with exactly one ``best/val/`` prefix.

    >>> best_metric_key("val/acc"), best_metric_key("acc"), best_metric_key("best/val/acc")
    ('best/val/acc', 'best/val/acc', 'best/val/acc')
    """
    for prefix in (BEST_PREFIX, "val/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return BEST_PREFIX + name


def _check_min_delta(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not is_real(value) or not value >= 0 or math.isinf(value):
        raise BookkeepingError(f"BestState.min_delta must be a finite float >= 0, got {value!r}")


def _check_score(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise BookkeepingError(f"BestState.score must be finite or None, got {value!r}")


def _check_epoch(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 0):
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be an int >= 0 or None, got {value!r}")


def _check_bool(instance: Any, attribute: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be a bool, got {value!r}")


def _optional_float(value: Any) -> float | None:
    return None if value is None else as_float(value, "BestState.score")


def _float(value: Any) -> float:
    return as_float(value, "BestState.min_delta") if not isinstance(value, bool) else value


@attrs.frozen(kw_only=True)
class BestState:
    """The best validation score seen so far, when it was seen, and the metrics of that epoch.

    :ivar minimize: True when a lower score is better (a loss); False when higher is better (an accuracy).
    :ivar min_delta: How much a score must beat the best by to count; a gain of exactly this much does not.
    :ivar score: The best finite score so far, or None before the first finite one.
    :ivar epoch: The epoch of the best score, when the caller gave one.
    :ivar step: The optimizer steps taken when the best score was seen, when the caller gave them (a run measured in
        steps reads its best by the step; records written before it was kept have None).
    :ivar metrics: The ``best/val/*`` metrics recorded at the best epoch, read-only.

    >>> BestState(minimize=True).score is None
    True
    """

    minimize: bool = attrs.field(default=False, validator=_check_bool)
    min_delta: float = attrs.field(default=0.0, converter=_float, validator=_check_min_delta)
    score: float | None = attrs.field(default=None, converter=_optional_float, validator=_check_score)
    epoch: int | None = attrs.field(default=None, validator=_check_epoch)
    step: int | None = attrs.field(default=None, validator=_check_epoch)
    metrics: Mapping[str, float] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=read_only_floats, hash=False
    )

    def to_dict(self) -> dict[str, Any]:
        """Return the record as plain JSON-able values with a schema version.

        >>> BestState.from_dict(BestState(score=0.5).to_dict()) == BestState(score=0.5)
        True
        """
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BestState:
        """Rebuild a record written by :meth:`to_dict`.

        :param data: The dict.
        :returns: The record.
        :raises BookkeepingError: On a foreign kind, a newer schema or an invalid field.
        """
        return record_from_dict(cls, data)


def save_if_best(
    state: BestState,
    score: Any,
    *,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    step: int | None = None,
) -> tuple[BestState, bool]:
    """Advance best-score tracking by one validation result.

    Pure: nothing is written here; the trainer snapshots weights when this returns True.
    A score improves iff it is finite and there is no best yet, or it beats the best by more than
    ``min_delta`` in the record's direction. Ties and NaN/inf never improve and leave the record as it is.

    :param state: The current record; left unchanged.
    :param score: The validation score: a float, int, 0-d tensor or numpy scalar.
    :param epoch: The epoch the score belongs to, recorded on improvement.
    :param metrics: The epoch's validation metrics, recorded on improvement under ``best/val/*`` keys.
    :param step: The optimizer steps taken when the score was measured, recorded on improvement.
    :returns: The next record, and whether the score improved.
    :raises BookkeepingError: When the score is not a real number.

    >>> state, improved = save_if_best(BestState(minimize=True), 0.5, epoch=0, metrics={"val/loss": 0.5})
    >>> improved, state.score, dict(state.metrics)
    (True, 0.5, {'best/val/loss': 0.5})
    >>> save_if_best(state, 0.5, epoch=1)[1]
    False
    >>> save_if_best(state, float("nan"), epoch=1)[0] is state
    True
    """
    value = as_float(score, "score")
    if not math.isfinite(value):
        return state, False
    if state.score is not None:
        if state.minimize:
            improved = value < state.score - state.min_delta
        else:
            improved = value > state.score + state.min_delta
        if not improved:
            return state, False
    recorded = {best_metric_key(str(name)): val for name, val in (metrics or {}).items()}
    return attrs.evolve(state, score=value, epoch=epoch, step=step, metrics=recorded), True


def retune_min_delta(state: BestState, min_delta: float) -> tuple[BestState, bool]:
    """Apply a changed ``min_delta`` to a record, keeping its best score, epoch and metrics.

    Pure. Used when a run resumes with a new ``val.min_delta``: later comparisons use it; the best
    recorded so far stays the best.

    :param state: The record read from the checkpoint; left unchanged.
    :param min_delta: The new margin (a finite float >= 0).
    :returns: The next record, and whether the margin changed.
    :raises BookkeepingError: When ``min_delta`` is negative, infinite or not a number.

    >>> state = BestState(minimize=True, score=1.0)
    >>> state, changed = retune_min_delta(state, 0.1)
    >>> state.min_delta, state.score, changed
    (0.1, 1.0, True)
    >>> save_if_best(state, 0.95)[1], save_if_best(state, 0.85)[1]
    (False, True)
    """
    new = attrs.evolve(state, min_delta=min_delta)
    return new, new.min_delta != state.min_delta
