"""Where the training epoch stands: the loop's batches counted, step boundaries decided, samplers and loaders checked.

Side effects: warnings (pointing at the user's code), the ranks' stop vote (a non-blocking all-reduce per step
boundary under DDP), ``set_epoch`` on the samplers handed over, and what :class:`~trainkit.loop.batches.TrackedBatches`
does to a loader it counts.

:class:`EpochTracker` is the position part of the trainer: ``progress()`` hands it the epoch's loader and
gets the batches back (counted for step checkpoints, and skipped into when an epoch resumes inside); at each
step boundary the loop asks it whether a step checkpoint is due and whether the ranks must stop; the
checkpointer saves what it reports (:meth:`EpochTracker.epoch_position`, :meth:`EpochTracker.rank_position`).
It is built from plain values (``ckpt.every_n_steps``, ``ckpt.enable``, the world size, ``dist.timeout_s``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainkit import bookkeeping as core
from trainkit.distributed import collectives as dist_utils
from trainkit.errors import CheckpointMismatchError, UsageError
from trainkit.loop.batches import RankPosition, TrackedBatches, epoch_tagged, loader_shape, unskippable_reason
from trainkit.messages import warn_user
from trainkit.state.rng import loader_generators

__all__ = ["EpochTracker"]

_NOTHING: frozenset[int] = frozenset()
"""No batch left out (shared: looked up once per epoch)."""


class EpochTracker:
    """The training epoch's position: which batches were trained on, when a step checkpoint is due, a stop.

    It also holds where the loop stands: :attr:`epoch` and :attr:`step`, the trainer's ``epoch`` and ``step``
    (the first registered optimizer's post-step hook advances :attr:`step`); the parts that need them (the
    divergence guard, the throughput counters, the rollback) are given this part and read them here.

    :param every_n_steps: ``ckpt.every_n_steps`` (None: checkpoints at epoch ends only).
    :param enabled: ``ckpt.enable``.
    :param world_size: The number of processes.
    :param timeout_s: The bound on the stop vote's all-reduce (``dist.timeout_s``).
    :param left_out: Per epoch, the batch positions the counted loop leaves out (``guard.skip_batches``).
    :param count_always: Count the loop even without step checkpoints (``guard.nonfinite=rollback``: a rollback
        names the batches to leave out).
    """

    def __init__(
        self,
        *,
        every_n_steps: int | None,
        enabled: bool,
        world_size: int,
        timeout_s: float,
        left_out: Mapping[int, frozenset[int]] | None = None,
        count_always: bool = False,
    ) -> None:
        self.epoch = 0
        """The epoch being run (0-based); after the last one, the last one that ran."""
        self.step = 0
        """The optimizer steps taken so far, in the run and the runs it resumed."""
        self._every_n_steps = every_n_steps
        self._stepping = enabled and every_n_steps is not None
        self._enabled = enabled
        self._world_size = world_size
        self._vote = dist_utils.DelayedVote(timeout_s)
        self._pending: tuple[core.EpochPosition, RankPosition] | None = None
        self._due_at = math.inf  # the step from which a step checkpoint is due (this epoch's tracked loop)
        self._voting = False  # whether this epoch's step boundaries take part in the ranks' stop vote
        self._in_epoch = False
        self._tracked = False
        self.counted_batches: TrackedBatches | None = None
        """This epoch's counted loop (one object per pass over the epoch), or None outside one; an attribute, not a
        property: the divergence guard reads it before every optimizer step in rollback mode."""
        self._untracked_warned = False
        self.first_batch = 0
        """The index in the epoch of the first batch the tracked loop yields (a resumed epoch's consumed ones)."""
        self.samplers: list[Any] = []
        """The samplers whose ``set_epoch`` is called before every epoch."""
        self._count_always = count_always
        self._left_out: dict[int, frozenset[int]] = dict(left_out or {})  # the one owner: saved, restored, extended
        self.on_drop: Callable[[int, int, Any], None] | None = None
        """Called ``(epoch, position, indices)`` as the counted loop leaves a batch out."""
        # weak sets, not ids: a loader built anew each epoch may reuse a freed one's id
        self._loaders_checked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._samplers_unchecked: weakref.WeakSet[Any] = weakref.WeakSet()

    # ------------------------------------------------------------------ samplers

    def add_samplers(self, samplers: tuple[Any, ...]) -> None:
        """Take samplers whose ``set_epoch(epoch)`` is called before every epoch.

        :param samplers: Objects with a ``set_epoch(int)`` method.
        :raises UsageError: When one has no ``set_epoch``.
        """
        for sampler in samplers:
            if not callable(getattr(sampler, "set_epoch", None)):
                raise UsageError(f"add_samplers() needs objects with set_epoch(epoch), got {type(sampler).__name__}")
            self.samplers.append(sampler)

    def read_step(self) -> int:
        """The optimizer step counter (:attr:`step`), for the parts that are handed a reader.

        :returns: :attr:`step`.
        """
        return self.step

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: it becomes :attr:`epoch`, and ``set_epoch(epoch)`` is called on every sampler.

        :param epoch: The 0-based epoch about to run.
        """
        self.epoch = epoch
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    # ------------------------------------------------------------------ the batches left out

    def leave_out(self, epoch: int, batches: Iterable[int]) -> None:
        """Leave ``batches`` of ``epoch`` out from now on (a rollback's, or a checkpoint's saved ones).

        :param epoch: The 0-based epoch.
        :param batches: 0-based batch positions in that epoch.
        """
        self._left_out[epoch] = self._left_out.get(epoch, _NOTHING) | frozenset(batches)

    def left_out(self) -> list[tuple[int, int]]:
        """Every ``(epoch, batch)`` left out, sorted: what a checkpoint saves as ``guard_skips``.

        :returns: The pairs.
        """
        return [(epoch, batch) for epoch in sorted(self._left_out) for batch in sorted(self._left_out[epoch])]

    # ------------------------------------------------------------------ the epoch

    def resume(
        self, resume_path: Path, ckpt: Mapping[str, Any], *, rank: int, loop: core.LoopState, epochs: int
    ) -> dict[str, Any] | None:
        """Take a checkpoint's place in the run: the batches it leaves out and, for a step checkpoint, its position,
        kept for the resumed epoch's tracked loop.

        :param resume_path: Where the checkpoint was read (for messages).
        :param ckpt: The checkpoint (validated): its ``guard_skips``, and a step checkpoint's ``trainkit`` entry
            and this rank's RNG states at the save.
        :param rank: This rank.
        :param loop: The reconciled loop record.
        :param epochs: ``epochs``.
        :returns: This rank's share of a step checkpoint (its unpushed ``logs`` and ``grad_norm`` mean), or None
            (an epoch-end checkpoint, or a run that ends before that epoch: warned).
        :raises CheckpointMismatchError: When written by another number of processes.
        """
        for epoch, batch in ckpt.get("guard_skips") or []:
            self.leave_out(epoch, (batch,))
        mid_epoch, rng = ckpt.get("trainkit"), ckpt.get("rng")
        if mid_epoch is None or rng is None:
            return None
        rng_at_save = rng[rank]
        position = core.EpochPosition.from_dict(mid_epoch["position"])
        if loop.finished or loop.epoch != position.epoch:
            warn_user(
                f"{resume_path} was written inside epoch {position.epoch} (after {position.batches} of "
                f"{position.batches_per_epoch} batches), but epochs={epochs} ends the run before it: "
                "the rest of that epoch is not trained"
            )
            return None
        mismatch = core.position_mismatch(position, world_size=self._world_size)
        if mismatch is not None:  # the checkpoint's reader refuses another world size already; kept for a caller
            raise CheckpointMismatchError(f"{resume_path} was written inside an epoch: {mismatch}")
        state = mid_epoch["ranks"][rank]
        self.first_batch = position.batches
        self._pending = (
            position,
            RankPosition(
                rng_at_iter=state["rng_at_iter"],
                generators_at_iter=state["generators_at_iter"],
                rng_at_save=rng_at_save,
            ),
        )
        return state

    @contextlib.contextmanager
    def running_epoch(self) -> Iterator[None]:
        """Around ``train_epoch()``: the tracked loop is counted inside; afterwards, warn when a resumed epoch's
        position was never used (``train_epoch()`` did not iterate a ``DataLoader`` through ``progress()``)."""
        self._in_epoch, self._tracked = True, False
        try:
            yield
        finally:
            self._in_epoch = False
            self.first_batch = 0
            self.counted_batches = None
        if self._pending is not None:
            position = self._pending[0]
            self._pending = None
            warn_user(
                f"the run resumed inside epoch {position.epoch} (after {position.batches} of "
                f"{position.batches_per_epoch} batches), but train_epoch() did not iterate a DataLoader through "
                "self.progress(), so the epoch ran from its first batch: the batches before the checkpoint were "
                "trained on twice"
            )

    def track(self, loader: Any, at_boundary: Callable[[TrackedBatches], None]) -> TrackedBatches | None:
        """The epoch's batches counted (for step checkpoints) and skipped into (for a mid-epoch resume), or None.

        :param loader: What ``progress()`` was given (for epoch :attr:`epoch`).
        :param at_boundary: Called at each step boundary (when step checkpoints are on).
        :returns: The tracked batches, or None when this loop is not counted (warned once when it should be).
        :raises CheckpointMismatchError: When a resumed epoch's loader cannot be skipped into, or differs.
        """
        pending, epoch = self._pending, self.epoch
        drop = self._left_out.get(epoch, _NOTHING)
        if not self._in_epoch or not (self._stepping or pending is not None or self._count_always or drop):
            return None
        if self._tracked:
            self._warn_untracked(
                "progress() was called a second time in one train_epoch(): only the first loop is counted, so "
                "no step checkpoint is written while this one runs"
            )
            return None
        reason = unskippable_reason(loader)
        if reason is not None:
            if pending is None and drop:
                raise CheckpointMismatchError(
                    f"batches {sorted(drop)} of epoch {epoch} are to be left out (guard.nonfinite=rollback), but "
                    f"train_epoch() iterates {reason}, which trainkit cannot leave batches out of"
                )
            if pending is not None:
                raise CheckpointMismatchError(
                    f"the checkpoint was written inside epoch {pending[0].epoch}, after {pending[0].batches} batches, "
                    f"but train_epoch() now iterates {reason}, which trainkit cannot skip into; "
                    "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
                )
            self._warn_untracked(
                "ckpt.every_n_steps needs progress() to be given a DataLoader over a map-style dataset, with a "
                f"length, got {reason}: this loop writes no step checkpoints and resumes at epoch boundaries"
            )
            return None
        position, resume = pending if pending is not None else (None, None)
        if position is not None:
            self._check_same_data(position, resume, loader)
            self._pending = None
        beyond = sorted(batch for batch in drop if batch >= len(loader))
        if beyond:
            warn_user(
                f"guard.skip_batches names batches {beyond} of epoch {epoch}, but its loader has {len(loader)} batches "
                "(positions are 0-based): nothing is left out there"
            )
        self._tracked = True
        self.saved(self.step)
        self._voting = self._stepping and dist_utils.is_distributed()
        self.counted_batches = TrackedBatches(
            loader,
            epoch=epoch,
            skip=position.batches if position is not None else 0,
            resume=resume,
            step=self.read_step,
            at_step_boundary=at_boundary if self._stepping else None,
            on_close=self._vote.finish,
            on_untracked=self._warn_untracked,
            drop=drop,
            on_drop=self.on_drop,
        )
        return self.counted_batches

    def epoch_tagged(self, loader: Any) -> Any:
        """The loader of a loop :meth:`track` does not count, its batches saying the epoch to
        :func:`trainkit.sample_generator` inside ``train_epoch()``; outside it, ``loader`` itself.

        :param loader: What ``progress()`` was given.
        :returns: What ``progress()`` iterates (see :func:`trainkit.loop.batches.epoch_tagged`).
        """
        return epoch_tagged(loader, self.epoch) if self._in_epoch else loader

    def current_batch(self) -> int | None:
        """The 0-based index in the epoch of the last batch the counted loop yielded, or None (no counted loop).

        :returns: The index, for messages (the divergence guard's error names it).
        """
        batches = self.counted_batches
        return None if batches is None or batches.consumed == 0 else batches.consumed - 1

    def _check_same_data(self, position: core.EpochPosition, resume: Any, loader: Any) -> None:
        mismatch = core.position_mismatch(position, world_size=self._world_size, loader=loader_shape(loader))
        generators = len(loader_generators(loader))
        if mismatch is None and generators != len(resume.generators_at_iter):
            mismatch = f"generators of its own: {len(resume.generators_at_iter)} then, {generators} now"
        if mismatch is not None:
            raise CheckpointMismatchError(
                f"the checkpoint was written inside epoch {position.epoch}, after {position.batches} of "
                f"{position.batches_per_epoch} batches, and skipping them needs the same data: {mismatch}; "
                "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )

    def _warn_untracked(self, message: str) -> None:
        """Say once per trainer that a loop runs without step checkpoints."""
        if not self._untracked_warned:
            self._untracked_warned = True
            warn_user(message)

    # ------------------------------------------------------------------ step boundaries

    def boundary(self, step: int, signalled: bool) -> tuple[bool, bool]:
        """Decide, between two batches right after an optimizer step, whether to save and whether to stop.

        The ranks agree on a signal through a vote started at the previous boundary, so no rank waits here; a
        signal is acted on one step later under DDP than on one process.

        :param step: The optimizer step counter.
        :param signalled: Whether this process got a stop signal.
        :returns: ``(save, stop)``: a step checkpoint is due (or the run stops), and the ranks stop now.
        """
        if not (signalled or self._voting or step >= self._due_at):
            return False, False  # one process, no signal, nothing due: what almost every step boundary is
        stop = self._vote.cast(signalled)
        return stop or step >= self._due_at, stop

    def saved(self, step: int) -> None:
        """Record that ``last`` holds ``step`` (or that the tracked epoch starts there): the next one is due later.

        :param step: The optimizer step counter.
        """
        due_at = core.next_step_checkpoint(step, self._every_n_steps)
        self._due_at = math.inf if due_at is None else due_at

    def save_position(
        self, batches: TrackedBatches | None, epoch: int, metrics: tuple[dict[str, Any], dict[str, Any]]
    ) -> tuple[core.EpochPosition | None, dict[str, Any] | None]:
        """What a save records of the epoch's position: none at an epoch's end (``batches`` None), else where the
        epoch stands and this rank's share (:meth:`epoch_position`, :meth:`rank_position`).

        :param batches: The tracked batches of a step checkpoint, or None.
        :param epoch: The epoch.
        :param metrics: This rank's unpushed logs and grad-norm mean (``TrainerMetrics.state_dict()``).
        """
        if batches is None:
            return None, None
        return self.epoch_position(batches, epoch, self._world_size), self.rank_position(batches, *metrics)

    @staticmethod
    def epoch_position(batches: TrackedBatches, epoch: int, world_size: int) -> core.EpochPosition:
        """Where the tracked epoch stands, for a step checkpoint.

        :param batches: The tracked batches.
        :param epoch: The epoch.
        :param world_size: The number of processes.
        """
        return core.EpochPosition(
            epoch=epoch,
            batches=batches.consumed,
            batches_per_epoch=len(batches),
            batch_size=batches.loader.batch_size,
            dataset_length=len(batches.loader.dataset),
            world_size=world_size,
        )

    @staticmethod
    def rank_position(batches: TrackedBatches, logs: dict[str, Any], grad_norm: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of a step checkpoint: what it puts back to continue from the same batch.

        :param batches: The tracked batches.
        :param logs: Its unpushed metrics (``LogBuffer.state_dict()``).
        :param grad_norm: Its epoch grad-norm mean so far.
        """
        return {
            "rng_at_iter": batches.rng_at_iter,
            "generators_at_iter": batches.generators_at_iter,
            "logs": logs,
            "grad_norm": grad_norm,
        }

    # ------------------------------------------------------------------ loaders

    def check_loader(self, loader: Any, *, epoch: int, registered: Callable[[], list[Any]]) -> None:
        """Warn once per loader whose shuffle would repeat every epoch, or that a resume would not restore.

        :param loader: What ``progress()`` was given.
        :param epoch: The current epoch.
        :param registered: Returns the ``torch.Generator`` objects registered as checkpoint items (asked only the
            first time a loader comes by).
        """
        try:
            weakref.ref(loader)
        except TypeError:  # a list or a tuple of batches: no sampler, no generator to check
            return
        sampler = getattr(loader, "sampler", None)
        if loader in self._samplers_unchecked or loader not in self._loaders_checked:
            # decided at the first epoch after 0: by then a set_epoch() called by hand shows in sampler.epoch
            if epoch == 0 and getattr(sampler, "epoch", None) == 0:
                self._samplers_unchecked.add(loader)
            else:
                self._samplers_unchecked.discard(loader)
                self._warn_if_epoch_never_set(sampler, epoch)
        if loader in self._loaders_checked:
            return
        self._loaders_checked.add(loader)
        generators = loader_generators(loader) if self._enabled else []
        if generators and any(all(g is not r for r in registered()) for g in generators):
            warn_user(
                "the DataLoader given to progress() shuffles with a torch.Generator of its own, which is not "
                "registered, so a resumed run would shuffle differently from an uninterrupted one; register it "
                "in setup(): self.add_checkpoint_items(loader_generator=generator)"
            )

    def _warn_if_epoch_never_set(self, sampler: Any, epoch: int) -> None:
        if not (callable(getattr(sampler, "set_epoch", None)) and getattr(sampler, "shuffle", False)):
            return
        if any(sampler is known for known in self.samplers) or getattr(sampler, "epoch", None) == epoch:
            return  # handed over, or its set_epoch() is called by hand
        warn_user(
            f"the DataLoader given to progress() has a {type(sampler).__name__} that shuffles by epoch, but its "
            f"epoch is {getattr(sampler, 'epoch', None)!r} in epoch {epoch}: nothing calls its set_epoch(), so "
            "every epoch shuffles the same way; hand it to the trainer in setup(): self.add_samplers(sampler)"
        )
