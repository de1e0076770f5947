"""The shape of a user's state before it is saved: no cycle, bounded depth and size, shared parts counted once.

A registered item's or a loader's ``state_dict()`` is user code: it may return a container that holds itself (a
cycle, which no checkpoint can resume as a tree) or one sub-object shared many times (``a = [a, a]`` sixty times: a
few dozen objects, 2**60 paths). Every walk over such a state for a save (measuring, copying, digesting, checking
that it loads) visits each distinct container once; :func:`check_state_graph` refuses a cycle, a depth past what a
resume reads back, and an unbounded number of containers, naming the item and the path, before anything is written.

Side effects: none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainkit.errors import CheckpointUnsafeError

__all__ = ["MAX_STATE_CONTAINERS", "check_state_graph", "CONTAINERS"]

MAX_STATE_CONTAINERS = 4_000_000
"""The most distinct containers (dicts, lists, tuples, sets) one item's state may hold: a bound on the walk's time
(about a second per million) far above any real state (a model's state dict holds one, an optimizer's one per
parameter)."""

CONTAINERS = (dict, list, tuple, set, frozenset)
"""The containers a state is walked through (subclasses included), and a tensor's Python attributes (which
``torch.save`` pickles with it); anything else is a leaf."""

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), *_TENSORS})


def _attributes(obj: Any) -> dict[str, Any]:
    """A tensor's Python attributes (``t.meta = {...}``): ``torch.save`` pickles them with it, so they are walked."""
    return (getattr(obj, "__dict__", None) or {}) if isinstance(obj, torch.Tensor) else {}


def _walked(obj: Any) -> bool:
    """Whether the walk goes into ``obj``: a container, or a tensor that carries Python attributes."""
    return isinstance(obj, CONTAINERS) or bool(_attributes(obj))


def _plain(members: Any) -> bool:
    """Whether every member is a leaf the walk need not look into (no tensor among them carries attributes)."""
    types = set(map(type, members))
    if not _LEAVES.issuperset(types):
        return False
    return not types & _TENSORS or not any(_attributes(m) for m in members if type(m) in _TENSORS)


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(step, child)`` for each child of ``obj`` the walk goes into: the step as a path renders it."""
    if isinstance(obj, torch.Tensor):
        for name, value in _attributes(obj).items():
            if _walked(value):
                yield f".{name}", value
    elif isinstance(obj, dict):
        members: Any = obj.values()
        attributes = getattr(obj, "__dict__", None) or {}  # an OrderedDict's: a module state dict's _metadata
        if attributes or not _plain(members):
            for key, value in obj.items():
                if isinstance(key, CONTAINERS):
                    yield "[<key>]", key
                if _walked(value):
                    yield f"[{key!r}]" if type(key) in _LEAVES else "[<key>]", value
            for name, value in attributes.items():
                if _walked(value):
                    yield f".{name}", value
    elif isinstance(obj, set | frozenset):
        for member in obj:
            if isinstance(member, CONTAINERS):
                yield "{<member>}", member
    elif not _plain(obj):
        for index, value in enumerate(obj):
            if _walked(value):
                yield f"[{index}]", value


def _path(name: str, crumb: tuple[Any, str] | None) -> str:
    """``name`` then the steps the crumbs left, e.g. ``counter['self']``; a long path keeps its first steps."""
    steps: list[str] = []
    while crumb is not None:
        crumb, step = crumb
        steps.append(step)
    steps.reverse()
    shown = "".join(step if len(step) <= 60 else step[:57] + "..." for step in steps[:12])
    return name + shown + ("..." if len(steps) > 12 else "")


def check_state_graph(
    name: str, state: Any, *, owner: str, max_depth: int, max_containers: int = MAX_STATE_CONTAINERS
) -> None:
    """Refuse a state that holds a cycle, nests deeper than ``max_depth`` or holds more than ``max_containers``
    distinct containers; a container shared by several paths is walked once (the cost is linear in distinct
    containers and their entries, not in paths).

    >>> shared = [0]
    >>> for _ in range(60):
    ...     shared = [shared, shared]
    >>> check_state_graph("counter", {"l": shared}, owner="checkpoint item 'counter'", max_depth=256)
    >>> state = {}
    >>> state["self"] = state
    >>> check_state_graph("counter", state, owner="checkpoint item 'counter'", max_depth=256)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointUnsafeError: checkpoint item 'counter' holds a cycle: counter['self'] is the dict ...

    :param name: How a path into the state starts (the item's name, ``loader_state``).
    :param state: The state, as ``state_dict()`` returned it.
    :param owner: Whose state it is, for the message (``checkpoint item 'counter'``).
    :param max_depth: The deepest nesting allowed (a resume refuses deeper).
    :param max_containers: The most distinct containers allowed.
    :raises CheckpointUnsafeError: On a cycle, a deeper nesting or too many containers, naming ``owner`` and the
        path; its ``location`` is the path.
    """
    if not _walked(state):
        return
    done: set[int] = set()
    on_path: dict[int, tuple[Any, str] | None] = {}  # the containers being walked, to the crumb that reached them
    stack: list[tuple[Any, tuple[Any, str] | None, int, bool]] = [(state, None, 1, False)]
    count = 0
    while stack:
        obj, crumb, depth, leaving = stack.pop()
        key = id(obj)
        if leaving:
            del on_path[key]
            done.add(key)
            continue
        if key in done:
            continue
        if key in on_path:
            where, back = _path(name, crumb), _path(name, on_path[key])
            raise CheckpointUnsafeError(
                f"{owner} holds a cycle: {where} is the {type(obj).__name__} at {back}, which contains it, so no "
                "checkpoint can hold it as a tree; return a state_dict() without references back to itself",
                type(obj).__name__,
                where,
            )
        if depth > max_depth:
            where = _path(name, crumb)
            raise CheckpointUnsafeError(
                f"{owner} nests containers deeper than {max_depth} at {where}, deeper than a resume reads back; "
                "return a flatter state_dict()",
                type(obj).__name__,
                where,
            )
        count += 1
        if count > max_containers:
            where = _path(name, crumb)
            raise CheckpointUnsafeError(
                f"{owner} holds more than {max_containers} distinct containers (dicts, lists, tuples, sets; reached "
                f"at {where}); keep large data in tensors, or out of the checkpoint",
                type(obj).__name__,
                where,
            )
        on_path[key] = crumb
        stack.append((obj, crumb, depth, True))
        for step, child in _children(obj):
            if id(child) not in done:
                stack.append((child, (crumb, step), depth + 1, False))
