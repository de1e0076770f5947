"""The object-store verbs of the remote tier, as plain functions on an fsspec filesystem: open a store, list a prefix,
read an object bounded in size and time, put, delete, download an object with its CRC-32, and the lease's
conditional create, replace and delete for each kind of store (S3, a file system, ``memory://``).

Side effects: every function but :func:`shown`, :func:`store_kind` and :func:`is_local` calls the store; the
lease's functions on a file system also create, rename and link files beside the lease, under an ``flock``.

Every object is read as hostile input: only a regular object is opened (on a local or mounted file system with
``O_NONBLOCK`` and ``O_NOFOLLOW`` and checked with ``fstat``, so a FIFO or device never blocks), no more bytes are read
than it may hold, and no open, read or listing waits longer than :data:`READ_DEADLINE_S`. What a store's client raises
reaches the user as one line, credentials masked and control characters escaped (:func:`store_errors`).

The policy that decides when to call these (the lease's renewal, uploads, retention, which checkpoint to take) is
:mod:`trainkit.checkpoint.remote.tier`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from trainkit.checkpoint.remote.manifest import (
    MAX_MANIFEST_BYTES,
    UNREADABLE_LEASE,
    Lease,
    lease_bytes,
    parse_lease,
    read_lease,
)
from trainkit.config import redact_text
from trainkit.config.secrets import has_url_userinfo
from trainkit.errors import CheckpointUnsafeError, OutDirError, TrainkitError, UsageError
from trainkit.files.bounded_read import UnreadableFile, file_kind, open_regular
from trainkit.files.checksum import copy_with_checksum
from trainkit.files.durable import link_or_copy
from trainkit.messages import printable, warn_user

__all__ = [
    "READ_DEADLINE_S",
    "LEASE_LOCK",
    "LEASE_LOCK_S",
    "USERINFO_REFUSAL",
    "shown",
    "store_errors",
    "open_store",
    "store_kind",
    "is_local",
    "is_link",
    "list_names",
    "read_object",
    "open_object",
    "copy_object",
    "make_folder",
    "put_files",
    "write_object",
    "delete_folder",
    "read_lease_object",
    "lease_version",
    "lease_lock",
    "create_lease",
    "replace_lease",
    "release_lease",
]

_T = TypeVar("_T")

READ_DEADLINE_S = 120.0
"""The most seconds opening a store's object, or one read of it (a record, or one chunk of a download), may take;
past it the read is given up as a ``TimeoutError`` (its thread is left behind, a daemon)."""
LEASE_LOCK = "lease.json.lock"
"""On a file system, the file at the prefix's root whose ``flock`` makes each change of the lease (a create, a
takeover, a renewal, a release) one step among runs: a takeover renames the lease aside and may have to put it back,
and no other run may create one meanwhile. The lock goes with its holder's process (a kill lets it go)."""
LEASE_LOCK_S = 30.0
"""The most seconds a run waits for :data:`LEASE_LOCK` (held for a few file operations at a time)."""
USERINFO_REFUSAL = (
    "a remote URL must not hold credentials before the host (user:password@ or token@), so it is not repeated "
    "here: give them the store's own way (its environment variables, its config files, an instance role)"
)
"""Why a URL with userinfo is refused, in every command (the URL is not shown: it holds the secret)."""

_MEMORY_LEASES = threading.Lock()
"""memory:// lives in one process: this lock makes a lease's check and write on it one step."""

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


# ---------------------------------------------------------------------- messages


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


# ---------------------------------------------------------------------- the store


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


def store_kind(fs: Any) -> str:
    """Which lease mechanism a store has.

    :param fs: The store's fsspec filesystem.
    :returns: ``"s3"`` (conditional puts), ``"local"`` (a file system: renames and hard links), ``"memory"`` (one
        process: a lock) or ``"other"`` (no conditional write known).
    """
    from fsspec.implementations.memory import MemoryFileSystem

    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "s3" in protocols:
        return "s3"
    if is_local(fs):
        return "local"
    return "memory" if isinstance(fs, MemoryFileSystem) else "other"


def is_local(fs: Any) -> bool:
    """Whether a store is a local (or mounted) file system.

    :param fs: The store's fsspec filesystem.
    :returns: True for fsspec's local filesystem.
    """
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def is_link(fs: Any, path: str) -> bool:
    """Whether ``path`` is a symbolic link on a local (or mounted) file system: no run writes one, and reading or
    deleting through it would reach another prefix's files.

    :param fs: The store's fsspec filesystem.
    :param path: The path on it.
    :returns: True for a symbolic link (never on an object store).
    """
    return is_local(fs) and os.path.islink(fs._strip_protocol(path))


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


# ---------------------------------------------------------------------- reading


def list_names(fs: Any, root: str, what: str) -> list[str]:
    """The names directly under ``root`` (none when it is missing), listed within :data:`READ_DEADLINE_S`: a hung
    mount or connection must not hang the run.

    :param fs: The store's fsspec filesystem.
    :param root: The prefix.
    :param what: How a timeout names the prefix.
    :returns: The last part of each entry's path.
    :raises TimeoutError: When the store takes longer.
    """
    fs.invalidate_cache(root)
    try:
        entries = _within_deadline(functools.partial(fs.ls, root, detail=False), f"listing {what}")
    except FileNotFoundError:
        return []
    return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]


def _open_regular(fs: Any, path: str) -> tuple[BinaryIO, int | None]:
    """Open a store's object for reading only if it is a regular object, and say its size.

    On a local (or mounted) file system the object is opened with ``O_NONBLOCK | O_NOFOLLOW`` and the descriptor
    ``fstat``-ed (:func:`~trainkit.files.bounded_read.open_regular`): a FIFO, a device, a directory or a link is
    refused without blocking, and nothing can be swapped in between the check and the open. An object store holds
    only objects and prefixes: its ``info`` must say ``file``, not a link.

    :raises FileNotFoundError: When it is missing.
    :raises UnreadableFile: When it is not a regular object (the reason names what it is).
    """
    if is_local(fs):
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


def read_object(fs: Any, path: str, limit: int) -> bytes:
    """A small object's bytes (a commit record, the lease): regular, at most ``limit`` bytes, within
    :data:`READ_DEADLINE_S`.

    :param fs: The store's fsspec filesystem.
    :param path: The object.
    :param limit: The most bytes it may hold.
    :returns: Its bytes.
    :raises FileNotFoundError: When it is missing.
    :raises UnreadableFile: When it is not a regular object, or larger than ``limit``.
    :raises TimeoutError: When the store takes longer.
    """

    def read() -> bytes:
        handle, size = _open_regular(fs, path)
        with handle:
            if size is not None and size > limit:
                raise UnreadableFile(path, f"{size} bytes, more than the {limit} it may hold")
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise UnreadableFile(path, f"more than the {limit} bytes it may hold")
        return data

    return _within_deadline(read, f"reading {path}")


def open_object(fs: Any, path: str, what: str) -> tuple[BinaryIO, int | None]:
    """Open a regular object for a download, within :data:`READ_DEADLINE_S`.

    :param fs: The store's fsspec filesystem.
    :param path: The object.
    :param what: How a timeout names it.
    :returns: ``(handle, size)`` (the size the store says, or None).
    :raises FileNotFoundError: When it is missing.
    :raises UnreadableFile: When it is not a regular object.
    :raises TimeoutError: When the store takes longer.
    """
    return _within_deadline(lambda: _open_regular(fs, path), f"opening {what}")


def copy_object(source: BinaryIO, local: Path, limit: int, what: str) -> tuple[int, int]:
    """Copy an opened object into the new file ``local`` (never through a link, never over a file), each read within
    :data:`READ_DEADLINE_S`, at most one byte past ``limit``; synced before it returns.

    :param source: What :func:`open_object` opened.
    :param local: The new file.
    :param limit: The bytes expected (:func:`~trainkit.files.checksum.copy_with_checksum`).
    :param what: How a timeout names the object.
    :returns: ``(bytes copied, CRC-32)``: more than ``limit`` bytes means the object is longer than expected.
    :raises TimeoutError: When a read takes longer.
    :raises OSError: When ``local`` exists or cannot be written.
    """

    def read(size: int) -> bytes:
        return _within_deadline(functools.partial(source.read, size), what)

    with os.fdopen(os.open(local, _NEW_FILE, 0o644), "wb") as target:
        copied = copy_with_checksum(read, target, limit)
        target.flush()
        os.fsync(target.fileno())
    return copied


# ---------------------------------------------------------------------- writing


def make_folder(fs: Any, path: str) -> None:
    """Create a folder of the store (and its parents) unless it exists; an object store needs none and ignores it.

    :param fs: The store's fsspec filesystem.
    :param path: The folder's path.
    """
    fs.makedirs(path, exist_ok=True)


def put_files(fs: Any, folder: str, files: list[tuple[Path, str]]) -> None:
    """Upload files into a folder of the store with the store's own put (its part sizes, its concurrency), creating
    the folders a file system needs first.

    :param fs: The store's fsspec filesystem.
    :param folder: The folder's path on the store.
    :param files: ``(local file, name in the folder)`` pairs; a name may hold ``/``.
    """
    for sub in sorted({name.rpartition("/")[0] for _, name in files}):
        make_folder(fs, f"{folder}/{sub}" if sub else folder)
    fs.put([str(path) for path, _ in files], [f"{folder}/{name}" for _, name in files])


def write_object(fs: Any, path: str, data: bytes) -> None:
    """Write a small object whole (a commit record).

    :param fs: The store's fsspec filesystem.
    :param path: The object.
    :param data: Its bytes.
    """
    fs.pipe_file(path, data)


def delete_folder(fs: Any, folder: str, first: str) -> None:
    """Delete a folder of the store, its object ``first`` before the rest (the commit record: no reader takes half a
    folder); what is gone already counts as deleted.

    :param fs: The store's fsspec filesystem.
    :param folder: The folder's path.
    :param first: The name of the object deleted first.
    """
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(f"{folder}/{first}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(folder, recursive=True)


# ---------------------------------------------------------------------- the lease


def read_lease_object(fs: Any, path: str, url: str) -> Lease | None:
    """The lease at ``path``, or None when there is none; an unreadable one (no run wrote it: it must not lock the
    prefix) is warned about and counts as expired (:data:`~trainkit.checkpoint.remote.manifest.UNREADABLE_LEASE`).

    :param fs: The store's fsspec filesystem.
    :param path: The lease object.
    :param url: The store's URL as messages show it.
    :returns: The lease, or None.
    :raises TimeoutError: When the store takes longer than :data:`READ_DEADLINE_S`.
    """
    try:
        return read_lease(read_object(fs, path, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return None
    except (UnreadableFile, CheckpointUnsafeError) as exc:
        warn_user(f"ckpt.remote={url}: {path.rsplit('/', 1)[-1]} is unreadable ({shown(exc)}); it counts as expired")
        return UNREADABLE_LEASE


def lease_version(fs: Any, path: str, url: str) -> tuple[Lease | None, Any]:
    """The lease now and a token of the very object read (S3: its ETag; a file system: its inode), taken before
    the read: the token is never newer than the lease, so a write conditional on it fails on any change.

    :param fs: The store's fsspec filesystem.
    :param path: The lease object.
    :param url: The store's URL as messages show it.
    :returns: ``(lease, token)``; ``(None, None)`` when there is none.
    """
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None, None
    return read_lease_object(fs, path, url), info.get("ETag") if "ETag" in info else info.get("ino")


@contextlib.contextmanager
def lease_lock(fs: Any, path: str) -> Iterator[None]:
    """Hold the ``flock`` of the file ``path`` (:data:`LEASE_LOCK`) on a local file system, created if missing.

    :param fs: The store's fsspec filesystem (a local one).
    :param path: The lock file's path on it.
    :raises TimeoutError: When another process holds it for more than :data:`LEASE_LOCK_S`.
    :raises UnreadableFile: When something other than a regular file is at ``path``.
    """
    local = fs._strip_protocol(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(local, flags, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(local, f"{file_kind(mode)}, not a regular file")
        deadline = time.monotonic() + LEASE_LOCK_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{LEASE_LOCK} was held by another process for {LEASE_LOCK_S:g} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # lets the flock go


def create_lease(fs: Any, path: str, lease: Lease, url: str) -> bool:
    """Create the lease if there is none, in one step of the store: S3 a conditional put; a file system a hard link
    of a private file (hold :func:`lease_lock` around it); memory:// a check and write under one process lock; any
    other store a check, a write and a read back (a race remains).

    :param fs: The store's fsspec filesystem.
    :param path: The lease object.
    :param lease: The lease to write.
    :param url: The store's URL as messages show it.
    :returns: Whether it was created.
    """
    data, kind = lease_bytes(lease), store_kind(fs)
    if kind == "local":
        return _link_new(fs._strip_protocol(path), data)
    if kind == "memory":
        with _MEMORY_LEASES:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    try:
        fs.pipe_file(path, data, mode="create")
        return True
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError):  # no conditional create: check, write, read back (a race remains)
        if read_lease_object(fs, path, url) is not None:
            return False
        fs.pipe_file(path, data)
        held = read_lease_object(fs, path, url)
        return held is not None and held.holder == lease.holder


def replace_lease(fs: Any, path: str, lease: Lease, seen: Lease, version: Any, url: str) -> bool:
    """Write ``lease`` over the one read (``seen``, of ``version``, :func:`lease_version`) only if it is still that
    object: a takeover of an expired lease, or a renewal of the holder's own.

    S3: a put with ``If-Match`` on the ETag. A file system: the old lease renamed aside (of two runs, one renames
    it), checked to be the one read (else put back), then the new one created (hold :func:`lease_lock` around it).
    memory://: check and write under one process lock. Other stores: a check right before the write only.

    :param fs: The store's fsspec filesystem.
    :param path: The lease object.
    :param lease: The lease to write.
    :param seen: The lease read.
    :param version: Its token.
    :param url: The store's URL as messages show it.
    :returns: Whether it was written.
    """
    data, kind = lease_bytes(lease), store_kind(fs)
    if kind == "s3":
        if not isinstance(version, str):  # no ETag to condition on: never an unconditional overwrite
            return False
        try:
            fs.pipe_file(path, data, IfMatch=version)
        except FileNotFoundError:  # deleted meanwhile: the caller creates one, or is refused
            return False
        except OSError as exc:
            if _precondition_failed(exc):
                return False
            raise
        return True
    if kind == "local":
        return _remove_if_read(fs._strip_protocol(path), seen, version) and create_lease(fs, path, lease, url)
    with _MEMORY_LEASES if kind == "memory" else contextlib.nullcontext():  # other: the window is check to write
        if read_lease_object(fs, path, url) != seen:
            return False
        fs.pipe_file(path, data)
    return True


def release_lease(fs: Any, path: str, held: Lease, version: Any, url: str) -> None:
    """Delete the lease read (``held``, of ``version``) only if it is still that object (as :func:`replace_lease`):
    a successor's lease, taken over meanwhile, is never deleted. Other stores: deleted unconditionally.

    :param fs: The store's fsspec filesystem.
    :param path: The lease object.
    :param held: The lease read.
    :param version: Its token.
    :param url: The store's URL as messages show it.
    """
    kind = store_kind(fs)
    if kind == "s3" and isinstance(version, str):  # s3fs's rm_file takes no condition: the client's call does
        bucket, key, _ = fs.split_path(path)
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        fs.invalidate_cache(path)
    elif kind == "local":
        _remove_if_read(fs._strip_protocol(path), held, version)
    elif kind == "memory":
        with _MEMORY_LEASES:
            if read_lease_object(fs, path, url) == held:
                fs.rm_file(path)
    else:
        fs.rm_file(path)


def _precondition_failed(exc: BaseException) -> bool:
    """Whether a store's error says that a conditional write's condition did not hold (S3: 412, or 409 for a
    conditional write that raced another)."""
    response = getattr(exc.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def _link_new(path: str, data: bytes) -> bool:
    """Create the file ``path`` holding ``data`` unless one exists, in one step: the bytes go into a private temp
    file, then :func:`~trainkit.files.durable.link_or_copy` gives them the name (a link never replaces a file, and no
    reader sees a torn lease; where the file system has no hard links, an exclusive create of a copy, which a reader
    may see half written).

    :returns: Whether it was created.
    """
    temp = f"{path}.{secrets.token_hex(8)}.new"
    try:
        with os.fdopen(os.open(temp, _NEW_FILE, 0o644), "wb") as handle:
            handle.write(data)
        link_or_copy(temp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return True


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
