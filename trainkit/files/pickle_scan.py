"""Bound a pickle before any unpickler sees it: nesting, memo indices, expensive calls and colliding keys.

Pure: reads the opcode stream only (``pickletools.genops``), builds nothing and imports no class. Standard
library only.

Even an unpickler that builds only plain values can be crashed or stalled by one:

- a million nested one-element tuples used as a dict key make CPython hash them recursively in C, past the end of
  the thread's stack: the process dies of a segmentation fault, before any ``except`` can run;
- a memo index of 2**31 makes CPython's C unpickler allocate and clear a memo array of that many entries;
- functions on torch's own ``weights_only`` allowlist do work a file chooses: ``bytearray(10**10)`` allocates
  10 GB from a few bytes, and ``_codecs.encode(s, "punycode")`` takes seconds per call on a few kB;
- keys whose hashes collide (ints that differ by multiples of 2**61 - 1, say) make every dict insert compare
  with every earlier key: quadratic in the key count.

:func:`check_pickle` walks the opcodes once, tracking each value on the unpickler's stack: how deeply it nests
(a container is one deeper than its deepest member), its plain value where the opcodes give it (numbers, strings,
tuples of them, the global a name refers to), and refuses the pickle before it is unpickled. Depths only hold if a
value cannot grow deeper after it was put into another one, so that is refused too: a pickler fills every
container (and sets every object's state) right after making it, before the value it belongs to takes it.
"""

from __future__ import annotations

import collections
import pickletools
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_PICKLE_DEPTH", "MAX_COLLISIONS", "MAX_OPAQUE_KEYS", "PickleRefused", "PickleUnsafe", "check_pickle"]

MAX_PICKLE_DEPTH = 1000
"""The deepest nesting of containers (and of objects built from their arguments) a checkpoint's pickle may
have. A state dict nests a few levels, trainkit's validators refuse items nested deeper than 256, and CPython
crashes somewhere past 100,000 (less in a thread with a small stack)."""

MAX_COLLISIONS = 64
"""The most keys of one dict or set whose hashes are equal (keys whose hash the pickle decides: numbers and
tuples of them); real state dicts have none."""

MAX_OPAQUE_KEYS = 10_000
"""The most dict keys or set members built by calling something (whose hash the scan cannot know) in one pickle."""


class PickleRefused(ValueError):
    """A pickle that no pickler writes: truncated, an unknown opcode, a stack that does not add up.

    :param reason: What is wrong, and where.
    """


class PickleUnsafe(PickleRefused):
    """A pickle built to crash or stall its reader: it nests deeper than the limit, fills a value after nesting it,
    names memo entries far beyond its own size, makes an allowlisted function do work of its choosing, or holds keys
    whose hashes collide. Not damage: no pickler writes one."""


_UNKNOWN = object()
"""The value of a stack entry the scan does not know (a container, an object being built)."""


class _Global:
    __slots__ = ("name",)

    def __init__(self, name: str | None) -> None:
        self.name = name


class _Opaque:
    """The result of calling ``name`` (a REDUCE or NEWOBJ): hashable, perhaps, by rules the scan cannot see."""

    __slots__ = ("name",)

    def __init__(self, name: str | None) -> None:
        self.name = name


class _Bytes:
    """A bytes value (its content does not matter: bytes hash with a per-process random seed)."""


_BYTES = _Bytes()

_STRINGS = frozenset(
    ["UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"]
)
_NUMBERS = frozenset(["INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"])
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_OTHER_LEAVES = frozenset(["BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NEXT_BUFFER", "PERSID"])
_EMPTY = frozenset({"EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_SET"})
_FROM_MARK = frozenset({"LIST", "TUPLE", "DICT", "FROZENSET", "INST", "OBJ"})
"""Opcodes that build one value from everything above the topmost mark."""
_FROM_TOP = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "BINPERSID": 1}
"""Opcodes that build one value from a fixed number of values on top of the stack."""
_FILL_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
"""Opcodes that put everything above the topmost mark into the value below the mark."""
_FILL_FROM_TOP = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}
"""Opcodes that put a fixed number of values into the value below them."""
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_NOTHING = frozenset({"PROTO", "FRAME", "READONLY_BUFFER", "NONREADONLY_BUFFER"})

_TUPLE_VALUE_LIMIT = 16
_VALUE_DEPTH = 8
"""Tuples up to this length and depth keep their members' values (larger ones are keys no state dict has)."""


class _Cell:
    """One value on the unpickler's stack: its depth, whether it was nested, what it is, how it was built."""

    __slots__ = ("depth", "nested", "value", "hashes")

    def __init__(self, depth: int, value: Any = _UNKNOWN) -> None:
        self.depth = depth
        self.nested = False
        self.value = value
        self.hashes: collections.Counter[int] | None = None  # of the keys put into it, when a dict or set


class _Scan:
    def __init__(self, size: int, max_depth: int, opaque_keys: frozenset[str]) -> None:
        self.size = size
        self.max_depth = max_depth
        self.opaque_keys_ok = opaque_keys
        self.opaque_keys = 0
        self.position = 0

    def refuse(self, reason: str) -> PickleUnsafe:
        return PickleUnsafe(f"{reason} (at byte {self.position})")

    def depth_of(self, members: Iterable[_Cell]) -> int:
        """One more than the deepest member's depth; the members are nested from now on."""
        depth = 1
        for member in members:
            if member.depth >= depth:
                depth = member.depth + 1
            member.nested = True
        if depth > self.max_depth:
            raise self.refuse(f"nests values more than {self.max_depth} deep")
        return depth

    def nest(self, name: str, members: list[_Cell]) -> _Cell:
        cell = _Cell(self.depth_of(members))
        if name.startswith("TUPLE"):
            if (
                cell.depth <= _VALUE_DEPTH
                and len(members) <= _TUPLE_VALUE_LIMIT
                and all(m.value is not _UNKNOWN for m in members)
            ):
                cell.value = tuple(member.value for member in members)
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            cell.value = self.call(members[0].value, members[1].value)
        elif name == "FROZENSET":
            self.keys(cell, members)
        elif name == "DICT":
            self.keys(cell, members[::2])
        return cell

    def call(self, callable_value: Any, args: Any) -> Any:
        """What a call builds, refusing the calls of torch-allowlisted functions that do work a file chooses."""
        name = callable_value.name if isinstance(callable_value, _Global) else None
        if name == "_codecs.encode":  # how protocol 2 writes bytes: encode(text, "latin1"); never another codec
            if not (
                type(args) is tuple and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1")
            ):
                raise self.refuse(f"calls _codecs.encode with {_show(args)}, where pickles pass (text, 'latin1')")
            return _BYTES
        if name == "builtins.bytearray":  # bytearray(n) allocates n bytes: only the bytes it holds are written
            text = type(args) is tuple and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1")
            if not (type(args) is tuple and (not args or (len(args) == 1 and args[0] is _BYTES) or text)):
                raise self.refuse(f"calls bytearray with {_show(args)}, where pickles pass the bytes it holds")
            return _Opaque(name)
        if name in ("torch.Size", "builtins.tuple") and type(args) is tuple and len(args) == 1:
            return args[0] if type(args[0]) is tuple else _Opaque(name)
        if name == "builtins.complex" and type(args) is tuple and all(type(a) in (int, float) for a in args):
            try:
                return complex(*args)
            except (TypeError, ValueError, OverflowError):
                return _Opaque(name)
        return _Opaque(name)

    def fill(self, name: str, container: _Cell, members: list[_Cell]) -> None:
        if container.nested:
            raise self.refuse("fills a value after nesting it in another one")
        depth = self.depth_of(members)
        if depth > container.depth:
            container.depth = depth
        if name in ("SETITEM", "SETITEMS"):
            self.keys(container, members[::2])
        elif name == "ADDITEMS":
            self.keys(container, members)

    def keys(self, container: _Cell, keys: list[_Cell]) -> None:
        """Count the keys of one dict or set whose hash the pickle decides; refuse colliding ones."""
        counts = container.hashes
        for key in keys:
            value = key.value
            if isinstance(value, _Opaque):
                if value.name not in self.opaque_keys_ok:
                    self.opaque_keys += 1
                    if self.opaque_keys > MAX_OPAQUE_KEYS:
                        raise self.refuse(f"uses more than {MAX_OPAQUE_KEYS} built objects as keys")
                continue
            if value is _UNKNOWN or value is _BYTES or isinstance(value, (str, _Global)) or not _hashable(value):
                continue  # str and bytes hash with a per-process random seed: a file cannot aim at them
            if counts is None:
                counts = container.hashes = collections.Counter()
            digest = hash(value)
            counts[digest] += 1
            if counts[digest] > MAX_COLLISIONS:
                raise self.refuse(f"holds more than {MAX_COLLISIONS} keys of one dict or set with equal hashes")


def _dotted(module: str, qualname: str) -> str:
    """A global's dotted name, with protocol 2's ``__builtin__`` spelled as Python 3 spells it."""
    return f"{'builtins' if module == '__builtin__' else module}.{qualname}"


def _hashable(value: Any) -> bool:
    if value is _UNKNOWN or isinstance(value, (_Opaque, _Bytes)):
        return False
    if type(value) is tuple:
        return all(_hashable(member) for member in value)
    return value is None or type(value) in (bool, int, float, complex, str) or isinstance(value, _Global)


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (_Opaque, _Global, _Bytes)) and value is not _UNKNOWN else "a value"
    return text[:80]


def check_pickle(
    data: bytes | bytearray | memoryview, *, max_depth: int = MAX_PICKLE_DEPTH, opaque_keys: Iterable[str] = ()
) -> None:
    """Refuse a pickle built to crash or stall its reader, or that no pickler writes, before it is unpickled.

    Pure. One pass over the opcodes (about a microsecond each: a few ms for the pickle of a 300 MB checkpoint,
    whose tensors are stored outside it).

    >>> import pickle
    >>> check_pickle(pickle.dumps({"model": {"w": [1.0, 2.0]}, "step": 3, 7: (1, 2)}, protocol=2))
    >>> check_pickle(b"\\x80\\x02}K\\x01" + b"\\x85" * 2000 + b"K\\x02s.")  # a 2000-deep tuple as a dict key
    Traceback (most recent call last):
    ...
    trainkit.files.pickle_scan.PickleUnsafe: nests values more than 1000 deep (at byte 1005)

    :param data: The whole pickle (up to and including its ``STOP``).
    :param max_depth: The deepest nesting accepted.
    :param opaque_keys: Dotted names of classes whose instances may be keys without counting against
        :data:`MAX_OPAQUE_KEYS` (their unpickler gives them hashes a file cannot aim).
    :raises PickleUnsafe: When a value nests deeper than ``max_depth``, a value is filled after it was nested, a
        memo index is larger than the pickle itself, ``_codecs.encode`` or ``bytearray`` is called with other
        arguments than a pickler writes, or keys collide.
    :raises PickleRefused: When the opcode stream is truncated, holds an unknown or extension opcode, or its
        stack does not add up (a mark or a value missing where an opcode needs one).
    """
    scan = _Scan(len(data), max_depth, frozenset(opaque_keys))
    stack: list[_Cell] = []
    marks: list[int] = []
    memo: dict[int, _Cell] = {}
    try:
        for opcode, arg, position in pickletools.genops(bytes(data) if not isinstance(data, bytes) else data):
            scan.position = position
            _step(scan, opcode.name, arg, stack, marks, memo)
    except (IndexError, KeyError):
        raise PickleRefused(
            f"does not add up: an opcode finds no value or mark to use (at byte {scan.position})"
        ) from None
    except ValueError as exc:
        if isinstance(exc, PickleRefused):
            raise
        raise PickleRefused(f"is truncated or malformed ({exc})") from None


def _step(scan: _Scan, name: str, arg: Any, stack: list[_Cell], marks: list[int], memo: dict[int, _Cell]) -> None:
    """Apply one opcode to the simulated stack."""
    if name in _STRINGS:
        stack.append(_Cell(0, arg if isinstance(arg, str) else _BYTES))
    elif name in _NUMBERS:
        stack.append(_Cell(0, arg))
    elif name in _CONSTANTS:
        stack.append(_Cell(0, _CONSTANTS[name]))
    elif name in _OTHER_LEAVES:
        stack.append(_Cell(0, _BYTES if "BYTES" in name else _UNKNOWN))
    elif name == "GLOBAL":
        named = isinstance(arg, str) and " " in arg
        stack.append(_Cell(0, _Global(_dotted(*arg.split(" ", 1)) if named else None)))
    elif name in _GETS:
        stack.append(memo[arg])
    elif name in _PUTS or name == "MEMOIZE":
        index = len(memo) if name == "MEMOIZE" else arg
        if index > scan.size:
            raise scan.refuse(f"names memo entry {index} in a pickle of {scan.size} bytes")
        memo[index] = stack[-1]
    elif name in _EMPTY:
        stack.append(_Cell(1, () if name == "EMPTY_TUPLE" else _UNKNOWN))
    elif name in _FROM_TOP:
        count = _FROM_TOP[name]
        if len(stack) - (marks[-1] if marks else 0) < count:
            raise IndexError
        members = stack[-count:]
        del stack[-count:]
        stack.append(scan.nest(name, members))
    elif name in _FROM_MARK:
        start = marks.pop()
        members = stack[start:]
        del stack[start:]
        if name == "OBJ" and not members:
            raise IndexError
        stack.append(scan.nest(name, members))
    elif name in _FILL_FROM_TOP or name in _FILL_FROM_MARK:
        if name in _FILL_FROM_TOP:
            count = _FILL_FROM_TOP[name]
            if len(stack) - (marks[-1] if marks else 0) <= count:
                raise IndexError
            members = stack[-count:]
            del stack[-count:]
        else:
            start = marks.pop()
            members = stack[start:]
            del stack[start:]
            if not stack or (marks and len(stack) <= marks[-1]):
                raise IndexError
        scan.fill(name, stack[-1], members)
    elif name == "MARK":
        marks.append(len(stack))
    elif name == "POP":
        if marks and marks[-1] == len(stack):
            marks.pop()  # CPython's unpickler pops a mark that is on top
        else:
            stack.pop()
    elif name == "POP_MARK":
        del stack[marks.pop() :]
    elif name == "DUP":
        stack.append(stack[-1])
    elif name == "STACK_GLOBAL":
        if len(stack) - (marks[-1] if marks else 0) < 2:
            raise IndexError
        module, qualname = stack[-2].value, stack[-1].value
        del stack[-2:]
        known = isinstance(module, str) and isinstance(qualname, str)
        stack.append(_Cell(0, _Global(_dotted(module, qualname) if known else None)))
    elif name == "STOP":
        if len(stack) != 1 or marks:
            raise PickleRefused(f"ends with {len(stack)} values and {len(marks)} marks on its stack")
    elif name not in _NOTHING:  # EXT1/2/4 (the copyreg extension registry) and anything newer than this list
        raise PickleRefused(f"uses opcode {name}, which torch.save never writes (at byte {scan.position})")
