"""The checkpoint registry: which named objects go into a checkpoint, and how they get there and back.

Pure with respect to files: collecting calls each object's ``state_dict()`` and applying calls its
``load_state_dict()``, but nothing here reads or writes a file; the trainer does that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from trainkit.errors import RegistryError

__all__ = ["CkptRegistry", "RESERVED_NAMES", "register_items", "collect_payload", "apply_payload"]

RESERVED_NAMES = frozenset(
    {
        "trainkit",
        "guard_skips",
        "lineage",
        "schema_version",
        "epoch",
        "step",
        "world_size",
        "config",
        "loop",
        "best",
        "patience",
        "rng",
        "wandb_run_id",
        "items",
        "results",
        "latest_metrics",
        "metrics_offset",
        "training_modes",
        "rank_items",
        "loader_states",
    }
)
"""Top-level checkpoint keys that hold the engine's own state; no registered item may take them."""


def _freeze(items: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(items))


def _has(obj: Any, method: str) -> bool:
    return callable(getattr(obj, method, None)) and not isinstance(obj, type)


@attrs.frozen
class CkptRegistry:
    """The immutable mapping of names to the objects that go into a checkpoint.

    :ivar items: Read-only mapping of name to object, in registration order.

    >>> registry, added = register_items(CkptRegistry(), {"epoch_count": 3})
    >>> added, dict(registry.items)
    (('epoch_count',), {'epoch_count': 3})
    """

    items: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze, hash=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self.items)


def register_items(registry: CkptRegistry, items: Mapping[str, Any]) -> tuple[CkptRegistry, tuple[str, ...]]:
    """Register more objects to be saved and restored by name.

    Pure: returns a new registry.

    :param registry: The current registry; left unchanged.
    :param items: Name to object: anything with ``state_dict``/``load_state_dict``, or a plain value.
    :returns: The new registry, and the names added.
    :raises RegistryError: When a name is reserved, already registered, or not an identifier.

    >>> registry, _ = register_items(CkptRegistry(), {"model": 1})
    >>> register_items(registry, {"model": 2})
    Traceback (most recent call last):
    ...
    trainkit.errors.RegistryError: checkpoint item 'model' is already registered; register each item once, in setup()
    """
    merged = dict(registry.items)
    for name, obj in items.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise RegistryError(f"checkpoint item name must be a Python identifier, got {name!r}")
        if name in RESERVED_NAMES:
            raise RegistryError(
                f"checkpoint item name {name!r} is reserved for trainkit's own state "
                f"(reserved: {', '.join(sorted(RESERVED_NAMES))}); choose another name"
            )
        if name in merged:
            raise RegistryError(f"checkpoint item {name!r} is already registered; register each item once, in setup()")
        merged[name] = obj
    return CkptRegistry(merged), tuple(items)


def collect_payload(registry: CkptRegistry, *, state_of: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Collect every registered item's state into a dict keyed by name.

    Side effects: none beyond calling each object's ``state_dict()``.

    :param registry: The registry.
    :param state_of: Reads the state of an object with ``state_dict()``; ``obj.state_dict()`` when None.
        The trainer passes one that saves modules under names free of ``torch.compile`` prefixes.
    :returns: Name to ``obj.state_dict()``, or to the object itself for plain values.

    >>> class Counter:
    ...     def __init__(self): self.n = 2
    ...     def state_dict(self): return {"n": self.n}
    ...     def load_state_dict(self, d): self.n = d["n"]
    >>> registry, _ = register_items(CkptRegistry(), {"counter": Counter(), "note": "hi"})
    >>> collect_payload(registry)
    {'counter': {'n': 2}, 'note': 'hi'}
    """
    read = state_of or (lambda obj: obj.state_dict())
    return {name: read(obj) if _has(obj, "state_dict") else obj for name, obj in registry.items.items()}


_CAUSE_LINES = 4
"""How many lines of a loader's error a refusal repeats (torch lists every tensor whose shape differs)."""


def _one_line(text: str, limit: int = 600) -> str:
    """An error's text as one bounded line: its first lines joined, the rest counted.

    >>> _one_line("Error(s) in loading state_dict for Net:\\n\\tsize mismatch for a\\n\\tsize mismatch for b")
    'Error(s) in loading state_dict for Net:; size mismatch for a; size mismatch for b'
    >>> _one_line("\\n".join(f"line {i}" for i in range(10)))
    'line 0; line 1; line 2; line 3; ... and 6 more lines'
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    shown = "; ".join(lines[:_CAUSE_LINES])
    if len(lines) > _CAUSE_LINES:
        shown += f"; ... and {len(lines) - _CAUSE_LINES} more lines"
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def apply_payload(
    registry: CkptRegistry,
    payload: Mapping[str, Any],
    *,
    strict: bool = True,
    load_into: Callable[[Any, Any], None] | None = None,
) -> tuple[CkptRegistry, tuple[str, ...]]:
    """Load a payload collected by :func:`collect_payload` back into the registered objects.

    Side effects: calls ``load_state_dict()`` on registered objects that have one. Plain values
    cannot be restored in place, so the returned registry holds the restored values instead.

    :param registry: The registry whose objects receive the state.
    :param payload: Name to state, e.g. a loaded checkpoint; keys that are not registered names and are
        reserved engine keys are ignored.
    :param strict: When True, a registered name missing from the payload, or a payload item that is not
        registered, is an error.
    :param load_into: Loads a state into an object with ``load_state_dict()``;
        ``obj.load_state_dict(state)`` when None.
    :returns: The registry with plain values replaced by the restored ones, and the names restored.
    :raises RegistryError: Naming every missing and unexpected entry, when ``strict``; or naming the item
        whose ``load_state_dict()`` refused its state (e.g. parameter names or shapes that differ).

    >>> registry, _ = register_items(CkptRegistry(), {"note": "old"})
    >>> registry, restored = apply_payload(registry, {"note": "new"})
    >>> dict(registry.items), restored
    ({'note': 'new'}, ('note',))
    """
    offered = {name for name in payload if name not in RESERVED_NAMES}
    missing = [name for name in registry.items if name not in payload]
    unexpected = sorted(offered - set(registry.items))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            parts.append(f"in the checkpoint but not registered: {unexpected}")
        raise RegistryError(
            "checkpoint items do not match the registered items (" + "; ".join(parts) + "); register the same "
            "items with add_checkpoint_items() as the run that wrote the checkpoint"
        )
    load = load_into or (lambda obj, state: obj.load_state_dict(state))
    restored = dict(registry.items)
    names = []
    for name, obj in registry.items.items():
        if name not in payload:
            continue
        if _has(obj, "load_state_dict"):
            try:
                load(obj, payload[name])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise RegistryError(
                    f"checkpoint item {name!r} could not be restored into the registered {type(obj).__name__}: "
                    f"{_one_line(str(exc))}"
                ) from exc
        else:
            restored[name] = payload[name]
        names.append(name)
    return CkptRegistry(restored), tuple(names)
