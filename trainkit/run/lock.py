"""One run per ``out_dir``: an exclusive lock on the run folder for the life of a run.

Side effects: creates ``out_dir`` and ``out_dir/.trainkit.lock``, holds an ``flock`` on it, and writes who
holds it (pid, host, since when) into it. The operating system drops the lock when the process dies, so a
lock left by a crashed or killed run never blocks the next one; the file itself stays (deleting a lock
file races with the next run that opens it).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import weakref
from pathlib import Path
from typing import Any

from trainkit.errors import OutDirError
from trainkit.files.bounded_read import load_json

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; runs are not locked there
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "RunLock"]

LOCK_FILE = ".trainkit.lock"
"""The lock file's name inside ``out_dir``."""

_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()
"""The locks this process holds; a forked child lets go of its copies of them (see ``_forget_in_child``)."""


def _forget_in_child() -> None:
    """In a process just forked (a DataLoader worker), close the inherited lock descriptors without unlocking.

    A child holding a copy keeps the folder locked after its parent dies: a trainer killed with SIGKILL
    left its workers holding the lock for the seconds they take to notice, and a resume started at once
    was refused. Closing the copy (never ``LOCK_UN``, which would unlock the parent's lock too) leaves
    the parent the only holder.
    """
    for lock in list(_HELD):
        lock._forget()


class RunLock:
    """An exclusive lock on a run folder, held from :meth:`acquire` until :meth:`release` or process exit.

    Also released when the object is garbage collected, so a trainer that is dropped without ``close()``
    does not keep its folder locked.

    :param directory: The run folder (``out_dir``); created when missing.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None
        self._finalizer: Any = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or refuse at once naming the run that holds it.

        Side effects: creates the folder and the lock file; writes this process's pid, host and start time
        into it.

        :raises OutDirError: When another run (another process, or another trainer in this one)
            holds the folder, naming it; also when the folder cannot be written (read-only, not a folder,
            the lock file a symbolic link), naming the cause.
        """
        if self._fd is not None or fcntl is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, _OPEN_FLAGS, 0o666)
        except OSError as exc:
            raise OutDirError(self._unusable(exc)) from exc
        links = os.fstat(fd).st_nlink
        if links != 1:  # another name shares the file: writing the lock record would write into it too
            os.close(fd)
            raise OutDirError(
                f"{self.path} has {links} hard links: another file shares it, and trainkit does not write into a file "
                "with other names; remove it (the next run creates its own)"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutDirError(self._busy(holder)) from None
            raise OutDirError(self._unusable(exc)) from exc
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        _HELD.add(self)
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
        except OSError:  # a full disk: the lock still holds, the message of a refused run is only vaguer
            pass

    def release(self) -> None:
        """Let go of the lock (idempotent); the lock file stays.

        Unlocked explicitly before the descriptor is closed: processes forked while the lock was held
        (DataLoader workers, persistent ones outliving the trainer) hold copies of the descriptor, and a
        close alone would leave the folder locked until the last of them exits.
        """
        if self._fd is None:
            return
        try:
            if fcntl is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._finalizer()  # closes the descriptor
            self._fd = None
            self._finalizer = None
            _HELD.discard(self)

    def _forget(self) -> None:
        """Close this process's copy of the descriptor without unlocking (in a forked child only)."""
        fd, finalizer = self._fd, self._finalizer
        self._fd = self._finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _busy(self, holder: dict[str, Any] | None) -> str:
        folder = self.path.parent
        if not holder:
            who = "another run that is just starting"
        elif holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            who = f"another trainer in this process (pid {holder['pid']}, since {holder.get('since')})"
        else:
            who = f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"
        return (
            f"out_dir {folder} is in use by {who}; two runs on one folder would overwrite each other's "
            "checkpoints and metrics. Wait for that run to finish (or stop it), or choose another out_dir"
        )

    def _unusable(self, exc: OSError) -> str:
        folder = self.path.parent
        if exc.errno == errno.ELOOP:
            return f"{self.path} is a symbolic link; trainkit does not write through links it did not create"
        return f"out_dir {folder} cannot be written ({exc.strerror or exc}); choose a writable out_dir"


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        data = load_json(os.pread(fd, 4096, 0) or b"null", max_depth=2)  # a planted deep one is no holder
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
