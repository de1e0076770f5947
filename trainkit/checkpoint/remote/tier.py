"""The remote tier: every published checkpoint copied to object storage (any fsspec URL) in the background.

Side effects: objects under ``ckpt.remote`` (one folder per upload, its commit record last, the lease), a
background thread on rank 0, hard links under ``out_dir/.remote-staging/`` while an upload is pending, a
download folder ``out_dir/.remote-fetch-<token>/`` while a remote checkpoint is verified, warnings.

The protocol (see ``docs/remote.rst``):

- **Hand-over.** Right after a local publish the published files are hard-linked into a staging folder (no copy,
  no bytes read) and handed to one uploader thread; one upload is in flight, and a newer hand-over replaces a
  queued one. The loop waits for nothing else.
- **Catch-up.** At its start a resumed run queues what its local checkpoints hold and the remote lacks
  (:meth:`RemoteTier.catch_up`): a list the uploader drains oldest first, before the queued hand-over, that no
  hand-over replaces; then retention runs once (a step committed twice keeps the copy that is the local one).
- **Commit.** An upload streams each file into a fresh folder ``step-<step>-<token>/`` (CRC-32 computed on the
  way), then writes :data:`~trainkit.checkpoint.remote.manifest.MANIFEST`, which lists every object's size and
  CRC-32: a folder without one is never read, and is deleted by the next writer.
- **Retention.** After each commit, the committed folders are described as the local kept checkpoints are and
  :func:`~trainkit.bookkeeping.retain` decides which stay (never the newest).
- **Lease.** One run writes under a prefix: :data:`~trainkit.checkpoint.remote.manifest.LEASE` is created with a
  conditional create and renewed by the uploader every third of ``ckpt.remote_lease_s``; a lease not renewed for
  that long may be taken over, and so may, at once, a lease that names the identity of the run folder
  (:func:`~trainkit.checkpoint.remote.staging.folder_identity`) of a rerun that holds that folder's lock (a requeue
  after a kill). A takeover or renewal replaces the lease only if it is still the object read (S3 ``If-Match`` on
  its ETag; a file system: rename aside, check, hard-link a new one, every step of it under an ``flock`` of
  :data:`~trainkit.checkpoint.remote.store.LEASE_LOCK` so that no other run's create falls between the rename and a
  put-back; memory: a lock).
- **Sharded.** Every rank uploads its own files of a sharded save into one folder (named alike on every rank);
  rank 0 writes the commit record once every rank reported its upload done (:meth:`RemoteTier.report`, gathered
  by the next save's collective or at the run's end; :meth:`RemoteTier.commit_reports`).
- **Faults.** A failed upload is retried with backoff a few times, warned about once, and superseded by the next
  checkpoint; a failed deletion of retention is warned about once and tried again after the next commit (the
  commit stands); nothing here raises into the loop after the start.
- **Hostile objects.** Every object is read as hostile input, through the store's verbs
  (:mod:`trainkit.checkpoint.remote.store`): only a regular object is opened, no more bytes are read than it may
  hold, and no open or read waits longer than :data:`~trainkit.checkpoint.remote.store.READ_DEADLINE_S`. What a
  store's client raises reaches the user as one line (:func:`~trainkit.checkpoint.remote.store.store_errors`).

This module is the tier's policy: when to take, renew and release the lease, what to upload and in which order, what
retention deletes, which remote checkpoint a resume takes. The store's verbs are
:mod:`~trainkit.checkpoint.remote.store`'s, its records :mod:`~trainkit.checkpoint.remote.manifest`'s, and its files
in the run folder :mod:`~trainkit.checkpoint.remote.staging`'s.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs

from trainkit.bookkeeping import Checkpoint, Lineage, in_history, keep_reasons
from trainkit.checkpoint.remote import store
from trainkit.checkpoint.remote.manifest import (
    KIND,
    LEASE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Lease,
    Manifest,
    RemoteObject,
    folder_name,
    folder_step,
    manifest_bytes,
    newest_first,
    parse_manifest,
)
from trainkit.checkpoint.remote.staging import (
    FETCH_PREFIX,
    LAST,
    LAST_DIR,
    PUBLISHED_NAMES,
    STAGING_DIR,
    publish_fetched,
    stage_files,
)
from trainkit.checkpoint.remote.store import LEASE_LOCK, shown
from trainkit.config import CkptConfig, redact_text
from trainkit.errors import CheckpointCorruptError, CheckpointUnsafeError, OutDirError
from trainkit.files.bounded_read import UnreadableFile
from trainkit.files.checksum import file_checksum
from trainkit.files.weights_only_load import load_checkpoint
from trainkit.messages import say, warn_user

__all__ = ["RemoteTier", "Upload", "Anchor", "Fetched", "ATTEMPTS", "BACKOFF_S"]

_T = TypeVar("_T")

ATTEMPTS = 4
"""Tries per upload before it is given up (the next checkpoint supersedes it)."""
BACKOFF_S = 0.5
"""The first retry's delay; each next one doubles it."""


def _utc(seconds: float) -> str:
    """A Unix time as messages show it (UTC, to the second)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _guarded(doing: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """A :class:`RemoteTier` method whose store failures are one line
    (:func:`~trainkit.checkpoint.remote.store.store_errors`)."""

    def wrap(method: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(method)
        def guarded(self: RemoteTier, *args: Any, **kwargs: Any) -> _T:
            with store.store_errors(self.url, doing):
                return method(self, *args, **kwargs)

        return guarded

    return wrap


@attrs.frozen(kw_only=True)
class Upload:
    """One checkpoint handed over for upload: its staged files and what its manifest says.

    :ivar staged: The staging folder holding the files (hard links), removed once the upload ends.
    :ivar files: ``(name, size)`` of each file in ``staged``; only the first ``size`` bytes go up.
    :ivar step: The optimizer step.
    :ivar epoch: The epoch.
    :ivar run_id: The W&B run id.
    :ivar description: The checkpoint as retention sees it.
    :ivar policy: The retention policy (``ckpt.keep``) the remote folders are kept by.
    :ivar minimize: The run's ``val.minimize``: recorded in the commit record, for ``retain URL``'s ``best`` rules
        (None: not known).
    :ivar folder: The remote folder's name (every rank's shards of a sharded save go into one); None: a fresh one.
    :ivar commits: Write the commit record after the upload (a sharded save's is written by rank 0 once every
        rank reported its shards uploaded, :meth:`RemoteTier.commit_reports`).
    :ivar lineage: The checkpoint's lineage (:func:`~trainkit.bookkeeping.in_history`), recorded in its commit record;
        retention judges only the folders in its history.
    :ivar newest: The step of the newest checkpoint the run wrote, for the retention after this commit (None: this
        upload's step; a catch-up of an older checkpoint names the run's newest).
    :ivar prefer: Remote folders kept over another copy of their step by that retention (besides this upload's).
    """

    staged: Path
    files: tuple[tuple[str, int], ...]
    step: int
    epoch: int
    run_id: str | None
    description: Checkpoint
    policy: Any
    minimize: bool | None = None
    folder: str | None = None
    commits: bool = True
    lineage: Lineage | None = None
    newest: int | None = None
    prefer: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Anchor:
    """What a resume has locally, that a remote checkpoint must descend from to be taken.

    :ivar lineage: Its lineage; ``()`` for a checkpoint written before lineages existed (no remote one is taken).
    :ivar step: Its step.
    :ivar checkpoint: A local checkpoint (only a strictly newer remote one counts), or the run folder's record of
        the life that started there and saved nothing yet (any descendant counts).
    :ivar what: How messages name it.
    """

    lineage: Lineage
    step: int
    checkpoint: bool
    what: str


@attrs.frozen(kw_only=True)
class Fetched:
    """A remote checkpoint downloaded and verified into a folder of its own under ``out_dir``, not published yet.

    :ivar folder: The download folder (``out_dir/.remote-fetch-<token>/``).
    :ivar name: The remote folder's name.
    :ivar manifest: Its commit record.
    """

    folder: Path
    name: str
    manifest: Manifest


@attrs.frozen(kw_only=True)
class _Retention:
    """A retention to run once the catch-up uploads before it are done."""

    policy: Any
    newest: int
    prefer: tuple[str, ...]
    history: tuple[Lineage, int] | None = None


@attrs.frozen(kw_only=True)
class _Commit:
    """A sharded save's commit record, to write once every rank's shards are up."""

    upload: Upload
    folder: str
    objects: tuple[RemoteObject, ...]


def _version() -> str:
    """trainkit's installed version (the package is not imported from here: it sits above this layer)."""
    try:
        return importlib.metadata.version("trainkit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class RemoteTier:
    """Rank 0's remote copies of a run's checkpoints: lease, background uploads, retention, verified downloads.

    :param url: ``ckpt.remote``.
    :param fs: Its fsspec filesystem.
    :param root: Its root path on ``fs``.
    :param out_dir: The run folder (staging and downloads live there).
    :param lease_s: ``ckpt.remote_lease_s``.
    :param wait_s: ``ckpt.remote_wait_s``.
    :param rank: This process's rank: rank 0 holds the lease, commits and deletes; every rank uploads its own files.
    """

    def __init__(
        self, url: str, fs: Any, root: str, *, out_dir: Path, lease_s: float, wait_s: float, rank: int = 0
    ) -> None:
        self.url = redact_text(url)
        """The URL as shown in messages (credentials masked)."""
        self._fs, self._root = fs, root
        self._out_dir = out_dir
        self._staging = out_dir / STAGING_DIR / f"rank-{rank}"  # each rank's own: out_dir is shared when sharded
        self._lease_s, self._wait_s = lease_s, wait_s
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._cond = threading.Condition()
        self._queued: Upload | None = None
        self._catching_up: list[Upload | _Retention] = []  # drained oldest first, before the queued hand-over
        self._busy = False
        self._stopping = False
        self._warned = False
        self._retention_warned = False
        self._committed_step: int | None = None
        self._newest_step: int | None = None  # the newest step an upload started for
        self._lost_step: int | None = None  # the newest step given up on
        self._thread: threading.Thread | None = None
        self._renewed = 0.0
        self._refused: set[str] = set()
        self._manifests: dict[str, Manifest] = {}
        self.last_upload_s: float | None = None
        """The seconds the last committed upload took, from its start to its commit record."""
        self._held = False
        self._folder: str | None = None  # the run folder's identity, named in the lease (see Lease.folder)
        self._rank = rank
        self._evicted = False
        self._commit: _Commit | None = None
        self._awaiting: dict[str, Upload] = {}  # rank 0: sharded uploads waiting for every rank's report
        self._uploaded: tuple[str, tuple[RemoteObject, ...]] | None = None  # the newest uncommitted upload done
        self._lease_guard = threading.RLock()  # the uploader renews while the main thread may release
        self._lease_depth = 0  # how deep this process is in :meth:`_lease_locked` (the flock is taken once)

    @classmethod
    def build(cls, ckpt: CkptConfig, out_dir: Path, *, rank: int) -> RemoteTier | None:
        """The tier ``ckpt.remote`` names in a run that writes checkpoints: on rank 0 (``ckpt.format="file"``) or
        on every rank (``"sharded"``: each uploads its own shards); None otherwise.

        :param ckpt: The ``ckpt`` section.
        :param out_dir: The run folder.
        :param rank: This process's rank.
        :returns: The tier, or None.
        :raises UsageError: When fsspec or the store's package is missing.
        """
        if ckpt.remote is None or not ckpt.enable or (rank != 0 and ckpt.format != "sharded"):
            return None
        fs, root = store.open_store(ckpt.remote, dict(ckpt.remote_options))
        options = {"lease_s": ckpt.remote_lease_s, "wait_s": ckpt.remote_wait_s, "rank": rank}
        return cls(ckpt.remote, fs, root, out_dir=out_dir, **options)

    # ------------------------------------------------------------------ the lease

    @_guarded("taking the lease")
    def acquire(self, *, uploads: bool = True, folder: str | None = None) -> None:
        """Take the prefix for this run, delete uncommitted leftovers and start the uploader (unless ``uploads`` is
        False: ``retain`` holds the lease only to delete, and deletes the leftovers itself). An expired lease is
        taken over, and so is, at once, one that names ``folder`` (left by a killed run of this run folder): each
        conditionally on the very object read.

        :param uploads: Start the uploader.
        :param folder: The run folder's identity (:func:`~trainkit.checkpoint.remote.staging.folder_identity`, read
            holding the folder's lock), named in this run's lease; None: no run folder (``retain``), and no lease is
            taken over before it expires.
        :raises OutDirError: When another run holds it (or took the expired lease first), naming the prefix, the
            holder and when it expires; or the store fails (one line,
            :func:`~trainkit.checkpoint.remote.store.store_errors`).
        """
        if self._rank != 0:  # rank 0 holds the prefix for the run
            self._start(uploads)
            return
        self._folder = folder
        store.make_folder(self._fs, self._root)
        with self._lease_locked():  # a file system: no other run's takeover moves the lease while it is read here
            self._take_lease()
        self._held = True
        if uploads:  # ``retain`` deletes them among the rest, and says what it could not
            try:
                self._remove_uncommitted()
            except OutDirError as exc:  # the next commit's retention deletes them
                self._warn_retention(str(exc))
        self._start(uploads)

    def _take_lease(self) -> None:
        """Create the lease, or take over one this run folder's killed run left, or an expired one: a few tries, each
        conditional on the very object read (one changed since it was read is read again).

        :raises OutDirError: When another run holds it, or took the expired lease first.
        """
        for _ in range(3):
            if self._create_lease():
                return
            held, version = self._lease_version()
            if held is not None and not held.expired(time.time()) and held.held_for(self._folder):
                if self._replace_lease(held, version):  # this folder's killed run left it: no wait
                    say(
                        f"ckpt.remote={self.url}: took over the lease that a killed run of {self._out_dir} left "
                        f"({shown(held.holder)}, held until {_utc(held.expires)})"
                    )
                    return
                continue  # changed since it was read: read it again
            if held is not None and not held.expired(time.time()):
                raise OutDirError(
                    f"ckpt.remote={self.url} is held by another run ({shown(held.holder)}) until {_utc(held.expires)} "
                    "unless it renews its lease; one run writes under a prefix: wait for it to end, or use another "
                    "prefix"
                )
            if held is not None and self._replace_lease(held, version):  # expired: its run is gone
                return
        raise OutDirError(f"ckpt.remote={self.url}: another run took the expired lease first; try again")

    def lease(self) -> Lease | None:
        """The lease on the prefix now, or None."""
        return self._read_lease()

    def _start(self, uploads: bool) -> None:
        if uploads:
            self._thread = threading.Thread(target=self._run, name="trainkit-remote-upload", daemon=True)
            self._thread.start()

    def _renew_quietly(self) -> None:
        try:
            self._renew()
        except Exception as exc:  # noqa: BLE001 - a store that is down now may be up at the next renewal
            self._warn(f"the lease could not be renewed ({type(exc).__name__}: {exc})")

    def _renew(self) -> None:
        with self._lease_locked():  # a file system: a racing takeover's rename aside never reads as "gone" here
            held, version = self._lease_version()
            renewed = (
                self._create_lease()  # gone (deleted by hand): this run's again, unless another took the prefix
                if held is None
                else held.holder == self._holder and self._replace_lease(held, version)
            )
        if not renewed:
            self._held = False  # this run stalled past its lease and another took the prefix: it writes no more
            self._evicted = True
            holder = shown(held.holder) if held is not None else "another run"
            raise OutDirError(f"the lease was taken over by {holder}; this run uploads nothing more")

    def _path(self, *parts: str) -> str:
        return "/".join((self._root, *parts))

    def _read_lease(self) -> Lease | None:
        return store.read_lease_object(self._fs, self._path(LEASE), self.url)

    def _lease_version(self) -> tuple[Lease | None, Any]:
        return store.lease_version(self._fs, self._path(LEASE), self.url)

    @contextlib.contextmanager
    def _lease_locked(self) -> Iterator[None]:
        """On a file system, hold :data:`~trainkit.checkpoint.remote.store.LEASE_LOCK`'s ``flock`` (re-entrant in this
        process: taken once, by the outermost); elsewhere nothing.

        :raises TimeoutError: When another process holds it for more than
            :data:`~trainkit.checkpoint.remote.store.LEASE_LOCK_S`.
        :raises UnreadableFile: When something other than a regular file is at the lock's path.
        """
        with self._lease_guard:
            outermost = self._lease_depth == 0 and store.store_kind(self._fs) == "local"
            with store.lease_lock(self._fs, self._path(LEASE_LOCK)) if outermost else contextlib.nullcontext():
                self._lease_depth += 1
                try:
                    yield
                finally:
                    self._lease_depth -= 1

    def _new_lease(self) -> Lease:
        return Lease(holder=self._holder, expires=time.time() + self._lease_s, folder=self._folder)

    def _create_lease(self) -> bool:
        """Create the lease if there is none, in one step of the store (:func:`~trainkit.checkpoint.remote.store.
        create_lease`; a file system: never inside another run's takeover, between its rename and put-back)."""
        with self._lease_locked():
            created = store.create_lease(self._fs, self._path(LEASE), self._new_lease(), self.url)
        if created:
            self._renewed = time.monotonic()
        return created

    def _replace_lease(self, seen: Lease, version: Any) -> bool:
        """Write this run's lease over the one read (``seen``, of ``version``) only if it is still that object
        (:func:`~trainkit.checkpoint.remote.store.replace_lease`; a file system: the rename aside, the check, the
        put-back and the create are one step under the lock). True when written."""
        with self._lease_locked():
            replaced = store.replace_lease(self._fs, self._path(LEASE), self._new_lease(), seen, version, self.url)
        if replaced:
            self._renewed = time.monotonic()
        return replaced

    def _release(self) -> None:
        """Delete this run's lease, conditionally on it being the object read (as :meth:`_replace_lease`): a
        successor's lease, taken over meanwhile, is never deleted."""
        with self._lease_locked():
            held, version = self._lease_version()
            if held is not None and held.holder == self._holder:
                store.release_lease(self._fs, self._path(LEASE), held, version, self.url)

    # ------------------------------------------------------------------ hand-over and upload

    def hand_over(self, files: list[tuple[Path, str, int | None]], make_upload: Callable[..., Upload]) -> None:
        """Stage just-published files (hard links, so the next publish cannot change them) and queue their upload,
        replacing a queued one. Never raises: a failure is warned about once.

        :param files: ``(path, name, size)`` of each file to upload, in order: ``name`` is its name in the remote
            folder; only the first ``size`` bytes go (None: the whole file). A missing file is left out.
        :param make_upload: Builds the upload from ``staged=`` (the folder) and ``files=`` (``(name, size)`` pairs).
        """
        upload = self._stage(files, make_upload)
        if upload is None:
            return
        with self._cond:
            dropped, self._queued = self._queued, upload
            if not upload.commits and self._rank == 0 and upload.folder is not None:
                self._awaiting[upload.folder] = upload
            self._cond.notify_all()
        if dropped is not None:
            shutil.rmtree(dropped.staged, ignore_errors=True)

    def catch_up(
        self, uploads: list[tuple[list[tuple[Path, str, int | None]], Callable[..., Upload]]], retention: Any
    ) -> None:
        """Queue uploads that no hand-over replaces (a resumed run's local checkpoints the remote lacks), in the
        order given (oldest first), and then, unless ``retention`` is None, one retention of the prefix. Staged as
        :meth:`hand_over` stages; never raises (a failure is warned about once).

        :param uploads: ``(files, make_upload)`` of each checkpoint, as :meth:`hand_over` takes them.
        :param retention: ``(policy, newest, prefer, history)``: the retention to run after them (``prefer``: the
            folders kept over another copy of their step; ``history``: the lineage and step of the resumed
            checkpoint, whose history alone is judged, see :meth:`plan`), or None.
        """
        staged = [upload for files, make in uploads if (upload := self._stage(files, make)) is not None]
        with self._cond:
            self._catching_up.extend(staged)
            for upload in staged:
                if not upload.commits and self._rank == 0 and upload.folder is not None:
                    self._awaiting[upload.folder] = upload
            if retention is not None and self._rank == 0:
                policy, newest, prefer, history = retention
                self._catching_up.append(
                    _Retention(policy=policy, newest=newest, prefer=tuple(prefer), history=history)
                )
            self._cond.notify_all()

    def report(self) -> tuple[str, tuple[RemoteObject, ...]] | None:
        """The newest sharded upload of this rank that is done and not committed yet: its folder and objects."""
        with self._cond:
            return self._uploaded

    def commit_reports(self, reports: list[tuple[str, tuple[RemoteObject, ...]] | None]) -> None:
        """Rank 0: queue the commit record of the newest sharded upload every rank reports done (the reports are
        gathered by the save's own collective, or at the run's end); older uncommitted ones are given up.

        :param reports: :meth:`report` of every rank, in rank order.
        """
        folders = {report[0] if report is not None else None for report in reports}
        if len(folders) != 1 or None in folders:
            return
        (folder,) = folders
        with self._cond:
            upload = self._awaiting.pop(folder, None)
            if upload is None:
                return
            for older in [name for name, job in self._awaiting.items() if job.step <= upload.step]:
                del self._awaiting[older]
            objects = tuple(o for report in reports if report is not None for o in report[1])
            self._commit = _Commit(upload=upload, folder=folder, objects=objects)
            self._cond.notify_all()

    def _stage(self, files: list[tuple[Path, str, int | None]], make_upload: Callable[..., Upload]) -> Upload | None:
        """Stage files for an upload (see :meth:`hand_over`): the upload, or None (warned) when they could not be."""
        staged = self._staging / secrets.token_hex(8)
        try:
            listed = stage_files(staged, files)
        except OSError as exc:
            self._warn(f"could not stage checkpoint files for upload ({exc})")
            return None
        return make_upload(staged=staged, files=listed)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._queued is not None
                        or self._commit is not None
                        or bool(self._catching_up)
                        or self._stopping
                    ),
                    timeout=self._lease_s / 3,
                )
                if self._stopping:
                    return
                commit, self._commit = self._commit, None
                retention, catching_up = None, False
                if commit is not None:
                    job = None
                elif self._catching_up:  # before the queued hand-over: a newer checkpoint is uploaded after them
                    first = self._catching_up.pop(0)
                    job, retention = (first, None) if isinstance(first, Upload) else (None, first)
                    catching_up = True
                else:
                    job, self._queued = self._queued, None
                self._busy = job is not None or commit is not None or retention is not None
                if job is not None:
                    self._newest_step = job.step
            try:
                if self._held and time.monotonic() - self._renewed > self._lease_s / 3:
                    self._renew_quietly()
                if self._evicted:
                    if job is not None:
                        shutil.rmtree(job.staged, ignore_errors=True)
                        self._lost_step = job.step
                    continue
                if retention is not None:
                    retain = {"newest": retention.newest, "prefer": retention.prefer, "history": retention.history}
                    self._retain(retention.policy, **retain)
                if commit is not None:
                    self._commit_sharded(commit)
                if job is not None:
                    self._upload_with_retries(job, superseded=not catching_up)
            except Exception as exc:  # noqa: BLE001 - the loop must not fail for its remote copy
                self._warn(f"the uploader failed ({type(exc).__name__}: {exc})")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload_with_retries(self, job: Upload, *, superseded: bool = True) -> None:
        """Upload with retries; a newer hand-over ends the backoff and gives this one up (when ``superseded``: a
        catch-up upload is not replaced by a newer checkpoint)."""
        uploaded = None
        try:
            for attempt in range(ATTEMPTS):
                try:
                    started = time.perf_counter()
                    uploaded = self._upload(job)
                    break
                except Exception as exc:  # noqa: BLE001 - retried, then warned
                    self._warn(f"uploading step {job.step} failed ({type(exc).__name__}: {exc}); retrying")
                    with self._cond:  # the backoff ends early for a newer checkpoint or the run's end
                        if attempt == ATTEMPTS - 1 or self._cond.wait_for(
                            lambda: (superseded and self._queued is not None) or self._stopping,
                            timeout=BACKOFF_S * 2**attempt,
                        ):
                            break
        finally:
            shutil.rmtree(job.staged, ignore_errors=True)
        if uploaded is None:
            self._lost_step = job.step
        elif not job.commits:  # rank 0 commits once every rank reported its shards up
            with self._cond:
                self._uploaded = uploaded
        else:  # committed: whatever retention does now, this upload is done
            self.last_upload_s = time.perf_counter() - started
            self._committed_step = max(job.step, self._committed_step or job.step)
            newest = job.step if job.newest is None else job.newest  # a catch-up's: the run's newest
            history = (job.lineage, job.step) if job.lineage else None
            self._retain(job.policy, newest=newest, prefer=(uploaded[0], *job.prefer), history=history)

    def _commit_sharded(self, commit: _Commit) -> None:
        try:
            self._write_manifest(commit.upload, commit.folder, commit.objects)
        except Exception as exc:  # noqa: BLE001 - the next save's commit supersedes it
            self._warn(f"committing step {commit.upload.step} failed ({type(exc).__name__}: {exc})")
            self._lost_step = commit.upload.step
            return
        self._committed_step = max(commit.upload.step, self._committed_step or commit.upload.step)
        upload = commit.upload
        newest = upload.step if upload.newest is None else upload.newest
        history = (upload.lineage, upload.step) if upload.lineage else None
        self._retain(upload.policy, newest=newest, prefer=(commit.folder, *upload.prefer), history=history)

    def _upload(self, job: Upload) -> tuple[str, tuple[RemoteObject, ...]]:
        """Upload a staged checkpoint into its folder, its commit record last (unless a sharded rank's share).

        :returns: The folder's name and the objects uploaded.
        """
        own = job.folder or folder_name(job.step, secrets.token_hex(8))
        crcs: dict[str, int] = {}
        # the CRC-32 pass reads the staged files (none changes any more) beside the upload (zlib lets go of the GIL):
        # it costs no upload time

        def summed() -> None:
            for name, size in job.files:
                with contextlib.suppress(OSError):  # a file it could not read has no CRC: the upload fails below
                    read, crc = file_checksum(job.staged / name, size)
                    if read == size:
                        crcs[name] = crc

        summing = threading.Thread(target=summed, daemon=True)
        summing.start()
        try:
            store.put_files(self._fs, self._path(own), [(job.staged / name, name) for name, _ in job.files])
        finally:
            summing.join()
        if len(crcs) != len(job.files):
            raise OSError(f"could not read every staged file of step {job.step}")
        objects = tuple(RemoteObject(name=name, size=size, crc32=crcs[name]) for name, size in job.files)
        if job.commits:
            self._write_manifest(job, own, objects)
        return own, objects

    def _write_manifest(self, job: Upload, own: str, objects: tuple[RemoteObject, ...]) -> None:
        described = job.description
        manifest = Manifest(
            step=job.step,
            epoch=job.epoch,
            kind=KIND,
            objects=objects,
            run_id=job.run_id,
            version=_version(),
            description={
                "epoch_end": described.epoch_end,
                "time": described.time,
                "scores": {metric: value for metric, value in described.scores.items() if math.isfinite(value)},
                "minimize": job.minimize,
            },
            lineage=job.lineage,
        )
        store.write_object(self._fs, self._path(own, MANIFEST), manifest_bytes(manifest))  # the commit: written last

    def _warn_retention(self, text: str) -> None:
        if not self._retention_warned:  # once per run: the next commit's retention tries again
            self._retention_warned = True
            warn_user(f"{text}; the checkpoints are committed, and retention tries again after the next commit")

    def _warn(self, text: str) -> None:
        if not self._warned:  # once per run: a store that is down would otherwise warn at every checkpoint
            self._warned = True
            warn_user(
                f"ckpt.remote={self.url}: {shown(text)}; training goes on, and the next checkpoint supersedes a lost "
                "upload (further remote failures are not warned about)"
            )

    # ------------------------------------------------------------------ what is on the remote

    def committed(self) -> list[tuple[str, Manifest]]:
        """The committed checkpoint folders, newest first; a folder whose manifest is unsafe is warned about and
        left out.

        :returns: ``(folder name, manifest)`` pairs.
        """
        return self._scan()[0]

    def uncommitted(self) -> list[str]:
        """The checkpoint folders without a commit record (uploads cut short): never read, deleted by the writer."""
        return self._scan()[1]

    def plan(
        self,
        policy: Any,
        *,
        newest: int | None = None,
        prefer: str | tuple[str, ...] | None = None,
        history: tuple[Lineage, int] | None = None,
    ) -> tuple[dict[str, tuple[str, ...]], list[str]]:
        """Which committed folders a retention policy keeps, and why; and every folder to delete: those it does not
        keep, second copies of a step (``prefer`` is the copy kept), uncommitted ones.

        :param policy: The retention policy (as ``ckpt.keep`` gives it).
        :param newest: The step of the newest checkpoint the run wrote (None: the largest step).
        :param prefer: The folder (or folders) kept of two with the same step.
        :param history: The lineage and step of the checkpoint the run just committed: only the folders in its
            history are judged; another history's (an older run's, a branch a rewind abandoned) and those without
            a lineage are neither counted nor deleted. None: every committed folder is judged.
        :returns: ``(reasons by kept folder, folders to delete)``.
        """
        by_step: dict[int, str] = {}
        doomed: list[str] = []
        described = []
        committed, uncommitted = self._scan()
        if history is not None:
            committed = [
                (name, manifest)
                for name, manifest in committed
                if manifest.lineage is not None and in_history(manifest.lineage, manifest.step, *history)
            ]
        preferred = {prefer} if isinstance(prefer, str) else set(prefer or ())
        for name, manifest in sorted(committed, key=lambda item: item[0] not in preferred):
            if manifest.step in by_step:  # the same step uploaded twice (a resumed run): one copy is enough
                doomed.append(name)
                continue
            by_step[manifest.step] = name
            d = manifest.description
            described.append(
                Checkpoint(
                    step=manifest.step,
                    epoch=manifest.epoch,
                    epoch_end=d["epoch_end"],
                    time=d["time"],
                    scores=d["scores"],
                )
            )
        reasons = keep_reasons(policy, described, newest=newest)
        doomed += [name for step, name in by_step.items() if not reasons[step]]
        # an uncommitted folder of a later save may be another rank's upload in flight: only older ones go
        doomed += [name for name in uncommitted if newest is None or (folder_step(name) or 0) < newest]
        return {by_step[step]: why for step, why in reasons.items() if why}, doomed

    def delete(self, names: list[str]) -> None:
        """Delete remote folders (under the lease: only the holder deletes); one that cannot be deleted does not stop
        the others.

        :param names: Folder names under the prefix.
        :raises OutDirError: When some could not be deleted (after every other one was): one line naming the first
            folder and its cause, and listing the folders left.
        """
        failed: list[tuple[str, Exception]] = []
        for name in names:
            self._manifests.pop(name, None)
            if self._linked(name):  # swapped for a link since it was listed: nothing behind it is touched
                failed.append((name, OSError(f"{name} is a symbolic link, which trainkit does not follow")))
                continue
            try:  # the commit record first: no reader takes half a folder
                store.delete_folder(self._fs, self._path(name), MANIFEST)
            except Exception as exc:  # noqa: BLE001 - any store error: the other folders are still deleted
                failed.append((name, exc))
        if failed:
            name, exc = failed[0]
            cause = redact_text(f"{type(exc).__name__}: {exc}".strip().splitlines()[0])
            left = ", ".join(n for n, _ in failed)
            raise OutDirError(
                f"ckpt.remote={self.url}: could not delete {name} ({cause}); {len(names) - len(failed)} of "
                f"{len(names)} folders deleted, left: {left}"
            )

    def _retain(
        self, policy: Any, *, newest: int, prefer: tuple[str, ...], history: tuple[Lineage, int] | None = None
    ) -> None:
        """Apply the run's retention after a commit; a failure is warned about once and retried after the next."""
        try:
            self.delete(self.plan(policy, newest=newest, prefer=prefer, history=history)[1])
        except Exception as exc:  # noqa: BLE001 - the commit stands: retention is not the upload
            text = (
                str(exc)
                if isinstance(exc, OutDirError)
                else f"ckpt.remote={self.url}: retention failed ({type(exc).__name__}: {exc})"
            )
            self._warn_retention(text)

    def _remove_uncommitted(self) -> None:
        self.delete(self.uncommitted())

    def _folders(self) -> list[str]:
        return [name for name in store.list_names(self._fs, self._root, self.url) if folder_step(name) is not None]

    def _linked(self, name: str) -> bool:
        """Whether the folder ``name`` is a symbolic link on a local (or mounted) file system: no run writes one, and
        reading or deleting through it would reach another prefix's files (its commit record deleted by retention)."""
        return store.is_link(self._fs, self._path(name))

    def _scan(self) -> tuple[list[tuple[str, Manifest]], list[str]]:
        found, uncommitted = [], []
        for name in self._folders():
            if self._linked(name):  # neither committed nor uncommitted: never read, never deleted
                self._refuse(name, "a symbolic link, which trainkit does not follow: no run writes one")
                continue
            manifest = self._manifests.get(name)  # a commit record is written once: read once
            if manifest is None:
                try:
                    record = store.read_object(self._fs, self._path(name, MANIFEST), MAX_MANIFEST_BYTES)
                    if not record and store.is_local(self._fs):  # a file system shows a record being written as empty
                        continue  # neither committed yet nor uncommitted (never deleted as such): the next scan sees it
                    manifest = parse_manifest(record)
                except FileNotFoundError:
                    uncommitted.append(name)  # never read
                    continue
                except (CheckpointUnsafeError, UnreadableFile, TimeoutError) as exc:  # the rest are still used
                    self._refuse(name, str(exc))
                    continue
                if manifest.step != folder_step(name):
                    self._refuse(name, f"its manifest says step {manifest.step}")
                    continue
                self._manifests[name] = manifest
            found.append((name, manifest))
        return newest_first(found), uncommitted

    def _refuse(self, name: str, why: str) -> None:
        if name not in self._refused:  # once per folder: retention lists the remote after every upload
            self._refused.add(name)
            warn_user(f"ckpt.remote={self.url}: {name} is refused ({shown(why)})")

    # ------------------------------------------------------------------ resuming

    @_guarded("looking for a newer checkpoint")
    def fetch(self, anchor: Anchor | None) -> Fetched | None:
        """Download the newest of :meth:`candidates` that verifies into a folder of its own under ``out_dir``:
        checked against its manifest, each ``.pt`` file loaded by the safe reader. A damaged one is warned about
        and the next older one tried. Nothing in ``out_dir`` itself changes: the caller checks the checkpoint
        further and then publishes it (:meth:`publish`) or lets it go (:meth:`discard`).

        :param anchor: What the resume has locally, or None (see :meth:`candidates`).
        :returns: The verified download, or None.
        """
        for stale in self._out_dir.glob(f"{FETCH_PREFIX}*"):  # a download a kill interrupted
            shutil.rmtree(stale, ignore_errors=True)
        for name, manifest in self.candidates(anchor):
            tops = {item.name.split("/")[0] for item in manifest.objects}
            if not tops & {LAST, LAST_DIR}:
                self._refuse(name, f"its manifest lists neither {LAST} nor {LAST_DIR}/")
                continue
            if not tops <= PUBLISHED_NAMES:  # anything else would replace a file or folder of out_dir
                self._refuse(name, f"its manifest lists {sorted(tops - PUBLISHED_NAMES)}, not a checkpoint's files")
                continue
            try:
                folder = self.download(name, manifest)
            except (CheckpointCorruptError, CheckpointUnsafeError, OSError) as exc:
                warn_user(f"{shown(exc)}; trying the previous committed remote checkpoint")
                continue
            try:
                for item in manifest.objects:
                    if item.name.endswith(".pt"):
                        load_checkpoint(folder / item.name)  # refused here, before anything is published
            except (CheckpointCorruptError, CheckpointUnsafeError) as exc:
                shutil.rmtree(folder, ignore_errors=True)
                warn_user(
                    f"ckpt.remote={self.url}: {name} is refused ({shown(exc)}); trying the previous committed one"
                )
                continue
            return Fetched(folder=folder, name=name, manifest=manifest)
        return None

    @_guarded("listing the committed checkpoints")
    def candidates(self, anchor: Anchor | None) -> list[tuple[str, Manifest]]:
        """The committed remote checkpoints a resume may take, newest (largest step) first.

        With a local ``anchor``, those whose lineage descends from it (:func:`~trainkit.bookkeeping.in_history`):
        never one of another history (an older run's on the prefix, a branch a rewind abandoned), however large its
        step; none when the anchor has no lineage (written before lineages existed). With nothing local (an empty
        ``out_dir``), the history of the most recently committed checkpoint (by its recorded time, then step): it
        and its ancestors; when that one has no lineage, the committed folders without one (as before lineages).

        :param anchor: What the resume has locally, or None.
        :returns: ``(folder name, manifest)`` pairs.
        """
        committed = [(name, m) for name, m in self.committed() if name not in self._refused]
        if anchor is not None:
            taken = [
                (name, m)
                for name, m in committed
                if m.lineage is not None
                and (m.step > anchor.step or (not anchor.checkpoint and m.step == anchor.step))
                and in_history(anchor.lineage, anchor.step, m.lineage, m.step)
            ]
            passed = [(name, m) for name, m in committed if m.step > anchor.step and (name, m) not in taken]
            if passed and (not taken or passed[0][1].step > taken[0][1].step):
                name, manifest = passed[0]
                say(
                    f"ckpt.remote={self.url}: {name} (step {manifest.step}) is not taken: it is not in the history of "
                    f"{anchor.what} (another run's, a branch a rewind or a fresh start left, or written before "
                    "trainkit recorded lineages)"
                )
            return taken
        if not committed:
            return []
        _, tip = max(committed, key=lambda item: (item[1].description["time"], item[1].step, item[0]))
        if tip.lineage is None:
            return [(name, m) for name, m in committed if m.lineage is None]
        return [
            (name, m)
            for name, m in committed
            if m.lineage is not None and in_history(m.lineage, m.step, tip.lineage, tip.step)
        ]

    def download(self, name: str, manifest: Manifest) -> Path:
        """Download a committed folder into ``out_dir/.remote-fetch-<token>/``, verified against its manifest
        (regular objects, sizes bounded and equal, CRC-32), and return that folder.

        :param name: The folder's name.
        :param manifest: Its manifest.
        :returns: The local folder holding the verified files.
        :raises CheckpointCorruptError: On a missing object, a size or CRC-32 that differs.
        :raises CheckpointUnsafeError: On an object that is not a regular file.
        """
        target = self._out_dir / f"{FETCH_PREFIX}{secrets.token_hex(8)}"
        target.mkdir()
        try:
            for item in manifest.objects:
                self._download_one(self._path(name, item.name), target / item.name, item, name)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        return target

    def _download_one(self, source: str, local: Path, item: RemoteObject, name: str) -> None:
        """Download one object into the new file ``local``, checked against ``item``: a regular object, its size
        (the store's, then the bytes read: at most one more than ``item.size``) and its CRC-32."""
        where = f"ckpt.remote={self.url}: {name}/{item.name}"
        try:
            src, size = store.open_object(self._fs, source, where)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where} is listed in its manifest and missing") from None
        except UnreadableFile as exc:
            raise CheckpointUnsafeError(f"{where} is not a regular object ({shown(exc.reason)})") from None
        with src:
            if size != item.size:
                raise CheckpointCorruptError(f"{where} is {size} bytes, its manifest says {item.size}")
            local.parent.mkdir(parents=True, exist_ok=True)
            total, crc = store.copy_object(src, local, item.size, where)
        if total > item.size:
            raise CheckpointCorruptError(f"{where} holds more than the {item.size} bytes of its manifest")
        if total != item.size or crc != item.crc32:
            raise CheckpointCorruptError(f"{where} does not match its manifest (size {total}, CRC-32 {crc:#010x})")

    def publish(self, fetched: Fetched) -> None:
        """Move a fetched checkpoint that passed every check into ``out_dir`` (``last`` last) and say so.

        :param fetched: What :meth:`fetch` returned.
        """
        tops = {item.name.split("/")[0] for item in fetched.manifest.objects}
        publish_fetched(fetched.folder, self._out_dir, sorted(tops, key=lambda top: top in (LAST, LAST_DIR)))
        say(f"took step {fetched.manifest.step} from ckpt.remote={self.url} ({fetched.name})")

    def refuse(self, fetched: Fetched, why: str) -> None:
        """Let a fetched checkpoint that a later check refused go: warned, its download deleted, and never offered
        again by :meth:`candidates` in this run.

        :param fetched: What :meth:`fetch` returned.
        :param why: The refusal, for the warning.
        """
        self.discard(fetched)
        self._refuse(fetched.name, why)

    @staticmethod
    def discard(fetched: Fetched) -> None:
        """Delete a fetched checkpoint's download folder; ``out_dir`` itself is left as it was.

        :param fetched: What :meth:`fetch` returned.
        """
        shutil.rmtree(fetched.folder, ignore_errors=True)

    # ------------------------------------------------------------------ the end

    def finish(self) -> None:
        """Wait up to ``ckpt.remote_wait_s`` for the last upload; say what is not on the remote when it gives up."""
        done = self.wait_idle(self._wait_s)
        with self._cond:
            waiting = [job.step for job in self._catching_up if isinstance(job, Upload)]
            pending = self._queued.step if self._queued is not None else waiting[-1] if waiting else self._newest_step
        newest = "none" if self._committed_step is None else f"step {self._committed_step}"
        if not done:
            warn_user(
                f"ckpt.remote={self.url}: gave up waiting after ckpt.remote_wait_s={self._wait_s:g}s; step {pending} "
                f"is not on the remote (the newest committed there by this run: {newest})"
            )
        elif self._lost_step is not None and (self._committed_step or -1) < self._lost_step:
            warn_user(
                f"ckpt.remote={self.url}: step {self._lost_step} is not on the remote (its upload failed; the newest "
                f"committed there by this run: {newest})"
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the uploader has nothing queued (catch-up uploads included), no commit record to write and no
        upload in flight.

        :param timeout_s: The most seconds to wait.
        :returns: Whether it is idle (False: the time ran out first).
        """
        with self._cond:
            return self._cond.wait_for(self._idle, timeout=max(0.0, timeout_s))

    def _idle(self) -> bool:
        return self._queued is None and self._commit is None and not self._catching_up and not self._busy

    def close(self) -> None:
        """Stop the uploader (an upload in flight is left uncommitted) and let the prefix go."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._held:
            self._held = False
            with contextlib.suppress(Exception):  # best effort: an unreleased lease expires on its own
                self._release()
        shutil.rmtree(self._staging, ignore_errors=True)  # this rank's only: another rank may still upload
        with contextlib.suppress(OSError):
            (self._out_dir / STAGING_DIR).rmdir()  # the last rank out removes the folder
