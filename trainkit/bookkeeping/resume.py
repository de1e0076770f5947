"""Resuming: the records a checkpoint holds, reconciled with the config a run resumes under.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

import attrs

from trainkit.bookkeeping.best import BestState, retune_min_delta
from trainkit.bookkeeping.patience import PatienceState, retune_patience
from trainkit.bookkeeping.schedule import STOP_EARLY, STOP_MAX_EPOCHS, LoopState, resume_loop

__all__ = ["Resumed", "reconcile"]


@attrs.frozen(kw_only=True)
class Resumed:
    """The records a resumed run continues from, and what to tell its user."""

    loop: LoopState
    """The loop record to continue from (see :func:`~trainkit.bookkeeping.resume_loop`)."""
    best: BestState | None
    """The best record, with the configured ``min_delta``."""
    patience: PatienceState | None
    """The patience record, with the configured patience."""
    more: bool
    """Whether another epoch runs."""
    notes: tuple[str, ...]
    """What a changed ``val.min_delta``/``val.patience``/``val.start_patience`` does (for one warning)."""
    line: str
    """Where the run stands and what this run does with it (one printed line)."""


def reconcile(
    loop: LoopState,
    best: BestState | None,
    patience: PatienceState | None,
    *,
    epochs: int,
    val_patience: int | None,
    start_patience: int,
    min_delta: float,
) -> Resumed:
    """Apply the current config to the records read from a checkpoint.

    Pure. A changed ``min_delta`` applies to later comparisons (:func:`~trainkit.bookkeeping.retune_min_delta`);
    a changed patience applies from the resumed epoch on, keeping the misses counted
    (:func:`~trainkit.bookkeeping.retune_patience`); a changed ``epochs`` extends a finished run, reopens one
    that stopped early only when the new patience leaves room, or ends one that is already past it
    (:func:`~trainkit.bookkeeping.resume_loop`).

    :param loop: The loop record from the checkpoint.
    :param best: The best record from the checkpoint, if any.
    :param patience: The patience record from the checkpoint, if any.
    :param epochs: ``epochs``.
    :param val_patience: ``val.patience``.
    :param start_patience: ``val.start_patience``.
    :param min_delta: ``val.min_delta``.
    :returns: The reconciled records, whether more epochs run, and the messages.

    >>> r = reconcile(LoopState(epoch=3), None, None, epochs=5, val_patience=None, start_patience=0, min_delta=0.0)
    >>> r.more, r.line
    (True, 'at epoch 3 of 5')
    >>> stopped = PatienceState(patience=2, remaining=0)
    >>> r = reconcile(LoopState(epoch=4, stop_reason="early_stop"), None, stopped, epochs=9, val_patience=4,
    ...     start_patience=0, min_delta=0.0)
    >>> r.more, r.patience.remaining, r.line
    (True, 2, 'stopped early after 4 epochs; val.patience=4 allows more, so it continues (up to epochs=9)')
    """
    notes = []
    if best is not None:
        old_delta = best.min_delta
        best, changed = retune_min_delta(best, min_delta)
        if changed:
            notes.append(
                f"val.min_delta {old_delta!r} -> {best.min_delta!r}: later scores must beat the best "
                f"({best.score!r} at epoch {best.epoch}) by more than {best.min_delta!r}"
            )
    saved_patience = patience
    if saved_patience is not None and (
        saved_patience.patience != val_patience or saved_patience.start_patience != start_patience
    ):
        patience, misses = retune_patience(saved_patience, patience=val_patience, start_patience=start_patience)
        left = "no limit" if patience.remaining is None else f"{patience.remaining} left"
        notes.append(
            f"val.patience {saved_patience.patience!r} -> {patience.patience!r} and val.start_patience "
            f"{saved_patience.start_patience} -> {patience.start_patience}: applied from epoch {loop.epoch} on, "
            f"keeping the {misses} miss(es) already counted ({left})"
        )
    lifted = (
        loop.stop_reason == STOP_EARLY
        and saved_patience is not None
        and saved_patience.exhausted
        and patience is not None
        and not patience.exhausted
    )
    resumed, more = resume_loop(loop, epochs=epochs, early_stop_lifted=lifted)
    return Resumed(
        loop=resumed,
        best=best,
        patience=patience,
        more=more,
        notes=tuple(notes),
        line=_resume_line(loop, more, epochs=epochs, val_patience=val_patience),
    )


def _resume_line(saved: LoopState, more: bool, *, epochs: int, val_patience: int | None) -> str:
    if not saved.finished:
        if more:
            return f"at epoch {saved.epoch} of {epochs}"
        final = f"validating epoch {saved.epoch - 1} and finishing" if not saved.last_validated else "finishing"
        return f"{saved.epoch} epochs done, epochs={epochs} is already reached: {final}"
    if saved.stop_reason == STOP_MAX_EPOCHS:
        if more:
            return f"finished after {saved.epoch} epochs; epochs={epochs} extends it by {epochs - saved.epoch}"
        return f"finished after {saved.epoch} epochs (max_epochs); nothing to train (raise epochs to extend it)"
    if more:
        return (
            f"stopped early after {saved.epoch} epochs; val.patience={val_patience} allows more, "
            f"so it continues (up to epochs={epochs})"
        )
    if saved.epoch >= epochs:
        return f"stopped early after {saved.epoch} epochs; epochs={epochs} allows no more"
    return (
        f"stopped early after {saved.epoch} epochs and stays stopped: its stopping rule allows no more "
        "(raise val.patience to continue a run that patience stopped)"
    )
