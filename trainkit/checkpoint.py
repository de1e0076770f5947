"""Checkpoint files: atomic, durable writes; verified, code-free reads; RNG capture.

Side effects: file I/O. Payloads hold only tensors and plain Python values, so every checkpoint loads
with ``torch.load(..., weights_only=True)``; trainkit never loads with ``weights_only=False``. Numpy numeric
values, slices and ``b""`` also load, through :func:`load_checkpoint`'s own checked allowlist (a bare
``torch.load`` refuses them); :func:`check_loadable` refuses anything else before a save.
"""

from __future__ import annotations

import datetime
import enum
import errno
import functools
import importlib.util
import io
import itertools
import math
import numbers
import os
import pickle
import re
import shutil
import stat
import struct
import sys
import threading
import time
import types
import zipfile
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointUnsafeError
from trainkit.messages import warn_user
from trainkit.pickle_scan import PickleRefused, PickleUnsafe, check_pickle

# they lived here before trainkit.rng gathered every generator's seeding, capture and restore
from trainkit.rng import capture_rng, restore_rng, seed_everything  # noqa: F401

__all__ = [
    "atomic_save",
    "previous_path",
    "load_checkpoint",
    "load_archive",
    "verify_checkpoint",
    "check_loadable",
    "capture_rng",
    "restore_rng",
    "seed_everything",
    "remove_stale_temp_files",
    "payload_nbytes",
    "warn_if_low_on_space",
    "fsync_directory",
    "current_umask",
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


def atomic_save(payload: Any, path: str | os.PathLike[str], *, keep_previous: bool = False) -> float:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the new one, never a torn one.

    Side effects: serializes straight into a temp file in the same directory, flushes, fsyncs,
    ``os.replace``\\ s it over ``path`` and fsyncs the directory. On any failure the temp file is removed
    and ``path`` is left byte-identical.

    :param payload: Tensors and plain Python values.
    :param path: The destination file.
    :param keep_previous: Keep the file being replaced as :func:`previous_path` (a hard link, so no copy),
        for a fallback when the newest one turns out corrupted.
    :returns: The seconds the save took.
    :raises CheckpointError: On a full disk, naming the path, the bytes written so far and the bytes free.
    """
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
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if keep_previous:
            _link_previous(target, names)
        os.replace(tmp, target)
    except BaseException as exc:
        written = _size_or_zero(tmp)
        with suppress(OSError):
            os.unlink(tmp)
        full = _disk_full_error(exc)
        if full is not None:
            free = shutil.disk_usage(names.directory).free
            needed = max(payload_nbytes(payload), written)
            raise CheckpointError(
                f"cannot write checkpoint {target}: no space left after {written} bytes; about {needed} bytes "
                f"are needed and {free} bytes are free; {target} was left unchanged"
            ) from full
        raise
    fsync_directory(names.directory)
    return time.perf_counter() - start


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
    leave no previous file at all if the process were killed in between.
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
            if exc.errno not in _NO_HARD_LINKS:
                raise
            try:
                _copy_new_file(path, link_tmp)  # no hard links on this filesystem: a copy into a file of our own
                break
            except FileExistsError:
                continue
    os.replace(link_tmp, names.previous)


_NO_HARD_LINKS = frozenset(
    code for code in (errno.EPERM, errno.EXDEV, errno.EMLINK, getattr(errno, "ENOTSUP", None)) if code is not None
)
"""``link()`` errors that mean the filesystem has no hard links here (FAT, some network mounts)."""

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
"""A file trainkit creates: never one that exists already, never through a symbolic link."""


def _copy_new_file(source: str, target: str) -> None:
    """Copy ``source`` into a file created for it at ``target`` (``FileExistsError`` if anything is there)."""
    fd = os.open(target, _NEW_FILE_FLAGS, _FILE_MODE)
    try:
        with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
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


def payload_nbytes(payload: Any) -> int:
    """Estimate a payload's size on disk: the bytes of every tensor storage in it, counted once.

    :param payload: Nested dicts, lists and tuples of tensors and plain values.
    :returns: The total tensor bytes (pickled plain values are small next to them and not counted).
    """
    seen: set[int] = set()
    total = 0
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
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


_TEMP_NAME = re.compile(r"^\.(?:last|best)(?:\.prev)?\.pt\.(?P<pid>\d+)\.\d+\.tmp$")
"""The temp files trainkit's own saves make: ``.last.pt.<pid>.<n>.tmp``, ``.best.prev.pt.<pid>.<n>.tmp``, ..."""


def _process_gone(pid: int) -> bool:
    """Whether no process with this id runs on this machine (a pid reused since errs on the side of keeping)."""
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
        found = _TEMP_NAME.match(entry.name)
        if found is None or not entry.is_file(follow_symlinks=False) or not _process_gone(int(found["pid"])):
            continue
        with suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


# --- What a checkpoint may hold ---------------------------------------------------------------------------------
#
# torch's weights_only unpickler builds tensors, torch.Size/dtype/device/layout, None, bool, int, float, complex,
# str, bytes, bytearray, dict, OrderedDict, Counter, list, tuple and set. trainkit adds, for the load only (a scoped
# torch.serialization.safe_globals, never the process-wide add_safe_globals), what state_dicts commonly hold: slices,
# empty bytes (protocol 2 writes ``b""`` as ``bytes()``), and numpy scalars and arrays of the numeric dtypes below.
# The names a file uses for those are bound to trainkit's own checked builders, never to numpy's unpickling: numpy's
# ``dtype.__setstate__`` takes any flags and fields, so a crafted file could build a float64 that claims to hold
# object pointers. check_loadable() refuses before a save whatever this load would refuse.

_NUMPY_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
"""The numpy dtypes a checkpoint may hold, as a pickle names them (kind and item size): bool, signed and unsigned
integers, float16/32/64, complex64/128. Object, string, datetime, structured and extended-precision dtypes are
refused: object arrays hold arbitrary objects, the others need more of numpy's unpickling than the raw bytes."""

_SCOPED_ALLOWLIST = torch.__version__ >= (2, 6)
"""torch 2.6+ takes ``(callable, "dotted.name")`` pairs in ``safe_globals``, which bind a file's names to trainkit's
builders; with an older torch only torch's own allowlist applies, and check_loadable refuses the rest."""

_LEAF_TYPES = frozenset(
    {
        type(None),
        bool,
        float,
        complex,
        str,
        bytearray,
        torch.Tensor,
        torch.nn.Parameter,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.Size,
    }
    | ({bytes} if _SCOPED_ALLOWLIST else set())  # older torch cannot load b"" (see _why_not_loadable)
)
"""Types that load as they are, without looking inside (a tensor's data, a torch.Size's ints). ``int`` is not
one: torch's unpickler has no LONG4, so an int of 2**2039 or more saves but does not load."""

_INT_LIMIT = 2**2039
"""Ints strictly between ``-_INT_LIMIT`` and ``_INT_LIMIT`` pickle as LONG1 (255 bytes at most) or shorter."""

_MAPPING_TYPES = frozenset({dict, OrderedDict, Counter})

_ITEM, _KEY, _MEMBER, _ATTR = range(4)  # how a value hangs off its parent, for the key path in a refusal


def check_loadable(payload: Mapping[str, Any]) -> None:
    """Refuse, before a save, a payload that :func:`load_checkpoint` could not load back.

    Walks dicts (``OrderedDict``, ``Counter``), lists, tuples, sets and slices; tensors (``nn.Parameter``
    included), ``torch.Size``/``dtype``/``device``/``layout`` and plain scalars are leaves; numpy scalars, arrays
    and dtypes must be of a numeric dtype (bool, ints, uints, float16/32/64, complex64/128). Types the caller put on
    torch's process-wide allowlist (``torch.serialization.add_safe_globals``) are accepted as they are. Shared and
    cyclic containers are visited once; nothing inside a tensor is looked at. It costs about 0.1 microseconds per
    container entry: some 70 microseconds for the AdamW ``state_dict()`` of a 100-tensor model.

    >>> import torch
    >>> check_loadable({"model": {"w": torch.zeros(2)}, "sched": {"last_epoch": 3, "milestones": [1, 2]}})
    >>> check_loadable({"sampler": {"rng": {"gen": lambda: 0}}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointUnsafeError: checkpoint item 'sampler' holds a function at sampler['rng']['gen'] ...

    :param payload: The checkpoint payload: item name to value.
    :raises CheckpointUnsafeError: Naming the item, the key path, the type and the fix, for the first value that
        would not load; also when ``payload`` is not a dict.
    """
    if type(payload) not in _MAPPING_TYPES:
        name = _type_name(type(payload))
        raise CheckpointUnsafeError(
            f"a checkpoint payload must be a dict of items, got a {name}; put the values under item names",
            name,
        )
    leaves, mappings, limit = _LEAF_TYPES, _MAPPING_TYPES, _INT_LIMIT
    numpy = sys.modules.get("numpy") if _SCOPED_ALLOWLIST else None  # no numpy loaded: no numpy values to check
    seen: set[int] = set()
    for name, item in payload.items():
        stack: list[tuple[Any, Any]] = [(item, None)]
        pop, push = stack.pop, stack.append
        while stack:
            obj, crumb = pop()
            kind = type(obj)
            if kind in mappings:
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                for key, value in obj.items():
                    if type(key) not in leaves and not (type(key) is int and -limit < key < limit):
                        push((key, (crumb, _KEY, key)))
                    if type(value) not in leaves and not (type(value) is int and -limit < value < limit):
                        push((value, (crumb, _ITEM, key)))
                if kind is OrderedDict and obj.__dict__:  # a module's state_dict: _metadata is saved with it
                    for attr, value in obj.__dict__.items():
                        push((value, (crumb, _ATTR, attr)))
            elif kind is list or kind is tuple:
                if kind is list:
                    if id(obj) in seen:
                        continue
                    seen.add(id(obj))
                for index, value in enumerate(obj):
                    if type(value) not in leaves and not (type(value) is int and -limit < value < limit):
                        push((value, (crumb, _ITEM, index)))
            elif kind is set:
                for member in obj:
                    if type(member) not in leaves and not (type(member) is int and -limit < member < limit):
                        push((member, (crumb, _MEMBER, None)))
            elif kind is slice and _SCOPED_ALLOWLIST:
                for attr in ("start", "stop", "step"):
                    push((getattr(obj, attr), (crumb, _ATTR, attr)))
            elif kind not in leaves:
                refused = _why_not_loadable(obj, numpy)
                if refused is not None:
                    type_name, hint = refused
                    location = _location(name, crumb)
                    raise CheckpointUnsafeError(
                        f"checkpoint item {name!r} holds a {type_name} at {location} that cannot be loaded safely "
                        f"(trainkit loads with weights_only=True); {hint}",
                        type_name,
                        location,
                    )


def _location(name: Any, crumb: Any) -> str:
    """Render a key path such as ``sampler['rng']['gen']`` from the crumbs the walk left (only on a refusal)."""
    steps = []
    while crumb is not None:
        crumb, how, key = crumb
        steps.append((how, key))
    text = str(name)
    for how, key in reversed(steps):
        if how == _ITEM:
            text += f"[{key!r}]"
        elif how == _KEY:
            text += "[<key>]"  # the value is a key of the dict at ``text``
        elif how == _MEMBER:
            text += "{<member>}"
        else:
            text += f".{key}"
    return text


def _type_name(kind: type) -> str:
    module = getattr(kind, "__module__", "")
    qualname = getattr(kind, "__qualname__", repr(kind))
    return qualname if module in ("builtins", "", None) else f"{module}.{qualname}"


def _why_not_loadable(obj: Any, numpy: Any) -> tuple[str, str] | None:
    """Return ``(type name, fix)`` for a value that would not load, None for one that would (the walk's slow path)."""
    kind = type(obj)
    if kind is int:
        if -_INT_LIMIT < obj < _INT_LIMIT:
            return None
        return f"very large int ({obj.bit_length()} bits)", "store str(value), or split it into ints below 2**2039"
    if kind is bytes:  # only reached with a torch older than 2.6, which loads every bytes value but b""
        return None if obj else ("empty bytes value", "store None or a non-empty value instead (torch < 2.6)")
    if numpy is not None and (kind is numpy.ndarray or isinstance(obj, numpy.generic | numpy.dtype)):
        dtype = obj if isinstance(obj, numpy.dtype) else obj.dtype
        if _numpy_dtype_loads(dtype) and (not isinstance(obj, numpy.generic) or kind is dtype.type):
            return None
        what = "numpy.dtype" if isinstance(obj, numpy.dtype) else _type_name(kind)
        return f"{what} of dtype {dtype}", (
            "only numpy values of bool, integer, float16/32/64 and complex64/128 dtypes load; store .tolist(), "
            ".item() or a tensor instead"
        )
    if kind in _user_allowed_types():
        return None  # the caller allowlisted it process-wide, so torch.load(weights_only=True) builds it
    return _type_name(kind), _fix_for(obj, kind)


@functools.lru_cache(maxsize=64)
def _numpy_dtype_loads(dtype: Any) -> bool:
    """True for a dtype :class:`_NumpyDtype` rebuilds: numeric, no fields, no sub-array, no metadata."""
    return (
        dtype.fields is None
        and dtype.subdtype is None
        and dtype.metadata is None
        and f"{dtype.kind}{dtype.itemsize}" in _NUMPY_CODES
        and dtype.kind in "biufc"
    )


def _user_allowed_types() -> set[Any]:
    allowed = set()
    for entry in torch.serialization.get_safe_globals():
        allowed.add(entry[0] if isinstance(entry, tuple) else entry)
    return allowed


def _fix_for(obj: Any, kind: type) -> str:
    """How to turn a refused value into one that loads, for the types state_dicts hold by mistake."""
    module = kind.__module__ or ""
    if module.startswith("numpy.random"):
        return (
            "store generator.bit_generator.state (a dict of ints) and set it back in load_state_dict(), or "
            "random_state.get_state(legacy=False)"
        )
    if isinstance(obj, torch.Tensor):
        return "store a plain tensor instead: value.as_subclass(torch.Tensor)"
    if isinstance(obj, torch.Generator):
        return "store generator.get_state() (a uint8 tensor) and restore it with set_state()"
    if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType | types.MethodType | functools.partial):
        return "store the name or the arguments that recreate it, not the callable itself"
    if isinstance(obj, enum.Enum):
        return "store member.value or member.name"
    if isinstance(obj, datetime.timedelta):
        return "store value.total_seconds()"
    if isinstance(obj, datetime.date | datetime.time):
        return "store value.isoformat() or a timestamp"
    if isinstance(obj, os.PathLike):
        return "store str(path)"
    if isinstance(obj, tuple):
        return "store tuple(value), or value._asdict() for a named tuple"
    if isinstance(obj, dict):
        return "store dict(value)"
    if isinstance(obj, frozenset):
        return "store set(value) or a sorted list"
    if isinstance(obj, range):
        return "store (start, stop, step) or list(value)"
    if isinstance(obj, numbers.Number):
        return "store float(value), int(value) or str(value)"
    return (
        "return plain values from its state_dict() instead: tensors, numbers, strings, bytes, numeric numpy arrays, "
        "and lists, tuples, dicts and sets of them"
    )


# Load side: the names a file may use beyond torch's own allowlist, bound to checked builders.

_LOADING = threading.local()
"""Per thread: ``arrays``, the :class:`_NumpyArray` recipes the running load built (None outside a load), and
``refused``, the numpy dtype it refused as a type (not as damage)."""


def _refuse(reason: str) -> NoReturn:
    raise pickle.UnpicklingError(f"trainkit refused {reason}")


class _NumpyDtype:
    """What the name ``numpy.dtype`` builds in a checkpoint: a checked recipe, turned into a real dtype by its users.

    numpy pickles a dtype as ``dtype(code, False, True)`` followed by a BUILD with
    ``(3, byteorder, None, None, None, -1, -1, 0)`` for every numeric dtype; anything else is refused here, so
    numpy's own ``dtype.__setstate__`` never sees a file's state.
    """

    __slots__ = ("code", "byteorder")

    def __new__(cls, code: object = None, align: object = False, copy: object = True) -> _NumpyDtype:
        if type(code) is not str or type(align) not in (bool, int) or align or type(copy) not in (bool, int):
            _refuse("a malformed numpy dtype")
        if code not in _NUMPY_CODES:
            _LOADING.refused = f"numpy dtype {code[:16]!r}"  # an intact file holding e.g. an object array
            _refuse(f"numpy dtype {code[:16]!r}")
        self = object.__new__(cls)
        self.code = code
        self.byteorder = "="
        return self

    def __setstate__(self, state: object) -> None:
        plain = (None, None, None, -1, -1, 0)  # no subarray, names, fields; default size, alignment; no flags
        if not (
            type(state) is tuple
            and len(state) == 8
            and type(state[0]) is int
            and state[0] == 3
            and type(state[1]) is str
            and state[1] in ("<", ">", "|", "=")
            and all(type(got) is type(want) and got == want for got, want in zip(state[2:], plain))
        ):
            _refuse("a numpy dtype state that numpy does not write for a numeric dtype")
        self.byteorder = state[1]


def _real_dtype(dtype: object) -> Any:
    if type(dtype) is _NumpyDtype:
        import numpy  # a file naming numpy globals only gets here when numpy is installed (_load_allowlist)

        return numpy.dtype(dtype.code).newbyteorder(dtype.byteorder)
    # numpy's own dtype, where the caller put numpy on torch's process-wide allowlist: check what it built
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(dtype, numpy.dtype) or dtype.flags or not _numpy_dtype_loads(dtype):
        _refuse("a numpy value whose dtype is not a checked numeric dtype")
    return dtype


class _NumpyArrayClass:
    """What the name ``numpy.ndarray`` builds in a checkpoint: a marker only :func:`_numpy_reconstruct` accepts.

    The real class would let a file call ``numpy.ndarray(shape, dtype, buffer, offset, strides)`` at will.
    """

    def __new__(cls, *args: object, **kwargs: object) -> NoReturn:
        _refuse("a direct call of numpy.ndarray")


_RECIPE_TOKEN = object()


class _NumpyArray:
    """What ``numpy.core.multiarray._reconstruct`` builds in a checkpoint: the array, made once its state is checked.

    :func:`load_checkpoint` puts :attr:`array` in its place wherever it sits in the payload.
    """

    __slots__ = ("array",)

    def __new__(cls, token: object = None) -> _NumpyArray:
        if token is not _RECIPE_TOKEN:
            _refuse("a direct call of a trainkit numpy builder")
        return object.__new__(cls)

    def __setstate__(self, state: object) -> None:
        # (version, shape, dtype, Fortran order, raw bytes), as ndarray.__reduce__ writes it
        if not (type(state) is tuple and len(state) == 5):
            _refuse("a malformed numpy array state")
        version, shape, dtype, fortran, data = state
        if not (
            type(version) is int
            and version == 1
            and type(shape) is tuple
            and all(type(n) is int and n >= 0 for n in shape)
            and type(fortran) is bool
            and type(data) is bytes
        ):
            _refuse("a malformed numpy array state")
        real = _real_dtype(dtype)
        if len(data) != math.prod(shape) * real.itemsize:
            _refuse("a numpy array whose bytes do not match its shape and dtype")
        reconstruct, _ = _numpy_builders()
        import numpy

        array = reconstruct(numpy.ndarray, (0,), b"b")
        array.__setstate__((1, shape, real, fortran, data))  # numpy's own, on a dtype and bytes checked above
        self.array = array


def _numpy_reconstruct(subtype: object = None, shape: object = None, typecode: object = None) -> _NumpyArray:
    """What ``numpy.core.multiarray._reconstruct`` names in a checkpoint (numpy 1 and 2 spellings alike)."""
    arrays = getattr(_LOADING, "arrays", None)
    if arrays is None:  # another thread's torch.load while trainkit's allowlist is in place
        _refuse("a numpy array outside trainkit.checkpoint.load_checkpoint")
    if subtype is not _NumpyArrayClass:  # plain arrays only: matrix, memmap and masked arrays name other globals
        _refuse("a numpy array of a subclass")
    recipe = _NumpyArray(_RECIPE_TOKEN)
    arrays.append(recipe)
    return recipe


def _numpy_scalar(dtype: object = None, data: object = None) -> Any:
    """What ``numpy.core.multiarray.scalar`` names in a checkpoint (numpy 1 and 2): a number of a checked dtype."""
    real = _real_dtype(dtype)
    if type(data) is not bytes or len(data) != real.itemsize:
        _refuse("a numpy scalar whose bytes do not match its dtype")
    return _numpy_builders()[1](real, data)


@functools.cache
def _numpy_builders() -> tuple[Any, Any]:
    """numpy's own ``_reconstruct`` and ``scalar``, found the way pickle finds them in any numpy version."""
    import numpy

    return numpy.zeros(0).__reduce__()[0], numpy.float64(0).__reduce__()[0]


def _slice(*args: object) -> slice:
    """What ``builtins.slice`` names in a checkpoint: a slice is inert, whatever its start, stop and step."""
    if not 1 <= len(args) <= 3:
        _refuse("a malformed slice")
    return slice(*args)


def _empty_bytes(*args: object) -> bytes:
    """What ``builtins.bytes`` names in a checkpoint: pickle protocol 2 writes ``b""`` as ``bytes()``."""
    if args:  # bytes(n) would allocate n bytes of a file's choosing
        _refuse("builtins.bytes called with arguments")
    return b""


@functools.cache
def _numpy_installed() -> bool:
    # sys.modules["numpy"] = None is how a process blocks numpy; find_spec answers None for it too
    return sys.modules.get("numpy") is not None or importlib.util.find_spec("numpy") is not None


@functools.cache
def _allowlist() -> tuple[tuple[Any, str], ...]:
    entries = [(_slice, "builtins.slice"), (_empty_bytes, "builtins.bytes")]
    if _numpy_installed():  # without numpy, a file's numpy names stay refused and the error says to install it
        entries += [
            (_NumpyDtype, "numpy.dtype"),
            (_NumpyArrayClass, "numpy.ndarray"),
            (_NumpyArray, "trainkit.checkpoint._NumpyArray"),  # torch sets state (BUILD) on allowlisted types only
        ]
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1.x and 2.x write different names
            entries += [(_numpy_reconstruct, f"{module}._reconstruct"), (_numpy_scalar, f"{module}.scalar")]
    return tuple(entries)


_ALLOWLIST_LOCK = threading.Lock()
_allowlist_users = 0
_allowlist_added: list[Any] = []


@contextmanager
def _load_allowlist() -> Iterator[None]:
    """Add trainkit's names to torch's weights_only allowlist for the duration of a load, then take them out.

    Counted, so that loads in two threads do not take the names out from under each other. Only trainkit's own
    entries are taken out again: what the caller put on the allowlist stays, and so does what torch itself adds
    while the load runs (its lazily imported modules register their types then), which torch's own
    ``safe_globals`` context would drop by restoring the list as it was.
    """
    global _allowlist_users, _allowlist_added
    if not _SCOPED_ALLOWLIST:
        yield
        return
    with _ALLOWLIST_LOCK:
        if _allowlist_users == 0:
            present = set(torch.serialization.get_safe_globals())
            _allowlist_added = [entry for entry in _allowlist() if entry not in present]
            torch.serialization.add_safe_globals(list(_allowlist_added))
        _allowlist_users += 1
    try:
        yield
    finally:
        with _ALLOWLIST_LOCK:
            _allowlist_users -= 1
            if _allowlist_users == 0 and _allowlist_added:
                ours = set(_allowlist_added)
                kept = [entry for entry in torch.serialization.get_safe_globals() if entry not in ours]
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(kept)
                _allowlist_added = []


def _put_arrays_in_place(obj: Any, memo: dict[int, tuple[Any, Any]], reached: set[int]) -> Any:
    """Return ``obj`` with every :class:`_NumpyArray`/:class:`_NumpyDtype` recipe in it replaced by the real thing.

    Mutable containers are updated in place (shared ones once, cycles end), tuples and slices rebuilt.
    """
    kind = type(obj)
    if kind is _NumpyArray:
        reached.add(id(obj))  # the recipes stay alive in the load's list, so their ids are not reused
        array = getattr(obj, "array", None)
        if array is None:
            _refuse("a numpy array without its data")
        return array
    if kind is _NumpyDtype:
        return _real_dtype(obj)
    if kind in _LEAF_TYPES or kind is int:
        return obj
    if id(obj) in memo:
        return memo[id(obj)][1]
    memo[id(obj)] = (obj, obj)  # the original is kept alive, so no new object can take its id during the walk
    if kind in _MAPPING_TYPES:
        items = [
            (_put_arrays_in_place(key, memo, reached), _put_arrays_in_place(value, memo, reached))
            for key, value in obj.items()
        ]
        obj.clear()
        for key, value in items:  # not update(): Counter.update would count the pairs
            obj[key] = value
        if kind is OrderedDict:
            for attr, value in list(obj.__dict__.items()):
                setattr(obj, attr, _put_arrays_in_place(value, memo, reached))
    elif kind is list:
        obj[:] = [_put_arrays_in_place(value, memo, reached) for value in obj]
    elif kind is set:
        members = [_put_arrays_in_place(member, memo, reached) for member in obj]
        obj.clear()
        obj.update(members)
    elif kind is tuple or kind is slice:
        parts = list(obj) if kind is tuple else [obj.start, obj.stop, obj.step]
        new = [_put_arrays_in_place(part, memo, reached) for part in parts]
        if any(a is not b for a, b in zip(new, parts)):
            rebuilt = tuple(new) if kind is tuple else slice(*new)
            memo[id(obj)] = (obj, rebuilt)
            return rebuilt
    return obj


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


class _Member(NamedTuple):
    name: str
    raw_name: bytes
    offset: int  # of its local header
    size: int
    crc: int


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((kind for test, kind in kinds if test(mode)), f"a special file (mode {mode:#o})")


def _not_a_file(path: Path, mode: int) -> CheckpointCorruptError:
    what = _file_kind(mode)
    if os.path.islink(path):
        what = f"a symbolic link to {what} ({os.path.realpath(path)})"
    return CheckpointCorruptError(f"checkpoint {path} is {what}, not a regular file; it was not read")


def _open_checkpoint(path: Path) -> tuple[Any, os.stat_result]:
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
        raise CheckpointCorruptError(f"checkpoint {path} could not be opened: {_reason(exc)}") from exc
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


def _reason(exc: BaseException) -> str:
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


class _InMemory(NamedTuple):
    """An archive held in memory (an entry of a sharded checkpoint's ``.distcp`` file), read like an open file."""

    data: bytes


def _pread(file: Any, offset: int, size: int) -> bytes:
    """Up to ``size`` bytes at ``offset``: positional where the OS has pread, so seeks for holes cannot interfere."""
    if type(file) is _InMemory:
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


def _directory_entries(path: Path, file: Any, size: int) -> tuple[list[_Member], int]:
    """Read and check the central directory; return its members and where it starts.

    A member is refused on what its entry declares (compressed, encrypted, a size or an offset beyond the file,
    a name torch.save does not write) before any of its bytes is read.
    """
    cd_offset, cd_size, entries = _directory_end(path, file, size)
    directory = _read_at(path, file, cd_offset, cd_size)  # no more than the file holds
    members: list[_Member] = []
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
        members.append(_Member(name, raw_name, offset, unpacked, crc))
    if at != cd_size:
        raise _damaged(path, "its central directory is longer than its entries")
    if f"{folder}/data.pkl" not in names:
        raise _foreign(path, "an archive without a data.pkl")
    return members, cd_offset


def _member_data(path: Path, file: Any, size: int) -> list[tuple[_Member, int]]:
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


def _check_crcs(path: Path, file: Any, spans: list[tuple[_Member, int]]) -> None:
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


def _verify_open(path: Path, file: Any, info: os.stat_result) -> list[tuple[_Member, int]]:
    try:
        spans = _member_data(path, file, info.st_size)
        _check_crcs(path, file, spans)
        _check_data_pickle(path, file, spans)
    except OSError as exc:  # a read error (EIO on a bad sector)
        raise CheckpointCorruptError(f"checkpoint {path} could not be read: {_reason(exc)}") from exc
    return spans


def _check_data_pickle(path: Any, file: Any, spans: list[tuple[_Member, int]]) -> None:
    """Bound the archive's pickle before torch unpickles it (:func:`trainkit.pickle_scan.check_pickle`).

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


def _check_unchanged(path: Path, file: Any, info: os.stat_result) -> None:
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
    file, info = _open_checkpoint(path)
    with file:
        _verify_open(path, file, info)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Verify and load a checkpoint with ``weights_only=True``: no code from the file ever runs.

    Besides torch's own allowlist, slices, empty bytes and numpy scalars, arrays and dtypes of numeric dtypes
    load (:func:`check_loadable` lists them), through trainkit's checked builders and only for this call.

    The file is opened once (only if it is a regular file), verified by the checks of :func:`verify_checkpoint`,
    and ``torch.load`` reads that same open file: a file swapped in at ``path`` meanwhile is never loaded, and one
    written into in place meanwhile (its size or modification time changed) is refused.

    :param path: The checkpoint file.
    :param map_location: Where tensors go, ``"cpu"`` by default.
    :returns: The payload dict.
    :raises CheckpointCorruptError: When the file fails verification, changed while it was read, or cannot be
        read as a checkpoint (a pickle nested too deeply for Python included).
    :raises CheckpointUnsafeError: When the file is intact but holds a type trainkit does not load (a class,
        a function, a numpy object array...), naming it; unlike a corrupt file, an older copy is no better.
    """
    path = Path(path)
    file, info = _open_checkpoint(path)
    with file:
        _verify_open(path, file, info)
        file.seek(0)
        payload = _safe_load(path, file, map_location, unchanged=lambda: _check_unchanged(path, file, info))
        _check_unchanged(path, file, info)
    if not isinstance(payload, dict):
        raise CheckpointCorruptError(f"checkpoint {path} holds a {type(payload).__name__}, not a dict")
    return payload


def load_archive(data: bytes, name: str, map_location: Any = "cpu") -> Any:
    """Load one ``torch.save`` archive held in memory with the checks of :func:`load_checkpoint`, but its CRCs.

    For the entries of a sharded checkpoint's ``.distcp`` files (each a ``torch.save`` of one tensor or one plain
    value), whose whole file's CRC-32 the checkpoint's manifest already checked: the zip structure is checked
    from its records, the pickle bounded, and the entry loaded with ``weights_only=True`` (trainkit's numpy and
    slice builders included), so no code from it runs.

    :param data: The archive's bytes.
    :param name: What names it in an error, e.g. ``"last.ckpt/__0_0.distcp, entry 'optimizer.param_groups.0.lr'"``.
    :param map_location: Where tensors go.
    :returns: The loaded value (any type ``weights_only`` builds, not only a dict).
    :raises CheckpointCorruptError: When the archive is not one ``torch.save`` writes, or cannot be read.
    :raises CheckpointUnsafeError: When it holds a type trainkit does not load, or a pickle built to crash its
        reader; also when it is not a zip archive at all (a legacy ``torch.save`` pickle, which trainkit never
        writes there and which ``weights_only`` may not refuse in time).
    """
    if not data.startswith(b"PK\x03\x04"):
        raise CheckpointUnsafeError(
            f"{name} was refused: it is not a zip archive as torch.save writes one (it starts {data[:8]!r}), so it "
            "was not unpickled; a legacy torch.save pickle there is what a planted entry looks like",
            "a legacy torch.save pickle",
        )
    memory = _InMemory(data)
    spans = _member_data(name, memory, len(data))  # type: ignore[arg-type]
    _check_data_pickle(name, memory, spans)
    return _safe_load(name, io.BytesIO(data), map_location, unchanged=lambda: None)


def _safe_load(path: Any, file: Any, map_location: Any, *, unchanged: Any) -> Any:
    """``torch.load(file, weights_only=True)`` with trainkit's allowlist, refusals turned into trainkit's errors
    and numpy recipes put back in place; ``unchanged()`` refuses a file written into meanwhile."""
    _LOADING.arrays, _LOADING.refused = [], None
    try:
        with _load_allowlist():
            payload = torch.load(file, map_location=map_location, weights_only=True, mmap=False)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        unchanged()  # a file changed under the load explains whatever went wrong
        if isinstance(exc, pickle.UnpicklingError):
            raise _refusal(path, str(exc), _LOADING.refused) from exc
        # RecursionError is a RuntimeError
        raise CheckpointCorruptError(f"checkpoint {path} could not be read: {_reason(exc)}") from exc
    finally:
        arrays, _LOADING.arrays, _LOADING.refused = _LOADING.arrays, None, None
    if arrays:
        reached: set[int] = set()
        try:
            payload = _put_arrays_in_place(payload, {}, reached)
        except (pickle.UnpicklingError, RecursionError) as exc:
            raise CheckpointCorruptError(f"checkpoint {path} could not be read: {_reason(exc)}") from exc
        if len(reached) < len(arrays):
            raise CheckpointUnsafeError(
                f"checkpoint {path} was refused: it holds a numpy array inside a tensor's attributes, where trainkit "
                "does not rebuild one; the file is intact, not corrupt. Keep numpy arrays in the state dicts "
                "themselves and save again",
                "numpy.ndarray",
            )
    return payload


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED_BUILD = re.compile(r"Can only (?:build|create new object for) .* but got <class '([\w.]+)'>")
_IMPORT_NEEDED = re.compile(r"must be imported to load ([\w ()]+)")


def _refusal(path: str | os.PathLike[str], message: str, refused: str | None) -> CheckpointError:
    """Turn torch's weights_only refusal into an error: an intact file holding a type trainkit does not load is
    :class:`CheckpointUnsafeError`, anything else (a pickle no ``torch.save`` writes) :class:`CheckpointCorruptError`.

    The file passed its CRC check, so a refused global is what was saved, not damage: falling back to an older
    copy would silently lose the newest state, and the older copy most likely holds the same type.
    """
    if refused is None:
        found = _REFUSED_GLOBAL.search(message) or _REFUSED_BUILD.search(message) or _IMPORT_NEEDED.search(message)
        if found is not None:
            refused = found.group(1).strip()
        elif f"Unsupported operand {pickle.LONG4[0]}" in message:  # what torch.save writes for an int >= 2**2039
            refused = "an int of 2**2039 or more"
    if refused is not None:
        if refused.startswith("numpy") and not _numpy_installed():
            return CheckpointUnsafeError(
                f"checkpoint {path} was refused: it holds numpy values ({refused}) and numpy is not installed; "
                "install numpy to load it (the file is intact, not corrupt)",
                refused,
            )
        return CheckpointUnsafeError(
            f"checkpoint {path} was refused: it holds {refused}, which is not a tensor or plain value, and trainkit "
            "only loads with weights_only=True, so no code from a file ever runs; the file is intact, not corrupt. "
            "Make the state_dict() of the object that held it return plain values (tensors, numbers, strings, bytes, "
            "numeric numpy arrays, and lists, tuples, dicts and sets of them) and save again",
            refused,
        )
    # torch's wording advises loading with weights_only=False; name what went wrong instead
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    lines = message.strip().splitlines() or ["an empty pickle"]
    return CheckpointCorruptError(
        f"checkpoint {path} was refused: it holds objects other than tensors and plain values "
        f"(trainkit only loads with weights_only=True): {detail.group(1).strip() if detail else lines[-1]}"
    )
