"""Plain-dict serialization shared by every bookkeeping record.

Pure: stdlib and attrs only. Checkpoints store these dicts, never pickled classes, so a checkpoint
stays loadable with ``torch.load(..., weights_only=True)`` and readable without trainkit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import attrs

from trainkit.errors import BookkeepingError

SCHEMA_VERSION = 3
"""The newest version of the dicts ``to_dict`` writes and ``from_dict`` reads; bumped when a field changes meaning.

A record is written with the oldest version that describes it, so a trainkit that reads only version 1 still reads
every record that uses nothing newer. Version 2: an :class:`~trainkit.bookkeeping.EpochPosition` may leave the
epoch's length and the dataset's unknown (None), for a loader that carries its own position. Version 3: it also
records its place in the epoch's global order (``samples``, ``global_batch``, ``order``), which lets another world
size resume it."""

R = TypeVar("R")


def is_int(value: Any) -> bool:
    """Tell whether ``value`` is an int and not a bool (``True`` is an int to Python, never a count here).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Tell whether ``value`` is an int or a float and not a bool.

    >>> is_real(0.5), is_real(2), is_real(False), is_real("1")
    (True, True, False, False)
    """
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_real(value: Any) -> bool:
    """Tell whether ``value`` is an int or a float (not a bool) with a finite float value.

    An int too large for a float (``10**400``, which JSON and pickles can hold) is not: comparing or converting
    it raises ``OverflowError``, so it is refused like NaN rather than met later.

    >>> is_finite_real(1.5), is_finite_real(7), is_finite_real(10**400), is_finite_real(float("nan"))
    (True, True, False, False)
    """
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def record_to_dict(record: Any, *, version: int = 1) -> dict[str, Any]:
    """Return a record's fields as plain JSON-able values, tagged with its kind and schema version.

    Pure: builds a new dict; the record is left unchanged.

    :param record: An attrs record of this package.
    :param version: The oldest schema version that describes this record (see :data:`SCHEMA_VERSION`).
    :returns: ``{"kind": ..., "schema_version": ..., <field>: <value>, ...}``.
    """
    data: dict[str, Any] = {"kind": type(record).__name__, "schema_version": version}
    for field in attrs.fields(type(record)):
        data[field.name] = _plain(getattr(record, field.name))
    return data


def record_from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
    """Rebuild a record from :func:`record_to_dict`'s output, re-running every validator.

    Pure: reads ``data`` only.

    :param cls: The record class to build.
    :param data: A dict written by ``cls.to_dict()``.
    :returns: The record.
    :raises BookkeepingError: When the kind, the schema version or the set of fields does not match.
    """
    if not isinstance(data, Mapping):
        raise BookkeepingError(f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}")
    kind = data.get("kind", cls.__name__)
    if kind != cls.__name__:
        raise BookkeepingError(f"{cls.__name__}.from_dict got a dict of kind {kind!r}")
    version = data.get("schema_version")
    if not is_int(version) or version < 1:
        raise BookkeepingError(f"{cls.__name__}.from_dict: schema_version must be an int >= 1, got {version!r}")
    if version > SCHEMA_VERSION:
        raise BookkeepingError(
            f"{cls.__name__}.from_dict: schema_version {version} is newer than this trainkit's "
            f"{SCHEMA_VERSION}; upgrade trainkit to read it"
        )
    names = {field.name for field in attrs.fields(cls)}
    given = set(data) - {"kind", "schema_version"}
    unexpected = sorted(given - names)
    if unexpected:
        raise BookkeepingError(f"{cls.__name__}.from_dict: unexpected fields {unexpected}")
    return cls(**{name: data[name] for name in names if name in data})


def read_only_floats(metrics: Mapping[str, Any] | None) -> Mapping[str, float]:
    """Freeze a metric mapping into a read-only mapping of str to float.

    :param metrics: Any mapping whose values convert with ``float()``; None gives an empty mapping.
    :returns: A :class:`types.MappingProxyType` over a fresh dict.
    :raises BookkeepingError: When a value does not convert to float.
    """
    frozen: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        frozen[str(key)] = as_float(value, f"metrics[{key!r}]")
    return MappingProxyType(frozen)


def as_float(value: Any, name: str) -> float:
    """Convert a score-like value (float, int, 0-d tensor, numpy scalar) to a Python float.

    :param value: The value to convert.
    :param name: What the value is, for the error message.
    :returns: ``float(value)``.
    :raises BookkeepingError: When the value is a bool, None, has no scalar float value, or is an int too large
        for a float.
    """
    if value is None or isinstance(value, bool | str | bytes) or is_bool_like(value):
        raise BookkeepingError(f"{name} must be a real number, got {value!r}")
    if is_int(value) and not is_finite_real(value):
        raise BookkeepingError(
            f"{name} must be a real number that fits a float, got an int of {value.bit_length()} bits"
        )
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise BookkeepingError(f"{name} must be a real number (a float or a 1-element tensor), got {value!r}") from exc


def is_bool_like(value: Any) -> bool:
    """Tell whether a value is a boolean of any library: ``bool``, ``numpy.bool_``, a bool tensor.

    Pure: looks at types and dtypes only, importing nothing.

    >>> is_bool_like(True), is_bool_like(1), is_bool_like(0.0)
    (True, False, False)
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return True
    return str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_verdict(value: Any) -> bool:
    """Return the truth of an early-stopping verdict, refusing a value whose truth is ambiguous.

    Pure: calls ``bool(value)`` only. Every value whose truth is unambiguous counts: bools of any
    library, None, numbers, 0-d (or 1-element) numpy arrays and tensors, containers (empty ones are
    falsey). Multi-element and empty arrays or tensors have no single truth and are refused.

    :param value: What a ``val_epoch()`` returned.
    :returns: ``bool(value)``.
    :raises BookkeepingError: When ``bool(value)`` is ambiguous (it raises).

    >>> as_verdict(None), as_verdict(0), as_verdict(0.0), as_verdict(""), as_verdict([]), as_verdict(True)
    (False, False, False, False, False, True)
    """
    try:
        return bool(value)
    except Exception as exc:  # noqa: BLE001 - numpy raises ValueError, torch RuntimeError, others anything
        raise BookkeepingError(
            f"an early-stopping verdict must have an unambiguous truth value, got {type(value).__name__} "
            f"{value!r} ({exc})"
        ) from exc

