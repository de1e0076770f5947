"""The divergence guard's rollback (``guard.nonfinite="rollback"``): back to a checkpoint, the bad batches left out.

When ``guard.max_skips`` non-finite steps fall within ``guard.window`` steps (at once without ``max_skips``), the
guard's step pre-hook raises :class:`RollbackNeeded` before the step is applied; the trainer catches it around
``train_epoch()`` and calls :func:`roll_back`: the newest checkpoint written before the first of those steps is
loaded (:meth:`~trainkit.checkpoint.checkpointer.Checkpointer.rollback_resume`) and restored in this process as a resume
restores it, and every batch position of an offending step (with gradient accumulation, each one of its window)
is added to the positions the counted loop leaves out at the index level (saved in every later checkpoint as
``guard_skips``). The epoch then runs again from the checkpoint's
position: a run that rolled back equals, bitwise, a run resumed from that checkpoint with
``guard.skip_batches`` naming the same batches. Under DDP the guard's verdict is the ranks' one verdict, so every
rank rolls back at the same step to the same file.

Side effects: the checkpoint read, the registered items, the records and the RNG states put back, the registered
modules' and optimizers' gradients set to None, a row in
``metrics.jsonl`` (rank 0), a line on stderr, and when the loop draws a left-out batch's indices, a row with
them (rank 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from trainkit.errors import DivergenceError
from trainkit.loop.metrics import LogBuffer
from trainkit.loop.optim import RunningMean
from trainkit.messages import say

if TYPE_CHECKING:
    from trainkit.trainer import BaseTrainer

__all__ = ["RollbackNeeded", "roll_back", "rolled_back", "ROLLBACK_KEY", "SKIPPED_BATCHES_KEY", "SKIPPED_SAMPLES_KEY"]

ROLLBACK_KEY = "guard/rolled_back_to_step"
"""The journal row of a rollback: the step of the checkpoint it went back to."""
SKIPPED_BATCHES_KEY = "guard/skipped_batches"
"""In that row: the ``"EPOCH:BATCH"`` positions left out from then on (what ``guard.skip_batches`` takes)."""
SKIPPED_SAMPLES_KEY = "guard/skipped_samples"
"""The row written when the loop leaves a batch out: the sample indices its sampler drew for it."""


class RollbackNeeded(DivergenceError):
    """The guard's window is exhausted under ``guard.nonfinite="rollback"``: the trainer rolls back.

    A :class:`~trainkit.DivergenceError` (what the user sees if it escapes the loop, e.g. raised outside
    ``train_epoch()``).

    :param bad: ``(step, epoch, batches)`` of every non-finite step in the window, oldest first: the batches (0-based
        positions in the epoch) it trained on, every one yielded since the step before (a gradient-accumulation
        window's).
    """

    def __init__(self, message: str, *, step: int, epoch: int, batch: int | None, bad: tuple[tuple, ...]) -> None:
        super().__init__(message, step=step, epoch=epoch, batch=batch)
        self.bad = bad


def _log_dropped(trainer: BaseTrainer) -> Any:
    """What the counted loop calls when it leaves a batch out: rank 0 journals its sample indices."""

    def dropped(epoch: int, position: int, indices: Any) -> None:
        if trainer.is_main:
            drawn = indices if isinstance(indices, list | tuple) else [indices]
            samples = [int(i) if isinstance(i, int) else str(i) for i in drawn]  # a key of a dict-like data set
            row = {"trainer/step": trainer.step, "trainer/epoch": epoch, SKIPPED_SAMPLES_KEY: samples}
            trainer._run_log.log({**row, "guard/skipped_batch": position})

    return dropped


def _drop_gradients(items: Iterable[Any]) -> None:
    """Set every ``.grad`` of the registered modules and optimizers to None, as a process resuming from the
    checkpoint starts: the rejected step's gradients (non-finite; with gradient accumulation, a loop that zeroes
    them after ``optimizer.step()`` would add the next window's to them) go with it."""
    for item in items:
        if isinstance(item, torch.nn.Module | torch.optim.Optimizer):
            item.zero_grad(set_to_none=True)


def roll_back(trainer: BaseTrainer, request: RollbackNeeded) -> None:
    """Restore the newest checkpoint before ``request``'s first bad step, and leave its bad batches out.

    :param trainer: The trainer, whose ``train_epoch()`` raised ``request``.
    :param request: What the guard raised.
    :raises DivergenceError: When no checkpoint was written before that step (``ckpt.enable`` off, the first
        epoch without ``ckpt.every_n_steps``, or every step checkpoint newer and none kept by ``ckpt.keep``).
    """
    first = request.bad[0][0]
    resume = trainer._checkpointer.rollback_resume(trainer.cfg, first)
    if resume is None:
        raise DivergenceError(
            f"{request}; guard.nonfinite=rollback found no checkpoint written before step {first} to roll back to "
            "(checkpoints need ckpt.enable; set ckpt.every_n_steps for step checkpoints, and ckpt.keep to keep "
            "older ones than last.pt and last.prev.pt)",
            step=request.step,
            epoch=request.epoch,
            batch=request.batch,
        ) from request
    metrics = trainer._metrics
    metrics.load_state_dict(LogBuffer().state_dict(), RunningMean().state_dict())  # the lost steps' logs go
    trainer._restore(resume)  # a step checkpoint puts its own unpushed logs back
    _drop_gradients(trainer._registry.items.values())
    skips = trainer._checkpointer.skips
    for _, epoch, batches in request.bad:
        skips[epoch] = skips.get(epoch, frozenset()) | frozenset(batches)
    if metrics.guard is not None:
        metrics.guard.reset()
    trainer._position.on_drop = _log_dropped(trainer)
    left_out = [f"{epoch}:{batch}" for epoch in sorted(skips) for batch in sorted(skips[epoch])]
    if trainer.is_main:
        row = {"trainer/step": trainer.step, "trainer/epoch": resume.records.loop.epoch, ROLLBACK_KEY: trainer.step}
        trainer._run_log.log({**row, "guard/rollback_from_step": first, SKIPPED_BATCHES_KEY: left_out})
        say(
            f"guard.nonfinite=rollback: {len(request.bad)} non-finite step(s) from step {first} on; rolled back to "
            f"{resume.path} (step {trainer.step}), leaving out batches {', '.join(left_out)} (EPOCH:BATCH; a rerun "
            f"skips them with guard.skip_batches)"
        )


_NEVER_ROLLED: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(())
"""What :func:`rolled_back` enters when nothing can ask for a rollback: an empty (falsy) result, no generator."""


def rolled_back(trainer: BaseTrainer) -> contextlib.AbstractContextManager[Any]:
    """Around the training epoch: a :class:`RollbackNeeded` raised inside is caught and acted on (:func:`roll_back`).

    :param trainer: The trainer.
    :returns: A context whose value is non-empty (truthy) after a rollback: the epoch must run again from the
        restored position. Without ``guard.nonfinite=rollback`` nothing raises a request, and the context is a
        shared no-op (this runs once per epoch of every run).
    """
    if trainer.cfg.guard.nonfinite != "rollback":
        return _NEVER_ROLLED
    return _rolling_back(trainer)


@contextlib.contextmanager
def _rolling_back(trainer: BaseTrainer) -> Iterator[list[bool]]:
    rolled: list[bool] = []
    try:
        yield rolled
    except RollbackNeeded as request:
        roll_back(trainer, request)
        rolled.append(True)
