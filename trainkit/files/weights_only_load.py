"""Loading a checkpoint without running code: ``weights_only=True`` with trainkit's checked builders.

Side effects: reads the file (after :mod:`trainkit.files.zip_check` verified it), and adds trainkit's builders to
torch's allowlist for the duration of a load only.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import math
import os
import pickle
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointUnsafeError
from trainkit.files.allowlist import LEAF_TYPES, MAPPING_TYPES, NUMPY_CODES, SCOPED_ALLOWLIST, numpy_dtype_loads
from trainkit.files.zip_check import (
    InMemory,
    check_data_pickle,
    check_unchanged,
    member_spans,
    open_checkpoint,
    reason,
    verify_open,
)

__all__ = ["load_checkpoint", "load_archive"]

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
        if code not in NUMPY_CODES:
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
    if numpy is None or not isinstance(dtype, numpy.dtype) or dtype.flags or not numpy_dtype_loads(dtype):
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
    if not SCOPED_ALLOWLIST:
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
    if kind in LEAF_TYPES or kind is int:
        return obj
    if id(obj) in memo:
        return memo[id(obj)][1]
    memo[id(obj)] = (obj, obj)  # the original is kept alive, so no new object can take its id during the walk
    if kind in MAPPING_TYPES:
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


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Verify and load a checkpoint with ``weights_only=True``: no code from the file ever runs.

    Besides torch's own allowlist, slices, empty bytes and numpy scalars, arrays and dtypes of numeric dtypes
    load (:func:`~trainkit.checkpoint.check_loadable` lists them), through trainkit's checked builders and only
    for this call.

    The file is opened once (only if it is a regular file), verified by the checks of
    :func:`~trainkit.checkpoint.verify_checkpoint`, and ``torch.load`` reads that same open file: a file swapped
    in at ``path`` meanwhile is never loaded, and one written into in place meanwhile (its size or modification
    time changed) is refused.

    :param path: The checkpoint file.
    :param map_location: Where tensors go, ``"cpu"`` by default.
    :returns: The payload dict.
    :raises CheckpointCorruptError: When the file fails verification, changed while it was read, or cannot be
        read as a checkpoint (a pickle nested too deeply for Python included).
    :raises CheckpointUnsafeError: When the file is intact but holds a type trainkit does not load (a class,
        a function, a numpy object array...), naming it; unlike a corrupt file, an older copy is no better.
    """
    path = Path(path)
    file, info = open_checkpoint(path)
    with file:
        verify_open(path, file, info)
        file.seek(0)
        payload = _safe_load(path, file, map_location, unchanged=lambda: check_unchanged(path, file, info))
        check_unchanged(path, file, info)
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
    memory = InMemory(data)
    spans = member_spans(name, memory, len(data))  # type: ignore[arg-type]
    check_data_pickle(name, memory, spans)
    return _safe_load(name, io.BytesIO(data), map_location, unchanged=lambda: None)


def _safe_load(path: Any, file: Any, map_location: Any, *, unchanged: Any) -> Any:
    """``torch.load(file, weights_only=True)`` with trainkit's allowlist, refusals turned into trainkit's errors
    and numpy recipes put back in place; ``unchanged()`` refuses a file written into meanwhile."""
    _LOADING.arrays, _LOADING.refused = [], None
    try:
        # sparse tensors are checked as they are built: an index out of bounds loads otherwise, and crashes later
        with _load_allowlist(), torch.sparse.check_sparse_tensor_invariants(True):
            payload = torch.load(file, map_location=map_location, weights_only=True, mmap=False)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a crafted pickle makes torch's unpickler raise anything a builder can
        unchanged()  # a file changed under the load explains whatever went wrong
        if isinstance(exc, pickle.UnpicklingError):
            raise _refusal(path, str(exc), _LOADING.refused) from exc
        # RecursionError is a RuntimeError; TypeError, KeyError, MemoryError: what no torch.save writes
        raise CheckpointCorruptError(
            f"checkpoint {path} could not be read: {type(exc).__name__}: {reason(exc)}"[:2000]
        ) from exc
    finally:
        arrays, _LOADING.arrays, _LOADING.refused = _LOADING.arrays, None, None
    if arrays:
        reached: set[int] = set()
        try:
            payload = _put_arrays_in_place(payload, {}, reached)
        except (pickle.UnpicklingError, RecursionError) as exc:
            raise CheckpointCorruptError(f"checkpoint {path} could not be read: {reason(exc)}") from exc
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
