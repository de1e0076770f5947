"""The sharded format (``ckpt.format="sharded"``): a run folder's checkpoint directories, every rank writing its shards.

Side effects: directories in ``out_dir`` (``last.ckpt/``, ``best.ckpt/``, their ``.prev`` copies, temporary
directories of unfinished saves), collectives (every rank calls :meth:`DcpStorage.load_resume`,
:meth:`~DcpStorage.read_best`, :meth:`~DcpStorage.save` and :meth:`~DcpStorage.wait` together) and, with
``ckpt.async_save``, DCP's writer thread. :class:`DcpStorage` answers the same
:class:`~trainkit.checkpoint.formats.base.Storage` calls as :class:`~trainkit.checkpoint.formats.pt.PtStorage`; it
is built from plain values and knows nothing of the trainer: the checkpointer hands it a
:class:`~trainkit.checkpoint.formats.base.SaveRequest` (or, one level down, DCP states and engine payloads built by
:func:`trainkit.checkpoint.payload.last_payload`), and it returns loaded dicts. One directory's writing, publishing
and reading is :mod:`trainkit.checkpoint.formats.dcp_directory`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from trainkit import bookkeeping
from trainkit.bookkeeping import BestState
from trainkit.checkpoint.formats import dcp_directory
from trainkit.checkpoint.formats.base import BestWeights, SaveRequest, item_state
from trainkit.checkpoint.payload import best_payload, validate_best, validate_last
from trainkit.distributed.collectives import all_gather_objects, broadcast_object
from trainkit.errors import CheckpointCorruptError, UsageError
from trainkit.messages import warn_user
from trainkit.run.folder import same_directory
from trainkit.state.modules import module_state

__all__ = ["DcpStorage", "published_directories"]


def published_directories(directory: Path) -> list[Path]:
    """The checkpoint directory ``directory`` and its ``.prev`` copy, those that exist, newest first.

    :param directory: A checkpoint directory's path (``.../last.ckpt`` or ``.../best.ckpt``).
    :returns: The existing ones.
    """
    return [path for path in (directory, dcp_directory.previous_directory(directory)) if path.is_dir()]


class DcpStorage:
    """The sharded checkpoint directories of one run folder: every rank writes its shards and reads them.

    :param out_dir: The run folder.
    :param enabled: ``ckpt.enable``: whether this run writes checkpoints at all (and resumes with ``auto``).
    :param rank: This process's rank.
    :param world_size: The number of processes.
    :param async_save: ``ckpt.async_save``: write ``last.ckpt`` in the background (one save in flight,
        published at the next save, :meth:`wait` or the end of the run), instead of before :meth:`save` returns.
    :param timeout_s: The bound on a background save's collectives (``dist.timeout_s``).
    """

    def __init__(
        self, out_dir: Path, *, enabled: bool, rank: int, world_size: int, async_save: bool, timeout_s: float
    ) -> None:
        self.out_dir = out_dir
        self.last_path = out_dir / dcp_directory.LAST_DIR
        """``out_dir/last.ckpt``."""
        self.best_path = out_dir / dcp_directory.BEST_DIR
        """``out_dir/best.ckpt``."""
        self.enabled = enabled
        self.rank = rank
        self.world_size = world_size
        self._background = dcp_directory.BackgroundSave(timeout_s) if async_save else None
        self._saves = 0
        self._after: Callable[[], None] | None = None  # what runs once the background save in flight is published
        self._last_seconds: float | None = None

    def load_resume(self, resume: str) -> tuple[dict[str, Any] | None, Path | None]:
        """The engine payload of the checkpoint ``resume`` names, and its directory (a collective).

        With ``auto``, ``last.ckpt`` or, when it is damaged or incomplete, ``last.prev.ckpt`` (with a warning);
        a named directory never falls back. The modules' and optimizers' shards are read later, into the
        objects ``setup()`` builds (:func:`trainkit.checkpoint.formats.dcp_directory.load_items`).

        :param resume: ``ckpt.resume``: ``auto``, ``never`` or a checkpoint directory.
        :returns: ``(payload, directory)``, or ``(None, None)`` when there is nothing to resume.
        :raises CheckpointCorruptError: When no candidate directory is whole (each one's problem named).
        """
        if resume == "never" or (resume == "auto" and not self.enabled):
            return None, None
        candidates = published_directories(self.last_path) if resume == "auto" else [Path(resume)]
        if not candidates:
            return None, None
        problems: list[str] = []
        for candidate in candidates:
            ckpt, problem = dcp_directory.read_engine(
                candidate, rank=self.rank, world_size=self.world_size, validate=validate_last
            )
            if ckpt is not None:
                if problems and self.rank == 0:
                    warn_user(f"{problems[-1]}; resuming from the previous checkpoint {candidate} instead")
                return ckpt, candidate
            problems.append(problem)
        raise CheckpointCorruptError("; ".join(problems))

    def read_best(self, directory: Path, best: BestState, template: dict[str, Any] | None) -> dict[str, Any] | None:
        """The best weights' shards from ``directory``'s ``best.ckpt`` (or ``best.prev.ckpt``) whose recorded best
        is ``best`` (a collective).

        :param directory: The folder of the resumed checkpoint.
        :param best: The best recorded in the resumed ``last.ckpt``.
        :param template: The model's state dict of this run (its shards), copied and filled in place; None
            when there is no model to read them for.
        :returns: The best weights in ``template``'s layout, or None (rank 0 warns) when no directory matches.
        """
        found = []
        for candidate in published_directories(directory / dcp_directory.BEST_DIR):
            engine, problem = dcp_directory.read_engine(
                candidate, rank=self.rank, world_size=self.world_size, validate=validate_best
            )
            if engine is None:
                if self.rank == 0:
                    warn_user(problem)
                continue
            recorded = BestState.from_dict(engine["best"])
            if attrs.evolve(recorded, min_delta=best.min_delta) != best or template is None:
                found.append(f"{candidate.name}: epoch {recorded.epoch}")
                continue
            # a copy of the model's own state: DCP fills it in place, and the model is left alone
            copy = {key: value.detach().clone() for key, value in template.items()}
            return dcp_directory.load_items_into({"model": copy}, candidate)["model"]
        if self.rank == 0:
            warn_user(
                f"no best checkpoint in {directory} matches the best recorded in the resumed checkpoint (epoch "
                f"{best.epoch}, score {best.score}; found {', '.join(found) or 'none'}); test() will use the current "
                "weights until the next improvement"
            )
        return None

    def save(
        self,
        *,
        epoch: int,
        step: int,
        last_state: dict[str, Any],
        last_engine: dict[str, Any] | None,
        best_state: dict[str, Any] | None = None,
        best_engine: dict[str, Any] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Write ``best.ckpt`` (when ``best_state`` is given), then ``last.ckpt`` (a collective).

        The save before it is finished first (one in flight). ``best.ckpt`` is always written before this
        returns; ``last.ckpt`` too, unless ``async_save``: then its shards are staged here and written in the
        background, and published by the next save, :meth:`wait` or :meth:`release`'s caller.

        :param epoch: The epoch being saved (names the temporary directory).
        :param step: The optimizer step (names the temporary directory).
        :param last_state: This rank's DCP state of the registered modules and optimizers.
        :param last_engine: The engine's payload for ``trainkit.pt`` (rank 0; None elsewhere).
        :param best_state: This rank's DCP state of the best weights, when they changed since the last save.
        :param best_engine: The best's payload for ``best.ckpt``'s ``trainkit.pt`` (rank 0).
        :param after: Called on this rank once ``last.ckpt`` is published by every rank (keeps it under
            ``checkpoints/``; rank 0): before this returns, or at the publishing :meth:`wait` of a background save.
            Its failure is warned, not raised: the other ranks would wait for this one at the next collective.
        :raises BaseException: A rank's failed write, on every rank (a background one's at the next save).
        """
        self.wait()
        self._saves += 1
        options = {"rank": self.rank, "world_size": self.world_size, "tag": f"{epoch}-{step}-{self._saves}"}
        if best_state is not None:
            dcp_directory.save_directory(self.best_path, best_state, best_engine, **options)
        if self._background is not None:
            self._background.start(self.last_path, last_state, last_engine, **options)
            self._after = after
        else:
            dcp_directory.save_directory(self.last_path, last_state, last_engine, **options)
            _run_after(after, self.last_path)

    def wait(self) -> None:
        """Finish a background save in flight: wait for its write, then publish it (every rank together).

        :raises BaseException: Its failed write, on every rank.
        """
        if self._background is not None:
            after, self._after = self._after, None
            self._background.finish(rank=self.rank, world_size=self.world_size)
            _run_after(after, self.last_path)

    def abandon(self) -> None:
        """Let a background save in flight end unpublished (this rank is failing; the others may be gone)."""
        self._after = None
        if self._background is not None:
            self._background.abandon()

    def release(self) -> None:
        """At the end of a run: free the host copy background saves reuse, and wait for the deletion of the
        directories that publishing moved aside, so nothing stray is left in ``out_dir``."""
        if self._background is not None:
            self._background.release()
        dcp_directory.wait_discarded()

    # ------------------------------------------------------------------ the Storage calls

    @property
    def last_seconds(self) -> float | None:
        """The seconds the last synchronous save took on rank 0 (None for a background one)."""
        return self._last_seconds

    def published(self) -> list[Path]:
        """``last.ckpt`` and ``last.prev.ckpt``, those that exist.

        :returns: Their paths, newest first.
        """
        return published_directories(self.last_path)

    def best_weights(self, directory: Path, best: BestState, model: nn.Module | None) -> BestWeights | None:
        """The best weights' shards from ``directory``'s ``best.ckpt`` that matches ``best`` (:meth:`read_best`; a
        collective).

        :param directory: The resumed checkpoint's folder.
        :param best: The best record it holds.
        :param model: The run's model (unwrapped); its state dict is the template the shards fill.
        :returns: The weights, or None (warned) when no directory matches.
        """
        loaded = self.read_best(directory, best, None if model is None else module_state(model))
        if loaded is None:
            return None
        return BestWeights(weights=loaded, private=True, rewrite=not same_directory(directory, self.out_dir))

    def save_checkpoint(self, request: SaveRequest) -> float | None:
        """Every rank writes its shards of ``best.ckpt`` (when the best changed) and of ``last.ckpt`` (:meth:`save`).

        :param request: What to write.
        :returns: The seconds a synchronous save took on rank 0; None elsewhere and in the background.
        :raises UsageError: When only some ranks recorded a new best (a rank-guarded ``save_if_best()``).
        """
        started = time.perf_counter()
        self.wait()  # one save in flight: the previous one is published (or its failure raised) now
        changed = request.best_weights is not None and request.best is not None
        if self.world_size > 1:  # best.ckpt is written by every rank together: the ranks must agree it changed
            votes = all_gather_objects(changed)
            if any(votes) and not all(votes):
                raise UsageError(
                    f"save_if_best() recorded a new best on ranks {[r for r, v in enumerate(votes) if v]} only; with "
                    "ckpt.format='sharded' every rank writes its shards of best.ckpt, so call save_if_best() on every "
                    "rank with the same score (pool it with reduce_mean() or broadcast())"
                )
        items = request.registry.items
        best_engine = last_engine = None
        if self.rank == 0:
            if changed:
                best_engine = best_payload(model={}, best=request.best, config=request.config)
            in_dcp = {id(obj) for obj in dcp_directory.dcp_items(items).values()}
            states = bookkeeping.collect_payload(
                request.registry, state_of=lambda obj: dcp_directory.SHARDED if id(obj) in in_dcp else item_state(obj)
            )
            last_engine = request.engine(states)
            if request.before is not None:
                request.before()
        self.save(
            epoch=request.epoch,
            step=request.step,
            last_state=dcp_directory.state_for_save(items),
            last_engine=last_engine,
            best_state={"model": request.best_weights} if changed else None,
            best_engine=best_engine,
            after=request.after,
        )
        seconds = None if self._background is not None or self.rank != 0 else time.perf_counter() - started
        self._last_seconds = seconds
        return seconds

    def lost_best(self, tracked: bool) -> bool:
        """Whether ``best.ckpt`` went missing during the run, decided by rank 0 for every rank (a collective).

        :param tracked: Whether a best was written and has not changed since (rank 0's answer counts).
        :returns: Whether it is gone.
        """
        lost = self.rank == 0 and tracked and not self.best_path.exists()
        return bool(broadcast_object(lost))

    def wait_local(self) -> None:
        """Nothing to wait for on this rank alone: a background save is published by every rank together."""


def _run_after(after: Callable[[], None] | None, published: Path) -> None:
    """Run what follows a published save on this rank alone; its failure is warned (``published`` is whole)."""
    if after is None:
        return
    try:
        after()
    except Exception as exc:  # noqa: BLE001 - raising on one rank would leave the others in the next collective
        warn_user(f"keeping a copy of {published} under checkpoints/ failed: {exc!r}; {published} itself is whole")
