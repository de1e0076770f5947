"""Where the training epoch stands: the loop's batches counted, step boundaries decided, samplers and loaders checked.

Side effects: warnings (pointing at the user's code), the ranks' stop vote (a non-blocking all-reduce per step
boundary under DDP), ``set_epoch`` on the samplers handed over, and what
:class:`~trainkit.loop.tracked_batches.TrackedBatches` does to a loader it counts.

:class:`EpochTracker` is the position part of the trainer: ``progress()`` hands it the epoch's loader and
gets the batches back (counted for step checkpoints, and skipped into when an epoch resumes inside); at each
step boundary the loop asks it whether a step checkpoint is due and whether the ranks must stop; the
checkpointer saves what it reports (:meth:`EpochTracker.epoch_position`, :meth:`EpochTracker.rank_position`).
It is built from plain values (``ckpt.every_n_steps``, ``ckpt.enable``, the world size, ``dist.timeout_s``). What
falls due at a step boundary is decided on plain numbers in :mod:`trainkit.bookkeeping.step_schedule`; the tracker
keeps the effects.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainkit import bookkeeping
from trainkit.bookkeeping.step_schedule import StepDue, StepSchedule, schedule_from, schedule_saved, step_due
from trainkit.checkpoint.payload import pooled_running_mean
from trainkit.distributed import collectives
from trainkit.errors import BookkeepingError, CheckpointMismatchError, UsageError
from trainkit.loop.stateful_batches import (
    StatefulBatches,
    carries_own_position,
    check_rollback_loader,
    loader_facts,
    loader_order,
)
from trainkit.loop.tracked_batches import RankPosition, TrackedBatches, WatchedBatches, epoch_tagged, unskippable_reason
from trainkit.messages import warn_user
from trainkit.state.rng import capture_rng, loader_generators

__all__ = ["EpochTracker"]

_NOTHING: frozenset[int] = frozenset()
"""No batch left out (shared: looked up once per epoch)."""


def _pooled_share(ranks: list[dict[str, Any]], resume_path: Path) -> dict[str, Any]:
    """What every rank of a run on another world size takes of a step checkpoint's per-rank shares.

    The unpushed logs are saved rank 0's (rank 0 writes the rows: the journal and W&B continue as they would have);
    the epoch's grad-norm mean pools the saved ranks' sums and counts
    (:func:`~trainkit.checkpoint.payload.pooled_running_mean`: identical ones, as DDP's all-reduced gradients give, stay
    as they are).
    """
    means = [state["grad_norm"] for state in ranks]
    try:
        grad_norm = pooled_running_mean(means, name="the epoch's grad-norm mean (train/grad_norm_epoch)")
    except BookkeepingError as exc:
        raise CheckpointMismatchError(f"{resume_path} was written inside an epoch: {exc}") from exc
    return {"logs": ranks[0]["logs"], "grad_norm": grad_norm}


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
    :param max_steps: ``max_steps``: the loop ends at that step boundary (None: at its last batch).
    :param val_every_n_steps: ``val.every_n_steps``: a step validation falls due every that many steps.
    :param log_every_n_steps: ``log_every_n_steps``: a row falls due every that many steps.
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
        max_steps: int | None = None,
        val_every_n_steps: int | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        self.epoch = 0
        """The epoch being run (0-based); after the last one, the last one that ran."""
        self.step = 0
        """The optimizer steps taken so far, in the run and the runs it resumed."""
        self._stepping = enabled and every_n_steps is not None
        self._enabled = enabled
        self._world_size = world_size
        self._vote = collectives.DelayedVote(timeout_s)
        self._pending: tuple[bookkeeping.EpochPosition, RankPosition] | None = None
        self._schedule = StepSchedule(
            every_n_steps=every_n_steps,
            val_every_n_steps=val_every_n_steps,
            log_every_n_steps=log_every_n_steps,
            max_steps=math.inf if max_steps is None else max_steps,
        )
        # step boundaries are watched for step checkpoints, for the step budget, step validation and rows
        self._watching = self._stepping or max_steps is not None or val_every_n_steps or log_every_n_steps
        self._due_at = self._schedule.due_at  # read at every step boundary: an attribute, not the record's
        self._resumable = False  # whether this epoch's loop writes step checkpoints (it can resume, and they are on)
        self._can_resume = False  # whether this epoch's loop can be resumed from a recorded position at all
        self.validated_at: int | None = None
        """The step of the last validation run at a step boundary (None: none yet)."""
        self.ended_inside = False
        """Whether the epoch's loop ended at a step boundary before its last batch (``max_steps``, or a step
        validation's early stop); the run's final checkpoint then records its position, when it can resume."""
        self._end_batches: TrackedBatches | None = None
        self._ran_out: StatefulBatches | None = None  # the epoch's counted pass over a loader with its own position
        self._epoch_start_state: dict[str, Any] | None = None  # an epoch-end checkpoint's state for that loader
        self._state_handed = False  # a resumed epoch handed its loader a saved state: the next pass starts after it
        self.stopped_early = False
        """Whether a step validation's early-stop verdict ended the epoch's loop."""
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
        self, resume_path: Path, ckpt: Mapping[str, Any], *, rank: int, loop: bookkeeping.LoopState, budget: str
    ) -> dict[str, Any] | None:
        """Take a checkpoint's place in the run: the batches it leaves out and, for a step checkpoint, its position,
        kept for the resumed epoch's tracked loop.

        :param resume_path: Where the checkpoint was read (for messages).
        :param ckpt: The checkpoint (validated): its ``guard_skips``, and a step checkpoint's ``trainkit`` entry
            and this rank's RNG states at the save.
        :param rank: This rank.
        :param loop: The reconciled loop record.
        :param budget: The run's length as configured (``epochs=3``, ``max_steps=900``), for the warning.
        :returns: This rank's share of a step checkpoint (its unpushed ``logs`` and ``grad_norm`` mean), or None
            (an epoch-end checkpoint, a finished run's, or a run that ends before that epoch: warned). On another
            world size every rank's share is the same: saved rank 0's logs and the pooled grad-norm mean.
        :raises CheckpointMismatchError: When written by another number of processes and its grad-norm means cannot
            be pooled (one that cannot be dealt over this one the checkpointer refused as it read it);
            when the run ended inside an epoch (``max_steps``, a step validation's early stop) without recording its
            position there, and this run would continue that epoch (its first batches would be trained twice).
        """
        for epoch, batch in ckpt.get("guard_skips") or []:
            self.leave_out(epoch, (batch,))
        mid_epoch, rng = ckpt.get("trainkit"), ckpt.get("rng")
        loader_states = ckpt.get("loader_states")
        if mid_epoch is None and loader_states is not None and not loop.finished:
            self._take_epoch_end_state(resume_path, loader_states, rank)
        if mid_epoch is None and loop.in_epoch and not loop.finished:
            # a run that ended inside an epoch without recording where: the epoch would start again at batch 0
            raise CheckpointMismatchError(
                f"{resume_path} ended inside epoch {loop.epoch} at step {loop.step} ({ckpt['loop'].get('stop_reason')})"
                f" but recorded no position to continue that epoch from (its loop was not one trainkit can skip into, "
                f"or an older trainkit wrote it), so {budget} would train that epoch's first batches twice; keep the "
                "budget it ended at, resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )
        if mid_epoch is None or rng is None:
            return None
        position = bookkeeping.EpochPosition.from_dict(mid_epoch["position"])
        if loop.finished or loop.epoch != position.epoch:
            if ckpt["loop"].get("stop_reason") is None:  # a finished run's final position is no news
                warn_user(
                    f"{resume_path} was written inside epoch {position.epoch} (after {position.done}), but {budget} "
                    "ends the run before it: the rest of that epoch is not trained"
                )
            return None
        self.first_batch = position.batches
        if position.world_size != self._world_size:
            state = _pooled_share(mid_epoch["ranks"], resume_path)
            now = capture_rng()  # the states the checkpointer seeded for this rank (no saved rank's maps onto it)
            self._pending = (position, RankPosition(rng_at_iter=now, generators_at_iter=None, rng_at_save=now))
            return state
        state = mid_epoch["ranks"][rank]
        self._pending = (
            position,
            RankPosition(
                rng_at_iter=state["rng_at_iter"],
                generators_at_iter=state["generators_at_iter"],
                rng_at_save=rng[rank],
                loader_state=state.get("loader_state"),
                generators_at_save=state.get("generators_at_save"),
            ),
        )
        return state

    def _take_epoch_end_state(self, resume_path: Path, states: list[dict[str, Any] | None], rank: int) -> None:
        """Keep this rank's state of the loader whose epoch ended at an epoch-end checkpoint, for the next epoch's
        pass to start from (:class:`~trainkit.loop.stateful_batches.StatefulBatches`); on another world size no saved
        rank's state is this rank's: warned, and the loaders start as they are."""
        if len(states) != self._world_size:
            warn_user(
                f"{resume_path} holds the states of {len(states)} ranks' loaders at the epoch's end, and this run has "
                f"{self._world_size} ranks: the loaders that carry their own position start the next epoch from "
                "their state as setup() built them, not from the saved one"
            )
            return
        self._epoch_start_state = states[rank]

    def epoch_end_loader_state(self) -> dict[str, Any] | None:
        """What an epoch-end save records of this rank's loader: the ``state_dict()`` of the loader that carries its
        own position whose counted pass ran out in the epoch that just ended, or None (no such loader, or the loop
        ended inside the epoch: that save records the position instead).

        :returns: The state (copied), or None.
        :raises UsageError: As :meth:`~trainkit.loop.stateful_batches.StatefulBatches.loader_state` does.
        """
        batches = self._ran_out
        if batches is None or self._end_batches is not None:
            return None
        return batches.loader_state()

    @contextlib.contextmanager
    def running_epoch(self) -> Iterator[None]:
        """Around ``train_epoch()``: the tracked loop is counted inside; afterwards, warn when a resumed epoch's
        position was never used (``train_epoch()`` did not iterate a ``DataLoader`` through ``progress()``)."""
        self._in_epoch, self._tracked = True, False
        self.ended_inside, self.stopped_early, self._end_batches = False, False, None
        self._ran_out = None
        try:
            yield
            batches = self.counted_batches
            if isinstance(batches, StatefulBatches) and batches.ended and not self.ended_inside:
                self._ran_out = batches
        finally:
            self._in_epoch = False
            self.first_batch = 0
            self.counted_batches = None
            self._epoch_start_state = None  # for this epoch's first pass only
        if self._pending is not None:
            position = self._pending[0]
            self._pending = None
            warn_user(
                f"the run resumed inside epoch {position.epoch} (after {position.done}), but train_epoch() did not "
                "iterate a DataLoader through "
                "self.progress(), so the epoch ran from its first batch: the batches before the checkpoint were "
                "trained on twice"
            )

    def track(self, loader: Any, at_boundary: Callable[[TrackedBatches], bool]) -> TrackedBatches | None:
        """The epoch's batches counted (for step checkpoints, the step budget, step validation and rows) and skipped
        into (for a mid-epoch resume), or None.

        :param loader: What ``progress()`` was given (for epoch :attr:`epoch`).
        :param at_boundary: Called at each step boundary; True ends the loop there.
        :returns: The tracked batches, or None when this loop is not counted (warned once when it should be).
        :raises CheckpointMismatchError: When a resumed epoch's loader cannot be skipped into, or differs.
        :raises ConfigError: Under ``guard.nonfinite=rollback`` (``count_always``), when the loop is one a rollback
            could not leave batches out of (:func:`~trainkit.loop.stateful_batches.check_rollback_loader`).
        """
        pending, epoch = self._pending, self.epoch
        drop = self._left_out.get(epoch, _NOTHING)
        if not self._in_epoch or not (self._watching or pending is not None or self._count_always or drop):
            return None
        if self._tracked:
            self._warn_untracked(
                "progress() was called a second time in one train_epoch(): only the first loop is counted, so "
                "no step checkpoint, step validation or step budget acts while this one runs"
            )
            return None
        if self._count_always:  # guard.nonfinite=rollback: refused here, before the first step, not at a rollback
            check_rollback_loader(loader)
        stateful = carries_own_position(loader)
        if stateful or (pending is not None and pending[1].loader_state is not None):
            self._check_stateful(loader, pending, drop)
        reason = None if stateful else unskippable_reason(loader)
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
            if self._stepping:
                self._warn_untracked(
                    "ckpt.every_n_steps needs progress() to be given a DataLoader over a map-style dataset, with a "
                    "length, or a loader that carries its own position (state_dict() and load_state_dict(), as "
                    f"torchdata's StatefulDataLoader has), got {reason}: this loop writes no step checkpoints and "
                    "resumes at epoch boundaries"
                )
            if not self._watching:
                return None
            return self._counted(WatchedBatches(loader, step=self.read_step, at_step_boundary=at_boundary), False)
        position, resume = pending if pending is not None else (None, None)
        skip = 0
        if position is not None:
            skip = self._decide_resume(position, resume, loader).skip_batches
            self._pending = None
        beyond = sorted(batch for batch in drop if batch >= len(loader))
        if beyond:
            warn_user(
                f"guard.skip_batches names batches {beyond} of epoch {epoch}, but its loader has {len(loader)} batches "
                "(positions are 0-based): nothing is left out there"
            )
        batches = (StatefulBatches if stateful else TrackedBatches)(
            loader,
            epoch=epoch,
            skip=skip,
            resume=resume,
            step=self.read_step,
            at_step_boundary=at_boundary if self._watching else None,
            on_close=self._vote.finish,
            on_untracked=self._lazy_loader,
            drop=drop,
            on_drop=self.on_drop,
        )
        if stateful and position is None:  # a pass from the epoch's first batch: after an epoch-end resume, its state
            batches.start_state, self._epoch_start_state = self._epoch_start_state, None
            batches.after_resume, self._state_handed = self._state_handed, False
        elif stateful:
            self._state_handed = True
        return self._counted(batches, True)

    def _counted(self, batches: Any, can_resume: bool) -> Any:
        """Make ``batches`` this epoch's counted loop; the step boundaries' dues start from the step it starts at.

        ``can_resume``: its position can be recorded and resumed (a loop trainkit skips into, or one that carries its
        own position); step checkpoints are written only where ``ckpt.every_n_steps`` is set too, but the run's final
        checkpoint records the position of a loop that ends inside the epoch either way (:meth:`end_inside`).
        """
        self._tracked, self._can_resume = True, can_resume
        self._resumable = self._stepping and can_resume
        self._voting = self._resumable and collectives.is_distributed()
        self._schedule = schedule_from(self._schedule, self.step, saving=self._resumable)
        self._due_at = self._schedule.due_at
        self.counted_batches = batches
        return batches

    def _lazy_loader(self, reason: str) -> None:
        """The tracked loader makes its iterator lazily: counted still, but no step checkpoint can resume it."""
        self._resumable = self._voting = self._can_resume = False
        if self._stepping:
            self._warn_untracked(reason)

    def epoch_tagged(self, loader: Any) -> Any:
        """The loader of a loop :meth:`track` does not count, its batches saying the epoch to
        :func:`trainkit.sample_generator` inside ``train_epoch()``; outside it, ``loader`` itself.

        :param loader: What ``progress()`` was given.
        :returns: What ``progress()`` iterates (see :func:`trainkit.loop.tracked_batches.epoch_tagged`).
        """
        return epoch_tagged(loader, self.epoch) if self._in_epoch else loader

    def current_batch(self) -> int | None:
        """The 0-based index in the epoch of the last batch the counted loop yielded, or None (no counted loop).

        :returns: The index, for messages (the divergence guard's error names it).
        """
        batches = self.counted_batches
        return None if batches is None or batches.consumed == 0 else batches.consumed - 1

    def _check_stateful(
        self, loader: Any, pending: tuple[bookkeeping.EpochPosition, RankPosition] | None, drop: frozenset[int]
    ) -> None:
        """Refuse what a loader that carries its own position cannot do, or a resume its position cannot serve."""
        name = type(loader).__name__
        if drop:
            raise CheckpointMismatchError(
                f"batches {sorted(drop)} of epoch {self.epoch} are to be left out (guard.nonfinite=rollback), but "
                f"train_epoch() iterates a {name}, which carries its own position: trainkit cannot leave batches out "
                "of it"
            )
        if pending is None:
            return
        position, resume = pending
        where = f"the checkpoint was written inside epoch {position.epoch}, after {position.batches} batches"
        if resume.loader_state is None:
            raise CheckpointMismatchError(
                f"{where}, of a loader trainkit skips into, but train_epoch() now iterates a {name}, which carries "
                "its own position and none was saved for it; resume with the loader that wrote it, from an "
                "epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )
        if not carries_own_position(loader):
            raise CheckpointMismatchError(
                f"{where}, with the state of a loader that carries its own position, but train_epoch() now iterates "
                f"a {name}, which has no load_state_dict() to take it; resume with the loader that wrote it, from an "
                "epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )

    def _decide_resume(
        self, position: bookkeeping.EpochPosition, resume: Any, loader: Any
    ) -> bookkeeping.ResumeDecision:
        """How the resumed epoch goes on over ``loader``: the core's decision
        (:func:`~trainkit.bookkeeping.decide_resume`), whose ``skip_batches`` the counted loop skips.

        :raises CheckpointMismatchError: Unless the rest of the epoch is the same samples (the decision refuses, or
            the loader's own generators differ in number from the saved ones).
        """
        batch_size, dataset_length, per_epoch = loader_facts(loader)
        decision = bookkeeping.decide_resume(
            position,
            world_size=self._world_size,
            batch_size=batch_size,
            dataset_length=dataset_length,
            batches_per_epoch=per_epoch,
            order=loader_order(loader),
        )
        if decision.action == "refuse" and position.world_size != self._world_size:
            raise CheckpointMismatchError(
                f"the checkpoint was written inside epoch {position.epoch}, after {position.done}, on "
                f"{position.world_size} ranks, and this run has {self._world_size}: {decision.reason}; or resume from "
                "an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )
        mismatch = decision.reason
        generators = len(loader_generators(loader))
        saved = resume.generators_at_iter  # None: another world size, whose ranks keep this run's generators
        if mismatch is None and saved is not None and generators != len(saved):
            mismatch = f"generators of its own: {len(saved)} then, {generators} now"
        if mismatch is not None:
            raise CheckpointMismatchError(
                f"the checkpoint was written inside epoch {position.epoch}, after {position.done}, and resuming "
                f"there needs the same data: {mismatch}; "
                "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            )
        return decision

    def _warn_untracked(self, message: str) -> None:
        """Say once per trainer that a loop runs without step checkpoints."""
        if not self._untracked_warned:
            self._untracked_warned = True
            warn_user(message)

    # ------------------------------------------------------------------ step boundaries

    def boundary(self, step: int, signalled: bool) -> StepDue | None:
        """Decide, between two batches right after an optimizer step, what falls due: a save, a stop on a signal,
        a step validation, a row, the end of the step budget.

        The ranks agree on a signal through a vote started at the previous boundary, so no rank waits here; a
        signal is acted on one step later under DDP than on one process, and only where a step checkpoint can be
        written (elsewhere at the epoch's end). The rest is decided by the step count alone, alike on every rank
        (:func:`~trainkit.bookkeeping.step_schedule.step_due`).

        :param step: The optimizer step counter.
        :param signalled: Whether this process got a stop signal.
        :returns: What is due, or None when nothing is (what almost every step boundary is).
        """
        if not (signalled or self._voting or step >= self._due_at):
            return None
        stop = self._vote.cast(signalled) if self._resumable else False
        if not (stop or step >= self._due_at):
            return None
        due, self._schedule = step_due(self._schedule, step, stop=stop, saving=self._resumable)
        self._due_at = self._schedule.due_at
        return due

    def saved(self, step: int) -> None:
        """Record that ``last`` holds ``step`` (or that the tracked epoch starts there): the next one is due later.

        :param step: The optimizer step counter.
        """
        self._schedule = schedule_saved(self._schedule, step, saving=self._resumable)
        self._due_at = self._schedule.due_at

    def validated(self, step: int) -> None:
        """Record a validation at ``step`` (never a second one there: see
        :func:`~trainkit.bookkeeping.validates_at_epoch_end`).

        :param step: The optimizer step counter.
        """
        self.validated_at = step

    def end_inside(self, batches: TrackedBatches, *, stopped_early: bool) -> None:
        """Record that the epoch's loop ends at this step boundary (inside the epoch, unless at its last batch).

        :param batches: The counted loop (its position goes into the run's final checkpoint when it can resume).
        :param stopped_early: Whether a step validation's early-stop verdict ends it (else ``max_steps``).
        """
        self.stopped_early = stopped_early
        try:
            complete = batches.consumed >= len(batches)  # its last batch: the epoch ends as it would have anyway
        except TypeError:  # an iterable without a length
            complete = False
        self.ended_inside = not complete
        # recorded with or without ckpt.every_n_steps: raising max_steps continues from the next batch
        self._end_batches = batches if self._can_resume and not complete else None

    @contextlib.contextmanager
    def validating(self, inside: bool = True) -> Iterator[None]:
        """Around a validation run at a step boundary (``inside``; else nothing): loops iterated through
        ``progress()`` in ``val_epoch()`` are not the training loop, and are not counted."""
        in_epoch, self._in_epoch = self._in_epoch, self._in_epoch and not inside
        try:
            yield
        finally:
            self._in_epoch = in_epoch

    def save_position(
        self, batches: TrackedBatches | None, epoch: int, metrics: tuple[dict[str, Any], dict[str, Any]]
    ) -> tuple[bookkeeping.EpochPosition | None, dict[str, Any] | None]:
        """What a save records of the epoch's position: none at an epoch's end (``batches`` None), else where the
        epoch stands and this rank's share (:meth:`epoch_position`, :meth:`rank_position`). A run whose last loop
        ended at a step boundary (:meth:`end_inside`) records that position in its final saves.

        :param batches: The tracked batches of a step checkpoint, or None.
        :param epoch: The epoch.
        :param metrics: This rank's unpushed logs and grad-norm mean (``TrainerMetrics.state_dict()``).
        """
        batches = batches if batches is not None else self._end_batches
        if batches is None:
            return None, None
        return self.epoch_position(batches, epoch, self._world_size), self.rank_position(batches, *metrics)

    @staticmethod
    def epoch_position(batches: TrackedBatches, epoch: int, world_size: int) -> bookkeeping.EpochPosition:
        """Where the tracked epoch stands, for a step checkpoint.

        :param batches: The tracked batches.
        :param epoch: The epoch.
        :param world_size: The number of processes.
        """
        batch_size, dataset_length, _ = loader_facts(batches.loader)
        # a loader that carries its own position keeps it per rank: no place in a global order to record
        own = isinstance(batches, StatefulBatches)
        global_batch = None if batch_size is None or own else batch_size * world_size
        return bookkeeping.EpochPosition(
            epoch=epoch,
            batches=batches.consumed,
            batches_per_epoch=batches.per_epoch,
            batch_size=batch_size,
            dataset_length=dataset_length,
            world_size=world_size,
            samples=None if global_batch is None else batches.consumed * global_batch,
            global_batch=global_batch,
            order=None if own else loader_order(batches.loader),
        )

    @staticmethod
    def rank_position(batches: TrackedBatches, logs: dict[str, Any], grad_norm: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of a step checkpoint: what it puts back to continue from the same batch.

        :param batches: The tracked batches.
        :param logs: Its unpushed metrics (``LogBuffer.state_dict()``).
        :param grad_norm: Its epoch grad-norm mean so far.
        :returns: Its share; with ``loader_state`` and ``generators_at_save`` for a loader that carries its own
            position (:meth:`~trainkit.loop.stateful_batches.StatefulBatches.saved_share`), without for one trainkit
            skips into (as checkpoints were written before such loaders).
        """
        share = {
            "rng_at_iter": batches.rng_at_iter,
            "generators_at_iter": batches.generators_at_iter,
            "logs": logs,
            "grad_norm": grad_norm,
        }
        if isinstance(batches, StatefulBatches):
            share.update(batches.saved_share())
        return share

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
