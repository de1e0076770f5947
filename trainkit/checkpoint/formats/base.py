"""One storage interface for a run's checkpoints, with the two formats behind it: files and sharded directories.

Side effects: those of :class:`~trainkit.checkpoint.pt_files.RunFiles` (``last.pt``/``best.pt``, rank 0 writes) and of
:class:`~trainkit.checkpoint.dcp_files.ShardedFiles` (``last.ckpt/``/``best.ckpt/``, every rank writes its shards;
collectives). :class:`~trainkit.checkpoint.checkpointer.Checkpointer` picks one at construction (``ckpt.format``) and
never asks which it has: both take the same :class:`SaveRequest`, answer the same calls with the same
signatures, and do the format's own work (which rank writes, the best's agreement across ranks, the DCP
state dicts, conversions between wraps) inside.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from trainkit import bookkeeping as core
from trainkit.checkpoint import dcp as sharded
from trainkit.checkpoint.dcp_files import ShardedFiles
from trainkit.checkpoint.payload import best_payload
from trainkit.checkpoint.pt_files import RunFiles
from trainkit.distributed import collectives as dist_utils
from trainkit.distributed import fsdp as sharding
from trainkit.errors import CheckpointError, UsageError
from trainkit.run.folder import same_directory
from trainkit.state.modules import module_state

__all__ = ["SaveRequest", "BestWeights", "Storage", "FileStorage", "ShardedStorage", "item_state"]


def item_state(obj: Any) -> Any:
    """A registered object's state: modules under names free of ``torch.compile``'s ``_orig_mod.``.

    :param obj: A registered object with ``state_dict()``.
    :returns: Its state.
    """
    return module_state(obj) if isinstance(obj, nn.Module) else obj.state_dict()


@attrs.frozen(kw_only=True)
class SaveRequest:
    """What one save writes: the registered items, the engine's payload, and the best weights when they changed.

    :ivar registry: The checkpoint registry (its objects' states are read by the storage).
    :ivar engine: Builds the ``last`` payload from the items' states (called on rank 0 only).
    :ivar best_weights: The best weights (each rank's own shards under FSDP2), when the best changed since the
        last save; None otherwise.
    :ivar best: The best record, with ``best_weights``.
    :ivar config: The config as saved (``public_config``), for ``best``'s payload.
    :ivar epoch: The epoch being saved (names a sharded save's temporary directory).
    :ivar step: The optimizer step (the same).
    :ivar before: Done before the first file is published: makes ``metrics.jsonl`` durable before ``last`` records
        its size (the file format runs it beside its first write, the sharded one before its writes); None when
        nothing needs it.
    :ivar after: Called once ``last`` is published, where the writes run (keeps it under ``checkpoints/``;
        for a sharded one on rank 0 once every rank's shards are published); None for nothing.
    """

    registry: core.CkptRegistry
    engine: Callable[[dict[str, Any]], dict[str, Any]]
    best_weights: dict[str, Any] | None
    best: core.BestState | None
    config: dict[str, Any]
    epoch: int
    step: int
    before: Callable[[], None] | None
    after: Callable[[], None] | None = None


@attrs.frozen(kw_only=True)
class BestWeights:
    """Best weights read back at a resume.

    :ivar weights: The state dict, in this run's layout (each rank's shards under FSDP2).
    :ivar private: No other code holds its tensors (the snapshot may refill them in place).
    :ivar rewrite: This run's folder lacks them in its format: the next save writes them.
    """

    weights: dict[str, Any]
    private: bool
    rewrite: bool


class Storage(Protocol):
    """What the :class:`~trainkit.checkpoint.checkpointer.Checkpointer` asks of a checkpoint format (both do it)."""

    last_path: Path
    """Where ``last`` is written."""
    best_path: Path
    """Where ``best`` is written."""

    @property
    def last_seconds(self) -> float | None: ...

    def published(self) -> list[Path]: ...

    def load_resume(self, resume: str) -> tuple[dict[str, Any] | None, Path | None]: ...

    def read_best(self, directory: Path, best: core.BestState, model: nn.Module | None) -> BestWeights | None: ...

    def save(self, request: SaveRequest) -> float | None: ...

    def lost_best(self, tracked: bool) -> bool: ...

    def wait(self) -> None: ...

    def wait_local(self) -> None: ...

    def abandon(self) -> None: ...

    def release(self) -> None: ...


class FileStorage:
    """``ckpt.format="file"``: ``last.pt``/``best.pt`` written whole by rank 0
    (:class:`~trainkit.checkpoint.pt_files.RunFiles`).

    :param files: The run folder's files.
    :param rank: This process's rank.
    :param world_size: The number of processes.
    :param device: Where best weights read back go.
    """

    def __init__(self, files: RunFiles, *, rank: int, world_size: int, device: torch.device) -> None:
        self._files = files
        self.last_path, self.best_path = files.last_path, files.best_path  # plain values, not a chain of properties
        self._rank = rank
        self._world_size = world_size
        self._device = device

    @property
    def last_seconds(self) -> float | None:
        """The seconds rank 0's last finished save took (after :meth:`wait`)."""
        return self._files.last_seconds

    def published(self) -> list[Path]:
        """``last.pt`` and ``last.prev.pt``, those that exist."""
        return [path for path in (self.last_path, previous_file(self.last_path)) if path.exists()]

    def load_resume(self, resume: str) -> tuple[dict[str, Any] | None, Path | None]:
        """The checkpoint ``ckpt.resume`` names, checked against this run's world size (see ``RunFiles``).

        :param resume: ``auto``, ``never`` or a path.
        :returns: ``(payload, path)``, or ``(None, None)``.
        """
        return self._files.load_resume(resume, world_size=self._world_size)

    def read_best(self, directory: Path, best: core.BestState, model: nn.Module | None) -> BestWeights | None:
        """The ``best.pt`` beside a resumed checkpoint that matches ``best``, in ``model``'s layout.

        :param directory: The resumed checkpoint's folder.
        :param best: The best record it holds.
        :param model: The run's model (unwrapped), whose layout the weights take; None keeps them whole.
        :returns: The weights, or None (warned) when no file matches.
        """
        saved = self._files.read_best(directory, best)
        if saved is None:
            return None
        if model is not None and sharding.is_sharded(model):  # whole weights: each rank keeps its own shards
            return BestWeights(
                weights=sharding.shard_like(saved["model"], module_state(model)), private=True, rewrite=True
            )
        weights = {
            key: value.to(self._device) if isinstance(value, torch.Tensor) else value
            for key, value in saved["model"].items()
        }
        # loaded tensors may share memory (tied weights): not private, so the next improvement allocates anew
        return BestWeights(weights=weights, private=False, rewrite=not same_directory(directory, self._files.out_dir))

    def save(self, request: SaveRequest) -> float | None:
        """Write ``best.pt`` (when the best changed) then ``last.pt`` on rank 0; every rank learns whether it worked.

        :param request: What to write.
        :returns: The seconds the writes took on rank 0 (None elsewhere, or when they run in the background).
        :raises CheckpointError: On every rank when rank 0's write failed.
        """
        seconds, error = None, None
        if self._rank == 0:
            try:
                self._files.wait()  # a failed background write surfaces here, and every rank hears of it
                best = None
                if request.best_weights is not None and request.best is not None:
                    best = best_payload(model=request.best_weights, best=request.best, config=request.config)
                last = request.engine(core.collect_payload(request.registry, state_of=item_state))
                seconds = self._files.save(last, best, before=request.before, after=request.after)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                error = exc
        dist_utils.raise_if_any_rank_failed(
            error,
            lambda: CheckpointError(f"rank 0 failed to write {self.last_path}; see rank 0's traceback"),
            world_size=self._world_size,
        )
        return seconds

    def lost_best(self, tracked: bool) -> bool:
        """Whether ``best.pt`` went missing from disk during the run (rank 0 looks; others answer False).

        :param tracked: Whether a best was written and has not changed since.
        """
        if self._rank != 0 or not tracked:
            return False
        self._files.wait()  # a background write may be about to put it there
        return not self.best_path.exists()

    def wait(self) -> None:
        """Block until a background write is on disk (its failure raises here)."""
        self._files.wait()

    wait_local = wait

    def abandon(self) -> None:
        """Let a background write land without raising (this run is failing already; a failure is warned)."""
        self._files.wait_quietly()

    def release(self) -> None:
        """Nothing is held between saves but the writer, which :meth:`wait` finishes."""
        self._files.wait()


def previous_file(path: Path) -> Path:
    """``last.pt`` -> ``last.prev.pt``."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


class ShardedStorage:
    """``ckpt.format="sharded"``: directories in which every rank writes its shards (``ShardedFiles``).

    :param shards: The run folder's sharded directories.
    :param rank: This process's rank.
    :param world_size: The number of processes.
    :param background: ``ckpt.async_save``: saves return after staging (for the seconds reported).
    """

    def __init__(self, shards: ShardedFiles, *, rank: int, world_size: int, background: bool) -> None:
        self._shards = shards
        self.last_path, self.best_path = shards.last_path, shards.best_path
        self._rank = rank
        self._world_size = world_size
        self._background = background
        self._last_seconds: float | None = None

    @property
    def last_seconds(self) -> float | None:
        """The seconds the last synchronous save took on rank 0 (None for a background one)."""
        return self._last_seconds

    def published(self) -> list[Path]:
        """``last.ckpt`` and ``last.prev.ckpt``, those that exist."""
        return self._shards.published(self.last_path)

    def load_resume(self, resume: str) -> tuple[dict[str, Any] | None, Path | None]:
        """The engine payload of the directory ``ckpt.resume`` names (a collective; see ``ShardedFiles``).

        :param resume: ``auto``, ``never`` or a directory.
        :returns: ``(payload, directory)``, or ``(None, None)``.
        """
        return self._shards.load_resume(resume)

    def read_best(self, directory: Path, best: core.BestState, model: nn.Module | None) -> BestWeights | None:
        """The best weights' shards from ``directory``'s ``best.ckpt`` that matches ``best`` (a collective).

        :param directory: The resumed checkpoint's folder.
        :param best: The best record it holds.
        :param model: The run's model (unwrapped); its state dict is the template the shards fill.
        :returns: The weights, or None (warned) when no directory matches.
        """
        loaded = self._shards.read_best(directory, best, None if model is None else module_state(model))
        if loaded is None:
            return None
        return BestWeights(weights=loaded, private=True, rewrite=not same_directory(directory, self._shards.out_dir))

    def save(self, request: SaveRequest) -> float | None:
        """Every rank writes its shards of ``best.ckpt`` (when the best changed) and of ``last.ckpt``.

        :param request: What to write.
        :returns: The seconds a synchronous save took on rank 0; None elsewhere and in the background.
        :raises UsageError: When only some ranks recorded a new best (a rank-guarded ``save_if_best()``).
        """
        started = time.perf_counter()
        self._shards.wait()  # one save in flight: the previous one is published (or its failure raised) now
        changed = request.best_weights is not None and request.best is not None
        if self._world_size > 1:  # best.ckpt is written by every rank together: the ranks must agree it changed
            votes = dist_utils.all_gather_objects(changed)
            if any(votes) and not all(votes):
                raise UsageError(
                    f"save_if_best() recorded a new best on ranks {[r for r, v in enumerate(votes) if v]} only; with "
                    "ckpt.format='sharded' every rank writes its shards of best.ckpt, so call save_if_best() on every "
                    "rank with the same score (pool it with reduce_mean() or broadcast())"
                )
        items = request.registry.items
        best_engine = last_engine = None
        if self._rank == 0:
            if changed:
                best_engine = best_payload(model={}, best=request.best, config=request.config)
            in_dcp = {id(obj) for obj in sharded.dcp_items(items).values()}
            states = core.collect_payload(
                request.registry, state_of=lambda obj: sharded.SHARDED if id(obj) in in_dcp else item_state(obj)
            )
            last_engine = request.engine(states)
            if request.before is not None:
                request.before()
        self._shards.save(
            epoch=request.epoch,
            step=request.step,
            last_state=sharded.state_for_save(items),
            last_engine=last_engine,
            best_state={"model": request.best_weights} if changed else None,
            best_engine=best_engine,
            after=request.after,
        )
        seconds = None if self._background or self._rank != 0 else time.perf_counter() - started
        self._last_seconds = seconds
        return seconds

    def lost_best(self, tracked: bool) -> bool:
        """Whether ``best.ckpt`` went missing during the run, decided by rank 0 for every rank (a collective).

        :param tracked: Whether a best was written and has not changed since (rank 0's answer counts).
        """
        lost = self._rank == 0 and tracked and not self.best_path.exists()
        return bool(dist_utils.broadcast_object(lost))

    def wait(self) -> None:
        """Publish a background save in flight (every rank together; its failure raises here)."""
        self._shards.wait()

    def wait_local(self) -> None:
        """Nothing to wait for on this rank alone: a background save is published by every rank together."""

    def abandon(self) -> None:
        """Let a background save in flight end unpublished (this rank is failing)."""
        self._shards.abandon()

    def release(self) -> None:
        """Free the host copy background saves reuse and wait for the deletion of replaced directories."""
        self._shards.release()
