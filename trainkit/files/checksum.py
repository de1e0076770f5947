"""A file's CRC-32, computed one way everywhere: a checkpoint directory's manifest, the remote tier's uploads and its
verified downloads.

Side effects: reads files (through no link, bounded by the size expected) and writes only the file a copy creates.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from trainkit.files.bounded_read import UnreadableFile, open_regular

__all__ = ["CHUNK", "file_checksum", "copy_with_checksum"]

CHUNK = 8 << 20
"""Bytes read at a time (8 MiB): large enough for the disk, small enough for memory."""


def file_checksum(path: str | os.PathLike[str], size: int | None = None) -> tuple[int, int]:
    """The size and CRC-32 of a regular file, read through no link and never past ``size`` bytes.

    Side effects: reads the file.

    >>> import tempfile, zlib
    >>> path = Path(tempfile.mkdtemp()) / "f"
    >>> _ = path.write_bytes(b"abc")
    >>> file_checksum(path) == (3, zlib.crc32(b"abc")), file_checksum(path, 5)
    (True, (3, 0))

    :param path: The file.
    :param size: The size it should have; a file of another size is not read (its size is returned, with CRC 0).
    :returns: ``(size, crc)``.
    :raises UnreadableFile: When the file is missing, a link, not a regular file, or unreadable.
    """
    fd, info = open_regular(path)
    try:
        if size is not None and info.st_size != size:
            return info.st_size, 0
        crc, total = 0, 0
        buffer = bytearray(min(CHUNK, max(info.st_size, 1)))  # one buffer read into again and again
        view = memoryview(buffer)
        limit = info.st_size if size is None else size
        while total < limit and (read := os.readv(fd, [view[: min(len(buffer), limit - total)]])):
            crc = zlib.crc32(view[:read], crc)
            total += read
        return total, crc
    except OSError as exc:
        if isinstance(exc, UnreadableFile):
            raise
        raise UnreadableFile(Path(path), f"unreadable ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)


def copy_with_checksum(read: Callable[[int], bytes], target: BinaryIO, limit: int) -> tuple[int, int]:
    """Copy what ``read`` gives into ``target`` until it gives nothing or more than ``limit`` bytes came, computing
    the CRC-32 of what was copied.

    Side effects: calls ``read`` and writes into ``target`` (neither flushed nor synced: the caller's).

    >>> import io, zlib
    >>> out = io.BytesIO()
    >>> copy_with_checksum(io.BytesIO(b"abcdef").read, out, 10) == (6, zlib.crc32(b"abcdef"))
    True
    >>> copy_with_checksum(io.BytesIO(b"abcdef").read, io.BytesIO(), 3)[0]  # one byte past the limit: refuse it
    4

    :param read: Gives at most the number of bytes asked for; ``b""`` at the end (a deadline may wrap it).
    :param target: Where the bytes go.
    :param limit: The bytes expected; at most one more is read, so that a caller sees a longer source.
    :returns: ``(bytes copied, crc)``; more than ``limit`` bytes copied means the source is longer than expected.
    """
    crc, total = 0, 0
    while total <= limit and (chunk := read(min(CHUNK, limit + 1 - total))):
        total += len(chunk)
        crc = zlib.crc32(chunk, crc)
        target.write(chunk)
    return total, crc
