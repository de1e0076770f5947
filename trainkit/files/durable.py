"""Writing checkpoints durably: atomic replacement, the ``.prev`` copy, fsyncs, and the temp files of killed saves.

Side effects: file writes in the checkpoint's folder. A save writes into a temp file of its own (created
exclusively, never through a link), fsyncs it, keeps the file it replaces as ``.prev`` (a hard link made under a
temp name and renamed into place) and renames itself over the destination, then fsyncs the folder: a reader sees
the old file or the new one, never a torn one. Work that must be durable before the file is published (the metrics
journal's ``fsync``) can run beside the write, in a thread of its own, and is waited for before the rename. The
``.prev`` file a save replaces is freed (its blocks given back, milliseconds for a large file) in a thread of its
own too, after the rename: :func:`finish_freeing` waits for it.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from trainkit.errors import CheckpointError
from trainkit.messages import warn_user

__all__ = [
    "TEMP_SUFFIX",
    "previous_path",
    "current_umask",
    "fsync_directory",
    "atomic_save",
    "atomic_write_bytes",
    "payload_nbytes",
    "warn_if_low_on_space",
    "remove_stale_temp_files",
    "finish_freeing",
    "NO_HARD_LINKS",
    "copy_new_file",
    "link_or_copy",
    "process_gone",
]

TEMP_SUFFIX = ".tmp"


_FILE_MODE = 0o666
"""Checkpoints get the permissions ``open()`` gives (the umask applies), not mkstemp's owner-only ones."""

_TEMP_COUNTER = itertools.count()


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Return where the previous version of a checkpoint is kept: ``last.pt`` -> ``last.prev.pt``.

    :param path: The checkpoint path.
    :returns: The sibling path for its previous version.
    """
    return Path(_save_names(os.fspath(path)).previous)


class _SaveNames(NamedTuple):
    directory: str
    temp_prefix: str  # + "<pid>.<n>.tmp": the file being written
    previous: str
    previous_temp_prefix: str  # + "<pid>.<n>.tmp": the link being made, renamed over ``previous``


@functools.lru_cache(maxsize=64)
def _save_names(path: str) -> _SaveNames:
    """The sibling names a save of ``path`` uses, worked out once per destination (string work, no pathlib)."""
    directory, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    previous_name = f"{stem}.prev{suffix}"
    return _SaveNames(
        directory=directory or os.curdir,
        temp_prefix=os.path.join(directory, f".{name}."),
        previous=os.path.join(directory, previous_name),
        previous_temp_prefix=os.path.join(directory, f".{previous_name}."),
    )


def _temp_name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}.{next(_TEMP_COUNTER)}{TEMP_SUFFIX}"


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status`` where Linux has it).

    Changing it to read it (``os.umask``) would let a file another thread creates meanwhile get mode 0666.

    :returns: The umask, e.g. ``0o022``.
    """
    with suppress(OSError, ValueError), open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o077)  # the safest value for the moment it is set
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file) durable; a filesystem that cannot is left alone.

    :param directory: The directory.
    """
    with suppress(OSError):  # some filesystems (and Windows) cannot open a directory for fsync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(
    payload: Any,
    path: str | os.PathLike[str],
    *,
    keep_previous: bool = False,
    alongside: Callable[[], None] | None = None,
) -> float:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the new one, never a torn one.

    Side effects: serializes straight into a temp file in the same directory, flushes, fsyncs,
    ``os.replace``\\ s it over ``path`` and fsyncs the directory. On any failure the temp file is removed
    and ``path`` is left byte-identical.

    :param payload: Tensors and plain Python values.
    :param path: The destination file.
    :param keep_previous: Keep the file being replaced as :func:`previous_path` (a hard link, so no copy),
        for a fallback when the newest one turns out corrupted.
    :param alongside: Work that must be done before the file is published (another file's ``fsync``, say): it
        runs in a thread of its own while the payload is serialized and fsynced, so its wait on the disk hides
        behind theirs, and ``path`` is replaced only once it has returned. Its failure fails the save as a
        failed write does (``path`` left as it was), and is raised as it is.
    :returns: The seconds the save took.
    :raises CheckpointError: On a full disk, naming the path, the bytes written so far and the bytes free.
    """
    return _atomic_write(
        path,
        lambda handle: torch.save(payload, handle),
        lambda: payload_nbytes(payload),
        keep_previous=keep_previous,
        alongside=alongside,
    )


def atomic_write_bytes(data: bytes, path: str | os.PathLike[str]) -> float:
    """Write ``data`` to ``path`` as :func:`atomic_save` writes a payload: whole or not at all, durably.

    Side effects: a temp file of its own in ``path``'s folder (created exclusively, never through a link), fsynced
    and renamed over ``path`` (a link there is replaced, not written through), then the folder fsynced.

    :param data: The file's bytes (a safetensors file that ``safetensors.torch.save`` made, say).
    :param path: The destination file.
    :returns: The seconds the write took.
    :raises CheckpointError: On a full disk, naming the path, the bytes written so far and the bytes free.
    """
    return _atomic_write(path, lambda handle: handle.write(data), lambda: len(data))


def _atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    nbytes: Callable[[], int],
    *,
    keep_previous: bool = False,
    alongside: Callable[[], None] | None = None,
) -> float:
    """The durable write behind :func:`atomic_save` and :func:`atomic_write_bytes`; ``nbytes`` sizes a full disk's
    error message."""
    target = os.fspath(path)
    names = _save_names(target)
    start = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:  # a name no other save uses; O_EXCL refuses a leftover from a process with the same pid
        tmp = _temp_name(names.temp_prefix)
        try:
            fd = os.open(tmp, flags, _FILE_MODE)
            break
        except FileExistsError:
            continue
        except FileNotFoundError:  # the first save into a folder that does not exist yet
            os.makedirs(names.directory, exist_ok=True)
    beside = _Beside(alongside) if alongside is not None else None
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if beside is not None:
            beside.join()  # raises its failure: nothing is published before it is done
        if keep_previous:
            _link_previous(target, names)
        os.replace(tmp, target)
    except BaseException as exc:
        if beside is not None:
            beside.join(raising=False)  # the write's own failure is the one raised
        written = _size_or_zero(tmp)
        with suppress(OSError):
            os.unlink(tmp)
        full = _disk_full_error(exc)
        if full is not None:
            free = shutil.disk_usage(names.directory).free
            needed = max(nbytes(), written)
            raise CheckpointError(
                f"cannot write checkpoint {target}: no space left after {written} bytes; about {needed} bytes "
                f"are needed and {free} bytes are free; {target} was left unchanged"
            ) from full
        raise
    fsync_directory(names.directory)
    return time.perf_counter() - start


class _Beside:
    """One callable run in a thread of its own; :meth:`join` waits for it and raises what it raised."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="trainkit-save-alongside", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised in the saving thread by join()
            self._error = exc

    def join(self, *, raising: bool = True) -> None:
        self._thread.join()
        error, self._error = self._error, None
        if error is not None and raising:
            raise error


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _disk_full_error(exc: BaseException | None) -> OSError | None:
    """Find the ENOSPC/EDQUOT error behind ``exc``: torch's zip writer masks it with its own RuntimeError."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _link_previous(path: str, names: _SaveNames) -> None:
    """Point ``previous_path(path)`` at the current ``path`` atomically; both stay loadable throughout.

    The link is made under a temp name and renamed over the old previous file: unlinking it first would
    leave no previous file at all if the process were killed in between. The old previous file is given a
    second name (a temp name) before that rename, so the rename frees nothing; the freeing of its blocks,
    which takes milliseconds for a large file, is left to a thread (:func:`_free_in_background`). A kill
    before it is done leaves that temp name, which :func:`remove_stale_temp_files` removes.
    """
    while True:
        link_tmp = _temp_name(names.previous_temp_prefix)
        try:
            os.link(path, link_tmp)
            break
        except FileExistsError:  # a leftover (or a planted link) under this name: never touch it, take another
            continue
        except FileNotFoundError:  # the first save: nothing to keep
            return
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            try:
                copy_new_file(path, link_tmp)  # no hard links on this filesystem: a copy into a file of our own
                break
            except FileExistsError:
                continue
    retired = _second_name(names)
    os.replace(link_tmp, names.previous)
    if retired is not None:
        _free_in_background(retired)


def _second_name(names: _SaveNames) -> str | None:
    """Give the current previous file a temp name of its own (a hard link), or None: none, or no hard links."""
    while True:
        retired = _temp_name(names.previous_temp_prefix)
        try:
            os.link(names.previous, retired, follow_symlinks=False)
            return retired
        except FileExistsError:
            continue
        except OSError:  # no previous file yet, or no hard links here: the rename frees it, as before
            return None


_FREEING_LOCK = threading.Lock()
_freeing: threading.Thread | None = None


def _free_in_background(path: str) -> None:
    """Unlink ``path`` (the last name of a retired file) in a thread; one at a time, so they never pile up."""
    global _freeing
    with _FREEING_LOCK:
        if _freeing is not None:
            _freeing.join()
        _freeing = threading.Thread(target=_unlink_quietly, args=(path,), name="trainkit-free-previous", daemon=True)
        _freeing.start()


def _unlink_quietly(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)


def finish_freeing() -> None:
    """Wait until the previous files replaced by saves so far are freed (their temp names gone).

    Side effects: joins the freeing thread, if one runs. The checkpoint writers call it when they wait.
    """
    global _freeing
    with _FREEING_LOCK:
        if _freeing is not None:
            _freeing.join()
            _freeing = None


NO_HARD_LINKS = frozenset(
    code for code in (errno.EPERM, errno.EXDEV, errno.EMLINK, getattr(errno, "ENOTSUP", None)) if code is not None
)
"""``link()`` errors that mean the filesystem has no hard links here (FAT, some network mounts)."""

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
"""A file trainkit creates: never one that exists already, never through a symbolic link."""


def copy_new_file(source: str, target: str) -> None:
    """Copy ``source`` into a file created for it at ``target``, durably (fsynced; removed again on failure).

    :param source: The file to copy (a symbolic link there is refused, never followed).
    :param target: The new file (never one that exists, never through a link).
    :raises FileExistsError: When anything is at ``target``.
    """
    fd = os.open(target, _NEW_FILE_FLAGS, _FILE_MODE)
    try:
        source_fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(source_fd, "rb") as src, os.fdopen(fd, "wb") as dst:
            fd = -1
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        if fd != -1:
            os.close(fd)
        with suppress(OSError):
            os.unlink(target)
        raise


def link_or_copy(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Give the file ``source`` the new name ``target``: a hard link, or a durable copy where the file system has no
    hard links (:data:`NO_HARD_LINKS`). Never through a link at either end, never over a file that exists.

    Side effects: creates ``target``.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a").write_bytes(b"x")
    >>> link_or_copy(folder / "a", folder / "b")
    >>> (folder / "b").read_bytes()
    b'x'

    :param source: The file (a symbolic link there is never followed: linked itself, or refused by the copy).
    :param target: The new name.
    :raises FileExistsError: When anything is at ``target``.
    :raises OSError: When ``source`` cannot be linked or copied.
    """
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        copy_new_file(os.fspath(source), os.fspath(target))  # no hard links here: a durable copy of our own


def payload_nbytes(payload: Any) -> int:
    """Estimate a payload's size on disk: the bytes of every tensor storage in it, counted once.

    :param payload: Nested dicts, lists and tuples of tensors and plain values.
    :returns: The total tensor bytes (pickled plain values are small next to them and not counted).
    """
    seen: set[int] = set()
    walked: set[int] = set()  # containers: a shared one is counted once, a cycle ends
    total = 0
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict | list | tuple):
            if id(item) in walked:
                continue
            walked.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
    return total


def warn_if_low_on_space(payload: Any, path: str | os.PathLike[str]) -> None:
    """Warn when the checkpoint's disk has less than twice the payload's size free.

    Two copies must fit during a save: the temp file being written and the file it replaces.

    :param payload: What is about to be saved.
    :param path: Where it goes.
    """
    needed = payload_nbytes(payload)
    directory = Path(path).parent
    free = shutil.disk_usage(directory if directory.exists() else Path.cwd()).free
    if free < 2 * needed:
        warn_user(
            f"{directory} has {free} bytes free, less than twice the checkpoint's ~{needed} bytes; "
            "saves may fail with a full disk (the previous checkpoint stays intact if they do)"
        )


_TEMP_NAME = re.compile(r"\.(?:last|best)(?:\.prev)?\.pt\.(?P<pid>\d+)\.\d+\.tmp")  # matched whole: fullmatch
"""The temp files trainkit's own saves make: ``.last.pt.<pid>.<n>.tmp``, ``.best.prev.pt.<pid>.<n>.tmp``, ..."""


def process_gone(pid: int) -> bool:
    """Whether no process with this id runs on this machine (a pid reused since errs on the side of keeping).

    :param pid: A process id (this process's own is never gone).
    :returns: True when no such process runs.
    """
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; or a number no process can have
        return True
    except PermissionError:  # alive, under another user
        return False
    return False


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temp files of trainkit's own saves whose writer is gone (a save killed mid-write).

    Side effects: removes regular files named like trainkit's temp files (``.last.pt.<pid>.<n>.tmp`` and
    the ``best``/``.prev`` variants) whose process no longer runs on this machine. Anything else is left
    alone: other files, symbolic links, and the temp file of a save still running (another run's, say).

    :param directory: The checkpoint directory.
    :returns: The files removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        found = _TEMP_NAME.fullmatch(entry.name)
        if found is None or not entry.is_file(follow_symlinks=False) or not process_gone(int(found["pid"])):
            continue
        with suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed
