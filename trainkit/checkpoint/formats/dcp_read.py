"""Reading a sharded checkpoint directory as what it is: input from whoever could write into the run folder.

Side effects: reads files; collectives in :func:`verify_directory` (every rank calls it together) and in
:func:`load_into` (DCP's own, when distributed).

torch.distributed.checkpoint (DCP) trusts its files: ``FileSystemReader.read_metadata`` reads ``.metadata`` with
a plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry of a ``.distcp`` file
with ``torch.load(weights_only=False)``; either runs whatever code a planted file holds. Nothing here hands a
byte to such an unpickler:

- every file of a directory is opened as :mod:`trainkit.files.bounded_read` opens untrusted files (regular files only,
  never through a link, never blocking, never more bytes than the manifest declares);
- ``.metadata`` is bounded by :func:`~trainkit.files.pickle_scan.check_pickle`, then unpickled by an unpickler that
  admits only DCP's own metadata records (and the torch values inside them), then checked field by field:
  every entry names a file of the manifest inside the directory, every chunk lies inside its tensor, and the
  tensors fit in the bytes the files hold (so reading one allocates no more than the disk holds);
- DCP reads through ``SafeReader`` and ``SafeLoadPlanner``: each entry of a ``.distcp`` file (a
  ``torch.save`` archive of one tensor or one plain value) is read within its file and loaded by
  :func:`trainkit.checkpoint.load_archive` (zip structure checked, pickle bounded, ``weights_only=True``).

A directory that cannot be read as a checkpoint is corrupt (:class:`~trainkit.CheckpointCorruptError`: a resume
falls back to its ``.prev``); one that holds what no trainkit save writes, built to run code or to crash the
reader, is unsafe (:class:`~trainkit.CheckpointUnsafeError`: the resume stops, and nothing is renamed).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import os
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from typing import Any

import torch

from trainkit import torch_private
from trainkit.distributed.collectives import all_gather_objects
from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointUnsafeError
from trainkit.files.bounded_read import UnreadableFile, load_json, open_regular, read_regular
from trainkit.files.checksum import file_checksum
from trainkit.files.pickle_scan import MAX_COLLISIONS, PickleUnsafe, check_pickle
from trainkit.files.weights_only_load import load_archive

__all__ = [
    "ENGINE_FILE",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "MANIFEST_LIMIT",
    "read_manifest",
    "verify_directory",
    "read_metadata",
    "SafeReader",  # noqa: F822 - made at first use (module __getattr__)
    "SafeLoadPlanner",  # noqa: F822
    "load_into",
]

ENGINE_FILE = "trainkit.pt"
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"
MANIFEST_LIMIT = 16 << 20
"""The largest ``manifest.json`` read: some 40 bytes per file, so room for hundreds of thousands of ranks."""
_CHUNK = 8 << 20
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.\-]{0,254}")
_OWN_FILES = frozenset({ENGINE_FILE, MANIFEST_FILE, METADATA_FILE})
"""Files of a checkpoint directory that hold no DCP entry."""


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in (".", "..") and _PLAIN_NAME.fullmatch(name) is not None


def read_manifest(directory: Path) -> dict[str, tuple[int, int]]:
    """Read and check a checkpoint directory's ``manifest.json``: every file's size and CRC-32, by name.

    Side effects: reads the file (at most :data:`MANIFEST_LIMIT` bytes, a regular file, never through a link).

    :param directory: The checkpoint directory.
    :returns: ``{name: (size, crc)}``; the names are plain file names in ``directory``.
    :raises CheckpointCorruptError: When the manifest is missing, not a regular file, too large, not the JSON
        trainkit writes, or names a file outside the directory.
    """
    path = directory / MANIFEST_FILE
    try:
        manifest = load_json(read_regular(path, MANIFEST_LIMIT), max_depth=3)
    except UnreadableFile as exc:
        raise CheckpointCorruptError(f"{exc}; its manifest is what makes a sharded checkpoint whole") from None
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path} is not a trainkit manifest ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or ENGINE_FILE not in files or METADATA_FILE not in files:
        raise CheckpointCorruptError(f"{path} is not a trainkit manifest: it does not list trainkit.pt and .metadata")
    checked = {}
    for name, entry in files.items():
        if not _plain_name(name) or name == MANIFEST_FILE:
            raise CheckpointCorruptError(f"{path} names {str(name)[:100]!r}, which is not a file of the directory")
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and all(type(value) is int for value in entry)
            and entry[0] >= 0
            and 0 <= entry[1] < 2**32
        ):
            raise CheckpointCorruptError(f"{path} gives {name!r} {str(entry)[:100]}, not [size, CRC-32]")
        checked[name] = (entry[0], entry[1])
    return checked


def verify_directory(directory: Path, *, rank: int, world_size: int) -> str | None:
    """Check a checkpoint directory against its manifest, every rank a share of the files (a collective).

    Every file the manifest lists must be a regular file (no link, FIFO or device) of its recorded size and
    CRC-32; the rank that checks ``.metadata`` also reads it as
    :func:`~trainkit.checkpoint.formats.dcp_read.read_metadata` does, so a planted one is refused before anything
    trusts the directory.

    :param directory: The checkpoint directory.
    :param rank: This rank.
    :param world_size: The number of ranks.
    :returns: None when the directory is whole; otherwise what is wrong (the same answer on every rank).
    :raises CheckpointUnsafeError: On every rank, when the directory holds what no trainkit save writes (a
        ``.metadata`` naming other classes, or entries outside the directory); nothing is renamed or removed.
    """
    problem: tuple[str, str, str] | None = None  # (kind, message, type name)
    try:
        files = read_manifest(directory)
        for index, (name, (size, crc)) in enumerate(sorted(files.items())):
            if index % world_size != rank:
                continue
            got_size, got_crc = file_checksum(directory / name, size)
            if (got_size, got_crc) != (size, crc):
                problem = (
                    "corrupt",
                    f"{name}: {got_size} bytes with CRC-32 {got_crc:#010x}, the manifest says {size} bytes with "
                    f"CRC-32 {crc:#010x}",
                    "",
                )
                break
            if name == METADATA_FILE:
                read_metadata(directory, files)
    except CheckpointUnsafeError as exc:
        problem = ("unsafe", str(exc), exc.type_name)
    except CheckpointCorruptError as exc:
        problem = ("corrupt", str(exc), "")
    except OSError as exc:
        problem = ("corrupt", str(exc), "")
    answers = [answer for answer in all_gather_objects(problem) if answer is not None]
    unsafe = [answer for answer in answers if answer[0] == "unsafe"]
    if unsafe:
        raise CheckpointUnsafeError(unsafe[0][1], unsafe[0][2])
    return f"{directory} is damaged or incomplete: {answers[0][1]}" if answers else None


# --- .metadata -------------------------------------------------------------------------------------------------


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a ``.metadata`` pickle may name: DCP's records, and the torch values and containers inside them."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(metadata, name)
    }
    storage_info = torch_private.dcp_storage_info_class()
    allowed[(filesystem.__name__, storage_info.__name__)] = storage_info
    allowed[("torch", "Size")] = torch.Size
    layout_by_name = torch_private.tensor_layout_by_name()
    allowed[(layout_by_name.__module__, layout_by_name.__name__)] = layout_by_name  # a lookup by name
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    import collections
    import pathlib

    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)  # StorageMeta.checkpoint_id: a path, made inert
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


_INDEX = ("torch.distributed.checkpoint.metadata", "MetadataIndex")


@functools.cache
def _index_key() -> type:
    """``MetadataIndex`` hashed and compared by identity while a ``.metadata`` is unpickled.

    Its real hash is that of ``(fqn, offset)``, which a file can make collide for every key of ``storage_data``
    (quadratic to build); the keys become real ``MetadataIndex`` objects once their hashes are counted.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    class _IndexKey(MetadataIndex):  # type: ignore[misc]
        __hash__ = object.__hash__
        __eq__ = object.__eq__

    return _IndexKey


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata records and nothing else (no other global, no persistent id)."""

    def __init__(self, file: Any, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _INDEX:
            return _index_key()
        found = self._allowed.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}"[:200])
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


class _Refused(pickle.UnpicklingError):
    """A global or persistent id the metadata unpickler does not build."""


class _Bad(Exception):
    """A metadata field that is not what DCP writes (corrupt), or that reaches outside the directory (unsafe)."""

    def __init__(self, message: str, unsafe: bool = False) -> None:
        super().__init__(message)
        self.unsafe = unsafe


def read_metadata(directory: Path, files: Mapping[str, tuple[int, int]] | None = None) -> Any:
    """Read a checkpoint directory's ``.metadata`` without running anything from it, and check it.

    Side effects: reads ``.metadata`` (a regular file, never through a link, at most its manifest size) and,
    without ``files``, the manifest.

    :param directory: The checkpoint directory.
    :param files: Its manifest (:func:`read_manifest`), when already read.
    :returns: DCP's ``Metadata``.
    :raises CheckpointUnsafeError: When the pickle names a class or function other than DCP's metadata records,
        is built to crash its reader, or its entries lie outside the directory's files.
    :raises CheckpointCorruptError: When it cannot be read or its fields are not what DCP writes.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    files = read_manifest(directory) if files is None else files
    path = directory / METADATA_FILE
    try:
        data = read_regular(path, files[METADATA_FILE][0])
        check_pickle(data, opaque_keys={".".join(_INDEX)})
        metadata = _MetadataUnpickler(io.BytesIO(data), _metadata_globals()).load()
    except UnreadableFile as exc:
        raise CheckpointCorruptError(str(exc)) from None
    except PickleUnsafe as exc:
        raise CheckpointUnsafeError(
            f"{path} was refused before it was unpickled: its pickle {exc}, which DCP never writes and which could "
            "crash Python while loading it; the checkpoint was not read",
            "a pickle built to crash its reader",
        ) from None
    except _Refused as exc:
        raise CheckpointUnsafeError(
            f"{path} was refused: its pickle names {exc}, which is not one of DCP's metadata records, so it was "
            "not unpickled (unpickling it could run code); the file is what somebody wrote, not damage",
            str(exc),
        ) from None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises what the records' constructors raise
        raise CheckpointCorruptError(
            f"{path} cannot be read as DCP metadata ({type(exc).__name__}: {exc})"[:500]
        ) from None
    if type(metadata) is not Metadata:
        raise CheckpointCorruptError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
    try:
        _check_metadata(metadata, files)
    except _Bad as exc:
        if exc.unsafe:
            raise CheckpointUnsafeError(
                f"{path} was refused: {exc}; the checkpoint was not read", "DCP metadata"
            ) from None
        raise CheckpointCorruptError(f"{path} is not DCP metadata as trainkit writes it: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a field of a kind the checks did not foresee
        raise CheckpointCorruptError(
            f"{path} is not DCP metadata as trainkit writes it ({type(exc).__name__}: {exc})"[:500]
        ) from None
    return metadata


def _check_metadata(metadata: Any, files: Mapping[str, tuple[int, int]]) -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    storage_info = torch_private.dcp_storage_info_class()
    _fields(metadata, {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}, "Metadata")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict or not all(type(key) is str for key in entries):
        raise _Bad("state_dict_metadata is not a dict of names")
    metadata.storage_data = storage = _real_indices(metadata.storage_data)
    data_bytes = sum(size for name, (size, _) in files.items() if name not in _OWN_FILES)
    seen: set[int] = set()  # DCP writes every entry and chunk object once: shared ones only multiply the work
    declared = 0
    for key, entry in entries.items():
        if id(entry) in seen:
            raise _Bad(f"entry {key[:100]!r} shares its record with another entry")
        seen.add(id(entry))
        if type(entry) is BytesStorageMetadata:
            _fields(entry, set(), key)
        elif type(entry) is TensorStorageMetadata:
            declared += _check_tensor_entry(key, entry, storage, seen)
        else:
            raise _Bad(f"entry {key[:100]!r} is a {type(entry).__name__}")
    if declared > 2 * data_bytes:
        # a tensor's bytes are in the files: declaring more would make a reader allocate what the disk never held
        raise _Bad(
            f"the entries declare {declared // 2} bytes of tensors, more than the shard files hold ({data_bytes})", True
        )
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not storage_info:
            raise _Bad(f"storage_data maps a {type(index).__name__} to a {type(info).__name__}")
        _fields(index, {"fqn", "offset", "index"}, "MetadataIndex")
        if type(index.fqn) is not str or not (index.offset is None or _is_size(index.offset)):
            raise _Bad(f"storage_data has a malformed index {str(index)[:100]}")
        if not (index.index is None or type(index.index) is int):
            raise _Bad(f"storage_data has a malformed index {str(index)[:100]}")
        _fields(info, {"relative_path", "offset", "length", "transform_descriptors"}, "_StorageInfo")
        name = info.relative_path
        if not _plain_name(name) or name not in files or name in _OWN_FILES:
            raise _Bad(
                f"entry {index.fqn[:100]!r} is stored in {str(name)[:100]!r}, which is not a shard file of the "
                "directory's manifest",
                unsafe=True,
            )
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise _Bad(f"entry {index.fqn[:100]!r} has offset {info.offset!r} and length {info.length!r}")
        if info.offset + info.length > files[name][0]:
            raise _Bad(f"entry {index.fqn[:100]!r} lies past the end of {name} ({files[name][0]} bytes)")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:  # compression and other stream extensions: trainkit never writes any (no decompression bomb)
            raise _Bad(
                f"entry {index.fqn[:100]!r} is stored through DCP stream transforms {str(transforms)[:100]}", True
            )
    planner = metadata.planner_data
    if planner is not None and not _plain(planner, 4):
        raise _Bad("planner_data is not plain data")
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None:
        if type(meta) is not StorageMeta:
            raise _Bad(f"storage_meta is a {type(meta).__name__}")
        _fields(meta, {"checkpoint_id", "save_id", "load_id", "modules"}, "StorageMeta")
        if not (meta.checkpoint_id is None or isinstance(meta.checkpoint_id, str | PurePath)):
            raise _Bad("storage_meta.checkpoint_id is not a path")
        if not all(value is None or type(value) is str for value in (meta.save_id, meta.load_id)):
            raise _Bad("storage_meta's ids are not strings")
        if not (isinstance(meta.modules, list) and all(type(module) is str for module in meta.modules)):
            raise _Bad("storage_meta.modules is not a list of names")
    if not (getattr(metadata, "version", None) is None or type(metadata.version) is str):
        raise _Bad("version is not a string")


def _real_indices(storage: Any) -> dict[Any, Any]:
    """``storage_data`` with real ``MetadataIndex`` keys, once no hash of theirs is shared by too many."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if type(storage) is not dict:
        raise _Bad("storage_data is not a dict")
    counts: collections.Counter[int] = collections.Counter()
    for index in storage:
        if not isinstance(index, MetadataIndex):
            raise _Bad(f"storage_data is keyed by a {type(index).__name__}")
        _fields(index, {"fqn", "offset", "index"}, "MetadataIndex")
        if type(index.fqn) is not str or not (index.offset is None or _is_size(index.offset)):
            raise _Bad(f"storage_data has a malformed index {str(vars(index))[:100]}")
        if not (index.index is None or type(index.index) is int):
            raise _Bad(f"storage_data has a malformed index {str(vars(index))[:100]}")
        counts[hash((index.fqn, index.offset))] += 1
    if counts and max(counts.values()) > MAX_COLLISIONS:
        raise _Bad(f"storage_data holds more than {MAX_COLLISIONS} indices whose hashes are equal", True)
    return {MetadataIndex(index.fqn, index.offset, index.index): info for index, info in storage.items()}


def _check_tensor_entry(key: str, entry: Any, storage: Mapping[Any, Any], seen: set[int]) -> int:
    """Check one tensor entry; return twice the bytes it declares (its tensor's, and its chunks')."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

    _fields(entry, {"properties", "size", "chunks"}, key)
    properties = entry.properties
    if type(properties) is not TensorProperties:
        raise _Bad(f"entry {key[:100]!r} has no TensorProperties")
    _fields(properties, {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"}, key)
    if not (
        isinstance(properties.dtype, torch.dtype)
        and properties.layout == torch.strided
        and type(properties.requires_grad) is bool
        and isinstance(properties.memory_format, torch.memory_format)
        and type(properties.pin_memory) is bool
    ):
        raise _Bad(f"entry {key[:100]!r} has malformed properties")
    size = entry.size
    if not _is_size(size) or type(entry.chunks) is not list:
        raise _Bad(f"entry {key[:100]!r} has a malformed size or chunk list")
    numel, stored = math.prod(size), 0
    for chunk in entry.chunks:
        if type(chunk) is not ChunkStorageMetadata or id(chunk) in seen:
            raise _Bad(f"entry {key[:100]!r} has a chunk that is a shared or foreign {type(chunk).__name__}")
        seen.add(id(chunk))
        _fields(chunk, {"offsets", "sizes"}, key)
        if not (
            _is_size(chunk.offsets) and _is_size(chunk.sizes) and len(chunk.offsets) == len(chunk.sizes) == len(size)
        ):
            raise _Bad(f"entry {key[:100]!r} has a malformed chunk")
        if any(start + length > whole for start, length, whole in zip(chunk.offsets, chunk.sizes, size)):
            raise _Bad(f"entry {key[:100]!r} has a chunk outside its {tuple(size)} tensor")
        volume = math.prod(chunk.sizes)  # 0 for a rank's empty shard (FSDP2 over a dim shorter than the ranks)
        if volume and MetadataIndex(key, chunk.offsets) not in storage:
            raise _Bad(f"entry {key[:100]!r} has a chunk that no file stores")
        stored += volume
    if stored < numel:
        raise _Bad(f"entry {key[:100]!r}: its chunks hold {stored} of the {numel} elements of its tensor")
    return (numel + stored) * torch.empty((), dtype=properties.dtype).element_size()


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and 0 <= n < 2**62 for n in value)


def _fields(obj: Any, known: set[str], where: str) -> None:
    """Refuse attributes a record of this kind does not have, unless they hold plain values (a newer torch's)."""
    for name, value in vars(obj).items():
        if name not in known and not _plain(value, 2):
            raise _Bad(f"{str(where)[:100]!r} has an unexpected attribute {str(name)[:50]!r}")
    if dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            if field.name in known and not hasattr(obj, field.name):
                raise _Bad(f"{str(where)[:100]!r} lacks its {field.name!r}")


def _plain(value: Any, depth: int) -> bool:
    if value is None or type(value) in (bool, int, float, str):
        return True
    if depth <= 0:
        return False
    if type(value) in (list, tuple):
        return all(_plain(item, depth - 1) for item in value)
    if type(value) is dict:
        return all(type(key) is str and _plain(item, depth - 1) for key, item in value.items())
    return False


# --- DCP's reader and planner ------------------------------------------------------------------------------------


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """``SafeReader`` and ``SafeLoadPlanner``, made at first use: they subclass DCP's reader and planner,
    and importing ``torch.distributed.checkpoint`` costs every process that imports trainkit about a second."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        """DCP's default load planner, with every non-tensor entry loaded by :func:`trainkit.checkpoint.load_archive`
        (``weights_only=True``, pickle bounded) instead of ``torch.load(weights_only=False)``."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            """Load a non-tensor entry safely and put it where the default planner would.

            :param read_item: DCP's read item.
            :param value: The entry's bytes.
            """
            self.set_value(read_item, load_archive(value.getvalue(), f"entry {read_item.dest_index.fqn!r}"))

        def set_value(self, read_item: Any, value: Any) -> None:
            """Put an entry's loaded value into the state dict being filled.

            :param read_item: DCP's read item.
            :param value: The loaded value.
            """
            if self.flatten_state_dict:
                torch_private.dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value

    class SafeReader(FileSystemReader):  # type: ignore[misc]
        """DCP's file reader for one checkpoint directory, reading nothing the way DCP's own reader trusts it.

        ``.metadata`` through :func:`read_metadata`; each entry of a ``.distcp`` file read within its file (a regular
        file, opened through no link) and loaded by :func:`trainkit.checkpoint.load_archive`.

        :param directory: The checkpoint directory (verified with :func:`verify_directory` first).
        """

        def __init__(self, directory: Path) -> None:
            super().__init__(str(directory))
            self.directory = Path(directory)

        def read_metadata(self) -> Any:  # no **kwargs: DCP would then try a rank's own __<rank>.metadata too
            """Read ``.metadata`` with :func:`read_metadata`.

            :returns: DCP's ``Metadata``.
            """
            metadata = read_metadata(self.directory)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            """Read the entries of ``plan`` into ``planner``'s state dict.

            :param plan: DCP's load plan for this rank.
            :param planner: A ``SafeLoadPlanner``.
            :returns: A completed future.
            :raises CheckpointError: When an entry cannot be read, or holds what trainkit does not load.
            """
            from torch.distributed.checkpoint.planner import LoadItemType
            from torch.futures import Future

            if not isinstance(planner, _dcp_classes()[1]):
                raise TypeError("SafeReader reads for a SafeLoadPlanner only")
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                path = self.directory / name
                try:
                    fd, info = open_regular(path)
                except UnreadableFile as exc:
                    raise CheckpointCorruptError(str(exc)) from None
                try:
                    for item in sorted(items, key=lambda item: self.storage_data[item.storage_index].offset):
                        stored = self.storage_data[item.storage_index]
                        what = f"{path}, entry {item.storage_index.fqn!r}"
                        data = _read_span(fd, info.st_size, stored.offset, stored.length, what)
                        value = load_archive(data, what)
                        if item.type == LoadItemType.BYTE_IO:
                            planner.set_value(item, value)
                            continue
                        if type(value) is not torch.Tensor:
                            raise CheckpointCorruptError(
                                f"{what} holds a {type(value).__name__} where a tensor is stored"
                            )
                        tensor = torch_private.narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != tensor.size():
                            raise CheckpointCorruptError(
                                f"{what} holds a {tuple(tensor.size())} slice where {tuple(target.size())} is read"
                            )
                        target.copy_(tensor)
                        planner.commit_tensor(item, target)
                finally:
                    os.close(fd)
            done: Future = Future()
            done.set_result(None)
            return done

    SafeReader.__qualname__, SafeLoadPlanner.__qualname__ = "SafeReader", "SafeLoadPlanner"
    return SafeReader, SafeLoadPlanner


def __getattr__(name: str) -> Any:
    if name in ("SafeReader", "SafeLoadPlanner"):
        reader, planner = _dcp_classes()
        return reader if name == "SafeReader" else planner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _read_span(fd: int, file_size: int, offset: int, length: int, what: str) -> bytes:
    if offset + length > file_size:
        raise CheckpointCorruptError(f"{what} lies past the end of its file ({file_size} bytes)")
    parts, position, end = [], offset, offset + length
    while position < end:
        part = os.pread(fd, min(_CHUNK, end - position), position)
        if not part:
            raise CheckpointCorruptError(f"{what} ends early: its file was cut short while it was read")
        parts.append(part)
        position += len(part)
    return b"".join(parts)


def load_into(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> dict[str, Any]:
    """``dcp.load`` of ``state`` from ``directory`` through ``SafeReader`` and ``SafeLoadPlanner``.

    Side effects: reads the directory's files; DCP's collectives unless ``no_dist``.

    :param state: The template (tensors and DTensors of this run's shapes and shards), filled in place.
    :param directory: The checkpoint directory.
    :param no_dist: Read in this process alone, even inside a process group.
    :returns: ``state``.
    :raises CheckpointUnsafeError: When an entry holds what trainkit does not load (a class, code, a pickle built
        to crash its reader), naming the file and the entry.
    :raises CheckpointCorruptError: When DCP cannot read an entry (a missing key, a shape that changed, damage).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    SafeReader, SafeLoadPlanner = _dcp_classes()  # noqa: N806 - the classes, made at first use
    try:
        dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        cause = _trainkit_error(exc)
        if isinstance(cause, CheckpointUnsafeError):
            raise CheckpointUnsafeError(str(cause), cause.type_name, cause.location) from exc
        detail = str(cause) if cause is not None else _why(exc)
        raise CheckpointCorruptError(
            f"{directory}: the sharded state could not be read into the registered items ({detail}); "
            "register the same modules and optimizers as the run that wrote it"
        ) from exc
    return state


def _trainkit_error(exc: BaseException) -> CheckpointError | None:
    """The trainkit error behind a DCP failure (DCP wraps each rank's error in its ``CheckpointException``)."""
    if isinstance(exc, CheckpointError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, CheckpointUnsafeError):
            return error
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, CheckpointError):
            return error
    return None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def entries_of(metadata: Any, key: str) -> Iterable[tuple[str, Any]]:
    """The tensor entries of one top-level item (``"model"``, say) in checked metadata, without the prefix.

    :param metadata: What :func:`read_metadata` returned.
    :param key: The item.
    :returns: ``(name, TensorStorageMetadata)`` pairs.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{key}."
    for name, entry in metadata.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            yield name[len(prefix) :], entry
