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
  (:func:`folder_identity`) of a rerun that holds that folder's lock (a requeue after a kill). A takeover or renewal
  replaces the lease only if it is still the object read (S3 ``If-Match`` on its ETag; a file system: rename
  aside, check, hard-link a new one, every step of it under an ``flock`` of :data:`LEASE_LOCK` so that no other
  run's create falls between the rename and a put-back; memory: a lock).
- **Sharded.** Every rank uploads its own files of a sharded save into one folder (named alike on every rank);
  rank 0 writes the commit record once every rank reported its upload done (:meth:`RemoteTier.report`, gathered
  by the next save's collective or at the run's end; :meth:`RemoteTier.commit_reports`).
- **Faults.** A failed upload is retried with backoff a few times, warned about once, and superseded by the next
  checkpoint; a failed deletion of retention is warned about once and tried again after the next commit (the
  commit stands); nothing here raises into the loop after the start.
- **Hostile objects.** Every object is read as hostile input (``RemoteTier._read_object``,
  ``_open_regular``): only a regular object is opened (on a local or mounted file system with ``O_NONBLOCK``
  and ``O_NOFOLLOW`` and checked with ``fstat``, so a FIFO or device never blocks), no more bytes are read than
  it may hold, and no open or read waits longer than :data:`READ_DEADLINE_S`. What a store's client raises
  reaches the user as one line, credentials masked and control characters escaped (:func:`store_errors`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import math
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import attrs

from trainkit import bookkeeping as core
from trainkit.checkpoint.remote.manifest import (
    LEASE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    UNREADABLE_LEASE,
    Lease,
    Manifest,
    RemoteObject,
    folder_id,
    folder_name,
    folder_step,
    lease_bytes,
    manifest_bytes,
    newest_first,
    parse_lease,
    parse_manifest,
    read_lease,
)
from trainkit.config import CkptConfig, redact_text
from trainkit.config.secrets import has_url_userinfo
from trainkit.errors import CheckpointCorruptError, CheckpointUnsafeError, OutDirError, TrainkitError, UsageError
from trainkit.files.bounded_read import UnreadableFile, file_kind, open_regular, read_regular
from trainkit.files.durable import atomic_write_bytes, fsync_directory
from trainkit.files.weights_only_load import load_checkpoint
from trainkit.messages import printable, say, warn_user

__all__ = [
    "RemoteTier",
    "Upload",
    "Anchor",
    "Fetched",
    "open_store",
    "remove_transfer_leftovers",
    "store_errors",
    "STAGING_DIR",
    "FETCH_PREFIX",
    "READ_DEADLINE_S",
    "FOLDER_ID_FILE",
    "folder_identity",
    "LEASE_LOCK",
    "LEASE_LOCK_S",
]

_T = TypeVar("_T")

FOLDER_ID_FILE = ".trainkit-folder-id"
"""The file in ``out_dir`` that holds the run folder's identity (:func:`folder_identity`), named in its leases."""
STAGING_DIR = ".remote-staging"
"""The folder under ``out_dir`` where handed-over files wait (hard links) for their upload, in a folder per rank."""
FETCH_PREFIX = ".remote-fetch-"
"""The prefix of the folder under ``out_dir`` where a remote checkpoint is downloaded and verified."""
CHUNK = 8 << 20
"""Bytes moved per read and write: the most of a checkpoint held in memory at once."""
LAST = "last.pt"
"""The object that makes a remote folder a file checkpoint to resume (published into ``out_dir`` last)."""
LAST_DIR = "last.ckpt"
"""The directory that makes a remote folder a sharded checkpoint to resume (its files under ``last.ckpt/``)."""
PUBLISHED_NAMES = frozenset({"best.pt", LAST, "best.ckpt", LAST_DIR, "metrics.jsonl"})
"""The only top-level names a remote checkpoint may hold: what the uploader writes, and all a fetch may publish."""
ATTEMPTS = 4
"""Tries per upload before it is given up (the next checkpoint supersedes it)."""
BACKOFF_S = 0.5
"""The first retry's delay; each next one doubles it."""
LEASE_LOCK = "lease.json.lock"
"""On a file system, the file at the prefix's root whose ``flock`` makes each change of the lease (a create, a
takeover, a renewal, a release) one step among runs: a takeover renames the lease aside and may have to put it back,
and no other run may create one meanwhile. The lock goes with its holder's process (a kill lets it go)."""
LEASE_LOCK_S = 30.0
"""The most seconds a run waits for :data:`LEASE_LOCK` (held for a few file operations at a time)."""
READ_DEADLINE_S = 120.0
"""The most seconds opening a store's object, or one read of it (a record, or one chunk of a download), may take;
past it the read is given up as a ``TimeoutError`` (its thread is left behind, a daemon)."""
USERINFO_REFUSAL = (
    "a remote URL must not hold credentials before the host (user:password@ or token@), so it is not repeated "
    "here: give them the store's own way (its environment variables, its config files, an instance role)"
)
"""Why a URL with userinfo is refused, in every command (the URL is not shown: it holds the secret)."""


def shown(text: object) -> str:
    """Text that came from a store (or its client's error) made safe to show: credentials masked, one line,
    control characters escaped (:func:`~trainkit.messages.printable`).

    :param text: The text.
    :returns: The text to put in a message.
    """
    return printable(redact_text(" ".join(str(text).split())), limit=1000)


def _failure(exc: BaseException) -> str:
    return shown(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def store_errors(url: str, doing: str) -> Iterator[None]:
    """Turn what a store's client raises into one :class:`~trainkit.errors.OutDirError` line: the URL and the
    exception's message with credentials masked and control characters escaped, and no traceback of the client's
    (``from None``). trainkit's own errors pass unchanged.

    :param url: The URL the store was opened at.
    :param doing: What was being done, e.g. ``"listing the checkpoints"``.
    :raises OutDirError: For any other exception.
    """
    try:
        yield
    except TrainkitError:
        raise
    except Exception as exc:
        raise OutDirError(f"ckpt.remote={shown(url)}: {doing} failed ({_failure(exc)})") from None


def _guarded(doing: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """A :class:`RemoteTier` method whose store failures are one line (:func:`store_errors`)."""

    def wrap(method: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(method)
        def guarded(self: RemoteTier, *args: Any, **kwargs: Any) -> _T:
            with store_errors(self.url, doing):
                return method(self, *args, **kwargs)

        return guarded

    return wrap


def _within_deadline(call: Callable[[], _T], what: str) -> _T:
    """``call()`` in a daemon thread, waited for at most :data:`READ_DEADLINE_S`.

    :raises TimeoutError: When it takes longer (the thread is left to finish or hang on its own).
    """
    done = threading.Event()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=target, name="trainkit-remote-read", daemon=True).start()
    if not done.wait(READ_DEADLINE_S):
        raise TimeoutError(f"{what} took more than {READ_DEADLINE_S:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _open_regular(fs: Any, path: str) -> tuple[BinaryIO, int | None]:
    """Open a store's object for reading only if it is a regular object, and say its size.

    On a local (or mounted) file system the object is opened with ``O_NONBLOCK | O_NOFOLLOW`` and the descriptor
    ``fstat``-ed (:func:`~trainkit.files.bounded_read.open_regular`): a FIFO, a device, a directory or a link is
    refused without blocking, and nothing can be swapped in between the check and the open. An object store holds
    only objects and prefixes: its ``info`` must say ``file``, not a link.

    :raises FileNotFoundError: When it is missing.
    :raises UnreadableFile: When it is not a regular object (the reason names what it is).
    """
    if _is_local(fs):
        local = fs._strip_protocol(path)
        try:
            fd, info = open_regular(local)
        except UnreadableFile as exc:
            if exc.reason == "missing":
                raise FileNotFoundError(local) from None
            raise
        return os.fdopen(fd, "rb"), info.st_size
    info = fs.info(path)
    if info.get("type") != "file" or info.get("islink"):
        raise UnreadableFile(path, f"a {info.get('type')} object, not a regular one")
    return fs.open(path, "rb"), info.get("size")


def folder_identity(out_dir: Path) -> str | None:
    """The run folder's identity, named in the leases its runs take: read from :data:`FOLDER_ID_FILE` (a regular
    file of 32 lowercase hex digits; anything else is replaced), or drawn and written there first. Call it holding
    the folder's lock (rank 0, :class:`~trainkit.run.lock.RunLock`): a lease naming it is then one that a run of
    this folder left, and none runs here any more.

    Side effects: creates or replaces ``out_dir/.trainkit-folder-id``.

    :param out_dir: The run folder (it exists).
    :returns: The identity, or None (warned) when it cannot be written: this run's lease is then never taken over
        early.
    """
    path = out_dir / FOLDER_ID_FILE
    try:
        known = folder_id(read_regular(path, 64).decode("ascii").strip())
    except (OSError, UnicodeDecodeError):  # missing, a link, a folder, too large: replaced (atomically, not through)
        known = None
    if known is not None:
        return known
    fresh = secrets.token_hex(16)
    try:
        atomic_write_bytes(fresh.encode() + b"\n", path)
    except (OSError, TrainkitError) as exc:
        warn_user(f"{path} cannot be written ({exc}); a rerun of this run waits for its lease to expire")
        return None
    return fresh


def remove_transfer_leftovers(out_dir: Path) -> list[Path]:
    """Remove what killed runs left in ``out_dir``: staged files (``.remote-staging/``, hard links of dead
    checkpoints) and downloads (``.remote-fetch-*``). Links are removed, never followed.

    Call it only while holding ``out_dir``'s lock, before any rank stages (rank 0, when the run claims the folder):
    a live run's files are never touched.

    :param out_dir: The run folder.
    :returns: What was removed.
    """
    removed = []
    for path in [out_dir / STAGING_DIR, *out_dir.glob(f"{FETCH_PREFIX}*")]:
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def open_store(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem and root path of ``url``, with fsspec's own configuration (its config files and
    ``FSSPEC_<PROTOCOL>_<OPTION>`` variables, read now) under ``options``.

    :param url: The ``ckpt.remote`` URL.
    :param options: ``ckpt.remote_options``.
    :returns: ``(filesystem, root)``.
    :raises UsageError: When fsspec or the store's filesystem package is missing (one line naming it), the URL
        holds credentials (not repeated), or the store's client refuses the URL or an option (one line).
    """
    if has_url_userinfo(url):
        raise UsageError(USERINFO_REFUSAL)
    where = f"ckpt.remote={shown(url)}"
    try:
        import fsspec
        import fsspec.config
    except ImportError:
        raise UsageError(f"{where} needs fsspec: pip install 'trainkit[remote]'") from None
    from_env: dict[str, dict[str, Any]] = {}
    fsspec.config.set_conf_env(from_env)  # a variable set after fsspec was imported counts too
    protocol = fsspec.utils.get_protocol(url)
    merged = {**fsspec.config.conf.get(protocol, {}), **from_env.get(protocol, {}), **(options or {})}
    try:
        fs, root = fsspec.core.url_to_fs(url, **merged)
    except ImportError as exc:  # fsspec's message names the package to install
        raise UsageError(f"{where}: {shown(str(exc).strip().splitlines()[0])}") from None
    except Exception as exc:  # a bad option, an unknown protocol: the store's client, in one line
        raise UsageError(f"{where}: {_failure(exc)}") from None
    return fs, root.rstrip("/")


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
    description: core.Checkpoint
    policy: Any
    minimize: bool | None = None
    folder: str | None = None
    commits: bool = True
    lineage: core.Lineage | None = None
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

    lineage: core.Lineage
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
    history: tuple[core.Lineage, int] | None = None


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


def _crc32(path: Path, size: int) -> int:
    """The CRC-32 of a file's first ``size`` bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(min(CHUNK, size)):
            crc = zlib.crc32(chunk, crc)
            size -= len(chunk)
    return crc


def _copy_prefix(source: Path, target: Path, size: int) -> None:
    """Copy the first ``size`` bytes of ``source`` (fewer if it is shorter) to the new file ``target``, in chunks."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        remaining = size
        while remaining and (chunk := src.read(min(CHUNK, remaining))):
            dst.write(chunk)
            remaining -= len(chunk)


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
        fs, root = open_store(ckpt.remote, dict(ckpt.remote_options))
        options = {"lease_s": ckpt.remote_lease_s, "wait_s": ckpt.remote_wait_s, "rank": rank}
        return cls(ckpt.remote, fs, root, out_dir=out_dir, **options)

    # ------------------------------------------------------------------ the lease

    def _path(self, *parts: str) -> str:
        return "/".join((self._root, *parts))

    def lease(self) -> Lease | None:
        """The lease on the prefix now, or None."""
        return self._read_lease()

    def _read_lease(self) -> Lease | None:
        try:
            return read_lease(self._read_object(self._path(LEASE), MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            return None
        except (UnreadableFile, CheckpointUnsafeError) as exc:  # no run wrote it: it must not lock the prefix
            warn_user(f"ckpt.remote={self.url}: {LEASE} is unreadable ({shown(exc)}); it counts as expired")
            return UNREADABLE_LEASE

    def _read_object(self, path: str, limit: int) -> bytes:
        """A small object's bytes (a commit record, the lease): regular, at most ``limit`` bytes, within
        :data:`READ_DEADLINE_S`.

        :raises FileNotFoundError: When it is missing.
        :raises UnreadableFile: When it is not a regular object, or larger than ``limit``.
        :raises TimeoutError: When the store takes longer.
        """

        def read() -> bytes:
            handle, size = _open_regular(self._fs, path)
            with handle:
                if size is not None and size > limit:
                    raise UnreadableFile(path, f"{size} bytes, more than the {limit} it may hold")
                data = handle.read(limit + 1)
            if len(data) > limit:
                raise UnreadableFile(path, f"more than the {limit} bytes it may hold")
            return data

        return _within_deadline(read, f"reading {path}")

    def _store(self) -> str:
        """Which lease mechanism the store has: ``"s3"`` (conditional puts), ``"local"`` (a file system: renames and
        hard links), ``"memory"`` (one process: a lock) or ``"other"`` (no conditional write known)."""
        from fsspec.implementations.local import LocalFileSystem
        from fsspec.implementations.memory import MemoryFileSystem

        protocols = self._fs.protocol if isinstance(self._fs.protocol, tuple | list) else (self._fs.protocol,)
        if "s3" in protocols:
            return "s3"
        if isinstance(self._fs, LocalFileSystem):
            return "local"
        return "memory" if isinstance(self._fs, MemoryFileSystem) else "other"

    @contextlib.contextmanager
    def _lease_locked(self) -> Iterator[None]:
        """On a file system, hold :data:`LEASE_LOCK`'s ``flock`` (re-entrant in this process); elsewhere nothing.

        :raises TimeoutError: When another process holds it for more than :data:`LEASE_LOCK_S`.
        :raises UnreadableFile: When something other than a regular file is at :data:`LEASE_LOCK`.
        """
        with self._lease_guard:
            if self._store() != "local" or self._lease_depth:
                self._lease_depth += 1
                try:
                    yield
                finally:
                    self._lease_depth -= 1
                return
            path = self._fs._strip_protocol(self._path(LEASE_LOCK))
            flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(path, flags, 0o644)
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    raise UnreadableFile(path, f"{file_kind(mode)}, not a regular file")
                deadline = time.monotonic() + LEASE_LOCK_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"{LEASE_LOCK} was held by another process for {LEASE_LOCK_S:g} s"
                            ) from None
                        time.sleep(0.01)
                self._lease_depth += 1
                try:
                    yield
                finally:
                    self._lease_depth -= 1
            finally:
                os.close(fd)  # lets the flock go

    def _new_lease(self) -> bytes:
        return lease_bytes(Lease(holder=self._holder, expires=time.time() + self._lease_s, folder=self._folder))

    def _create_lease(self) -> bool:
        """Create the lease if there is none, in one step of the store (see :meth:`_store`): True when created."""
        path, data, store = self._path(LEASE), self._new_lease(), self._store()
        if store == "local":
            with self._lease_locked():  # never inside another run's takeover (between its rename and put-back)
                created = _link_new(path, data)
        elif store == "memory":
            with _MEMORY_LEASES:
                created = not self._fs.exists(path)
                if created:
                    self._fs.pipe_file(path, data)
        else:
            try:
                self._fs.pipe_file(path, data, mode="create")
                created = True
            except FileExistsError:
                created = False
            except (TypeError, NotImplementedError):  # no conditional create: check, write, read back (a race remains)
                if self._read_lease() is not None:
                    return False
                self._fs.pipe_file(path, data)
                held = self._read_lease()
                created = held is not None and held.holder == self._holder
        if created:
            self._renewed = time.monotonic()
        return created

    def _lease_version(self) -> tuple[Lease | None, Any]:
        """The lease now and a token of the very object read (S3: its ETag; a file system: its inode), taken before
        the read: the token is never newer than the lease, so a write conditional on it fails on any change."""
        path = self._path(LEASE)
        self._fs.invalidate_cache(path)
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            return None, None
        return self._read_lease(), info.get("ETag") if "ETag" in info else info.get("ino")

    def _replace_lease(self, seen: Lease, version: Any) -> bool:
        """Write this run's lease over the one read (``seen``, of ``version``) only if it is still that object: a
        takeover of an expired lease, or a renewal of this run's own. True when written.

        S3: a put with ``If-Match`` on the ETag. A file system: the old lease renamed aside (of two runs, one
        renames it), checked to be the one read (else put back), then this run's created (:func:`_link_new`).
        memory://: check and write under one process lock. Other stores: a check right before the write only.
        """
        path, store = self._path(LEASE), self._store()
        if store == "s3":
            if not isinstance(version, str):  # no ETag to condition on: never an unconditional overwrite
                return False
            try:
                self._fs.pipe_file(path, self._new_lease(), IfMatch=version)
            except FileNotFoundError:  # deleted meanwhile: the caller creates one, or is refused
                return False
            except OSError as exc:
                if _precondition_failed(exc):
                    return False
                raise
        elif store == "local":
            with self._lease_locked():  # the rename aside, the check, the put-back and the create: one step
                return _remove_if_read(path, seen, version) and self._create_lease()
        elif store == "memory":
            with _MEMORY_LEASES:
                if self._read_lease() != seen:
                    return False
                self._fs.pipe_file(path, self._new_lease())
        else:
            if self._read_lease() != seen:  # no conditional write: the window is this check to the write
                return False
            self._fs.pipe_file(path, self._new_lease())
        self._renewed = time.monotonic()
        return True

    def _release(self) -> None:
        """Delete this run's lease, conditionally on it being the object read (as :meth:`_replace_lease`): a
        successor's lease, taken over meanwhile, is never deleted."""
        with self._lease_locked():
            self._release_locked()

    def _release_locked(self) -> None:
        held, version = self._lease_version()
        if held is None or held.holder != self._holder:
            return
        path, store = self._path(LEASE), self._store()
        if store == "s3" and isinstance(version, str):  # s3fs's rm_file takes no condition: the client's call does
            bucket, key, _ = self._fs.split_path(path)
            self._fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
            self._fs.invalidate_cache(path)
        elif store == "local":
            with self._lease_locked():
                _remove_if_read(path, held, version)
        elif store == "memory":
            with _MEMORY_LEASES:
                if self._read_lease() == held:
                    self._fs.rm_file(path)
        else:
            self._fs.rm_file(path)

    @_guarded("taking the lease")
    def acquire(self, *, uploads: bool = True, folder: str | None = None) -> None:
        """Take the prefix for this run, delete uncommitted leftovers and start the uploader (unless ``uploads`` is
        False: ``retain`` holds the lease only to delete, and deletes the leftovers itself). An expired lease is
        taken over, and so is, at once, one that names ``folder`` (left by a killed run of this run folder): each
        conditionally on the very object read.

        :param folder: The run folder's identity (:func:`folder_identity`, read holding the folder's lock), named in
            this run's lease; None: no run folder (``retain``), and no lease is taken over before it expires.
        :raises OutDirError: When another run holds it (or took the expired lease first), naming the prefix, the
            holder and when it expires; or the store fails (one line, :func:`store_errors`).
        """
        if self._rank != 0:  # rank 0 holds the prefix for the run
            self._start(uploads)
            return
        self._folder = folder
        self._fs.makedirs(self._root, exist_ok=True)
        with self._lease_locked():  # a file system: no other run's takeover moves the lease while it is read here
            for _ in range(3):
                if self._create_lease():
                    break
                held, version = self._lease_version()
                if held is not None and not held.expired(time.time()) and held.held_for(folder):
                    if self._replace_lease(held, version):  # this folder's killed run left it: no wait
                        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(held.expires))
                        say(
                            f"ckpt.remote={self.url}: took over the lease that a killed run of {self._out_dir} left "
                            f"({shown(held.holder)}, held until {until})"
                        )
                        break
                    continue  # changed since it was read: read it again
                if held is not None and not held.expired(time.time()):
                    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(held.expires))
                    raise OutDirError(
                        f"ckpt.remote={self.url} is held by another run ({shown(held.holder)}) until {until} unless "
                        "it renews its lease; one run writes under a prefix: wait for it to end, or use another prefix"
                    )
                if held is not None and self._replace_lease(held, version):  # expired: its run is gone
                    break
            else:
                raise OutDirError(f"ckpt.remote={self.url}: another run took the expired lease first; try again")
        self._held = True
        if uploads:  # ``retain`` deletes them among the rest, and says what it could not
            try:
                self._remove_uncommitted()
            except OutDirError as exc:  # the next commit's retention deletes them
                self._warn_retention(str(exc))
        self._start(uploads)

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

    def _stage(self, files: list[tuple[Path, str, int | None]], make_upload: Callable[..., Upload]) -> Upload | None:
        """Stage files for an upload (see :meth:`hand_over`): the upload, or None (warned) when they could not be."""
        staged = self._staging / secrets.token_hex(8)
        listed = []
        try:
            for path, name, size in files:
                target = staged / name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    if size is not None:  # metrics.jsonl grows while the upload runs: its prefix, frozen on disk
                        _copy_prefix(path, target, size)
                    else:
                        os.link(path, target)
                except FileNotFoundError:
                    continue
                except OSError:  # a file system without hard links: a copy on disk, still not in memory
                    shutil.copyfile(path, target)
                listed.append((name, os.stat(target).st_size))
        except OSError as exc:
            shutil.rmtree(staged, ignore_errors=True)
            self._warn(f"could not stage checkpoint files for upload ({exc})")
            return None
        return make_upload(staged=staged, files=tuple(listed))

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
        folder = self._path(own)
        for sub in sorted({name.rpartition("/")[0] for name, _ in job.files}):  # a file system needs its folders
            self._fs.makedirs(f"{folder}/{sub}" if sub else folder, exist_ok=True)
        crcs: dict[str, int] = {}
        names = [name for name, _ in job.files]  # staged: none of them changes any more
        # the CRC-32 pass reads the files beside the upload (zlib lets go of the GIL): it costs no upload time

        def summed() -> None:
            with contextlib.suppress(OSError):  # a file it could not read has no CRC: the upload fails below
                crcs.update((name, _crc32(job.staged / name, size)) for name, size in job.files)

        summing = threading.Thread(target=summed, daemon=True)
        summing.start()
        try:  # the store's own put, streamed from the files: its part sizes, its concurrency
            self._fs.put([str(job.staged / name) for name in names], [f"{folder}/{name}" for name in names])
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
            kind="last",
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
        self._fs.pipe_file(self._path(own, MANIFEST), manifest_bytes(manifest))  # the commit: written last

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

    def _folders(self) -> list[str]:
        self._fs.invalidate_cache(self._root)
        try:  # a hung mount or connection must not hang the run: the listing is bounded in time as a read is
            entries = _within_deadline(functools.partial(self._fs.ls, self._root, detail=False), f"listing {self.url}")
        except FileNotFoundError:
            return []
        return [
            name for name in (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries) if folder_step(name) is not None
        ]

    def committed(self) -> list[tuple[str, Manifest]]:
        """The committed checkpoint folders, newest first; a folder whose manifest is unsafe is warned about and
        left out.

        :returns: ``(folder name, manifest)`` pairs.
        """
        return self._scan()[0]

    def uncommitted(self) -> list[str]:
        """The checkpoint folders without a commit record (uploads cut short): never read, deleted by the writer."""
        return self._scan()[1]

    def _linked(self, name: str) -> bool:
        """Whether the folder ``name`` is a symbolic link on a local (or mounted) file system: no run writes one, and
        reading or deleting through it would reach another prefix's files (its commit record deleted by retention)."""
        return _is_local(self._fs) and os.path.islink(self._fs._strip_protocol(self._path(name)))

    def _scan(self) -> tuple[list[tuple[str, Manifest]], list[str]]:
        found, uncommitted = [], []
        for name in self._folders():
            if self._linked(name):  # neither committed nor uncommitted: never read, never deleted
                self._refuse(name, "a symbolic link, which trainkit does not follow: no run writes one")
                continue
            manifest = self._manifests.get(name)  # a commit record is written once: read once
            if manifest is None:
                try:
                    record = self._read_object(self._path(name, MANIFEST), MAX_MANIFEST_BYTES)
                    if not record and _is_local(self._fs):  # a file system shows a record being written as empty
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

    def _remove_uncommitted(self) -> None:
        self.delete(self.uncommitted())

    def plan(
        self,
        policy: Any,
        *,
        newest: int | None = None,
        prefer: str | tuple[str, ...] | None = None,
        history: tuple[core.Lineage, int] | None = None,
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
                if manifest.lineage is not None and core.in_history(manifest.lineage, manifest.step, *history)
            ]
        preferred = {prefer} if isinstance(prefer, str) else set(prefer or ())
        for name, manifest in sorted(committed, key=lambda item: item[0] not in preferred):
            if manifest.step in by_step:  # the same step uploaded twice (a resumed run): one copy is enough
                doomed.append(name)
                continue
            by_step[manifest.step] = name
            d = manifest.description
            described.append(
                core.Checkpoint(
                    step=manifest.step,
                    epoch=manifest.epoch,
                    epoch_end=d["epoch_end"],
                    time=d["time"],
                    scores=d["scores"],
                )
            )
        reasons = core.keep_reasons(policy, described, newest=newest)
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
            try:
                with contextlib.suppress(FileNotFoundError):  # the commit record first: no reader takes half a folder
                    self._fs.rm_file(self._path(name, MANIFEST))
                with contextlib.suppress(FileNotFoundError):  # gone already: the goal
                    self._fs.rm(self._path(name), recursive=True)
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
        self, policy: Any, *, newest: int, prefer: tuple[str, ...], history: tuple[core.Lineage, int] | None = None
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

    # ------------------------------------------------------------------ resuming

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
        where = f"ckpt.remote={self.url}: {name}/{item.name}"
        try:
            src, size = _within_deadline(lambda: _open_regular(self._fs, source), f"opening {where}")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where} is listed in its manifest and missing") from None
        except UnreadableFile as exc:
            raise CheckpointUnsafeError(f"{where} is not a regular object ({shown(exc.reason)})") from None
        with src:
            if size != item.size:
                raise CheckpointCorruptError(f"{where} is {size} bytes, its manifest says {item.size}")
            local.parent.mkdir(parents=True, exist_ok=True)
            self._copy_verified(src, local, item, where)

    def _copy_verified(self, src: BinaryIO, local: Path, item: RemoteObject, where: str) -> None:
        """Copy an opened object into the new file ``local``, each read within :data:`READ_DEADLINE_S`, checking
        its size and CRC-32 against ``item``."""
        crc, total = 0, 0
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as dst:
            while chunk := _within_deadline(functools.partial(src.read, min(CHUNK, item.size + 1 - total)), where):
                total += len(chunk)
                if total > item.size:
                    raise CheckpointCorruptError(f"{where} holds more than the {item.size} bytes of its manifest")
                crc = zlib.crc32(chunk, crc)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        if total != item.size or crc != item.crc32:
            raise CheckpointCorruptError(f"{where} does not match its manifest (size {total}, CRC-32 {crc:#010x})")

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
                and core.in_history(anchor.lineage, anchor.step, m.lineage, m.step)
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
            if m.lineage is not None and core.in_history(m.lineage, m.step, tip.lineage, tip.step)
        ]

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

    def publish(self, fetched: Fetched) -> None:
        """Move a fetched checkpoint that passed every check into ``out_dir`` (``last`` last) and say so.

        :param fetched: What :meth:`fetch` returned.
        """
        tops = {item.name.split("/")[0] for item in fetched.manifest.objects}
        publish_fetched(fetched.folder, self._out_dir, sorted(tops, key=lambda top: top in (LAST, LAST_DIR)))
        say(f"took step {fetched.manifest.step} from ckpt.remote={self.url} ({fetched.name})")

    # ------------------------------------------------------------------ the end

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


_MEMORY_LEASES = threading.Lock()
"""memory:// lives in one process: this lock makes a lease's check and write on it one step."""


def _precondition_failed(exc: BaseException) -> bool:
    """Whether a store's error says that a conditional write's condition did not hold (S3: 412, or 409 for a
    conditional write that raced another)."""
    response = getattr(exc.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def _link_new(path: str, data: bytes) -> bool:
    """Create the file ``path`` holding ``data`` unless one exists, in one step: the bytes go into a private temp
    file, then a hard link gives them the name (a link never replaces a file, and no reader sees a torn lease).

    :returns: Whether it was created.
    """
    temp = f"{path}.{secrets.token_hex(8)}.new"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: an exclusive create (a reader may see it half written)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _remove_if_read(path: str, seen: Lease, inode: Any) -> bool:
    """Remove the lease file ``path`` if it is still the one read (``seen``, of inode ``inode``), in one step of the
    file system: it is renamed aside (of two runs taking one lease over, one renames it), then checked; one that
    changed meanwhile (renewed, or another run's) is put back.

    :returns: Whether it was removed (the caller may then create its own, exclusively).
    """
    aside = f"{path}.{secrets.token_hex(8)}.old"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    info = os.lstat(aside)
    if not stat.S_ISREG(info.st_mode):  # no lease a run wrote (unreadable, so expired): left aside, never followed
        return True
    fd = os.open(aside, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        moved = parse_lease(handle.read(MAX_MANIFEST_BYTES))
    if info.st_ino != inode or moved != seen:
        with contextlib.suppress(FileExistsError):  # back where it was, unless a new one is there already
            os.link(aside, path)
    os.unlink(aside)
    return info.st_ino == inode and moved == seen


_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def published_files(
    checkpoints: list[Path], metrics: Path, metrics_size: int | None, *, rank: int
) -> list[tuple[Path, str, int | None]]:
    """What this rank uploads of a just-published save: a file checkpoint whole (rank 0), or this rank's own files
    of a sharded directory (``__<rank>_<n>.distcp``; rank 0 also the rest: ``.metadata``, ``trainkit.pt``, the
    manifest); ``metrics.jsonl`` up to ``metrics_size`` bytes (rank 0). ``last`` comes last.

    :param checkpoints: ``best`` then ``last`` (files, or directories).
    :param metrics: ``metrics.jsonl``.
    :param metrics_size: Its size the checkpoint records (None: not uploaded).
    :param rank: This rank.
    :returns: ``(path, remote name, size or None for the whole file)`` triples.
    """
    files: list[tuple[Path, str, int | None]] = []
    if metrics_size:
        files.append((metrics, metrics.name, metrics_size))
    for path in checkpoints:
        if path.is_dir() and not path.is_symlink():
            for entry in sorted(path.iterdir()):
                shard = _SHARD.fullmatch(entry.name)
                if (int(shard[1]) == rank if shard else rank == 0) and entry.is_file() and not entry.is_symlink():
                    files.append((entry, f"{path.name}/{entry.name}", None))
        elif rank == 0:
            files.append((path, path.name, None))
    return files


def publish_fetched(folder: Path, out_dir: Path, names: list[str]) -> None:
    """Move verified files and directories into ``out_dir`` (each an atomic rename; ``last.pt`` or ``last.ckpt/``,
    which makes it a checkpoint, last). A directory in the way (an older local ``last.ckpt/``) is moved aside first
    and deleted.

    :param folder: The download folder (under ``out_dir``).
    :param out_dir: The run folder.
    :param names: The top-level names, in the order to publish them.
    """
    for name in names:
        target = out_dir / name
        if target.is_dir() and not target.is_symlink():
            aside = out_dir / f"{FETCH_PREFIX}old-{secrets.token_hex(8)}"
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder / name, target)
    fsync_directory(out_dir)
    shutil.rmtree(folder, ignore_errors=True)
