"""Resuming: the records a checkpoint holds, reconciled with the config a run resumes under.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

import attrs

from trainkit.bookkeeping.best import BestState, retune_min_delta
from trainkit.bookkeeping.patience import PatienceState, retune_patience
from trainkit.bookkeeping.schedule import STOP_EARLY, STOP_MAX_EPOCHS, STOP_MAX_STEPS, LoopState, resume_loop

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
    epochs: int | None,
    val_patience: int | None,
    start_patience: int,
    min_delta: float,
    max_steps: int | None = None,
) -> Resumed:
    """Apply the current config to the records read from a checkpoint.

    Pure. A changed ``min_delta`` applies to later comparisons (:func:`~trainkit.bookkeeping.retune_min_delta`);
    a changed patience applies from the resumed epoch on, keeping the misses counted
    (:func:`~trainkit.bookkeeping.retune_patience`); a changed ``epochs`` or ``max_steps`` extends a finished run,
    reopens one that stopped early only when the new patience leaves room, or ends one that is already past it
    (:func:`~trainkit.bookkeeping.resume_loop`).

    :param loop: The loop record from the checkpoint.
    :param best: The best record from the checkpoint, if any.
    :param patience: The patience record from the checkpoint, if any.
    :param epochs: ``epochs`` (None: the run is measured in steps).
    :param val_patience: ``val.patience``.
    :param start_patience: ``val.start_patience``.
    :param min_delta: ``val.min_delta``.
    :param max_steps: ``max_steps``, or None.
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
    resumed, more = resume_loop(loop, epochs=epochs, max_steps=max_steps, early_stop_lifted=lifted)
    return Resumed(
        loop=resumed,
        best=best,
        patience=patience,
        more=more,
        notes=tuple(notes),
        line=_resume_line(loop, more, epochs=epochs, val_patience=val_patience, max_steps=max_steps),
    )


def _budget(epochs: int | None, max_steps: int | None) -> str:
    """The run's budget as the config says it: ``epochs=5``, ``max_steps=900``, or both."""
    parts = ([f"epochs={epochs}"] if epochs is not None else []) + (
        [f"max_steps={max_steps}"] if max_steps is not None else []
    )
    return " and ".join(parts)


def _resume_line(
    saved: LoopState, more: bool, *, epochs: int | None, val_patience: int | None, max_steps: int | None = None
) -> str:
    budget = _budget(epochs, max_steps)
    where = f"step {saved.step} (inside epoch {saved.epoch})" if saved.in_epoch else f"{saved.epoch} epochs done"
    if not saved.finished:
        if more:
            if saved.in_epoch:
                return f"at step {saved.step}, inside epoch {saved.epoch}, of {budget}"
            return f"at epoch {saved.epoch} of {epochs}" if max_steps is None else f"at epoch {saved.epoch} of {budget}"
        if saved.in_epoch:
            final = f"validating at step {saved.step} and finishing"
        else:
            final = f"validating epoch {saved.epoch - 1} and finishing" if not saved.last_validated else "finishing"
        return f"{where}, {budget} is already reached: {final}"
    ran = f"{saved.step} steps" if saved.stop_reason == STOP_MAX_STEPS else f"{saved.epoch} epochs"
    if saved.stop_reason in (STOP_MAX_EPOCHS, STOP_MAX_STEPS):
        if more and saved.stop_reason == STOP_MAX_EPOCHS and max_steps is None and epochs is not None:
            return f"finished after {ran}; {budget} extends it by {epochs - saved.epoch}"
        if more:
            return f"finished after {ran}; {budget} extends it"
        raise_what = "max_steps" if saved.stop_reason == STOP_MAX_STEPS else "epochs"
        return f"finished after {ran} ({saved.stop_reason}); nothing to train (raise {raise_what} to extend it)"
    if more:
        return (
            f"stopped early after {saved.epoch} epochs; val.patience={val_patience} allows more, "
            f"so it continues (up to {budget})"
        )
    if (epochs is not None and saved.epoch >= epochs) or (max_steps is not None and saved.step >= max_steps):
        return f"stopped early after {saved.epoch} epochs; {budget} allows no more"
    return (
        f"stopped early after {saved.epoch} epochs and stays stopped: its stopping rule allows no more "
        "(raise val.patience to continue a run that patience stopped)"
    )
