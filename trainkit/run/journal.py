"""``metrics.jsonl``: rows appended, cut back to a checkpoint's line on resume, synced before a checkpoint.

Side effects: the file in ``out_dir`` (rank 0).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainkit.errors import OutDirError
from trainkit.files.bounded_read import load_json
from trainkit.messages import warn_user

__all__ = [
    "JsonlSink",
]

_JOURNAL_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | os.O_APPEND
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
"""Append-only, created if missing, never through a symbolic link, and never blocking on a FIFO."""


class JsonlSink:
    """``out_dir/metrics.jsonl``: one JSON object per push, appended and flushed; synced before a checkpoint.

    The journal and ``last.pt`` agree after any crash: :meth:`sync` makes the rows durable before a
    checkpoint records the journal's size, and a resumed run cuts the file back to that size (dropping
    the rows of the epoch that was lost, so no step appears twice or goes backwards) or, when a crash cut
    the file below it, pads it to that size with a warning (ending a torn last row, which readers skip).
    The file is never opened through a symbolic link, and anything but a regular file is refused.

    :param path: The file.
    :param truncate_to: The byte size recorded in the checkpoint; None keeps the file as it is.
    :param history: Bytes to start the file with, replacing what is there (a run resumed from another
        folder carries that folder's rows over).
    :raises OutDirError: When ``path`` is a symbolic link or not a regular file.
    """

    def __init__(self, path: Path, truncate_to: int | None = None, history: bytes | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            fd = os.open(path, _JOURNAL_FLAGS, 0o666)
        except OSError as exc:
            raise OutDirError(_unusable_journal(path, exc)) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OutDirError(f"{path} is not a regular file; move it away so the run can keep its metrics")
            if info.st_nlink != 1:  # cutting it back or appending would change the file it shares a name with
                raise OutDirError(
                    f"{path} has {info.st_nlink} hard links: another file shares it, and trainkit does not write into "
                    "a file with other names; move it away so the run can keep its metrics"
                )
            os.set_blocking(fd, True)
            if history is not None:
                os.ftruncate(fd, 0)
                _write_all(fd, history)
            size = os.fstat(fd).st_size
            if truncate_to is not None and size > truncate_to:
                os.ftruncate(fd, truncate_to)
                size = truncate_to
            elif truncate_to is not None and size < truncate_to:
                missing = truncate_to - size
                _write_all(fd, b" " * (missing - 1) + b"\n")
                warn_user(
                    f"{path} is {missing} bytes shorter than the checkpoint recorded (a crash cut its tail before "
                    "it reached the disk); the rows in those bytes are lost, and the file was padded to the "
                    "recorded size so the next rows start on a line of their own"
                )
                size = truncate_to
            rows = _count_lines(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._size = size
        self._rows = rows
        # the size the last fsync made durable: a file empty at open and still empty has nothing to make durable;
        # anything found or changed at open (a resumed run's rows, history, a cut, padding) goes with the first sync()
        self._synced: int | None = 0 if size == 0 and info.st_size == 0 else None

    def tell(self) -> int:
        """The file's current size in bytes, for the checkpoint."""
        return self._size

    @property
    def synced(self) -> bool:
        """Whether every row written so far is durable (nothing for :meth:`sync` to do)."""
        return self._fd is None or self._synced == self._size

    @property
    def rows(self) -> int:
        """The lines the file holds, which is the 0-based line number of the next row."""
        return self._rows

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Append one row (one ``write``, so it is never interleaved).

        :param metrics: Name to float.
        :param step: Ignored: a row's step here is its line.
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        line = json.dumps(dict(metrics), allow_nan=True).encode() + b"\n"
        _write_all(self._fd, line)
        self._size += len(line)
        self._rows += 1

    def rows_from(self, first: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """The rows at line ``first`` and after, each with its line; a line that is not a JSON object is skipped.

        :param first: The 0-based line to start at.
        :returns: An iterator of (line, row).
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        line, position, pending = 0, 0, b""
        while position < self._size:
            chunk = os.pread(self._fd, min(1 << 20, self._size - position), position)
            if not chunk:
                break
            position += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for text in complete:
                if line >= first:
                    with contextlib.suppress(ValueError):  # a torn row, or one nested deeper than any row
                        row = load_json(text)
                        if isinstance(row, dict):
                            yield line, row
                line += 1

    def sync(self) -> None:
        """Make the rows written so far durable (``fsync``); called before a checkpoint records :meth:`tell`.

        No ``fsync`` when no row was written since the last one (the file only grows through :meth:`log`): an
        epoch that logged nothing costs its checkpoint no second ``fsync`` (~0.1 ms even on an unchanged file).
        """
        if self._fd is not None and self._synced != self._size:
            size = self._size  # a row appended during the fsync (a background save's) is not covered by it
            os.fsync(self._fd)
            self._synced = size

    def finish(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _count_lines(fd: int, size: int) -> int:
    count, position = 0, 0
    while position < size:
        chunk = os.pread(fd, min(1 << 20, size - position), position)
        if not chunk:
            break
        count += chunk.count(b"\n")
        position += len(chunk)
    return count


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unusable_journal(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{path} is a symbolic link; trainkit does not write through links it did not create; remove it"
    return f"{path} cannot be opened for appending ({exc.strerror or exc})"
