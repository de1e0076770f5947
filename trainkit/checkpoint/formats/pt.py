"""The ``.pt`` format (``ckpt.format="file"``): ``last.pt`` and ``best.pt`` written whole by rank 0.

Side effects: files in ``out_dir`` (``last.pt``, ``best.pt``, their ``.prev`` copies, temp files of
unfinished saves, ``*.corrupt.pt`` kept for inspection), with ``ckpt.async_save`` a writer thread, and the one
collective of a save (every rank learns whether rank 0's write worked). :class:`PtStorage` is built from plain
values and knows nothing of the trainer: the :class:`~trainkit.checkpoint.checkpointer.Checkpointer` hands it a
:class:`~trainkit.checkpoint.formats.base.SaveRequest` (or, one level down, payloads built by
:func:`trainkit.checkpoint.payload.last_payload`) and it returns loaded dicts. The other format (a directory per
checkpoint, written by every rank) answers the same :class:`~trainkit.checkpoint.formats.base.Storage` calls:
:class:`trainkit.checkpoint.formats.dcp.DcpStorage`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from trainkit import bookkeeping
from trainkit.bookkeeping import BestState
from trainkit.checkpoint.formats.async_save import AsyncCheckpointWriter, StagingBuffers, SyncCheckpointWriter
from trainkit.checkpoint.formats.base import BestWeights, SaveRequest, item_state
from trainkit.checkpoint.payload import SCHEMA_VERSION, best_payload, validate_best, validate_last
from trainkit.distributed import fsdp
from trainkit.distributed.collectives import raise_if_any_rank_failed
from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, OutDirError
from trainkit.files.allowlist import check_loadable
from trainkit.files.bounded_read import UnreadableFile, open_regular
from trainkit.files.durable import atomic_save, previous_path, remove_stale_temp_files, warn_if_low_on_space
from trainkit.files.weights_only_load import load_checkpoint
from trainkit.messages import warn_user
from trainkit.run.folder import METRICS_FILE, same_directory
from trainkit.state.modules import module_state

__all__ = ["LAST_CKPT", "BEST_CKPT", "METRICS_FILE", "PtStorage", "same_directory"]

LAST_CKPT = "last.pt"
BEST_CKPT = "best.pt"


class PtStorage:
    """The ``.pt`` checkpoint files of one run folder: every rank reads them, rank 0 writes them.

    :param out_dir: The run folder.
    :param enabled: ``ckpt.enable``: whether this run writes checkpoints at all.
    :param writer: Whether this process writes (rank 0); the others only read. A rank-0 reader of a run
        without checkpoints still keeps a damaged ``last.pt`` aside and repairs ``best.pt`` in ``out_dir``.
    :param async_save: ``ckpt.async_save``: stage each save in reused host buffers and write it in the
        background (one write in flight), instead of writing before :meth:`save` returns.
    :param world_size: The number of processes (a resume is validated for it; every rank hears of a failed write).
    :param device: Where best weights read back go (the CPU unless given).
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        enabled: bool,
        writer: bool,
        async_save: bool,
        world_size: int = 1,
        device: torch.device | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.last_path = out_dir / LAST_CKPT
        """``out_dir/last.pt``."""
        self.best_path = out_dir / BEST_CKPT
        """``out_dir/best.pt``."""
        self.enabled = enabled
        self.writer = writer
        self.writes = enabled and writer
        self._writer: SyncCheckpointWriter | AsyncCheckpointWriter = (
            AsyncCheckpointWriter() if async_save else SyncCheckpointWriter()
        )
        self._staging = StagingBuffers() if async_save else None
        self._space_checked = False
        self._world_size = world_size
        self._device = device if device is not None else torch.device("cpu")

    @property
    def metrics_path(self) -> Path:
        """``out_dir/metrics.jsonl``."""
        return self.out_dir / METRICS_FILE

    # ------------------------------------------------------------------ before the run

    def check_writable(self) -> None:
        """Refuse a folder where a checkpoint cannot be written (a directory in a checkpoint's place).

        :raises OutDirError: Naming the path in the way.
        """
        if not self.writes:
            return
        for name in (LAST_CKPT, BEST_CKPT):
            for path in (self.out_dir / name, previous_path(self.out_dir / name)):
                if path.is_dir() and not path.is_symlink():
                    raise OutDirError(f"{path} is a directory, so no checkpoint can be written there; move it away")

    def remove_stale_temp_files(self) -> list[Path]:
        """Remove the temp files that killed saves left in ``out_dir`` (rank 0 of a writing run only).

        :returns: The removed paths.
        """
        return remove_stale_temp_files(self.out_dir) if self.writes else []

    # ------------------------------------------------------------------ resuming

    def load_resume(self, resume: str, *, world_size: int | None = None) -> tuple[dict[str, Any] | None, Path | None]:
        """Load the checkpoint ``ckpt.resume`` names, checked against the schema (and validated for this run's world
        size; whether it may resume on it is the checkpointer's question, asked once for both formats).

        With ``auto`` a damaged ``last.pt`` falls back to ``last.prev.pt`` (with a warning; the damaged file
        is kept as ``last.corrupt.pt``); a named path never falls back.

        :param resume: ``"auto"``, ``"never"`` or a checkpoint path.
        :param world_size: The number of processes to validate it for (this run's unless given).
        :returns: The checkpoint and the path it was read from, or (None, None) when there is none to read.
        :raises CheckpointError: When a named path does not exist, or the file cannot be resumed here.
        """
        if world_size is None:
            world_size = self._world_size
        if resume == "never" or (resume == "auto" and not self.enabled):
            # a run that writes no checkpoints reads none either, unless ckpt.resume names one
            return None, None
        path = self.last_path if resume == "auto" else Path(resume)
        previous = previous_path(path)
        if resume == "auto" and not path.exists() and not previous.exists():
            return None, None
        if resume != "auto" and not path.exists():
            raise CheckpointError(
                f"ckpt.resume must be 'auto', 'never' or the path of an existing checkpoint, got {resume!r} "
                f"(there is no file at {path})"
            )
        try:
            ckpt = self._read_last(path, world_size)
        except CheckpointCorruptError as exc:
            if resume != "auto" or not previous.exists():
                raise
            # the newest file is damaged (bit rot, a disk that lied about fsync) or not a checkpoint at all (a
            # FIFO, a hand-edited payload): the one before it is intact
            ckpt = self._read_last(previous, world_size)
            kept = path.with_name(f"{path.stem}.corrupt{path.suffix}")
            if self.writer:
                os.replace(path, kept)  # kept for inspection, and so the next save cannot rotate it into .prev
            warn_user(
                f"{exc}; resuming from the previous checkpoint {previous} instead (the refused file is kept as {kept})"
            )
            path = previous
        _check_schema(ckpt, path)
        return ckpt, path

    @staticmethod
    def _read_last(path: Path, world_size: int) -> dict[str, Any]:
        ckpt = load_checkpoint(path)
        validate_last(ckpt, path=path, world_size=world_size)
        return ckpt

    def read_best(self, directory: Path, best: BestState) -> dict[str, Any] | None:
        """Read the ``best.pt`` beside a resumed checkpoint that matches its best record.

        Falls back to ``best.prev.pt`` when a crash between the two writes left ``best.pt`` a step ahead;
        in this run's own folder the matching file is put back in place as ``best.pt`` (warned). Elsewhere
        (``ckpt.resume=<path>``) nothing is written.

        :param directory: The folder of the resumed checkpoint.
        :param best: The best record the resumed checkpoint holds.
        :returns: The matching ``best.pt`` payload, or None (warned) when none matches.
        """
        path = directory / BEST_CKPT
        repair = self.writer and same_directory(directory, self.out_dir)
        found = []
        for candidate in (path, previous_path(path)):
            if not candidate.exists():
                continue
            try:
                payload = load_checkpoint(candidate)
                validate_best(payload, path=candidate)
            except CheckpointCorruptError as exc:
                warn_user(str(exc))
                continue
            recorded = BestState.from_dict(payload["best"])
            if attrs.evolve(recorded, min_delta=best.min_delta) == best:  # a resume may have changed min_delta
                if candidate != path and repair:
                    # best.pt was written, last.pt was not: put the matching best back in place
                    atomic_save(payload, path)
                    warn_user(
                        f"{path} did not match the best recorded in {self.last_path} (epoch "
                        f"{best.epoch}); repaired it from {candidate}"
                    )
                return payload
            found.append(f"{candidate.name}: epoch {payload['best'].get('epoch')}")
        warn_user(
            f"no best checkpoint matches the best recorded in {self.last_path} (epoch {best.epoch}, score "
            f"{best.score}; found {', '.join(found) or 'none'}); test() will use the current weights until the "
            "next improvement"
        )
        return None

    @staticmethod
    def read_metrics_prefix(directory: Path, size: int) -> bytes:
        """The first ``size`` bytes of another folder's ``metrics.jsonl`` (empty when it has none, or it is not a
        regular file: a FIFO there would block the read).

        :param directory: The folder a run resumes from.
        :param size: The size its checkpoint recorded.
        :returns: At most ``size`` bytes.
        """
        try:
            fd, info = open_regular(directory / METRICS_FILE, follow_links=True)
        except UnreadableFile:
            return b""
        try:
            with os.fdopen(fd, "rb") as handle:
                return handle.read(min(size, info.st_size))  # a recorded size, not the real one
        except OSError:
            return b""

    # ------------------------------------------------------------------ saving

    def save(
        self,
        last: dict[str, Any],
        best: dict[str, Any] | None = None,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> float | None:
        """Write ``best.pt`` (when given) then ``last.pt``, each atomically and durably, keeping ``.prev``.

        Waits for the previous background write first (its failure is raised here). Refuses a payload that
        would not load back before writing anything. The first save warns when the disk looks too small.

        :param last: The ``last.pt`` payload.
        :param best: The ``best.pt`` payload, when the best changed since the last save.
        :param before: Run beside the first write, in a thread of its own, and done before that write publishes
            its file (to make ``metrics.jsonl`` durable before ``last.pt`` records its size).
        :param after: Called after ``last.pt`` is published (to keep it under ``checkpoints/``).
        :returns: The seconds the writes took (both files), or None when they run in the background.
        :raises CheckpointError: From a write, or a payload that would not load.
        """
        self._writer.wait()
        payloads = {"best": best, "last": last} if best is not None else {"last": last}
        for data in payloads.values():  # a value that would not load back is refused before writing
            check_loadable(data)
        if not self._space_checked:
            warn_if_low_on_space(last, self.last_path)
            self._space_checked = True
        if self._staging is not None:  # named slots: best's buffers stay best's whether or not it is saved
            payloads = self._staging.stage(payloads)
        paths = {"best": self.best_path, "last": self.last_path}
        self._writer.submit([(data, paths[name]) for name, data in payloads.items()], before=before, after=after)
        return None if self._writer.background else self._writer.last_seconds

    @property
    def last_seconds(self) -> float | None:
        """The seconds the last finished save took, synchronous or in the background (after :meth:`wait`)."""
        return self._writer.last_seconds

    def wait(self) -> None:
        """Block until a background write is on disk.

        :raises BaseException: That write's failure.
        """
        self._writer.wait()

    wait_local = wait

    def abandon(self) -> None:
        """Let a background write land without raising (a failure is warned): for use while another error is raised."""
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - the exception being raised matters more
            warn_user(f"a background checkpoint write also failed: {exc!r}")

    def release(self) -> None:
        """Nothing is held between saves but the writer, which :meth:`wait` finishes."""
        self._writer.wait()

    # ------------------------------------------------------------------ the Storage calls

    def published(self) -> list[Path]:
        """``last.pt`` and ``last.prev.pt``, those that exist.

        :returns: Their paths, newest first.
        """
        return [path for path in (self.last_path, previous_path(self.last_path)) if path.exists()]

    def best_weights(self, directory: Path, best: BestState, model: nn.Module | None) -> BestWeights | None:
        """The ``best.pt`` beside a resumed checkpoint that matches ``best`` (:meth:`read_best`), in ``model``'s layout.

        :param directory: The resumed checkpoint's folder.
        :param best: The best record it holds.
        :param model: The run's model (unwrapped), whose layout the weights take; None keeps them whole.
        :returns: The weights, or None (warned) when no file matches.
        """
        saved = self.read_best(directory, best)
        if saved is None:
            return None
        if model is not None and fsdp.is_sharded(model):  # whole weights: each rank keeps its own shards
            return BestWeights(weights=fsdp.shard_like(saved["model"], module_state(model)), private=True, rewrite=True)
        weights = {
            key: value.to(self._device) if isinstance(value, torch.Tensor) else value
            for key, value in saved["model"].items()
        }
        # loaded tensors may share memory (tied weights): not private, so the next improvement allocates anew
        return BestWeights(weights=weights, private=False, rewrite=not same_directory(directory, self.out_dir))

    def save_checkpoint(self, request: SaveRequest) -> float | None:
        """Build the payloads of ``request`` and :meth:`save` them on rank 0; every rank learns whether it worked.

        :param request: What to write.
        :returns: The seconds the writes took on rank 0 (None elsewhere, or when they run in the background).
        :raises CheckpointError: On every rank when rank 0's write failed.
        """
        seconds, error = None, None
        if self.writer:
            try:
                self._writer.wait()  # a failed background write surfaces here, and every rank hears of it
                best = None
                if request.best_weights is not None and request.best is not None:
                    best = best_payload(model=request.best_weights, best=request.best, config=request.config)
                last = request.engine(bookkeeping.collect_payload(request.registry, state_of=item_state))
                seconds = self.save(last, best, before=request.before, after=request.after)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                error = exc
        raise_if_any_rank_failed(
            error,
            lambda: CheckpointError(f"rank 0 failed to write {self.last_path}; see rank 0's traceback"),
            world_size=self._world_size,
        )
        return seconds

    def lost_best(self, tracked: bool) -> bool:
        """Whether ``best.pt`` went missing from disk during the run (rank 0 looks; others answer False).

        :param tracked: Whether a best was written and has not changed since.
        :returns: Whether it is gone.
        """
        if not self.writer or not tracked:
            return False
        self._writer.wait()  # a background write may be about to put it there
        return not self.best_path.exists()


def _check_schema(ckpt: Mapping[str, Any], path: Path) -> None:
    """Refuse what is not a trainkit checkpoint, or one a newer trainkit wrote."""
    version = ckpt.get("schema_version")
    if not isinstance(version, int) or "loop" not in ckpt:
        raise CheckpointMismatchError(f"{path} is not a trainkit checkpoint (no schema_version/loop entries)")
    if version > SCHEMA_VERSION:
        raise CheckpointMismatchError(
            f"{path} has checkpoint schema version {version}, newer than this trainkit's "
            f"{SCHEMA_VERSION}; upgrade trainkit to resume it"
        )
