"""A run folder's checkpoint files: their names, reading one to resume, and writing them.

Side effects: files in ``out_dir`` (``last.pt``, ``best.pt``, their ``.prev`` copies, temp files of
unfinished saves, ``*.corrupt.pt`` kept for inspection) and, with ``ckpt.async_save``, a writer thread.
:class:`RunFiles` is built from plain values and knows nothing of the trainer: the trainer hands it payloads
(built by :func:`trainkit.checkpoint.payload.last_payload`) and engine records, and it returns loaded dicts. The other
storage format (a directory per checkpoint, written by every rank) sits beside it behind the same method
names: :class:`trainkit.checkpoint.dcp_files.ShardedFiles`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from trainkit import checkpoint as ckpt_io
from trainkit.bookkeeping import BestState
from trainkit.checkpoint.async_save import AsyncCheckpointWriter, StagingBuffers, SyncCheckpointWriter
from trainkit.checkpoint.payload import (
    SCHEMA_VERSION,
    finished_run,
    validate_best,
    validate_last,
    world_change_refusal,
)
from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, OutDirError
from trainkit.files.bounded_read import UnreadableFile, open_regular
from trainkit.messages import warn_user
from trainkit.run.folder import METRICS_FILE, same_directory
from trainkit.run.lock import RunLock

__all__ = ["LAST_CKPT", "BEST_CKPT", "METRICS_FILE", "RunFiles", "same_directory"]

LAST_CKPT = "last.pt"
BEST_CKPT = "best.pt"


class RunFiles:
    """The checkpoint files of one run folder: every rank reads them, rank 0 writes them.

    :param out_dir: The run folder.
    :param enabled: ``ckpt.enable``: whether this run writes checkpoints at all.
    :param writer: Whether this process writes (rank 0); the others only read. A rank-0 reader of a run
        without checkpoints still keeps a damaged ``last.pt`` aside and repairs ``best.pt`` in ``out_dir``.
    :param async_save: ``ckpt.async_save``: stage each save in reused host buffers and write it in the
        background (one write in flight), instead of writing before :meth:`save` returns.
    """

    def __init__(self, out_dir: Path, *, enabled: bool, writer: bool, async_save: bool) -> None:
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
        self._lock = RunLock(out_dir)

    @property
    def metrics_path(self) -> Path:
        """``out_dir/metrics.jsonl``."""
        return self.out_dir / METRICS_FILE

    # ------------------------------------------------------------------ before the run

    def claim(self) -> None:
        """Lock ``out_dir`` for this run (:class:`~trainkit.run.lock.RunLock`) and check it can take checkpoints.

        Only a writer of a run with checkpoints does anything; call it before reading anything, so a second
        run on the same folder is refused at once. :meth:`release` lets the folder go.

        :raises OutDirError: When another run holds the folder, or a checkpoint cannot be written there.
        """
        if self.writes:
            self._lock.acquire()
            self.check_writable()

    def release(self) -> None:
        """Let the folder go (idempotent): the next run on it may start."""
        self._lock.release()

    def check_writable(self) -> None:
        """Refuse a folder where a checkpoint cannot be written (a directory in a checkpoint's place).

        :raises OutDirError: Naming the path in the way.
        """
        if not self.writes:
            return
        for name in (LAST_CKPT, BEST_CKPT):
            for path in (self.out_dir / name, ckpt_io.previous_path(self.out_dir / name)):
                if path.is_dir() and not path.is_symlink():
                    raise OutDirError(f"{path} is a directory, so no checkpoint can be written there; move it away")

    def remove_stale_temp_files(self) -> list[Path]:
        """Remove the temp files that killed saves left in ``out_dir`` (rank 0 of a writing run only).

        :returns: The removed paths.
        """
        return ckpt_io.remove_stale_temp_files(self.out_dir) if self.writes else []

    # ------------------------------------------------------------------ resuming

    def load_resume(self, resume: str, *, world_size: int) -> tuple[dict[str, Any] | None, Path | None]:
        """Load the checkpoint ``ckpt.resume`` names, checked against the schema and this run's world size.

        With ``auto`` a damaged ``last.pt`` falls back to ``last.prev.pt`` (with a warning; the damaged file
        is kept as ``last.corrupt.pt``); a named path never falls back.

        :param resume: ``"auto"``, ``"never"`` or a checkpoint path.
        :param world_size: This run's number of processes.
        :returns: The checkpoint and the path it was read from, or (None, None) when there is none to read.
        :raises CheckpointError: When a named path does not exist, or the file cannot be resumed here.
        """
        if resume == "never" or (resume == "auto" and not self.enabled):
            # a run that writes no checkpoints reads none either, unless ckpt.resume names one
            return None, None
        path = self.last_path if resume == "auto" else Path(resume)
        previous = ckpt_io.previous_path(path)
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
        _check_compatible(ckpt, path, world_size)
        return ckpt, path

    @staticmethod
    def _read_last(path: Path, world_size: int) -> dict[str, Any]:
        ckpt = ckpt_io.load_checkpoint(path)
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
        for candidate in (path, ckpt_io.previous_path(path)):
            if not candidate.exists():
                continue
            try:
                payload = ckpt_io.load_checkpoint(candidate)
                validate_best(payload, path=candidate)
            except CheckpointCorruptError as exc:
                warn_user(str(exc))
                continue
            recorded = BestState.from_dict(payload["best"])
            if attrs.evolve(recorded, min_delta=best.min_delta) == best:  # a resume may have changed min_delta
                if candidate != path and repair:
                    # best.pt was written, last.pt was not: put the matching best back in place
                    ckpt_io.atomic_save(payload, path)
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
            ckpt_io.check_loadable(data)
        if not self._space_checked:
            ckpt_io.warn_if_low_on_space(last, self.last_path)
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

    def wait_quietly(self) -> None:
        """Let a background write land without raising (a failure is warned): for use while another error is raised."""
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - the exception being raised matters more
            warn_user(f"a background checkpoint write also failed: {exc!r}")


def _check_compatible(ckpt: Mapping[str, Any], path: Path, world_size: int) -> None:
    version = ckpt.get("schema_version")
    if not isinstance(version, int) or "loop" not in ckpt:
        raise CheckpointMismatchError(f"{path} is not a trainkit checkpoint (no schema_version/loop entries)")
    if version > SCHEMA_VERSION:
        raise CheckpointMismatchError(
            f"{path} has checkpoint schema version {version}, newer than this trainkit's "
            f"{SCHEMA_VERSION}; upgrade trainkit to resume it"
        )
    refusal = None if finished_run(dict(ckpt)) else world_change_refusal(dict(ckpt), world_size)
    if refusal is not None:
        raise CheckpointMismatchError(
            f"{path} was written by a run with world_size={ckpt.get('world_size')}, this run has "
            f"world_size={world_size}: {refusal} (or start fresh with ckpt.resume=never)"
        )
