"""The divergence guard part: what happens to an optimizer step whose total grad norm is not finite.

``guard.nonfinite="off"`` (the default) builds nothing: no hook, no tensor op. Otherwise
:meth:`~trainkit.BaseTrainer.clip_and_log_grad_norm` hands the pre-clip norm to :meth:`DivergenceGuard.observe`,
which turns it into a 0-d device flag (1.0: not finite), and an optimizer step pre-hook on every optimizer
registered with ``add_checkpoint_items`` acts on it before the step runs. Two paths, chosen once per run:

* **On the device** (``"skip"`` without ``max_skips``, and every watched optimizer fused, i.e. one that takes
  ``found_inf`` as ``torch.amp.GradScaler`` hands it: ``Adam``/``AdamW``/``SGD``/``Adagrad`` with
  ``fused=True``): the flag is set as the optimizer's ``found_inf`` attribute, and the fused kernel skips the
  update (parameters, moments, momentum; Adam's step count is put back). No host sync; the skip count is a
  device tensor pushed with the next :meth:`~trainkit.BaseTrainer.push_logs`.
* **On the host** (every other case): the norm is read once per step (the pre-hook's device-to-host read, as
  ``GradScaler.step`` makes; a CPU norm is judged from the float the log buffer read when it was logged, with no
  second read), and a non-finite one runs :func:`trainkit.bookkeeping.step_guard`: the pre-hook either raises
  :class:`~trainkit.DivergenceError` or skips the step by setting every parameter's ``.grad`` to None (torch's
  optimizers leave a parameter without a gradient untouched: no update, no state change).

``"rollback"`` takes the host path; when its window is exhausted the pre-hook raises
:class:`~trainkit.errors.RollbackNeeded` (a :class:`~trainkit.DivergenceError`) naming the window's bad steps
and their batches, and the trainer rolls back (:mod:`trainkit.loop.rollback`).

Under DDP the flag is all-reduced (MAX) before it is read or used, so every rank takes the same verdict even
when the norms differ. Side effects: optimizer hooks, ``found_inf`` set on a fused optimizer during its step,
``.grad`` cleared on a skipped step, ``guard/skipped_steps`` buffered for the next push.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from trainkit import bookkeeping, torch_private
from trainkit.bookkeeping.guard import CONTINUE, RAISE, ROLLBACK, SKIP
from trainkit.errors import DivergenceError, RollbackNeeded
from trainkit.loop.epoch_tracker import EpochTracker
from trainkit.loop.tracked_batches import TrackedBatches

if TYPE_CHECKING:
    from trainkit.config import GuardConfig

__all__ = ["DivergenceGuard", "SKIPPED_KEY"]

SKIPPED_KEY = "guard/skipped_steps"
"""The metric that counts the optimizer steps the guard skipped, in the run so far."""


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step takes ``found_inf`` (GradScaler's contract: a fused torch optimizer)."""
    return torch_private.optimizer_unscales_itself(optimizer)


class DivergenceGuard:
    """The guard of one trainer: the flag of the latest measured norm, the verdict on it, the skip count.

    :param mode: ``guard.nonfinite`` (not ``"off"``).
    :param max_skips: ``guard.max_skips``.
    :param window: ``guard.window``.
    :param world_size: The number of processes (the flag is all-reduced when > 1).
    """

    def __init__(self, *, mode: str, max_skips: int | None, window: int, world_size: int) -> None:
        self._state = bookkeeping.GuardState(mode=mode, max_skips=max_skips, window=window)
        self._host = mode != "skip" or max_skips is not None  # a verdict that needs the flag on the host
        self._all_fused = True
        self._on_device: bool | None = None  # the path, decided at the first observe()
        self._world_size = world_size
        self._flag: torch.Tensor | float | None = None  # the latest norm or its host read; device path: found_inf
        self._found_inf: torch.Tensor | None = None  # the device path's flag, reused from step to step
        self._verdict: str | None = None  # the host verdict on the current flag, once decided
        self._counted = False  # whether the current flag was counted
        self._skipped: torch.Tensor | None = None  # the device path's skip count
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._saved_found_inf: dict[int, Any] = {}
        self._seen: dict[int, tuple[int, tuple[int, ...] | None]] = {}  # rollback: the bad steps' (epoch, batches)
        self._rollback = mode == "rollback"
        self._position: EpochTracker | None = None  # where the loop stands: step, epoch, the counted batches
        self._stepped_in: TrackedBatches | None = None  # rollback: the counted pass of the latest optimizer step
        self._stepped_at = 0  # rollback: the batches that pass had consumed then
        self._fresh = False  # rollback: a norm was observed since the last optimizer step (a new step, not a second
        # optimizer stepping on the same one)
        self._step_start = 0  # rollback: the position of the first batch of the optimizer step under way

    def reset(self, skipped: float | None = None) -> None:
        """Start again from a checkpoint (a resume, or a rollback): nothing seen, the skip count as it was saved.

        :param skipped: The skip count the checkpoint holds (``guard/skipped_steps`` buffered or pushed before it);
            None: none.
        """
        state = self._state
        count = int(skipped) if skipped is not None else 0
        self._state = bookkeeping.GuardState(
            mode=state.mode, max_skips=state.max_skips, window=state.window, skipped=count
        )
        self._flag = self._skipped = self._verdict = None
        self._seen = {}
        self._stepped_in = None

    @classmethod
    def build(cls, cfg: GuardConfig, world_size: int) -> DivergenceGuard | None:
        """The guard ``cfg`` asks for, or None for ``"off"`` (nothing installed, nothing computed).

        :param cfg: ``cfg.guard``.
        :param world_size: The number of processes.
        :returns: The guard, or None.
        """
        if cfg.nonfinite == "off":
            return None
        return cls(mode=cfg.nonfinite, max_skips=cfg.max_skips, window=cfg.window, world_size=world_size)

    device_path_on_cpu = False
    """Take the device path for CPU tensors too (tests do, to exercise ``found_inf``): on the CPU a host read is
    no sync, and the flag's two tensor ops cost more than the read (measured: docs, "Divergence guard")."""

    @property
    def on_device(self) -> bool:
        """Whether the verdicts are taken on the device (no host read per step): see the module's docstring; decided
        at the first measured norm (on the CPU the host path is taken, unless :attr:`device_path_on_cpu`)."""
        return self._on_device is True

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped so far, in the run and the runs it resumed (a host read on the device path)."""
        value = self.count()[SKIPPED_KEY]
        return int(value.item() if isinstance(value, torch.Tensor) else value)

    def watch(self, objects: Iterable[Any], position: EpochTracker) -> None:
        """Install the step hooks on every optimizer among ``objects`` (once each).

        :param objects: What ``add_checkpoint_items`` was given.
        :param position: The trainer's position part: where the loop stands (step, epoch, batch) names the step in
            the error and the window, and its counted loop says which batches each optimizer step trained on (what
            a rollback leaves out).
        """
        self._position = position
        for optimizer in objects:
            if not isinstance(optimizer, torch.optim.Optimizer) or optimizer in self._watched:
                continue
            self._watched.add(optimizer)
            self._all_fused = self._all_fused and _fused(optimizer)
            optimizer.register_step_pre_hook(self._before_step)
            if _fused(optimizer):
                optimizer.register_step_post_hook(self._after_step)

    def observe(self, norm: torch.Tensor, read: float | None = None) -> None:
        """Take the step's pre-clip total grad norm (no host sync: on the host path it is only kept).

        :param norm: The 0-d norm from :func:`trainkit.loop.optim.total_grad_norm` (not changed).
        :param read: The same norm already read on the host (the log buffer reads a CPU tensor when it is logged),
            so that the host path's verdict needs no second read; ignored under DDP, where the verdict is on the
            all-reduced norm.
        """
        if self._world_size > 1:  # one verdict: a NaN or inf norm on any rank makes the sum non-finite everywhere
            norm = norm.clone()
            torch.distributed.all_reduce(norm)
            read = None
        if self._on_device is None:
            cpu = norm.device.type == "cpu" and not self.device_path_on_cpu
            self._on_device = not self._host and self._all_fused and not cpu
        if self._on_device:
            flag = self._found_inf
            if flag is None or flag.device != norm.device:
                flag = self._found_inf = torch.empty((), dtype=torch.float32, device=norm.device)
            torch.logical_not(torch.isfinite(norm), out=flag)  # 1.0 when not finite, as found_inf must be
            self._flag = flag
            self._verdict = None
        elif read is None:
            self._flag, self._verdict = norm, None  # read (once) by the first optimizer step's hook
        else:  # read on the host already: judged now, and a finite norm leaves the step's hook nothing to do
            self._flag, self._verdict = read, CONTINUE if math.isfinite(read) else None
        self._counted = False
        self._fresh = True

    def count(self) -> dict[str, Any]:
        """The skip count as a metric, for the next push (a device tensor on the device path: no host read).

        :returns: ``{"guard/skipped_steps": count}``.
        """
        if self._skipped is not None:
            return {SKIPPED_KEY: self._skipped}
        return {SKIPPED_KEY: self._state.skipped}

    # ------------------------------------------------------------------ the hooks

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._rollback:  # which batches this step trained on (what a rollback leaves out); inline: every step
            batches = self._position.counted_batches if self._position is not None else None
            if batches is None:  # not a counted loop: a rollback stops instead (see _decide)
                self._stepped_in = None
            elif batches is not self._stepped_in:  # the first step of this pass (a resumed one starts at its skip)
                self._stepped_in = batches
                self._step_start = batches.skip
                self._stepped_at = batches.consumed
            elif batches.consumed != self._stepped_at:  # (equal: a second optimizer stepping on the same batches)
                self._step_start = self._stepped_at
                self._stepped_at = batches.consumed
            elif self._fresh and batches.ended:  # a new norm after the loop's end: it trained on none of its batches
                self._step_start = self._stepped_at
            # else a new norm on the batches of the last step (a second optimizer, a GAN's, with a norm of its own),
            # or no new norm (a second optimizer stepping on the same one): the same batches are to blame
            self._fresh = False
        if self._verdict is CONTINUE:
            return  # a finite norm (judged when observed, or by the first optimizer stepping on it)
        flag = self._flag
        if flag is None:
            return  # no norm measured since the last step: this step is not guarded
        if self._on_device:  # (not the property: this runs every step, and a call costs more than the check)
            if not self._counted:
                self._counted = True
                if self._skipped is None:
                    self._skipped = torch.full((), float(self._state.skipped), device=flag.device)
                self._skipped.add_(flag)
            previous = getattr(optimizer, "found_inf", None)  # GradScaler's, when it calls this step
            self._saved_found_inf[id(optimizer)] = previous
            optimizer.found_inf = flag if previous is None else torch.maximum(previous, flag.to(previous.device))
            return
        verdict = self._verdict
        if verdict is None:  # once per measured norm, however many optimizers step on it
            finite = math.isfinite(flag)  # a float, or the one host read per step (as GradScaler.step makes)
            verdict = self._verdict = CONTINUE if finite else self._decide()
        if verdict == SKIP:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) not in self._saved_found_inf:
            return
        previous = self._saved_found_inf.pop(id(optimizer))
        if previous is None:
            del optimizer.found_inf
        else:
            optimizer.found_inf = previous

    def _decide(self) -> str:
        """The verdict on a non-finite step (a finite one is always taken: step_guard would say so)."""
        position = self._position
        step, epoch = (position.step, position.epoch) if position is not None else (0, 0)
        batch = position.current_batch() if position is not None else None
        batches = None  # not a counted loop; () when counted but the step trained on none of its batches
        if self._rollback and self._stepped_in is not None:
            batches = tuple(range(self._step_start, self._stepped_at))
        recent = self._state.recent
        if recent and step <= recent[-1]:
            # the counted optimizer did not step since (a second optimizer's step): judged as the next step
            step = recent[-1] + 1
        self._state, verdict = bookkeeping.step_guard(self._state, step, finite=False)
        if self._state.mode == "rollback":
            self._seen = {s: self._seen.get(s, (epoch, batches)) for s in self._state.recent}
        if verdict == ROLLBACK:
            self._flag = None
            bad = tuple((s, *self._seen[s]) for s in self._state.recent)
            counted = all(b is not None for _, _, b in bad)
            unblamed = [s for s, _, b in bad if b == ()]
            if not counted or unblamed:
                message = self._message(step, epoch, batch, counted=counted, unblamed=unblamed)
                raise DivergenceError(message, step=step, epoch=epoch, batch=batch)
            raise RollbackNeeded(self._message(step, epoch, batch), step=step, epoch=epoch, batch=batch, bad=bad)
        if verdict == RAISE:
            self._flag = None  # a caller that catches the error and steps again is not judged twice
            raise DivergenceError(self._message(step, epoch, batch), step=step, epoch=epoch, batch=batch)
        return verdict

    def _message(
        self, step: int, epoch: int, batch: int | None, *, counted: bool = True, unblamed: list[int] | None = None
    ) -> str:
        in_epoch = f", batch {batch} of the epoch" if batch is not None else ""
        where = f"optimizer step {step} (epoch {epoch}{in_epoch})"
        state = self._state
        if counted and unblamed:
            return (
                f"training stopped before {where}: its gradients are not finite, and step(s) "
                f"{', '.join(map(str, unblamed))} "
                "trained on no batch of the epoch's counted loop (an optimizer step after the loop's last batch or "
                "before its first: a flush of a gradient-accumulation window with nothing left in it, an extra step "
                "on a fixed batch), so guard.nonfinite=rollback has no batch to leave out and would fail the same "
                "way again; nothing of that step was applied. Step only on batches self.progress() yielded, or use "
                "guard.nonfinite=skip or raise"
            )
        if not counted:
            return (
                f"training stopped before {where}: its gradients are not finite, and guard.nonfinite=rollback cannot "
                "leave the offending batches out, as train_epoch() does not iterate a DataLoader over a map-style "
                "dataset through self.progress(); nothing of that step was applied"
            )
        if state.mode == "raise":
            why = "its gradients are not finite (total grad norm NaN or inf; guard.nonfinite=raise)"
            fix = "set guard.nonfinite=skip to drop such steps"
        else:  # already skipping: more skips, or going back before the run diverged
            fix = "raise guard.max_skips (or lower guard.window) to drop more such steps"
            steps = ", ".join(map(str, state.recent))
            why = (
                f"its gradients are not finite, and {len(state.recent)} non-finite steps fell within guard.window="
                f"{state.window} steps (steps {steps}; guard.max_skips={state.max_skips})"
            )
        return (
            f"training stopped before {where}: {why}; nothing of that step was applied. Resume from a checkpoint "
            f"before it, lower the learning rate, or {fix}"
        )
