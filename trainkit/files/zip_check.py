"""Verifying a checkpoint file's structure before anything reads it as a checkpoint.

Side effects: reads the file, in bounded chunks; nothing is unpickled, nothing decompressed.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from trainkit.errors import CheckpointCorruptError, CheckpointUnsafeError
from trainkit.files.bounded_read import file_kind
from trainkit.files.pickle_scan import PickleRefused, PickleUnsafe, check_pickle

__all__ = [
    "Member",
    "InMemory",
    "open_checkpoint",
    "member_spans",
    "verify_open",
    "check_data_pickle",
    "check_unchanged",
    "verify_checkpoint",
    "reason",
]

# Read side: a checkpoint is opened only when it is a regular file. Its zip structure is checked against what
# torch.save writes (members stored, never compressed; side by side, inside the file, none overlapping; torch's record
# names) from the central directory and local headers alone, then every member's CRC-32 is computed in bounded chunks.
# No member is read before its declared size is known to fit in the file and nothing is ever decompressed, so the
# bytes read add up to the file's size at most. torch.load then reads the same open file: a file swapped in at the
# path after the check is never the one loaded.

_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = (
    os.O_RDONLY | _O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
)
"""O_NONBLOCK: a FIFO swapped in between the stat and the open opens at once instead of waiting for a writer."""

_CHUNK = 1 << 20
"""Bytes read at a time when checking CRCs: the check's memory, besides the central directory."""

_END = struct.Struct("<4s4H2LH")  # end of central directory: signature, disks, entries, size, offset, comment length
_END64_LOCATOR = struct.Struct("<4sLQL")  # zip64 end locator: signature, disk, offset of the zip64 end record, disks
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end record: signature, size, versions, disks, entries, size, offset
_ENTRY = struct.Struct("<4s4x2H4x3L4H2x2L")  # central directory entry (the fields read below); name, extra, comment
_LOCAL = struct.Struct("<4s4xH16x2H")  # local file header: signature, method, name and extra sizes; then the data
_NO_32 = 0xFFFFFFFF  # a size or offset that is in the zip64 extra field instead

_ALLOWED_FLAGS = 0x0808
"""The zip flags torch.save's writer sets (sizes in a data descriptor, UTF-8 names); Python's zipfile sets a subset.
Anything else, encryption above all, is not a file torch.save wrote."""

_RECORD_NAME = re.compile(r"data\.pkl|\.?[a-z_]+|\.data/[a-z_]+|data/[A-Za-z0-9_]+")
"""What follows the archive's folder in the member names torch.save writes: ``data.pkl``, the storages
``data/<key>``, and metadata (``version``, ``byteorder``, ``.format_version``, ``.storage_alignment``,
``.data/serialization_id``). TorchScript's ``constants.pkl`` and ``code/...`` do not match."""


class Member(NamedTuple):
    name: str
    raw_name: bytes
    offset: int  # of its local header
    size: int
    crc: int


def _not_a_file(path: Path, mode: int) -> CheckpointCorruptError:
    what = file_kind(mode)
    if os.path.islink(path):
        what = f"a symbolic link to {what} ({os.path.realpath(path)})"
    return CheckpointCorruptError(f"checkpoint {path} is {what}, not a regular file; it was not read")


def open_checkpoint(path: Path) -> tuple[Any, os.stat_result]:
    """Open ``path`` for reading when it is a regular file (or a symbolic link to one), never blocking.

    The stat refuses a FIFO, device, socket or directory before anything opens it (opening some devices has
    effects); the fstat of the opened descriptor refuses one swapped in since.

    :returns: The open binary file, and its fstat for the reads to be checked against.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_a_file(path, mode)
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"checkpoint {path} could not be opened: {reason(exc)}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_a_file(path, info.st_mode)
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info
    except BaseException:
        os.close(fd)
        raise


def reason(exc: BaseException) -> str:
    """An exception's message, or its type's name when the message is empty."""
    return str(exc) or type(exc).__name__


def _damaged(path: Path, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path} is truncated or not a torch checkpoint ({detail}); it was not loaded"
    )


def _foreign(path: Path, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path} is not a torch checkpoint: {detail}, which torch.save never writes; it was not loaded"
    )


_HAS_PREAD = hasattr(os, "pread")
_SEEK_DATA = getattr(os, "SEEK_DATA", None) if _HAS_PREAD else None
_SEEK_HOLE = getattr(os, "SEEK_HOLE", None)


class InMemory(NamedTuple):
    """An archive held in memory (an entry of a sharded checkpoint's ``.distcp`` file), read like an open file."""

    data: bytes


def _pread(file: Any, offset: int, size: int) -> bytes:
    """Up to ``size`` bytes at ``offset``: positional where the OS has pread, so seeks for holes cannot interfere."""
    if type(file) is InMemory:
        return file.data[offset : offset + size]
    if not _HAS_PREAD:
        file.seek(offset)
        return file.read(size)
    parts = []
    while size:
        part = os.pread(file.fileno(), size, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        size -= len(part)
    return b"".join(parts)


def _read_at(path: Path, file: Any, offset: int, size: int) -> bytes:
    data = _pread(file, offset, size)
    if len(data) != size:
        raise _damaged(path, f"it ends {size - len(data)} bytes short of what its zip records describe")
    return data


def _directory_end(path: Path, file: Any, size: int) -> tuple[int, int, int]:
    """Read the end records: the central directory's offset, size and entry count, checked against the file."""
    if size < _END.size:
        raise _damaged(path, f"{size} bytes are too few for a zip archive")
    end_at = size - _END.size
    signature, disk, cd_disk, disk_entries, entries, cd_size, cd_offset, comment = _END.unpack(
        _read_at(path, file, end_at, _END.size)
    )
    if signature != b"PK\x05\x06":  # torch.save writes no archive comment, so the end record ends the file
        raise _damaged(path, "no zip end record at the end of the file")
    if disk or cd_disk or disk_entries != entries or comment:
        raise _foreign(path, "a zip end record of a multi-disk archive or with a comment")
    locator_at = end_at - _END64_LOCATOR.size
    end64_at = locator_at - _END64.size
    if end64_at >= 0 and _read_at(path, file, locator_at, 4) == b"PK\x06\x07":  # torch writes zip64 records always
        _, disk, offset, disks = _END64_LOCATOR.unpack(_read_at(path, file, locator_at, _END64_LOCATOR.size))
        if disk or disks > 1 or offset != end64_at:
            raise _damaged(path, "no zip64 end record where its locator says")
        signature, record, _, _, disk, cd_disk, disk_entries, *wide = _END64.unpack(
            _read_at(path, file, end64_at, _END64.size)
        )
        if signature != b"PK\x06\x06" or record != _END64.size - 12 or disk or cd_disk or disk_entries != wide[0]:
            raise _damaged(path, "a malformed zip64 end record")
        if any(narrow not in (value, 0xFFFF, _NO_32) for narrow, value in zip((entries, cd_size, cd_offset), wide)):
            raise _damaged(path, "its zip and zip64 end records disagree")
        entries, cd_size, cd_offset = wide
        end_at = end64_at
    elif entries == 0xFFFF or cd_size == _NO_32 or cd_offset == _NO_32:
        raise _damaged(path, "no zip64 end record before the zip end record")
    if cd_offset + cd_size != end_at:
        raise _damaged(
            path,
            f"its central directory is declared as {cd_size} bytes at offset {cd_offset}, but {end_at} bytes come "
            "before the end record",
        )
    if entries == 0 or entries * _ENTRY.size > cd_size or entries * _LOCAL.size > cd_offset:
        raise _foreign(path, f"a central directory of {cd_size} bytes declaring {entries} members")
    return cd_offset, cd_size, entries


def _zip64_values(path: Path, name: str, extra: bytes, count: int) -> list[int]:
    """The first ``count`` values of a member's zip64 extra field: the sizes and offset that did not fit 4 bytes."""
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack_from("<2H", extra, at)
        if kind == 0x0001 and length >= 8 * count and at + 4 + length <= len(extra):
            return list(struct.unpack_from(f"<{count}Q", extra, at + 4))
        at += 4 + length
    raise _damaged(path, f"member {name!r} lacks the zip64 sizes its entry refers to")


def _directory_entries(path: Path, file: Any, size: int) -> tuple[list[Member], int]:
    """Read and check the central directory; return its members and where it starts.

    A member is refused on what its entry declares (compressed, encrypted, a size or an offset beyond the file,
    a name torch.save does not write) before any of its bytes is read.
    """
    cd_offset, cd_size, entries = _directory_end(path, file, size)
    directory = _read_at(path, file, cd_offset, cd_size)  # no more than the file holds
    members: list[Member] = []
    names: set[str] = set()
    folder = None
    at = 0
    for _ in range(entries):
        if at + _ENTRY.size > cd_size:
            raise _damaged(path, "its central directory ends before its last entry")
        signature, flags, method, crc, packed, unpacked, name_size, extra_size, comment_size, disk, external, offset = (
            _ENTRY.unpack_from(directory, at)
        )
        if signature != b"PK\x01\x02":
            raise _damaged(path, "a bad central directory entry")
        start = at + _ENTRY.size
        at = start + name_size + extra_size + comment_size
        if at > cd_size:
            raise _damaged(path, "its central directory ends inside an entry")
        raw_name = directory[start : start + name_size]
        try:
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise _damaged(path, f"member name {raw_name[:100]!r} is not UTF-8") from None
        wide = (unpacked == _NO_32, packed == _NO_32, offset == _NO_32)  # in this order in the zip64 field
        if any(wide):
            values = iter(_zip64_values(path, name, directory[start + name_size : at - comment_size], sum(wide)))
            unpacked, packed, offset = (next(values) if big else v for big, v in zip(wide, (unpacked, packed, offset)))
        if name.endswith("/") or external & 0x10:
            # torch's reader skips a member flagged as a directory and leaves its tensor's memory uninitialized
            raise CheckpointCorruptError(
                f"checkpoint {path} is corrupted: {name!r} is marked as a directory; it was not loaded"
            )
        if flags & 0x41:
            raise _foreign(path, f"member {name!r} is encrypted")
        if flags & ~_ALLOWED_FLAGS:
            raise _foreign(path, f"member {name!r} has zip flags {flags:#06x}")
        if method != zipfile.ZIP_STORED:
            raise _foreign(path, f"member {name!r} is compressed (zip method {method})")
        if packed != unpacked:
            raise _foreign(path, f"member {name!r} declares {packed} stored bytes for {unpacked} bytes of data")
        if disk:
            raise _foreign(path, f"member {name!r} is on disk {disk} of a multi-disk archive")
        if offset + _LOCAL.size + name_size + unpacked > cd_offset:
            raise _foreign(
                path,
                f"member {name!r} declares {unpacked} bytes at offset {offset}, beyond the {cd_offset} bytes "
                f"before the central directory (the file has {size} bytes)",
            )
        head, _, record = name.partition("/")
        folder = head if folder is None else folder
        if head != folder or head in ("", ".", "..") or not _RECORD_NAME.fullmatch(record):
            raise _foreign(path, f"a member named {name[:100]!r}")
        if name in names:
            raise _foreign(path, f"two members named {name[:100]!r}")
        names.add(name)
        members.append(Member(name, raw_name, offset, unpacked, crc))
    if at != cd_size:
        raise _damaged(path, "its central directory is longer than its entries")
    if f"{folder}/data.pkl" not in names:
        raise _foreign(path, "an archive without a data.pkl")
    return members, cd_offset


def member_spans(path: Path, file: Any, size: int) -> list[tuple[Member, int]]:
    """Check the archive's members against their local headers; return each with where its data starts.

    The members must lie side by side from the first byte on (torch.load reads a file that does not start with
    one in its legacy, non-zip format), none overlapping another, all before the central directory.
    """
    members, cd_offset = _directory_entries(path, file, size)
    spans = []
    end = 0
    for member in sorted(members, key=lambda member: member.offset):
        if not spans and member.offset != 0:
            raise _foreign(path, f"an archive whose first member starts at offset {member.offset}, not 0")
        if member.offset < end:
            raise _foreign(path, f"member {member.name!r} overlapping the member before it")
        signature, method, name_size, extra_size = _LOCAL.unpack(_read_at(path, file, member.offset, _LOCAL.size))
        if signature != b"PK\x03\x04" or method != zipfile.ZIP_STORED:
            raise _damaged(path, f"a bad local header for member {member.name!r}")
        if _read_at(path, file, member.offset + _LOCAL.size, name_size) != member.raw_name:
            raise _damaged(path, f"member {member.name!r} has another name in its local header")
        start = member.offset + _LOCAL.size + name_size + extra_size
        end = start + member.size
        if end > cd_offset:
            raise _damaged(path, f"member {member.name!r} runs into the central directory")
        spans.append((member, start))
    return spans


def _check_crcs(path: Path, file: Any, spans: list[tuple[Member, int]]) -> None:
    """Compute every member's CRC-32 from its data, reading at most ``_CHUNK`` bytes at a time.

    A hole of a sparse file (which reads as zeros) is not read: its zeros enter the CRC arithmetically, so the
    time taken follows the bytes the file really stores, not the size it claims.
    """
    for member, start in spans:
        crc = 0
        for offset, length, hole in _runs(file, start, start + member.size):
            if hole:
                crc = _crc_after_zeros(crc, length)
                continue
            end = offset + length
            while offset < end:
                data = _pread(file, offset, min(_CHUNK, end - offset))
                if not data:
                    raise _damaged(path, f"it ends inside member {member.name!r}")
                crc = zlib.crc32(data, crc)
                offset += len(data)
        if crc != member.crc:
            raise CheckpointCorruptError(
                f"checkpoint {path} is corrupted: CRC mismatch in {member.name!r}; it was not loaded"
            )


def _runs(file: Any, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
    """Split ``[start, end)`` into ``(offset, length, is_hole)`` runs of stored data and of a sparse file's holes.

    Where the OS or the filesystem cannot tell holes apart, the whole range is one run of data.
    """
    fd = file.fileno()
    while start < end:
        try:
            data = os.lseek(fd, start, _SEEK_DATA) if _SEEK_DATA is not None else start
            hole = os.lseek(fd, data, _SEEK_HOLE) if _SEEK_DATA is not None and data < end else end
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # the filesystem cannot say: read it all
                yield start, end - start, False
                return
            data = hole = end  # no data from here to the end of the file: a hole
        if data > start:
            yield start, min(data, end) - start, True
        if data < end:
            yield data, min(hole, end) - data, False
        start = max(min(hole, end), start + 1) if data < end else end


def _crc_after_zeros(crc: int, count: int) -> int:
    """Return ``zlib.crc32(bytes(count), crc)`` in O(log count) steps, without the zeros.

    >>> _crc_after_zeros(zlib.crc32(b"ab"), 100_000) == zlib.crc32(b"ab" + bytes(100_000))
    True
    """
    register = crc ^ 0xFFFFFFFF
    for power, matrix in enumerate(_zero_byte_maps()):
        if not count >> power:
            break
        if count >> power & 1:
            register = _gf2_times(matrix, register)
    return register ^ 0xFFFFFFFF


@functools.cache
def _zero_byte_maps() -> tuple[tuple[int, ...], ...]:
    """What ``2**k`` zero bytes do to the CRC-32 register, k = 0..63: linear maps over GF(2), as 32 columns."""
    step = tuple(zlib.crc32(b"\0", (1 << bit) ^ 0xFFFFFFFF) ^ 0xFFFFFFFF for bit in range(32))
    maps = []
    for _ in range(64):
        maps.append(step)
        step = tuple(_gf2_times(step, column) for column in step)
    return tuple(maps)


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    result = 0
    for column in matrix:
        if not vector:
            break
        if vector & 1:
            result ^= column
        vector >>= 1
    return result


def verify_open(path: Path, file: Any, info: os.stat_result) -> list[tuple[Member, int]]:
    try:
        spans = member_spans(path, file, info.st_size)
        _check_crcs(path, file, spans)
        check_data_pickle(path, file, spans)
    except OSError as exc:  # a read error (EIO on a bad sector)
        raise CheckpointCorruptError(f"checkpoint {path} could not be read: {reason(exc)}") from exc
    return spans


def check_data_pickle(path: Any, file: Any, spans: list[tuple[Member, int]]) -> None:
    """Bound the archive's pickle before torch unpickles it (:func:`trainkit.files.pickle_scan.check_pickle`).

    A pickle that nests so deeply that unpickling it would crash the process (a segmentation fault, past any
    fallback) is unsafe, not corrupt: the file is what somebody wrote, and an older copy is no answer to a
    planted one. A pickle no pickler writes at all is corrupt, as torch would find it.
    """
    member, start = next((member, start) for member, start in spans if member.name.endswith("/data.pkl"))
    try:
        check_pickle(_read_at(path, file, start, member.size))
    except PickleUnsafe as exc:
        raise CheckpointUnsafeError(
            f"checkpoint {path} was refused before it was unpickled: its pickle {exc}, which no torch.save writes "
            "and which could crash Python while loading it; nothing from it was loaded",
            "a pickle built to crash its reader",
        ) from None
    except PickleRefused as exc:
        raise CheckpointCorruptError(f"checkpoint {path} was refused: its pickle {exc}; it was not loaded") from None


def check_unchanged(path: Path, file: Any, info: os.stat_result) -> None:
    """Refuse a file whose size or modification time changed since it was opened: written into in place."""
    now = os.fstat(file.fileno())
    if (now.st_size, now.st_mtime_ns) != (info.st_size, info.st_mtime_ns):
        raise CheckpointCorruptError(
            f"checkpoint {path} was written into while it was being read (its size or modification time changed); "
            "it was not loaded"
        )


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check that a checkpoint is a regular file holding an intact archive as ``torch.save`` writes it.

    Nothing is unpickled. A FIFO, device, socket or directory is refused before it is opened; a symbolic link to
    a regular file is followed. The zip structure is checked from its records before any member is read: every
    member stored uncompressed, inside the file, next to the others without overlapping, under a name
    ``torch.save`` writes. Then every member's CRC-32 is computed in 1 MiB chunks: ``torch.load`` does not check
    CRCs, so a flipped bit in tensor data would otherwise load silently. Each stored byte is read once (the holes
    of a sparse file are not read: their zeros enter the CRC arithmetically) and nothing is decompressed, so time
    and memory are bounded by the file's size.

    :param path: The checkpoint file.
    :raises CheckpointCorruptError: When the file is missing, not a regular file, unreadable, truncated, not a
        torch zip file, or corrupted; the message names the path and what was wrong.
    """
    path = Path(path)
    file, info = open_checkpoint(path)
    with file:
        verify_open(path, file, info)
