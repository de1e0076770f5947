"""Comparing two checkpoints bit for bit: the first item, and the first tensor in it, where they differ.

Two runs of the same training (one straight through, one killed and resumed) must write the same checkpoints. A
checkpoint is read (:func:`comparable_sections`) as named sections, in a fixed order: each registered item in
registration order, then ``rng`` (the RNG states trainkit captures), ``position`` (where inside the epoch a step
checkpoint stands), ``records`` (the loop, best and patience records and the engine's counters) and ``metrics``
(the latest pushed metrics and the final results); a ``best`` checkpoint has ``best weights`` and ``records``.
:func:`first_difference` walks two values in the same order and names the first leaf that differs.

Left out by rule, as run-specific by nature: the config (each run has its own ``out_dir``), the W&B run id (random
per run), the byte offset into ``metrics.jsonl`` (the rows' wall-clock numbers differ in length; the rows themselves
are compared apart) and every wall-clock metric (:func:`trainkit.run.read_metrics.is_wall_clock`).

Side effects: :func:`read_comparable` and :func:`compare_checkpoints` read checkpoint files through the verified,
code-free readers (:func:`~trainkit.checkpoint.load_checkpoint`, the DCP reader for sharded directories).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from trainkit.run.read_metrics import without_wall_clock

__all__ = [
    "Difference",
    "RUN_SPECIFIC_KEYS",
    "first_difference",
    "comparable_sections",
    "read_comparable",
    "compare_checkpoints",
]

RUN_SPECIFIC_KEYS = frozenset({"config", "wandb_run_id", "metrics_offset", "schema_version", "items", "lineage"})
"""Checkpoint entries that differ between two runs of the same training by nature (``lineage``: each life's random
segment id; or, ``items``, that name the sections compared); never compared."""

_RECORD_KEYS = ("loop", "best", "patience", "epoch", "step", "world_size", "training_modes", "guard_skips")
"""The engine's records and counters in a ``last`` checkpoint, compared together as ``records``."""


@attrs.frozen(kw_only=True)
class Difference:
    """Where two checkpoints, or two runs, first differ: the one record of a difference, for
    :func:`compare_checkpoints` and for certify's comparison of two run folders
    (:func:`trainkit.certification.comparison.compare_runs`, which says in which file and at which step).

    :ivar where: The file the difference is in (``checkpoints/step-7.pt``, ``last.pt``, ``best.pt``,
        ``metrics.jsonl``); empty when two given checkpoints were compared.
    :ivar step: The step of that checkpoint (of that metrics row), when it has one.
    :ivar section: The checkpoint section (a registered item's name, ``rng``, ``records``, ...), ``checkpoint`` for
        a whole checkpoint, or a metrics row.
    :ivar name: The path inside it (``layers.0.weight``, ``state.0.exp_avg``, ``loop.step``); empty for the whole.
    :ivar detail: What differs, in words.
    :ivar max_abs_diff: For two tensors of the same shape, or two numbers, the largest absolute difference; None
        otherwise.
    """

    where: str = ""
    step: int | None = None
    section: str
    name: str
    detail: str
    max_abs_diff: float | None = None

    def describe(self) -> str:
        """One line: the section, the name and what differs (how certify's report prints it).

        :returns: E.g. ``model: weight (max abs difference 0.0123)``.

        >>> Difference(section="model", name="w", detail="max abs difference 0.5").describe()
        'model: w (max abs difference 0.5)'
        """
        where = f"{self.section}: {self.name}" if self.name else self.section
        return f"{where} ({self.detail})"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[str, float | None] | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}", None
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a, b) and (not a.is_floating_point() or torch.equal(a.isnan(), b.isnan())):
        return None
    if a.is_floating_point() or a.is_complex():
        both_nan = a.isnan() & b.isnan()
        if bool(both_nan.any()) and torch.equal(a.isnan(), b.isnan()):
            same = torch.where(both_nan, torch.zeros_like(a), a).eq(torch.where(both_nan, torch.zeros_like(b), b))
            if bool(same.all()):
                return None  # NaN where both have NaN: the same bits as far as training goes
        diff = (a.double() - b.double()).abs()
        largest = float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0
    elif a.dtype == torch.bool:
        largest = float((a != b).sum())
        return f"{int(largest)} of {a.numel()} elements differ", None
    else:
        largest = float((a.long() - b.long()).abs().max())
    return f"max abs difference {largest:.6g}", largest


def first_difference(a: Any, b: Any, *, section: str = "", path: str = "") -> Difference | None:
    """Find the first leaf where two nested values differ, depth first in ``a``'s key order.

    Pure. Dicts are walked key by key, lists and tuples element by element; tensors are equal when their dtype,
    shape and every element are (NaN equal to NaN at the same place); floats compare bit for bit (NaN equals NaN);
    anything else with ``==``.

    :param a: One value.
    :param b: The other.
    :param section: The section name the result carries.
    :param path: The path of ``a`` and ``b`` inside it.
    :returns: The first difference, or None when the two are the same.

    >>> first_difference({"w": torch.zeros(2), "n": 3}, {"w": torch.tensor([0.0, 0.5]), "n": 3}, section="model")
    Difference(where='', step=None, section='model', name='w', detail='max abs difference 0.5', max_abs_diff=0.5)
    >>> first_difference({"a": [1, 2]}, {"a": [1, 2]}) is None
    True
    """
    stack: list[tuple[str, Any, Any]] = [(path, a, b)]
    while stack:
        where, left, right = stack.pop()
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)):
                return Difference(section=section, name=where, detail=f"{_kind(left)} against {_kind(right)}")
            found = _tensor_difference(left, right)
            if found is not None:
                return Difference(section=section, name=where, detail=found[0], max_abs_diff=found[1])
        elif isinstance(left, Mapping) and isinstance(right, Mapping):
            missing = [key for key in left if key not in right] + [key for key in right if key not in left]
            if missing:
                return Difference(section=section, name=_join(where, missing[0]), detail="present in one run only")
            stack.extend((_join(where, key), left[key], right[key]) for key in reversed(list(left)))
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            if len(left) != len(right):
                return Difference(section=section, name=where, detail=f"{len(left)} entries against {len(right)}")
            stack.extend((f"{where}[{i}]", x, y) for i, (x, y) in reversed(list(enumerate(zip(left, right)))))
        elif not _same_plain(left, right):
            detail = f"{_short(left)} against {_short(right)}"
            numbers = isinstance(left, int | float) and isinstance(right, int | float)
            gap = abs(float(left) - float(right)) if numbers and not isinstance(left, bool) else None
            return Difference(section=section, name=where, detail=detail, max_abs_diff=gap)
    return None


def _same_plain(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _kind(value: Any) -> str:
    return f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def comparable_sections(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Split a loaded checkpoint into the sections compared, in order, without the run-specific entries.

    Pure.

    :param payload: A loaded ``last`` (or kept step) checkpoint, or a ``best`` one.
    :returns: Section name to value: each registered item, ``rng``, ``position``, ``records``, ``metrics`` (a
        ``last`` checkpoint); ``best weights`` and ``records`` (a ``best`` one).

    >>> comparable_sections({"model": {"w": 1}, "best": {"score": 0.5}, "epoch": 2, "config": {}})
    {'best weights': {'w': 1}, 'records': {'best': {'score': 0.5}, 'epoch': 2}}
    """
    if "loop" not in payload:
        return {
            "best weights": payload.get("model"),
            "records": {"best": payload.get("best"), "epoch": payload.get("epoch")},
        }
    sections = {name: payload[name] for name in payload.get("items", ())}
    sections["rng"] = payload.get("rng")
    sections["position"] = payload.get("trainkit")
    sections["records"] = {key: payload.get(key) for key in _RECORD_KEYS}
    sections["metrics"] = {
        key: without_wall_clock(dict(payload.get(key) or {})) for key in ("latest_metrics", "results")
    }
    known = set(sections) | RUN_SPECIFIC_KEYS | set(_RECORD_KEYS) | {"trainkit", "latest_metrics", "results"}
    sections.update({key: value for key, value in payload.items() if key not in known})  # a newer schema's entries
    return sections


def read_comparable(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file or sharded directory as its comparable sections (:func:`comparable_sections`).

    Side effects: reads the checkpoint (CRCs and the manifest verified, ``weights_only`` loads; nothing runs).
    Items a sharded checkpoint keeps in its DCP shards are read whole.

    :param path: A ``.pt`` file or a ``.ckpt`` directory.
    :returns: The sections.
    :raises CheckpointError: When the checkpoint is damaged or unsafe.
    """
    from trainkit.checkpoint import load_checkpoint
    from trainkit.checkpoint.formats import dcp_directory, dcp_read
    from trainkit.errors import CheckpointCorruptError

    source = Path(path)
    if not source.is_dir():
        return comparable_sections(load_checkpoint(source))
    problem = dcp_read.verify_directory(source, rank=0, world_size=1)
    if problem is not None:
        raise CheckpointCorruptError(problem)
    payload = dict(load_checkpoint(source / dcp_directory.ENGINE_FILE))
    with warnings.catch_warnings():  # DCP's "loading in a single process" is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        for key, value in list(payload.items()):
            if isinstance(value, str) and value == dcp_directory.SHARDED:
                payload[key] = dcp_directory.read_whole(source, key)
    return comparable_sections(payload)


def compare_checkpoints(a: str | Path, b: str | Path) -> Difference | None:
    """Compare two checkpoints section by section (:func:`first_difference` on :func:`read_comparable`).

    Side effects: reads both checkpoints.

    :param a: One checkpoint file or directory.
    :param b: The other.
    :returns: The first difference (a section present in one only counts), or None when they are the same.
    :raises CheckpointError: When either is damaged or unsafe.
    """
    left, right = read_comparable(a), read_comparable(b)
    for section in [*left, *(name for name in right if name not in left)]:
        if section not in left or section not in right:
            return Difference(section=section, name="", detail="present in one run's checkpoint only")
        found = first_difference(left[section], right[section], section=section)
        if found is not None:
            return found
    return None
