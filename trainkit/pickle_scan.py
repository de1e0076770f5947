"""Bound a pickle before any unpickler sees it: how deeply it nests, and the memo indices it names.

Pure: reads the opcode stream only (``pickletools.genops``), builds nothing and imports no class. Standard
library only.

Even an unpickler that builds only plain values can be crashed by one. A million nested one-element tuples
used as a dict key make CPython hash them recursively in C, past the end of the thread's stack: the process
dies of a segmentation fault, before any ``except`` can run. And a memo index of 2**31 makes CPython's C
unpickler allocate and clear a memo array of that many entries. :func:`check_pickle` walks the opcodes once,
tracking how deeply every value on the unpickler's stack nests (a container is one deeper than its deepest
member), and refuses the pickle before it is unpickled.

Depths only hold if a value cannot grow deeper after it was put into another one, so that is refused too: a
pickler fills every container (and sets every object's state) right after making it, before the value it
belongs to takes it; only a pickle written to hide its depth fills a value it already nested.
"""

from __future__ import annotations

import pickletools

__all__ = ["MAX_PICKLE_DEPTH", "PickleRefused", "PickleUnsafe", "check_pickle"]

MAX_PICKLE_DEPTH = 1000
"""The deepest nesting of containers (and of objects built from their arguments) a checkpoint's pickle may
have. A state dict nests a few levels, trainkit's validators refuse items nested deeper than 256, and CPython
crashes somewhere past 100,000 (less in a thread with a small stack)."""


class PickleRefused(ValueError):
    """A pickle that no pickler writes: truncated, an unknown opcode, a stack that does not add up.

    :param reason: What is wrong, and where.
    """


class PickleUnsafe(PickleRefused):
    """A pickle built to crash its reader: it nests deeper than the limit, fills a value after nesting it, or
    names memo entries far beyond its own size. Not damage: no pickler writes one."""


_LEAVES = frozenset(
    [
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "NEXT_BUFFER",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "UNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "FLOAT",
        "BINFLOAT",
        "GLOBAL",
        "PERSID",
    ]
)
"""Opcodes that push one value built from their own argument, nesting nothing."""
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


def check_pickle(data: bytes | bytearray | memoryview, *, max_depth: int = MAX_PICKLE_DEPTH) -> None:
    """Refuse a pickle that nests deeper than ``max_depth`` or that no pickler writes, before it is unpickled.

    Pure. One pass over the opcodes (about half a microsecond each: some 3 ms for the pickle of a 300 MB
    checkpoint, whose tensors are stored outside it).

    >>> import pickle
    >>> check_pickle(pickle.dumps({"model": {"w": [1.0, 2.0]}, "step": 3}, protocol=2))
    >>> check_pickle(b"\\x80\\x02}K\\x01" + b"\\x85" * 2000 + b"K\\x02s.")  # a 2000-deep tuple as a dict key
    Traceback (most recent call last):
    ...
    trainkit.pickle_scan.PickleUnsafe: nests values more than 1000 deep (at byte 1005)

    :param data: The whole pickle (up to and including its ``STOP``).
    :param max_depth: The deepest nesting accepted.
    :raises PickleUnsafe: When a value nests deeper than ``max_depth``, or a memo index is larger than the
        pickle itself.
    :raises PickleRefused: When the opcode stream is truncated, holds an unknown or extension opcode, or its
        stack does not add up (a mark or a value missing where an opcode needs one).
    """
    size = len(data)
    stack: list[list[int]] = []  # each value's [nesting depth, nested yet], a cell shared with its memo entries
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    position = 0
    try:
        for opcode, arg, position in pickletools.genops(bytes(data) if not isinstance(data, bytes) else data):
            name = opcode.name
            if name in _LEAVES:
                stack.append([0, 0])
            elif name in _GETS:
                stack.append(memo[arg])
            elif name in _PUTS or name == "MEMOIZE":
                index = len(memo) if name == "MEMOIZE" else arg
                if index > size:
                    raise PickleUnsafe(f"names memo entry {index} in a pickle of {size} bytes (at byte {position})")
                memo[index] = stack[-1]
            elif name in _EMPTY:
                stack.append([1, 0])
            elif name in _FROM_TOP:
                count = _FROM_TOP[name]
                if len(stack) - (marks[-1] if marks else 0) < count:
                    raise IndexError
                members = stack[-count:]
                del stack[-count:]
                stack.append(_nest(members, max_depth, position))
            elif name in _FROM_MARK:
                start = marks.pop()
                members = stack[start:]
                del stack[start:]
                if name == "OBJ" and not members:
                    raise IndexError
                stack.append(_nest(members, max_depth, position))
            elif name in _FILL_FROM_TOP:
                count = _FILL_FROM_TOP[name]
                if len(stack) - (marks[-1] if marks else 0) <= count:
                    raise IndexError
                members = stack[-count:]
                del stack[-count:]
                _fill(stack[-1], members, max_depth, position)
            elif name in _FILL_FROM_MARK:
                start = marks.pop()
                members = stack[start:]
                del stack[start:]
                if not stack or (marks and len(stack) <= marks[-1]):
                    raise IndexError
                _fill(stack[-1], members, max_depth, position)
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
                del stack[-2:]
                stack.append([0, 0])
            elif name == "STOP":
                if len(stack) != 1 or marks:
                    raise PickleRefused(f"ends with {len(stack)} values and {len(marks)} marks on its stack")
            elif name in _NOTHING:
                continue
            else:  # EXT1/2/4 (the copyreg extension registry) and anything newer than this list
                raise PickleRefused(f"uses opcode {name}, which torch.save never writes (at byte {position})")
    except (IndexError, KeyError):
        raise PickleRefused(f"does not add up: an opcode finds no value or mark to use (at byte {position})") from None
    except ValueError as exc:
        if isinstance(exc, PickleRefused):
            raise
        raise PickleRefused(f"is truncated or malformed ({exc})") from None


def _depth(members: list[list[int]], max_depth: int, position: int) -> int:
    """One more than the deepest member's depth; the members are nested from now on."""
    depth = 1
    for member in members:
        if member[0] >= depth:
            depth = member[0] + 1
        member[1] = 1
    if depth > max_depth:
        raise PickleUnsafe(f"nests values more than {max_depth} deep (at byte {position})")
    return depth


def _nest(members: list[list[int]], max_depth: int, position: int) -> list[int]:
    return [_depth(members, max_depth, position), 0]


def _fill(container: list[int], members: list[list[int]], max_depth: int, position: int) -> None:
    if container[1]:
        raise PickleUnsafe(f"fills a value after nesting it in another one (at byte {position})")
    depth = _depth(members, max_depth, position)
    if depth > container[0]:
        container[0] = depth
