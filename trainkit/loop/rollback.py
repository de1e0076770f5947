"""The divergence guard's rollback (``guard.nonfinite="rollback"``): back to a checkpoint, the bad batches left out.

When ``guard.max_skips`` non-finite steps fall within ``guard.window`` steps (at once without ``max_skips``), the
guard's step pre-hook raises :class:`~trainkit.errors.RollbackNeeded` before the step is applied; the
:class:`Rollback` part catches it around ``train_epoch()`` (:func:`rolled_back`): the newest checkpoint written
before the first of those steps is loaded (:meth:`~trainkit.checkpoint.checkpointer.Checkpointer.rollback_resume`)
and restored in this process as a resume restores it (through the restore callable the trainer hands the part),
and every batch position of an offending step (with gradient accumulation, each one of its window) is added to the
positions the counted loop leaves out at the index level (the position part owns them; every later checkpoint saves
them as ``guard_skips``). The epoch then runs again from the checkpoint's position: a run that rolled back equals,
bitwise, a run resumed from that checkpoint with ``guard.skip_batches`` naming the same batches. Under DDP the
guard's verdict is the ranks' one verdict, so every rank rolls back at the same step to the same file.

Side effects: the checkpoint read, the registered items, the records and the RNG states put back, the registered
modules' and optimizers' gradients set to None, a row in
``metrics.jsonl`` (rank 0), a line on stderr, and when the loop draws a left-out batch's indices, a row with
them (rank 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from trainkit import bookkeeping
from trainkit.errors import DivergenceError, RollbackNeeded
from trainkit.loop.epoch_tracker import EpochTracker
from trainkit.loop.trainer_metrics import TrainerMetrics
from trainkit.messages import say

if TYPE_CHECKING:
    from trainkit.checkpoint.checkpointer import Checkpointer, Resume
    from trainkit.config import Config
    from trainkit.run.log import RunLog

__all__ = ["Rollback", "rolled_back", "drop_gradients", "ROLLBACK_KEY", "SKIPPED_BATCHES_KEY", "SKIPPED_SAMPLES_KEY"]

ROLLBACK_KEY = "guard/rolled_back_to_step"
"""The journal row of a rollback: the step of the checkpoint it went back to."""
SKIPPED_BATCHES_KEY = "guard/skipped_batches"
"""In that row: the ``"EPOCH:BATCH"`` positions left out from then on (what ``guard.skip_batches`` takes)."""
SKIPPED_SAMPLES_KEY = "guard/skipped_samples"
"""The row written when the loop leaves a batch out: the sample indices its sampler drew for it."""


def drop_gradients(items: Iterable[Any]) -> None:
    """Set every ``.grad`` of the registered modules and optimizers to None, as a process resuming from the
    checkpoint starts: the rejected step's gradients (non-finite; with gradient accumulation, a loop that zeroes
    them after ``optimizer.step()`` would add the next window's to them) go with it.

    :param items: The registered checkpoint items.
    """
    for item in items:
        if isinstance(item, torch.nn.Module | torch.optim.Optimizer):
            item.zero_grad(set_to_none=True)


class Rollback:
    """The rollback part: given the parts it acts on and a restore callable, never the trainer.

    :param cfg: The run's config (``checkpointer.rollback_resume`` reconciles the checkpoint with it).
    :param checkpointer: Finds the newest checkpoint written before a step.
    :param position: Where the loop stands (the step), and the owner of the batches left out.
    :param metrics: The unpushed logs, dropped with the steps they came from.
    :param run_log: Rank 0's journal (a null log elsewhere).
    :param restore: Puts a checkpoint back into this process as a resume does (the divergence guard's window and
        skip count included), and returns the registered items, whose gradients are then dropped.
    :param is_main: Whether this is rank 0 (the one that writes rows and says what happened).
    """

    def __init__(
        self,
        cfg: Config,
        checkpointer: Checkpointer,
        position: EpochTracker,
        metrics: TrainerMetrics,
        run_log: RunLog,
        *,
        restore: Callable[[Resume], Iterable[Any]],
        is_main: bool,
    ) -> None:
        self._cfg = cfg
        self._checkpointer = checkpointer
        self._position = position
        self._metrics = metrics
        self._run_log = run_log
        self._restore = restore
        self._is_main = is_main
        self._streak = bookkeeping.RollbackStreak()

    @classmethod
    def build(cls, cfg: Config, *parts: Any, **named: Any) -> Rollback | None:
        """The rollback part ``guard.nonfinite=rollback`` asks for, or None (nothing can ask for a rollback).

        :param cfg: The run's config.
        :param parts: The other positional parameters of the constructor.
        :param named: Its keyword-only parameters.
        :returns: The part, or None.
        """
        return cls(cfg, *parts, **named) if cfg.guard.nonfinite == "rollback" else None

    def roll_back(self, request: RollbackNeeded) -> None:
        """Restore the newest checkpoint before ``request``'s first bad step, and leave its bad batches out.

        :param request: What the guard raised.
        :raises DivergenceError: When no checkpoint was written before that step (``ckpt.enable`` off, the first
            epoch without ``ckpt.every_n_steps``, or every step checkpoint newer and none kept by ``ckpt.keep``).
        """
        first = request.bad[0][0]
        resume = self._checkpointer.rollback_resume(self._cfg, first)
        if resume is None:
            raise DivergenceError(
                f"{request}; guard.nonfinite=rollback found no checkpoint written before step {first} to roll back "
                "to (checkpoints need ckpt.enable; set ckpt.every_n_steps for step checkpoints, and ckpt.keep to "
                "keep older ones than last.pt and last.prev.pt)",
                step=request.step,
                epoch=request.epoch,
                batch=request.batch,
            ) from request
        self._refuse_a_futile(request, resume)
        self._refuse_a_streak(request, resume)
        position = self._position
        self._metrics.clear()  # the lost steps' logs go
        drop_gradients(self._restore(resume))  # a step checkpoint puts its own unpushed logs back
        for _, epoch, batches in request.bad:
            position.leave_out(epoch, batches)
        position.on_drop = _journal_dropped(position, self._run_log, self._is_main)
        left_out = [f"{epoch}:{batch}" for epoch, batch in position.left_out()]
        if self._is_main:
            step = position.step
            row = {"trainer/step": step, "trainer/epoch": resume.records.loop.epoch, ROLLBACK_KEY: step}
            self._run_log.log({**row, "guard/rollback_from_step": first, SKIPPED_BATCHES_KEY: left_out})
            say(
                f"guard.nonfinite=rollback: {len(request.bad)} non-finite step(s) from step {first} on; rolled back "
                f"to {resume.path} (step {step}), leaving out batches {', '.join(left_out)} (EPOCH:BATCH; a rerun "
                f"skips them with guard.skip_batches)"
            )

    def _refuse_a_streak(self, request: RollbackNeeded, resume: Resume) -> None:
        """Stop after ``guard.max_rollbacks`` rollbacks in a row to the same checkpoint (no newer one was written
        between: the run got nowhere)."""
        limit, back_to = self._cfg.guard.max_rollbacks, resume.records.loop.step
        self._streak, allowed = bookkeeping.step_rollbacks(self._streak, back_to, limit=limit)
        if not allowed:
            raise DivergenceError(
                f"{request}; guard.nonfinite=rollback rolled back {limit} times in a row to {resume.path} (step "
                f"{back_to}) without a newer checkpoint written between (guard.max_rollbacks={limit}): the "
                "divergence is not one batch's (a learning rate too high, or most of the batches bad); resume from "
                "a checkpoint with a lower learning rate, write step checkpoints (ckpt.every_n_steps) so that each "
                "rollback replays less, or raise guard.max_rollbacks",
                step=request.step,
                epoch=request.epoch,
                batch=request.batch,
            ) from request

    @staticmethod
    def _refuse_a_futile(request: RollbackNeeded, resume: Resume) -> None:
        """Stop when the checkpoint was written after every batch some bad step trained on: the replay would meet
        none of them, and fail the same way again."""
        loop, mid_epoch = resume.records.loop, resume.ckpt.get("trainkit")
        at = bookkeeping.EpochPosition.from_dict(mid_epoch["position"]) if mid_epoch is not None else None
        epoch, consumed = (at.epoch, at.batches) if at is not None else (loop.epoch, 0)
        futile = bookkeeping.unblamable_steps(request.bad, epoch=epoch, consumed=consumed)
        if futile:
            raise DivergenceError(
                f"{request}; guard.nonfinite=rollback would go back to {resume.path} (step {loop.step}, {consumed} "
                f"batches into epoch {epoch}), written after every batch step(s) {', '.join(map(str, futile))} "
                "trained on: leaving them out cannot change the replay, which would fail the same way again. "
                "Step only on batches self.progress() yielded, or write step checkpoints more often "
                "(ckpt.every_n_steps) with ckpt.keep",
                step=request.step,
                epoch=request.epoch,
                batch=request.batch,
            ) from request


def _journal_dropped(position: EpochTracker, run_log: RunLog, is_main: bool) -> Callable[[int, int, Any], None]:
    """What the counted loop calls when it leaves a batch out: rank 0 journals its sample indices.

    It holds the position part and the run log only: the position part lives as long as the optimizer's step hook,
    and a reference from it to the trainer would keep the trainer (and its process group) alive until the garbage
    collector runs."""

    def dropped(epoch: int, batch: int, indices: Any) -> None:
        if is_main:
            drawn = indices if isinstance(indices, list | tuple) else [indices]
            samples = [int(i) if isinstance(i, int) else str(i) for i in drawn]  # a key of a dict-like data set
            row = {"trainer/step": position.step, "trainer/epoch": epoch, SKIPPED_SAMPLES_KEY: samples}
            run_log.log({**row, "guard/skipped_batch": batch})

    return dropped


_NEVER_ROLLED: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(())
"""What :func:`rolled_back` enters when nothing can ask for a rollback: an empty (falsy) result, no generator."""


def rolled_back(rollback: Rollback | None) -> contextlib.AbstractContextManager[Any]:
    """Around the training epoch: a :class:`~trainkit.errors.RollbackNeeded` raised inside is caught and acted on.

    :param rollback: The rollback part, or None without ``guard.nonfinite=rollback``.
    :returns: A context whose value is non-empty (truthy) after a rollback: the epoch must run again from the
        restored position. Without a rollback part nothing raises a request, and the context is a shared no-op
        (this runs once per epoch of every run).
    """
    if rollback is None:
        return _NEVER_ROLLED
    return _rolling_back(rollback)


@contextlib.contextmanager
def _rolling_back(rollback: Rollback) -> Iterator[list[bool]]:
    rolled: list[bool] = []
    try:
        yield rolled
    except RollbackNeeded as request:
        rollback.roll_back(request)
        rolled.append(True)
