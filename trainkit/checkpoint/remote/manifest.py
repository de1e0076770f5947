"""The remote tier's records: checkpoint names, the commit record (manifest) and the lease, as plain values.

Pure: stdlib and attrs only. Everything read from a remote is hostile input, so every reader here checks what
it is given (names, sizes, CRC-32 values, types, JSON nesting, and that every number fits its range: a step, a
time or a score of 400 digits is refused, never met later as an ``OverflowError``) and refuses anything else with
:class:`~trainkit.errors.CheckpointUnsafeError`. The shell (:mod:`trainkit.checkpoint.remote`) moves the bytes.

A remote prefix holds one folder per uploaded checkpoint, named ``step-<step>-<token>`` (a fresh token per
upload: an object store has no atomic rename, so nothing is ever overwritten), and the lease object. A folder is
a checkpoint only once its commit record, :data:`MANIFEST`, is in it: it is written last and lists every other
object with its size and CRC-32.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from trainkit.bookkeeping import is_finite_real
from trainkit.bookkeeping.lineage import Lineage, lineage_from
from trainkit.errors import BookkeepingError, CheckpointUnsafeError
from trainkit.files.bounded_read import load_json

__all__ = [
    "KIND",
    "MANIFEST",
    "LEASE",
    "MAX_MANIFEST_BYTES",
    "MAX_OBJECT_BYTES",
    "RemoteObject",
    "Manifest",
    "Lease",
    "folder_name",
    "folder_step",
    "check_name",
    "manifest_bytes",
    "parse_manifest",
    "lease_bytes",
    "parse_lease",
    "read_lease",
    "UNREADABLE_LEASE",
    "MAX_UNIX_TIME",
    "folder_id",
]

KIND = "last"
"""What a commit record says was saved: the only kind trainkit writes (a run's ``last`` checkpoint)."""
MANIFEST = "commit.json"
"""The commit record of a remote checkpoint folder, written last."""
LEASE = "lease.json"
"""The lease object at the prefix's root: which run writes there, until when."""
MAX_MANIFEST_BYTES = 1 << 20
"""A manifest or lease larger than this is refused unread."""
MAX_OBJECT_BYTES = 1 << 40
"""No object a manifest lists may be larger than this (1 TiB)."""
MAX_OBJECTS = 10_000
"""No manifest may list more objects than this."""
MAX_UNIX_TIME = 253_402_300_799.0
"""The latest time a record may name (9999-12-31 23:59:59 UTC): what the clock and ``time.gmtime`` take."""

_FOLDER = re.compile(r"step-(0|[1-9][0-9]{0,17})-([0-9a-f]{8,64})")
_NAME_PART = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.-]{0,127}")  # DCP's ".metadata"; never "." or ".."


def folder_name(step: int, token: str) -> str:
    """The remote folder of a checkpoint of ``step``, under a fresh ``token`` (lowercase hex).

    >>> folder_name(42, "0a1b2c3d")
    'step-42-0a1b2c3d'
    """
    name = f"step-{step}-{token}"
    if _FOLDER.fullmatch(name) is None:
        raise ValueError(f"a remote checkpoint folder needs a step >= 0 and a hex token, got {step!r}, {token!r}")
    return name


def folder_step(name: str) -> int | None:
    """The step a remote folder's name carries; None for a name that is not a checkpoint folder's.

    >>> folder_step("step-42-0a1b2c3d"), folder_step("step-42"), folder_step("../step-1-0a1b2c3d")
    (42, None, None)
    """
    match = _FOLDER.fullmatch(name)
    return int(match[1]) if match else None


def check_name(name: Any) -> str:
    """A relative object name inside a checkpoint folder, or a refusal: no ``..``, no absolute path, no empty part,
    no ``.`` part, no backslash, only letters, digits, ``_``, ``.`` and ``-``.

    :param name: The name as a manifest gives it.
    :returns: The name.
    :raises CheckpointUnsafeError: Naming the name and the rule it breaks.

    >>> check_name("last.pt")
    'last.pt'
    >>> try:
    ...     check_name("../x")
    ... except CheckpointUnsafeError:
    ...     print("refused")
    refused
    """
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or len(parts) > 4 or not all(_NAME_PART.fullmatch(part) for part in parts):
        raise CheckpointUnsafeError(
            f"remote object name {name!r} must be a relative name of letters, digits, '_', '.' and '-' parts "
            "(no '..', no absolute path)"
        )
    return name


def _count(value: Any, what: str, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise CheckpointUnsafeError(f"remote manifest: {what} must be an int in [0, {top}], got {_short(value)}")
    return value


@attrs.frozen(kw_only=True)
class RemoteObject:
    """One object of a remote checkpoint: its name inside the folder, its size and its CRC-32.

    >>> RemoteObject(name="last.pt", size=3, crc32=0).size
    3
    """

    name: str = attrs.field(converter=check_name)
    size: int = attrs.field(converter=lambda v: _count(v, "an object's size", MAX_OBJECT_BYTES))
    crc32: int = attrs.field(converter=lambda v: _count(v, "an object's crc32", 0xFFFFFFFF))


def _text(data: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = data.get(key)
    if (value is None and optional) or (isinstance(value, str) and len(value) <= 256):
        return value
    raise CheckpointUnsafeError(f"remote manifest: {key} must be a short string, got {value!r:.80}")


def _description(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise CheckpointUnsafeError(f"remote manifest: description must be a mapping, got {value!r:.80}")
    scores = value.get("scores", {})
    if not isinstance(scores, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in scores.items()
    ):
        raise CheckpointUnsafeError(
            f"remote manifest: description.scores must map names to numbers, got {scores!r:.80}"
        )
    unfit = [key for key, score in scores.items() if not is_finite_real(score)]
    if unfit:  # NaN is never written (it is left out), and an int of 400 digits fits no float
        raise CheckpointUnsafeError(
            f"remote manifest: description.scores[{unfit[0][:64]!r}] must be a finite number that fits a float, got "
            f"{_short(scores[unfit[0]])}"
        )
    seconds = value.get("time", 0.0)
    if not is_finite_real(seconds) or not 0 <= seconds <= MAX_UNIX_TIME:
        raise CheckpointUnsafeError(
            f"remote manifest: description.time must be a number of seconds in [0, {MAX_UNIX_TIME:.0f}], got "
            f"{_short(seconds)}"
        )
    epoch_end = value.get("epoch_end", True)
    if not isinstance(epoch_end, bool):
        raise CheckpointUnsafeError(f"remote manifest: description.epoch_end must be a bool, got {_short(epoch_end)}")
    minimize = value.get("minimize")  # absent in records written before it was recorded: not known
    if minimize is not None and not isinstance(minimize, bool):
        raise CheckpointUnsafeError(f"remote manifest: description.minimize must be a bool, got {_short(minimize)}")
    described = {"epoch_end": epoch_end, "time": float(seconds), "scores": {k: float(v) for k, v in scores.items()}}
    return described if minimize is None else {**described, "minimize": minimize}


def _kind(value: Any) -> str:
    """The kind a commit record says it holds: only :data:`KIND` (a record of another kind is none this version
    wrote, and is refused rather than taken for a ``last`` checkpoint).

    >>> _kind("last")
    'last'
    >>> _kind("best")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointUnsafeError: remote manifest: kind must be 'last' (...), got 'best'
    """
    if value != KIND:
        raise CheckpointUnsafeError(
            f"remote manifest: kind must be {KIND!r} (the only kind trainkit writes), got {_short(value)}"
        )
    return KIND


def _short(value: Any) -> str:
    """``repr(value)`` cut short: an int of 400 digits is named by its size, not printed whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _lineage(value: Any) -> Lineage | None:
    if value is None:
        return None
    try:
        return lineage_from(value)
    except BookkeepingError as exc:
        raise CheckpointUnsafeError(f"remote manifest: lineage: {exc}") from None


@attrs.frozen(kw_only=True)
class Manifest:
    """A remote checkpoint's commit record.

    :ivar step: The optimizer step of the checkpoint.
    :ivar epoch: Its epoch.
    :ivar kind: What was saved: :data:`KIND`, the only kind trainkit writes; a record of another kind is refused
        (:class:`~trainkit.errors.CheckpointUnsafeError`), as a record of a format this version does not know.
    :ivar objects: Every object of the folder but the manifest.
    :ivar run_id: The W&B run id it belongs to (None without one).
    :ivar version: The trainkit version that wrote it.
    :ivar description: How retention sees it: ``epoch_end``, ``time`` and ``scores`` (plain values), and the run's
        ``val.minimize`` as ``minimize`` (absent in records written before it was recorded, or when not known).
    :ivar lineage: The history of lives the checkpoint belongs to (:func:`~trainkit.bookkeeping.in_history`); None in a
        record written before trainkit recorded it.
    """

    step: int = attrs.field(converter=lambda v: _count(v, "step", 1 << 62))
    epoch: int = attrs.field(converter=lambda v: _count(v, "epoch", 1 << 62))
    kind: str = attrs.field(converter=_kind)
    objects: tuple[RemoteObject, ...]
    run_id: str | None
    version: str
    description: Mapping[str, Any] = attrs.field(factory=dict, converter=_description, hash=False)
    lineage: Lineage | None = attrs.field(default=None, converter=lambda v: _lineage(v))


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written: JSON, keys sorted.

    >>> m = Manifest(step=1, epoch=0, kind="last", objects=(RemoteObject(name="a", size=1, crc32=2),),
    ...              run_id=None, version="0")
    >>> parse_manifest(manifest_bytes(m)) == m
    True
    """
    data = attrs.asdict(manifest, recurse=True)
    data["objects"] = [attrs.asdict(o) for o in manifest.objects]
    if manifest.lineage is None:
        del data["lineage"]  # a record without one reads as before
    return json.dumps(data, sort_keys=True, allow_nan=False).encode()


def _record_json(data: bytes, what: str) -> Any:
    """A store's record (a commit record, a lease) as JSON: bounded in size (:data:`MAX_MANIFEST_BYTES`) and nesting
    (:func:`~trainkit.files.bounded_read.load_json`), UTF-8; ``what`` names it in the error."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointUnsafeError(f"{what} is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        return load_json(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError too
        raise CheckpointUnsafeError(f"{what} is not JSON ({exc})") from None


def parse_manifest(data: bytes) -> Manifest:
    """A manifest read from a remote, checked: bounded size, JSON of the right shape, safe unique names.

    :param data: The object's bytes.
    :returns: The manifest.
    :raises CheckpointUnsafeError: On anything else, naming what is wrong.
    """
    raw = _record_json(data, "remote manifest")
    objects = raw.get("objects") if isinstance(raw, dict) else None
    if (
        not isinstance(objects, list)
        or not 0 < len(objects) <= MAX_OBJECTS
        or not all(isinstance(o, dict) for o in objects)
    ):
        raise CheckpointUnsafeError(f"remote manifest must be a mapping with a list of 1 to {MAX_OBJECTS} objects")
    listed = tuple(RemoteObject(name=o.get("name"), size=o.get("size"), crc32=o.get("crc32")) for o in objects)
    names = [o.name for o in listed]
    if len(set(names)) != len(names) or MANIFEST in names:
        raise CheckpointUnsafeError(f"remote manifest lists a name twice, or itself: {names}")
    return Manifest(
        step=raw.get("step"),
        epoch=raw.get("epoch"),
        kind=raw.get("kind"),
        objects=listed,
        run_id=_text(raw, "run_id", optional=True),
        version=_text(raw, "version"),
        description=_description(raw.get("description", {})),
        lineage=raw.get("lineage"),
    )


_FOLDER_ID = re.compile(r"[0-9a-f]{32}")


def folder_id(value: Any) -> str | None:
    """A run folder's identity as read (32 lowercase hex digits, see :class:`Lease`), or None for anything else.

    >>> folder_id("0123456789abcdef0123456789abcdef"), folder_id("../x"), folder_id(["x"] * 9)
    ('0123456789abcdef0123456789abcdef', None, None)
    """
    return value if isinstance(value, str) and _FOLDER_ID.fullmatch(value) else None


@attrs.frozen(kw_only=True)
class Lease:
    """Who writes to a remote prefix, and until when (Unix seconds).

    :ivar holder: The holding process (host, pid, a random part).
    :ivar expires: When it runs out unless renewed.
    :ivar folder: The identity of the holder's run folder (a random token kept in it): a rerun in that folder, once
        it holds the folder's lock (so the holder runs there no more), may take the lease over before it expires.
        None in a lease taken without a run folder (``retain``), written before trainkit recorded it, or whose
        value is malformed: then it is never taken over early.

    >>> Lease(holder="host:12:ab", expires=100.0).expired(now=101.0)
    True
    """

    holder: str
    expires: float
    folder: str | None = attrs.field(default=None, converter=folder_id)

    def expired(self, now: float) -> bool:
        """Whether the lease ran out at ``now`` (Unix seconds)."""
        return now > self.expires

    def held_for(self, folder: str | None) -> bool:
        """Whether the lease was taken for the run folder of identity ``folder`` (never for None).

        >>> lease = Lease(holder="h", expires=1.0, folder="0123456789abcdef0123456789abcdef")
        >>> lease.held_for("0123456789abcdef0123456789abcdef"), lease.held_for("f" * 32), lease.held_for(None)
        (True, False, False)
        """
        return folder is not None and self.folder == folder


def lease_bytes(lease: Lease) -> bytes:
    """The lease as written (``folder`` only when known: older readers read holder and expiry only).

    >>> parse_lease(lease_bytes(Lease(holder="h", expires=1.5)))
    Lease(holder='h', expires=1.5, folder=None)
    >>> parse_lease(lease_bytes(Lease(holder="h", expires=1.5, folder="ab" * 16))).folder == "ab" * 16
    True
    """
    data: dict[str, Any] = {"holder": lease.holder, "expires": lease.expires}
    if lease.folder is not None:
        data["folder"] = lease.folder
    return json.dumps(data).encode()


UNREADABLE_LEASE = Lease(holder="(unreadable)", expires=0.0)
"""What a malformed lease counts as: expired at once (its writer cannot be told apart from a torn write, and
refusing forever would lock the prefix for good)."""


def read_lease(data: bytes) -> Lease:
    """A lease read from a remote, checked: bounded size and nesting, a holder, and an expiry time that is a finite
    number in ``[0, MAX_UNIX_TIME]`` (``1e300`` or an int of 400 digits would overflow the clock's arithmetic).
    A ``folder`` that is not 32 lowercase hex digits is ignored (None: the lease holds, never taken over early).

    >>> read_lease(b'{"holder": "h", "expires": 1e300}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointUnsafeError: remote lease: expires must be a number of seconds in [0, ...], got 1e+300

    :param data: The object's bytes.
    :returns: The lease.
    :raises CheckpointUnsafeError: On anything else, naming what is wrong.
    """
    raw = _record_json(data, "remote lease")
    if not isinstance(raw, dict) or "holder" not in raw or "expires" not in raw:
        raise CheckpointUnsafeError("remote lease must be a mapping with a holder and an expiry time")
    expires = raw["expires"]
    if not is_finite_real(expires) or not 0 <= expires <= MAX_UNIX_TIME:
        raise CheckpointUnsafeError(
            f"remote lease: expires must be a number of seconds in [0, {MAX_UNIX_TIME:.0f}], got {_short(expires)}"
        )
    return Lease(holder=str(raw["holder"])[:256], expires=float(expires), folder=folder_id(raw.get("folder")))


def parse_lease(data: bytes) -> Lease:
    """A lease read from a remote (:func:`read_lease`); a malformed one is :data:`UNREADABLE_LEASE`, expired.

    >>> parse_lease(b"garbage").expires, parse_lease(b'{"holder": "h", "expires": 10e400}').expires
    (0.0, 0.0)
    """
    try:
        return read_lease(data)
    except CheckpointUnsafeError:
        return UNREADABLE_LEASE


def newest_first(manifests: Iterable[tuple[str, Manifest]]) -> list[tuple[str, Manifest]]:
    """Committed folders, newest first: the largest step; at one step (a save inside the epoch and its save at the
    epoch's end, or a copy a resumed life wrote again), the epoch's end after a save inside it, then the later save
    time, then the name. Never the name alone: a fresh resume must take the step's newest save, not whichever random
    folder name sorts last (it took an older copy of another life, and retention then left the newer one for good).

    >>> m = lambda s, end=True, t=0.0: Manifest(step=s, epoch=0, kind="last", run_id=None, version="0",
    ...     objects=(RemoteObject(name="a", size=0, crc32=0),), description={"epoch_end": end, "time": t})
    >>> [name for name, _ in newest_first([("a", m(1)), ("b", m(3))])]
    ['b', 'a']
    >>> [name for name, _ in newest_first([("step-6-ff", m(6, end=False, t=9.0)), ("step-6-00", m(6, t=5.0))])]
    ['step-6-00', 'step-6-ff']
    >>> [name for name, _ in newest_first([("step-6-ff", m(6, t=5.0)), ("step-6-00", m(6, t=9.0))])]
    ['step-6-00', 'step-6-ff']
    """

    def recency(item: tuple[str, Manifest]) -> tuple[int, bool, float, str]:
        name, manifest = item
        described = manifest.description
        return manifest.step, bool(described.get("epoch_end", True)), float(described.get("time", 0.0)), name

    return sorted(manifests, key=recency, reverse=True)
