"""Reading files that trainkit did not just write: regular files only, never blocking, never more than expected.

Side effects: opens and reads files; nothing is written. Standard library only.

A run folder is input from whoever can write into it, so every reader follows the same rules: the file is
opened with ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer) and, unless a link is
expected, ``O_NOFOLLOW`` (a link to ``/dev/zero`` or to another user's file is refused); the opened descriptor
is ``fstat``-ed and anything but a regular file is refused; and no more bytes are read than the caller
declares (a planted multi-gigabyte file costs a refusal, not the machine's memory). JSON that trainkit did
not just write is parsed by :func:`load_json`, which bounds its nesting.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["UnreadableFile", "file_kind", "open_regular", "read_regular", "load_json", "MAX_JSON_DEPTH"]

MAX_JSON_DEPTH = 64
"""How deeply a JSON document trainkit reads may nest arrays and objects; trainkit writes at most 3 levels."""

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class UnreadableFile(OSError):
    """A file that is not read: missing, not a regular file, a link where none is allowed, or too large.

    :param path: The file.
    :param reason: What it is, e.g. ``"a FIFO (named pipe), not a regular file"``.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path} is {reason}")
        self.path = Path(path)
        self.reason = reason


def file_kind(mode: int) -> str:
    """Name the kind of file a ``st_mode`` describes (for refusals).

    >>> file_kind(stat.S_IFIFO)
    'a FIFO (named pipe)'

    :param mode: An ``st_mode``.
    :returns: ``"a regular file"``, ``"a directory"``, ``"a FIFO (named pipe)"``, ...
    """
    kinds = [
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ]
    return next((kind for test, kind in kinds if test(mode)), f"a special file (mode {mode:#o})")


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = False) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without ever blocking, and return its descriptor and ``fstat``.

    Side effects: opens a descriptor, which the caller closes. The descriptor is in blocking mode again.

    :param path: The file.
    :param follow_links: Accept a symbolic link to a regular file (``O_NOFOLLOW`` otherwise).
    :returns: ``(fd, stat)``.
    :raises UnreadableFile: When the file is missing, a link (unless allowed), or not a regular file; the
        reason names what it is.
    """
    flags = _OPEN_FLAGS | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    try:
        if not follow_links and os.path.islink(path):  # O_NOFOLLOW says ELOOP; name the link's target instead
            raise UnreadableFile(path, f"a symbolic link (to {os.readlink(path)}), which trainkit does not follow here")
        fd = os.open(path, flags)
    except UnreadableFile:
        raise
    except FileNotFoundError:
        raise UnreadableFile(path, "missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnreadableFile(path, "a symbolic link, which trainkit does not follow here") from None
        raise UnreadableFile(path, f"unreadable ({exc.strerror or exc})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(path, f"{file_kind(info.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_links: bool = False) -> bytes:
    """Read a whole regular file of at most ``limit`` bytes (see :func:`open_regular`).

    Side effects: reads the file.

    :param path: The file.
    :param limit: The most bytes the file may hold.
    :param follow_links: Accept a symbolic link to a regular file.
    :returns: Its bytes.
    :raises UnreadableFile: As :func:`open_regular`, and when the file holds more than ``limit`` bytes.
    """
    fd, info = open_regular(path, follow_links=follow_links)
    try:
        if info.st_size > limit:
            raise UnreadableFile(path, f"{info.st_size} bytes, more than the {limit} it may hold")
        parts, total = [], 0
        while total <= limit:
            part = os.read(fd, min(1 << 20, limit + 1 - total))
            if not part:
                break
            parts.append(part)
            total += len(part)
        if total > limit:  # it grew since the fstat
            raise UnreadableFile(path, f"more than the {limit} bytes it may hold")
        return b"".join(parts)
    except OSError as exc:
        if isinstance(exc, UnreadableFile):
            raise
        raise UnreadableFile(path, f"unreadable ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)


def load_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON that trainkit did not just write, refusing documents nested deeper than ``max_depth``.

    Pure. Python's parser raises ``RecursionError`` on very deep input and builds, below that, values that
    later recursive code (``repr``, ``==``, ``json.dumps``) cannot handle; both end here as ``ValueError``.

    >>> load_json('{"a": [1, 2.5, null]}')
    {'a': [1, 2.5, None]}
    >>> load_json("[" * 100 + "]" * 100)
    Traceback (most recent call last):
    ...
    ValueError: JSON nested more than 64 deep

    :param text: The document.
    :param max_depth: The deepest nesting of arrays and objects accepted.
    :returns: The parsed value.
    :raises ValueError: When the text is not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``) or nests too
        deeply.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested more than {max_depth} deep") from None
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                raise ValueError(f"JSON nested more than {max_depth} deep")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value
