"""What a checkpoint may hold: the values ``weights_only`` loads, and the refusal before a save of anything else.

Pure but for reading torch's process-wide allowlist.
"""

from __future__ import annotations

import datetime
import enum
import functools
import numbers
import os
import sys
import types
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from trainkit.errors import CheckpointUnsafeError

__all__ = [
    "NUMPY_CODES",
    "SCOPED_ALLOWLIST",
    "LEAF_TYPES",
    "INT_LIMIT",
    "MAPPING_TYPES",
    "check_loadable",
    "numpy_dtype_loads",
]

# --- What a checkpoint may hold ---------------------------------------------------------------------------------
#
# torch's weights_only unpickler builds tensors, torch.Size/dtype/device/layout, None, bool, int, float, complex,
# str, bytes, bytearray, dict, OrderedDict, Counter, list, tuple and set. trainkit adds, for the load only (a scoped
# torch.serialization.safe_globals, never the process-wide add_safe_globals), what state_dicts commonly hold: slices,
# empty bytes (protocol 2 writes ``b""`` as ``bytes()``), and numpy scalars and arrays of the numeric dtypes below.
# The names a file uses for those are bound to trainkit's own checked builders, never to numpy's unpickling: numpy's
# ``dtype.__setstate__`` takes any flags and fields, so a crafted file could build a float64 that claims to hold
# object pointers. check_loadable() refuses before a save whatever this load would refuse.

NUMPY_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
"""The numpy dtypes a checkpoint may hold, as a pickle names them (kind and item size): bool, signed and unsigned
integers, float16/32/64, complex64/128. Object, string, datetime, structured and extended-precision dtypes are
refused: object arrays hold arbitrary objects, the others need more of numpy's unpickling than the raw bytes."""

SCOPED_ALLOWLIST = torch.__version__ >= (2, 6)
"""torch 2.6+ takes ``(callable, "dotted.name")`` pairs in ``safe_globals``, which bind a file's names to trainkit's
builders; with an older torch only torch's own allowlist applies, and check_loadable refuses the rest."""

LEAF_TYPES = frozenset(
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
    | ({bytes} if SCOPED_ALLOWLIST else set())  # older torch cannot load b"" (see _why_not_loadable)
)
"""Types that load as they are, without looking inside (a tensor's data, a torch.Size's ints). ``int`` is not
one: torch's unpickler has no LONG4, so an int of 2**2039 or more saves but does not load."""

INT_LIMIT = 2**2039
"""Ints strictly between ``-INT_LIMIT`` and ``INT_LIMIT`` pickle as LONG1 (255 bytes at most) or shorter."""

MAPPING_TYPES = frozenset({dict, OrderedDict, Counter})

_ITEM, _KEY, _MEMBER, _ATTR = range(4)  # how a value hangs off its parent, for the key path in a refusal


def check_loadable(payload: Mapping[str, Any]) -> None:
    """Refuse, before a save, a payload that :func:`~trainkit.checkpoint.load_checkpoint` could not load back.

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
    if type(payload) not in MAPPING_TYPES:
        name = _type_name(type(payload))
        raise CheckpointUnsafeError(
            f"a checkpoint payload must be a dict of items, got a {name}; put the values under item names",
            name,
        )
    leaves, mappings, limit = LEAF_TYPES, MAPPING_TYPES, INT_LIMIT
    numpy = sys.modules.get("numpy") if SCOPED_ALLOWLIST else None  # no numpy loaded: no numpy values to check
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
                if id(obj) in seen:  # shared tuples too: nested in pairs they make exponentially many paths
                    continue
                seen.add(id(obj))
                for index, value in enumerate(obj):
                    if type(value) not in leaves and not (type(value) is int and -limit < value < limit):
                        push((value, (crumb, _ITEM, index)))
            elif kind is set:
                for member in obj:
                    if type(member) not in leaves and not (type(member) is int and -limit < member < limit):
                        push((member, (crumb, _MEMBER, None)))
            elif kind is slice and SCOPED_ALLOWLIST:
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
        if -INT_LIMIT < obj < INT_LIMIT:
            return None
        return f"very large int ({obj.bit_length()} bits)", "store str(value), or split it into ints below 2**2039"
    if kind is bytes:  # only reached with a torch older than 2.6, which loads every bytes value but b""
        return None if obj else ("empty bytes value", "store None or a non-empty value instead (torch < 2.6)")
    if numpy is not None and (kind is numpy.ndarray or isinstance(obj, numpy.generic | numpy.dtype)):
        dtype = obj if isinstance(obj, numpy.dtype) else obj.dtype
        if numpy_dtype_loads(dtype) and (not isinstance(obj, numpy.generic) or kind is dtype.type):
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
def numpy_dtype_loads(dtype: Any) -> bool:
    """True for a dtype ``_NumpyDtype`` rebuilds: numeric, no fields, no sub-array, no metadata."""
    return (
        dtype.fields is None
        and dtype.subdtype is None
        and dtype.metadata is None
        and f"{dtype.kind}{dtype.itemsize}" in NUMPY_CODES
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
