"""The engine's checkpoint payloads: the keys a ``last.pt`` and a ``best.pt`` hold, and the shape of each value.

Side effects: none. :data:`LAST_PT` and :data:`BEST_PT` are the one place that names the engine's keys and states
their rules; :func:`validate_last` and :func:`validate_best` check a loaded payload against them before anything
reads it. A file that passed its CRC check but holds values of the wrong shape (a foreign or hand-edited file, a
user's own ``torch.save``) is then a :class:`~trainkit.CheckpointCorruptError` naming the path, the key, the rule
and the value, never an ``AttributeError`` or a ``RecursionError`` somewhere in a resume. Validation looks at
containers and the types in them, never inside a tensor: it runs once per resume and costs about what walking the
payload's dicts and lists does.
"""

from __future__ import annotations

import array
import itertools
import os
import random
import re
import reprlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from trainkit import bookkeeping
from trainkit.bookkeeping import RESERVED_NAMES, BestState, EpochPosition, LoopState, PatienceState
from trainkit.errors import BookkeepingError, CheckpointCorruptError

__all__ = [
    "SCHEMA_VERSION",
    "Key",
    "LAST_PT",
    "BEST_PT",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_ENTRIES",
    "MAX_ITEM_DEPTH",
    "validate_last",
    "validate_best",
    "last_payload",
    "best_payload",
    "mid_epoch_state",
    "resume_refusal",
    "finished_run",
    "is_running_mean",
    "rank_items_state",
    "item_states_for_rank",
    "pooled_running_mean",
]

SCHEMA_VERSION = 1
"""The checkpoint layout the schemas below describe (``trainkit.trainer.CHECKPOINT_SCHEMA_VERSION``)."""

MAX_CONFIG_DEPTH = 32
"""How deeply a saved config may nest dicts and lists; trainkit's own configs nest 3 levels."""

MAX_CONFIG_ENTRIES = 1_000_000
"""How many values a saved config may hold, counting a list or dict held twice twice (as a resume's walk of it
would): a few bytes of shared references cannot stand for an exponential amount of work."""

MAX_ITEM_DEPTH = 256
"""How deeply a registered item's state may nest containers: deeper than any state dict, and shallow enough for
the recursive walks that read one (``Optimizer.load_state_dict``, ``copy.deepcopy``) to stay within Python's
recursion limit."""

_INT_LIMIT = 2**63
"""Counters, sizes and offsets fit in a signed 64-bit int (a file offset, W&B's step)."""

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTAINERS = (dict, list, tuple, set, frozenset)
_LEAVES = frozenset({type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter})
_PYTHON_STATE_INTS = len(random.getstate()[1])  # 624 words and an index


class _Bad(Exception):
    """A value that breaks its rule: where it sits in the payload, the rule, the value, and optionally why."""

    def __init__(self, where: str, rule: str, value: Any, why: str = "") -> None:
        super().__init__(where)
        self.where, self.rule, self.value, self.why = where, rule, value, why


@attrs.frozen
class Key:
    """One engine key of a checkpoint payload.

    :ivar name: The key.
    :ivar rule: What its value must be, as the error message says it.
    :ivar check: Raises when the value breaks the rule; gets the value and the key.
    :ivar nullable: Whether the value may be None.
    :ivar required: False for a key that checkpoints of older trainkit versions lack.
    """

    name: str
    rule: str
    check: Callable[[Any, str], None] = attrs.field(repr=False)
    nullable: bool = False
    required: bool = True


# --- checks of one value ----------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, not a numpy or tensor integer


def _int_from(low: int) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if not (_is_int(value) and low <= value < _INT_LIMIT):
            raise _Bad(where, f"an int in [{low}, 2**63)", value)

    return check


_CONFIG_RULE = (
    f"a dict of str keys holding None, bools, numbers, strings, lists and dicts, nested at most {MAX_CONFIG_DEPTH} deep"
)


def _check_config(value: Any, where: str) -> None:
    """Dicts with str keys and lists, of plain values; every path is walked, so none is too deep or too long."""
    if type(value) is not dict:
        raise _Bad(where, _CONFIG_RULE, value)
    stack: list[tuple[Any, str, int]] = [(value, where, 1)]
    entries = 0
    while stack:
        obj, at, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise _Bad(at, f"nested at most {MAX_CONFIG_DEPTH} deep in {where}", obj, "it is nested deeper")
        entries += len(obj)
        if entries > MAX_CONFIG_ENTRIES:
            raise _Bad(where, f"{_CONFIG_RULE}, with at most {MAX_CONFIG_ENTRIES} values", value, "it holds more")
        pairs = obj.items() if type(obj) is dict else enumerate(obj)
        for key, item in pairs:
            if type(obj) is dict and type(key) is not str:
                raise _Bad(f"{at}[<key>]", "a str", key)
            kind = type(item)
            if kind is dict or kind is list or kind is tuple:
                deeper = _step(at, key) if depth < 6 else at if at.endswith("...") else f"{at}..."
                stack.append((item, deeper, depth + 1))
            elif item is not None and kind not in (bool, int, float, str):
                raise _Bad(_step(at, key), "None, a bool, a number, a string, a list or a dict", item)


def _record(cls: Any) -> Callable[[Any, str], None]:
    """A dict that ``cls.from_dict`` accepts: its kind, schema version and every field's rule."""

    def check(value: Any, where: str) -> None:
        rule = f"a {cls.__name__} dict"
        if type(value) is not dict:
            raise _Bad(where, rule, value)
        _check_nesting(value, where, 3)  # a record's dict is flat but for its metrics; a deep one never reaches repr()
        try:
            cls.from_dict(value)
        except Exception as exc:  # noqa: BLE001 - a hostile dict makes attrs validators and converters raise anything
            raise _Bad(where, f"{rule} that {cls.__name__}.from_dict accepts", value, _why(exc)) from None

    return check


def _check_rng(value: Any, where: str, *, python_required: bool = True) -> None:
    """One dict per rank of the states :func:`~trainkit.state.rng.capture_rng` takes; each is tried on a throwaway
    generator, so a state that :func:`~trainkit.state.rng.restore_rng` would refuse is refused here. A loader's
    iterator-time states (``python_required=False``) may hold torch's alone."""
    if type(value) is not list or not value:
        raise _Bad(where, "a non-empty list of generator states, one dict per rank", value)
    for rank, state in enumerate(value):
        at = f"{where}[{rank}]"
        if type(state) is not dict or "torch" not in state or (python_required and "python" not in state):
            entries = "'python' and 'torch' entries" if python_required else "a 'torch' entry"
            raise _Bad(at, f"a dict of generator states with {entries}", state)
        if "python" in state:
            _python_state(state["python"], f"{at}['python']")
        _torch_state(state["torch"], f"{at}['torch']")
        if "numpy" in state:
            _numpy_state(state["numpy"], f"{at}['numpy']")
        if "cuda" in state:
            cuda = state["cuda"]
            if type(cuda) is not list or not all(_is_byte_tensor(t) for t in cuda):
                raise _Bad(f"{at}['cuda']", "a list of uint8 tensors, as torch.cuda.get_rng_state_all() gives", cuda)


def _is_byte_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _python_state(value: Any, where: str) -> None:
    rule = "[version, state as bytes or 625 ints, gauss] as random.getstate() gives"
    if type(value) not in (list, tuple) or len(value) != 3:
        raise _Bad(where, rule, value)
    version, internal, gauss = value
    try:
        if type(internal) is bytes and len(internal) == 8 * _PYTHON_STATE_INTS:
            internal = array.array("q", internal).tolist()
        elif isinstance(internal, torch.Tensor) and internal.dim() == 1 and internal.numel() == _PYTHON_STATE_INTS:
            internal = internal.tolist()
        elif type(internal) not in (list, tuple) or len(internal) != _PYTHON_STATE_INTS:
            raise TypeError(f"the state is not {_PYTHON_STATE_INTS} ints")
        random.Random().setstate((version, tuple(internal), gauss))
    except Exception as exc:  # noqa: BLE001 - setstate raises ValueError, TypeError or OverflowError
        raise _Bad(where, rule, value, _why(exc)) from None


def _torch_state(value: Any, where: str) -> None:
    rule = "torch's CPU generator state, as bytes or a uint8 tensor"
    if type(value) is bytes and value:
        value = torch.frombuffer(bytearray(value), dtype=torch.uint8)
    elif not _is_byte_tensor(value):
        raise _Bad(where, rule, value)
    try:
        torch.Generator().set_state(value)
    except Exception as exc:  # noqa: BLE001 - a state of the wrong size is a RuntimeError
        raise _Bad(where, rule, value, _why(exc)) from None


def _numpy_state(value: Any, where: str) -> None:
    rule = "[name, keys as bytes or a tensor, pos, has_gauss, cached_gaussian] as numpy.random.get_state() gives"
    if type(value) not in (list, tuple) or len(value) != 5:
        raise _Bad(where, rule, value)
    name, keys, pos, has_gauss, cached = value
    if not (
        type(name) is str
        and (type(keys) is bytes or (isinstance(keys, torch.Tensor) and keys.dim() == 1))
        and _is_int(pos)
        and _is_int(has_gauss)
        and type(cached) in (int, float)
    ):
        raise _Bad(where, rule, value)
    numpy = sys.modules.get("numpy")
    if numpy is None:  # restore_rng only restores numpy's state where numpy is loaded
        return
    try:
        keys = numpy.frombuffer(keys, dtype=numpy.uint32) if type(keys) is bytes else keys.numpy()
        numpy.random.RandomState().set_state((name, keys.astype("uint32"), pos, has_gauss, cached))
    except Exception as exc:  # noqa: BLE001 - numpy raises ValueError or TypeError
        raise _Bad(where, rule, value, _why(exc)) from None


def _check_run_id(value: Any, where: str) -> None:
    if not (type(value) is str and _RUN_ID.fullmatch(value)):
        raise _Bad(where, "a W&B run id: 1 to 64 of the characters A-Z, a-z, 0-9, _ and -", value)


def _check_items(value: Any, where: str) -> None:
    rule = "a list of distinct item names: identifiers that are not engine keys"
    if type(value) is not list:
        raise _Bad(where, rule, value)
    seen: set[str] = set()
    for index, name in enumerate(value):
        if type(name) is not str or not name.isidentifier() or name in RESERVED_NAMES or name in seen:
            raise _Bad(f"{where}[{index}]", "an identifier that is not an engine key and not listed before", name)
        seen.add(name)


def _metrics(value: Any, where: str) -> None:
    rule = "a dict of str to int or float"
    if type(value) is not dict:
        raise _Bad(where, rule, value)
    for key, number in value.items():
        if type(key) is not str:
            raise _Bad(f"{where}[<key>]", "a str", key)
        if type(number) not in (int, float):
            raise _Bad(_step(where, key), "an int or a float", number)


def _check_modes(value: Any, where: str) -> None:
    rule = "a dict of item name to a dict of submodule name to bool"
    if type(value) is not dict:
        raise _Bad(where, rule, value)
    for name, modes in value.items():
        if type(name) is not str or type(modes) is not dict:
            raise _Bad(where, rule, {name: modes})
        for module, flag in modes.items():
            if type(module) is not str or type(flag) is not bool:
                raise _Bad(_step(where, name), "a dict of submodule name to bool", {module: flag})


_MID_EPOCH_RULE = "a dict with 'position' (an EpochPosition dict) and 'ranks' (one dict per rank)"
_RANK_KEYS = frozenset({"rng_at_iter", "generators_at_iter", "logs", "grad_norm"})
_LOADER_KEYS = frozenset({"loader_state", "generators_at_save"})
_RANK_RULE = (
    "a dict with 'rng_at_iter', 'generators_at_iter', 'logs' and 'grad_norm', and for a loader that carries its own "
    "position 'loader_state' and 'generators_at_save'"
)
_LOADER_STATE_RULE = (
    f"a dict of str keys: the loader's own state_dict(), nested at most {MAX_ITEM_DEPTH} deep (its load_state_dict() "
    "judges the rest)"
)


def _check_mid_epoch(value: Any, where: str) -> None:
    """The state of a step checkpoint written inside an epoch (see :func:`mid_epoch_state`)."""
    if type(value) is not dict or set(value) != {"position", "ranks"}:
        raise _Bad(where, _MID_EPOCH_RULE, value)
    _record(EpochPosition)(value["position"], f"{where}['position']")
    ranks = value["ranks"]
    if type(ranks) is not list or not ranks:
        raise _Bad(f"{where}['ranks']", "a non-empty list, one dict per rank", ranks)
    for rank, state in enumerate(ranks):
        at = f"{where}['ranks'][{rank}]"
        if type(state) is not dict or set(state) not in (_RANK_KEYS, _RANK_KEYS | _LOADER_KEYS):
            raise _Bad(at, _RANK_RULE, state)
        _check_rng([state["rng_at_iter"]], f"{at}['rng_at_iter']", python_required=False)
        _check_generators(state["generators_at_iter"], f"{at}['generators_at_iter']")
        if "loader_state" in state:
            _check_loader_state(state["loader_state"], f"{at}['loader_state']")
            _check_generators(state["generators_at_save"], f"{at}['generators_at_save']")
            if len(state["generators_at_save"]) != len(state["generators_at_iter"]):
                rule = f"a list of {len(state['generators_at_iter'])} states, as many as 'generators_at_iter'"
                raise _Bad(f"{at}['generators_at_save']", rule, state["generators_at_save"])
        _check_logs(state["logs"], f"{at}['logs']")
        _check_running_mean(state["grad_norm"], f"{at}['grad_norm']")


_LOADER_STATES_RULE = (
    "a list with one entry per rank: None, or the state_dict() of the loader that carries its own position whose "
    "epoch just ended on that rank"
)


def _check_loader_states(value: Any, where: str) -> None:
    """The epoch-end states of the loaders that carry their own position, one per rank (see :func:`last_payload`)."""
    if type(value) is not list or not value:
        raise _Bad(where, _LOADER_STATES_RULE, value)
    for rank, state in enumerate(value):
        if state is not None:
            _check_loader_state(state, f"{where}[{rank}]")


def _check_generators(value: Any, where: str) -> None:
    """A loader's own generators' states, each tried on a throwaway generator."""
    if type(value) is not list or not all(_is_byte_tensor(g) for g in value):
        raise _Bad(where, "a list of uint8 generator states", value)
    for index, generator in enumerate(value):
        _torch_state(generator, f"{where}[{index}]")


def _check_loader_state(value: Any, where: str) -> None:
    """A loader's own ``state_dict()`` (a loader that carries its own position): its top level, and its nesting."""
    if type(value) is not dict or not all(type(key) is str for key in value):
        raise _Bad(where, _LOADER_STATE_RULE, value)
    _check_nesting(value, where, MAX_ITEM_DEPTH)


_SKIPS_RULE = "a list of [epoch, batch] pairs of ints in [0, 2**63)"


def _check_skips(value: Any, where: str) -> None:
    """The batch positions the divergence guard's rollback leaves out, per epoch."""
    if type(value) is not list:
        raise _Bad(where, _SKIPS_RULE, value)
    for index, pair in enumerate(value):
        if type(pair) is not list or len(pair) != 2 or not all(_is_int(n) and 0 <= n < _INT_LIMIT for n in pair):
            raise _Bad(f"{where}[{index}]", "an [epoch, batch] pair of ints in [0, 2**63)", pair)


def _check_logs(value: Any, where: str) -> None:
    rule = "{'scalars': [[str, float], ...], 'vectors': [[[str, ...], [float, ...]], ...]}"
    if type(value) is not dict or set(value) != {"scalars", "vectors"}:
        raise _Bad(where, rule, value)
    scalars, vectors = value["scalars"], value["vectors"]
    if type(scalars) is not list or not all(
        type(pair) is list and len(pair) == 2 and type(pair[0]) is str and type(pair[1]) is float for pair in scalars
    ):
        raise _Bad(f"{where}['scalars']", "a list of [str, float] pairs", scalars)
    if type(vectors) is not list or not all(
        type(pair) is list
        and len(pair) == 2
        and type(pair[0]) is list
        and type(pair[1]) is list
        and len(pair[0]) == len(pair[1])
        and all(type(key) is str for key in pair[0])
        and all(type(number) is float for number in pair[1])
        for pair in vectors
    ):
        raise _Bad(
            f"{where}['vectors']", "a list of [keys, values] pairs of equal length (str keys, float values)", vectors
        )


def _check_running_mean(value: Any, where: str) -> None:
    rule = "{'sum': None or a 0-d floating tensor, 'count': an int >= 0}"
    if (
        type(value) is not dict
        or set(value) != {"sum", "count"}
        or not (_is_int(value["count"]) and value["count"] >= 0)
    ):
        raise _Bad(where, rule, value)
    total = value["sum"]
    if total is not None and not (isinstance(total, torch.Tensor) and total.dim() == 0 and total.is_floating_point()):
        raise _Bad(f"{where}['sum']", "None or a 0-d floating tensor", total)


_RANK_ITEMS_RULE = (
    "{'means': {item name: [a running mean's {'sum', 'count'}, one per rank]}, 'differ': [item names]}: the "
    "registered items whose state differed between ranks"
)


def _check_rank_items(value: Any, where: str) -> None:
    """The registered items whose state differed between the saving ranks (see :func:`rank_items_state`)."""
    if type(value) is not dict or set(value) != {"means", "differ"}:
        raise _Bad(where, _RANK_ITEMS_RULE, value)
    means, differ = value["means"], value["differ"]
    if type(means) is not dict or not all(type(name) is str for name in means):
        raise _Bad(f"{where}['means']", "a dict of item name to a list of running-mean states", means)
    for name, states in means.items():
        if type(states) is not list or not states:
            raise _Bad(f"{where}['means'][{_short(name)}]", "a non-empty list, one state per rank", states)
        for rank, state in enumerate(states):
            _check_running_mean(state, f"{where}['means'][{_short(name)}][{rank}]")
    if type(differ) is not list or not all(type(name) is str for name in differ):
        raise _Bad(f"{where}['differ']", "a list of item names", differ)


_LINEAGE_RULE = (
    f"a list of at most {bookkeeping.MAX_SEGMENTS} [token, first_step] pairs "
    "(tokens lowercase hex, steps never decreasing)"
)


def _check_lineage(value: Any, where: str) -> None:
    try:
        bookkeeping.lineage_from(value)
    except BookkeepingError:
        raise _Bad(where, _LINEAGE_RULE, value) from None


def _check_model(value: Any, where: str) -> None:
    if not isinstance(value, dict) or not all(type(key) is str for key in value):
        raise _Bad(where, "a state dict: str keys to tensors and plain values", value)
    _check_nesting(value, where, MAX_ITEM_DEPTH)


def _check_nesting(value: Any, where: str, limit: int) -> None:
    """Refuse containers nested deeper than ``limit``, counting the deepest path through shared containers.

    Each container is walked once, and its height (one more than its deepest child's) is computed from its
    children's; a container reached again on its own path (a cycle) adds nothing. So containers shared at several
    depths cannot hide how deep the structure really is.
    """
    if not isinstance(value, _CONTAINERS):
        return
    height: dict[int, int] = {}
    kids: dict[int, list[tuple[Any, Any]]] = {}
    parent: dict[int, tuple[Any, Any]] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        obj, expanded = stack.pop()
        key = id(obj)
        if expanded:
            on_path.discard(key)
            height[key] = 1 + max((height.get(id(child), 0) for _, child in kids[key]), default=0)
            if height[key] > limit:
                raise _Bad(
                    _deep_path(where, value, obj, parent, kids, height),
                    f"nested at most {limit} deep",
                    obj,
                    "it is nested deeper",
                )
            continue
        if key in height or key in on_path:
            continue
        on_path.add(key)
        kids[key] = list(_container_children(obj))
        stack.append((obj, True))
        for name, child in kids[key]:
            if id(child) not in height and id(child) not in on_path:
                parent.setdefault(id(child), (name, obj))
                stack.append((child, False))


def _container_children(obj: Any) -> Iterable[tuple[Any, Any]]:
    attributes = getattr(obj, "__dict__", None) or {}  # an OrderedDict's: a module state dict's _metadata
    members = obj.values() if isinstance(obj, dict) else obj
    if not attributes and _LEAVES.issuperset(map(type, members)):
        return ()  # nothing nested here: the common case of a state dict's tensors, checked at C speed
    children: Iterable[tuple[Any, Any]]
    if isinstance(obj, dict):
        children = itertools.chain(obj.items(), attributes.items())
    elif isinstance(obj, set | frozenset):
        children = (("<member>", member) for member in obj)
    else:
        children = enumerate(obj)
    return [(key, child) for key, child in children if type(child) not in _LEAVES and isinstance(child, _CONTAINERS)]


def _deep_path(
    where: str,
    root: Any,
    deep: Any,
    parent: dict[int, tuple[Any, Any]],
    kids: dict[int, list[tuple[Any, Any]]],
    height: dict[int, int],
) -> str:
    """``where[k1][k2]...``: the way from the root to ``deep``, then down its deepest children (the first steps)."""
    steps: list[Any] = []
    node = deep
    while node is not root and id(node) in parent:  # the parents form a tree: this ends at the root
        name, node = parent[id(node)]
        steps.append(name)
    steps.reverse()
    node = deep
    while len(steps) < 7 and kids.get(id(node)):
        name, node = max(kids[id(node)], key=lambda kid: height.get(id(kid[1]), 0))
        steps.append(name)
    return f"{where}" + "".join(f"[{_short(step)}]" for step in steps[:6]) + ("..." if len(steps) > 6 else "")


# --- the schemas ------------------------------------------------------------------------------------------------

_SCHEMA_VERSION_KEY = Key("schema_version", "an int >= 1", _int_from(1))
_CONFIG_KEY = Key("config", _CONFIG_RULE, _check_config)

LAST_PT: tuple[Key, ...] = (
    _SCHEMA_VERSION_KEY,
    Key("epoch", "an int in [0, 2**63): epochs completed", _int_from(0)),
    Key("step", "an int in [0, 2**63): optimizer steps taken", _int_from(0)),
    Key("world_size", "an int in [1, 2**63)", _int_from(1)),
    _CONFIG_KEY,
    Key("loop", "a LoopState dict", _record(LoopState)),
    Key("best", "None or a BestState dict", _record(BestState), nullable=True),
    Key("patience", "None or a PatienceState dict", _record(PatienceState), nullable=True),
    Key("rng", "a list of generator states, one dict per rank", _check_rng),
    Key("wandb_run_id", "None or a W&B run id: 1 to 64 of A-Z, a-z, 0-9, _ and -", _check_run_id, nullable=True),
    Key("items", "a list of distinct item names", _check_items),
    Key("latest_metrics", "a dict of str to int or float", _metrics),
    Key("results", "None or a dict of str to int or float", _metrics, nullable=True),
    Key("metrics_offset", "None or an int in [0, 2**63): the size of metrics.jsonl", _int_from(0), nullable=True),
    Key("training_modes", "a dict of item name to a dict of submodule name to bool", _check_modes, required=False),
    Key("trainkit", f"None or {_MID_EPOCH_RULE}", _check_mid_epoch, nullable=True, required=False),
    Key("guard_skips", _SKIPS_RULE, _check_skips, required=False),
    Key("rank_items", f"None or {_RANK_ITEMS_RULE}", _check_rank_items, nullable=True, required=False),
    Key("lineage", _LINEAGE_RULE, _check_lineage, required=False),
    Key("loader_states", f"None or {_LOADER_STATES_RULE}", _check_loader_states, nullable=True, required=False),
)
"""The engine's keys of a ``last.pt``, in the order the trainer writes them; each registered item's state sits
beside them under its own name (listed in ``items``). ``training_modes`` is absent from checkpoints written before
trainkit saved it, and ``trainkit`` (the state of a step checkpoint written inside an epoch, None at an epoch's end)
from checkpoints written before step checkpoints existed, ``guard_skips`` (the batches a rollback of the divergence
guard leaves out) from those written before it existed, ``rank_items`` (the items whose state differed between ranks,
None when none did) from those written before trainkit compared them, ``lineage`` (the history of lives the
checkpoint belongs to, :func:`~trainkit.bookkeeping.in_history`) from those written before trainkit recorded it,
``loader_states`` (at an epoch's end, each rank's ``state_dict()`` of the loader that carries its own position whose
epoch ended; None when no rank has one) from those written before trainkit saved it; a
``loop`` dict may lack ``last_validated``
(LoopState.from_dict supplies the default)."""

BEST_PT: tuple[Key, ...] = (
    _SCHEMA_VERSION_KEY,
    Key("model", "a state dict: str keys to tensors and plain values", _check_model),
    Key("best", "a BestState dict", _record(BestState)),
    Key("epoch", "None or an int in [0, 2**63): the best epoch", _int_from(0), nullable=True),
    _CONFIG_KEY,
)
"""The keys of a ``best.pt``: the best weights, the best record, its epoch and the config; nothing else."""


# --- building ---------------------------------------------------------------------------------------------------


def last_payload(
    *,
    items: dict[str, Any],
    epoch: int,
    step: int,
    world_size: int,
    config: dict[str, Any],
    loop: LoopState,
    best: BestState | None,
    patience: PatienceState | None,
    rng: list[dict[str, Any]],
    wandb_run_id: str | None,
    latest_metrics: dict[str, float],
    results: dict[str, float] | None,
    metrics_offset: int | None,
    training_modes: dict[str, dict[str, bool]],
    mid_epoch: dict[str, Any] | None = None,
    guard_skips: list[list[int]] | None = None,
    rank_items: dict[str, Any] | None = None,
    lineage: bookkeeping.Lineage = (),
    loader_states: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Build a ``last.pt`` payload: every registered item's state under its name, then the engine's keys.

    Pure. The engine's keys are exactly :data:`LAST_PT`'s, in its order, and every one of them is in
    :data:`~trainkit.bookkeeping.RESERVED_NAMES` (a test pins both).

    >>> payload = last_payload(items={"model": {}}, epoch=1, step=10, world_size=1, config={}, loop=LoopState(),
    ...     best=None, patience=None, rng=[{}], wandb_run_id="abc", latest_metrics={}, results=None,
    ...     metrics_offset=0, training_modes={})
    >>> list(payload)[1:] == [key.name for key in LAST_PT]
    True

    :param items: The registered items' states by name (``collect_payload``'s output).
    :param epoch: Epochs completed.
    :param step: Optimizer steps taken.
    :param world_size: The number of processes.
    :param config: The config as a plain dict without secrets (``public_config``).
    :param loop: The loop record.
    :param best: The best record, if tracked.
    :param patience: The patience record, if tracked.
    :param rng: Every rank's RNG states, by rank.
    :param wandb_run_id: The W&B run id.
    :param latest_metrics: The last pushed value of every metric.
    :param results: The final results of a finished run, else None.
    :param metrics_offset: The size of ``metrics.jsonl``, or None without one.
    :param training_modes: Per registered module, its submodules' ``training`` flags.
    :param mid_epoch: For a step checkpoint inside an epoch, :func:`mid_epoch_state`'s dict; None at an epoch's end.
    :param guard_skips: ``[epoch, batch]`` positions the divergence guard's rollback leaves out (None: none).
    :param rank_items: :func:`rank_items_state`'s dict, or None when every item's state was the same on every rank.
    :param lineage: The history of lives the checkpoint belongs to (:func:`~trainkit.bookkeeping.branch_lineage`).
    :param loader_states: At an epoch's end, per rank, the ``state_dict()`` of the loader that carries its own
        position whose epoch ended there (None for a rank without one); None when no rank has one.
    :returns: The payload, ready for :func:`~trainkit.checkpoint.atomic_save`.
    """
    return {
        **items,
        "schema_version": SCHEMA_VERSION,
        "epoch": epoch,
        "step": step,
        "world_size": world_size,
        "config": config,
        "loop": loop.to_dict(),
        "best": best.to_dict() if best is not None else None,
        "patience": patience.to_dict() if patience is not None else None,
        "rng": rng,
        "wandb_run_id": wandb_run_id,
        "items": list(items),
        "latest_metrics": dict(latest_metrics),
        "results": results,
        "metrics_offset": metrics_offset,
        "training_modes": training_modes,
        "trainkit": mid_epoch,
        "guard_skips": list(guard_skips or []),
        "rank_items": rank_items,
        "lineage": [list(segment) for segment in lineage],
        "loader_states": loader_states,
    }


def mid_epoch_state(position: EpochPosition, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``trainkit`` entry of a step checkpoint written inside an epoch.

    Pure.

    >>> p = EpochPosition(epoch=0, batches=1, batches_per_epoch=2, batch_size=1, dataset_length=2, world_size=1)
    >>> sorted(mid_epoch_state(p, [{}]))
    ['position', 'ranks']

    :param position: Where the epoch stands.
    :param ranks: Per rank: ``rng_at_iter`` (its RNG states when the loader's iterator was made),
        ``generators_at_iter`` (its loader's own generators' states then), ``logs`` (its unpushed metrics,
        ``LogBuffer.state_dict()``) and ``grad_norm`` (its epoch grad-norm mean so far); and, for a loader that carries
        its own position, ``loader_state`` (its ``state_dict()`` at the save) and ``generators_at_save`` (its own
        generators' states then); both absent for a loader trainkit skips into, so such checkpoints are what they
        were before.
    :returns: ``{"position": ..., "ranks": [...]}``.
    """
    return {"position": position.to_dict(), "ranks": ranks}


def finished_run(ckpt: dict[str, Any]) -> bool:
    """Whether a checkpoint (validated) is a finished run's: its loop records why it stopped.

    The checkpointer does not refuse such a checkpoint for another world size (:func:`resume_refusal`) as it reads
    it: rerun as it was, the run only says it has finished and returns its results, on any number of processes; the
    checkpointer refuses it once the config is known to continue it (a raised ``epochs`` or ``max_steps``).

    >>> finished_run({"loop": {"epoch": 3, "stop_reason": "max_epochs"}}), finished_run({"loop": {"epoch": 1}})
    (True, False)

    :param ckpt: The checkpoint's engine entries.
    :returns: Whether its run had finished.
    """
    return ckpt["loop"].get("stop_reason") is not None


def resume_refusal(ckpt: dict[str, Any], world_size: int) -> str | None:
    """Say why a checkpoint (validated) cannot resume on ``world_size`` processes, or None when it can.

    The one question "may this checkpoint resume on W ranks", for both formats: the checkpointer asks it once per
    resume (``Checkpointer._refuse_world_change``). Pure. An epoch's end resumes on any number (the model and
    optimizer are replicated in a file, resharded from a sharded directory); a position inside an epoch resumes on
    another number only when it records its place in a world-size-free order whose global batch the new number
    divides (:func:`~trainkit.bookkeeping.world_change_refusal`).

    >>> resume_refusal({"world_size": 2, "trainkit": None}, 3) is None
    True

    :param ckpt: The checkpoint's engine entries.
    :param world_size: This run's number of processes.
    :returns: The reason, naming what would work; None when it resumes here.
    """
    mid_epoch = ckpt.get("trainkit")
    if ckpt.get("world_size") == world_size:
        return None
    rank_items = ckpt.get("rank_items") or {"means": {}, "differ": []}
    refusal = bookkeeping.differing_items_refusal(
        rank_items["differ"], saved_world_size=ckpt["world_size"], world_size=world_size
    )
    for name, states in rank_items["means"].items():
        if refusal is None:
            try:
                pooled_running_mean(states, name=f"checkpoint item {name!r}")
            except BookkeepingError as exc:
                refusal = str(exc)
    if refusal is not None or mid_epoch is None:
        return refusal
    return bookkeeping.world_change_refusal(EpochPosition.from_dict(mid_epoch["position"]), world_size)


def is_running_mean(state: Any) -> bool:
    """Whether a registered item's state is a running mean's (``trainkit.RunningMean.state_dict()``), which pools
    over ranks.

    Pure.

    >>> is_running_mean({"sum": torch.tensor(3.0), "count": 2}), is_running_mean({"sum": 3.0, "count": 2})
    (True, False)

    :param state: The state.
    :returns: True for ``{"sum": None or a 0-d floating tensor, "count": an int >= 0}``.
    """
    try:
        _check_running_mean(state, "state")
    except _Bad:
        return False
    return True


def rank_items_state(states: list[dict[str, Any]], differ: list[str]) -> dict[str, Any] | None:
    """The ``rank_items`` entry of a checkpoint: every rank's state of each running mean that differed between the
    ranks, and the names of the other items that did.

    Pure.

    >>> rank_items_state([{"m": {"sum": torch.tensor(1.0), "count": 1}}, {"m": {"sum": torch.tensor(3.0), "count": 1}}],
    ...                  ["m", "tally"])["differ"]
    ['tally']
    >>> rank_items_state([{}, {}], []) is None
    True

    :param states: Per rank, the state of each of its running means (item name to state).
    :param differ: The items whose state differed between ranks (:func:`~trainkit.bookkeeping.differing_items`).
    :returns: ``{"means": {name: [state per rank]}, "differ": [other names]}``, or None when nothing differed.
    """
    if not differ:
        return None
    means = {name: [rank[name] for rank in states] for name in differ if name in states[0]}
    return {"means": means, "differ": [name for name in differ if name not in means]}


def item_states_for_rank(ckpt: dict[str, Any], *, rank: int, world_size: int) -> dict[str, Any]:
    """The running means' states this rank resumes with: its own on the world size that wrote them, the pooled
    share (:func:`pooled_running_mean`) on another.

    :param ckpt: The checkpoint (validated; :func:`resume_refusal` found nothing in the way).
    :param rank: This rank.
    :param world_size: This run's number of processes.
    :returns: Item name to the state to load (empty for a checkpoint whose ranks held the same states).
    :raises BookkeepingError: When the saved counts differ on another world size, naming the item (the checkpointer
        refuses such a checkpoint first, through :func:`resume_refusal`).

    >>> shares = [{"sum": torch.tensor(1.0), "count": 1}, {"sum": torch.tensor(3.0), "count": 1}]
    >>> ckpt = {"world_size": 2, "rank_items": {"means": {"m": shares}, "differ": []}}
    >>> item_states_for_rank(ckpt, rank=1, world_size=2)["m"]["sum"].item()
    3.0
    >>> item_states_for_rank(ckpt, rank=2, world_size=3)["m"]
    {'sum': tensor(2.), 'count': 1}
    """
    means = (ckpt.get("rank_items") or {}).get("means") or {}
    if ckpt.get("world_size") == world_size:
        return {name: states[rank] for name, states in means.items()}
    return {name: pooled_running_mean(states, name=f"checkpoint item {name!r}") for name, states in means.items()}


def pooled_running_mean(states: list[dict[str, Any]], *, name: str) -> dict[str, Any]:
    """What every rank of a run on another world size takes of the saved ranks' running-mean states (a
    ``trainkit.RunningMean``'s, the epoch's grad-norm mean): the pooled mean over the count each saved rank held
    (:func:`~trainkit.bookkeeping.pooled_mean_share`), summed in float64 and kept in the saved dtype. Identical
    states (a mean of all-reduced values) come back as they are.

    >>> pooled_running_mean([{"sum": torch.tensor(2.0), "count": 2}, {"sum": torch.tensor(6.0), "count": 2}],
    ...                     name="loss_mean")
    {'sum': tensor(4.), 'count': 2}
    >>> pooled_running_mean([{"sum": None, "count": 0}, {"sum": None, "count": 0}], name="loss_mean")
    {'sum': None, 'count': 0}

    :param states: Each saved rank's ``{"sum": a 0-d floating tensor or None, "count": int}``.
    :param name: What the states are, for the error (``"checkpoint item 'loss_mean'"``).
    :returns: The state for every new rank.
    :raises BookkeepingError: When the saved ranks' counts differ (no per-rank share is then exact), naming ``name``.
    """
    shares = [(0.0 if state["sum"] is None else float(state["sum"].double()), state["count"]) for state in states]
    total, count = bookkeeping.pooled_mean_share(shares, name=name)
    if (total, count) == shares[0]:
        return {"sum": states[0]["sum"], "count": states[0]["count"]}
    dtype = next((state["sum"].dtype for state in states if state["sum"] is not None), None)
    return {"sum": None if dtype is None else torch.tensor(total, dtype=dtype), "count": count}


def best_payload(*, model: dict[str, Any], best: BestState, config: dict[str, Any]) -> dict[str, Any]:
    """Build a ``best.pt`` payload: exactly :data:`BEST_PT`'s keys, in its order.

    >>> list(best_payload(model={}, best=BestState(), config={})) == [key.name for key in BEST_PT]
    True

    :param model: The best weights (a state dict).
    :param best: The best record.
    :param config: The config as a plain dict without secrets.
    :returns: The payload.
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "best": best.to_dict(),
        "epoch": best.epoch,
        "config": config,
    }


# --- validation -------------------------------------------------------------------------------------------------


def validate_last(payload: Any, *, path: str | os.PathLike[str], world_size: int | None = None) -> None:
    """Check a loaded ``last.pt`` payload against :data:`LAST_PT` before anything reads it.

    Pure: reads the payload only (each RNG state is tried on a throwaway generator, never the process's own).
    Every engine key must be there (``training_modes`` may be absent) and follow its rule; ``items`` must name
    every other key, and the RNG list must hold one state per rank. Registered items' states are only checked
    for nesting deeper than :data:`MAX_ITEM_DEPTH`: their owners' ``load_state_dict`` judges the rest. A payload
    with a ``schema_version`` newer than :data:`SCHEMA_VERSION` is left to the caller, to refuse as written by a
    newer trainkit.

    :param payload: What :func:`~trainkit.checkpoint.load_checkpoint` returned.
    :param path: The file it came from, for the message.
    :param world_size: The resuming run's world size. When the payload's differs, the RNG list is not held to it:
        the caller refuses the mismatch with its own error.
    :raises CheckpointCorruptError: Naming the path, the key, its rule and the value, for the first value that
        breaks its rule.

    >>> validate_last({"schema_version": 1, "loop": 5}, path="last.pt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointCorruptError: checkpoint last.pt is not a valid trainkit last.pt: it lacks 'epoch', ...
    """
    _validate(payload, path, "last.pt", LAST_PT, world_size=world_size, newer_is_callers=True)


def validate_best(payload: Any, *, path: str | os.PathLike[str]) -> None:
    """Check a loaded ``best.pt`` payload against :data:`BEST_PT` before anything reads it.

    Pure: reads the payload only. A ``best.pt`` holds exactly the keys of :data:`BEST_PT`; a newer
    ``schema_version`` is refused too, as its layout is unknown.

    :param payload: What :func:`~trainkit.checkpoint.load_checkpoint` returned.
    :param path: The file it came from, for the message.
    :raises CheckpointCorruptError: Naming the path, the key, its rule and the value.

    >>> import torch
    >>> validate_best({"0.weight": torch.zeros(2)}, path="best.pt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.CheckpointCorruptError: checkpoint best.pt is not a valid trainkit best.pt: it lacks ...
    """
    _validate(payload, path, "best.pt", BEST_PT, world_size=None, newer_is_callers=False)


def _validate(
    payload: Any, path: Any, kind: str, schema: tuple[Key, ...], *, world_size: int | None, newer_is_callers: bool
) -> None:
    prefix = f"checkpoint {path} is not a valid trainkit {kind}"
    if not isinstance(payload, dict):
        raise CheckpointCorruptError(f"{prefix}: it holds a {type(payload).__name__}, not a dict")
    version = payload.get("schema_version")
    if _is_int(version) and version > SCHEMA_VERSION:
        if newer_is_callers:
            return
        raise CheckpointCorruptError(
            f"{prefix}: schema_version must be at most {SCHEMA_VERSION}, got {version} (a newer trainkit wrote it)"
        )
    missing = [key.name for key in schema if key.required and key.name not in payload]
    if missing:
        hint = ""
        if payload and all(isinstance(value, torch.Tensor) for value in payload.values()):
            hint = "; it looks like a bare state_dict (torch.save(model.state_dict(), ...)), not a file trainkit wrote"
        raise CheckpointCorruptError(f"{prefix}: it lacks {', '.join(map(repr, missing))}{hint}")
    try:
        for key in schema:
            value = payload.get(key.name)
            if key.name not in payload or (value is None and key.nullable):
                continue
            try:
                key.check(value, key.name)
            except _Bad as bad:
                if bad.where == key.name and key.nullable:
                    bad.rule = f"None or {bad.rule}"
                raise
        if schema is LAST_PT:
            _check_last_consistency(payload, world_size)
        else:
            names = [key.name for key in schema]
            extra = next((name for name in payload if name not in names), None)
            if extra is not None:
                raise _Bad(
                    f"key {_short(extra)}", f"one of {', '.join(names)}", payload[extra], "a best.pt has no other"
                )
    except _Bad as bad:
        why = f" ({bad.why})" if bad.why else ""
        raise CheckpointCorruptError(f"{prefix}: {bad.where} must be {bad.rule}, got {_show(bad.value)}{why}") from None


def _check_last_consistency(payload: dict[str, Any], world_size: int | None) -> None:
    """What holds across keys: one RNG state per rank; ``items`` names the other keys; item states are not deep."""
    saved = payload["world_size"]
    if (world_size is None or world_size == saved) and len(payload["rng"]) != saved:
        raise _Bad("rng", f"a list of {saved} states (world_size={saved}, one per rank)", payload["rng"])
    items = payload["items"]
    engine = {key.name for key in LAST_PT}
    for name in items:
        if name not in payload:
            raise _Bad("items", "the names of the items the payload holds", items, f"{name!r} is not in the payload")
    for name in payload:
        if name not in engine and name not in items:
            raise _Bad(f"key {_short(name)}", "an engine key or an item listed in items", payload[name])
    for name in payload.get("training_modes", {}):
        if name not in items:
            raise _Bad(f"training_modes[{_short(name)}]", "the mode of an item listed in items", name)
    for name in items:
        _check_nesting(payload[name], name, MAX_ITEM_DEPTH)
    lineage = payload.get("lineage")
    if lineage and lineage[-1][1] > payload["step"]:
        raise _Bad("lineage", f"segments that start at most at the checkpoint's step, {payload['step']}", lineage)
    rank_items = payload.get("rank_items")
    if rank_items is not None:
        for name in [*rank_items["means"], *rank_items["differ"]]:
            if name not in items:
                raise _Bad("rank_items", "the names of items listed in items", name)
        for name, states in rank_items["means"].items():
            if len(states) != saved:
                rule = f"a list of {saved} states (world_size={saved}, one per rank)"
                raise _Bad(f"rank_items['means'][{_short(name)}]", rule, states)
    loader_states = payload.get("loader_states")
    if loader_states is not None and len(loader_states) != saved:
        rule = f"a list of {saved} entries (world_size={saved}, one per rank)"
        raise _Bad("loader_states", rule, loader_states)
    mid_epoch = payload.get("trainkit")
    if mid_epoch is not None:
        position = mid_epoch["position"]
        if len(mid_epoch["ranks"]) != saved:
            raise _Bad(
                "trainkit['ranks']", f"a list of {saved} dicts (world_size={saved}, one per rank)", mid_epoch["ranks"]
            )
        if position["world_size"] != saved:
            raise _Bad(
                "trainkit['position']['world_size']", f"the checkpoint's world_size, {saved}", position["world_size"]
            )
        loop = payload["loop"]
        ended_inside = loop.get("in_epoch") is True  # a run that ended at a step boundary keeps its position
        if (loop.get("stop_reason") is not None and not ended_inside) or position["epoch"] != loop.get("epoch"):
            raise _Bad(
                "trainkit['position']['epoch']",
                f"the epoch in progress, loop['epoch']={loop.get('epoch')!r}, in a run that has not finished (or "
                "that ended inside that epoch)",
                position["epoch"],
            )


# --- messages ---------------------------------------------------------------------------------------------------


class _Repr(reprlib.Repr):
    """A bounded repr: a few levels, entries and characters, and a tensor as its shape and dtype only."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxother = 60
        self.maxlong = 40

    def repr_Tensor(self, value: torch.Tensor, level: int) -> str:  # noqa: N802 - reprlib dispatches on the type name
        return f"tensor(shape={list(value.shape)}, dtype={value.dtype})"

    repr_Parameter = repr_Tensor  # noqa: N815

    def repr_bytes(self, value: bytes, level: int) -> str:
        return f"<{len(value)} bytes>"


_SHORT = _Repr()


def _short(value: Any) -> str:
    return _SHORT.repr(value)


def _show(value: Any) -> str:
    """The type and a bounded repr of a value, safe on any nesting depth."""
    return f"{type(value).__name__} {_short(value)}"


def _step(where: str, key: Any) -> str:
    return f"{where}[{_short(key)}]"


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
