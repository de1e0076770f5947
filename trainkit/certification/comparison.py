"""Comparing certify's two runs: their kept step checkpoints in step order, ``last``, ``best``, then ``metrics.jsonl``.

Each checkpoint pair is compared bit for bit by :func:`trainkit.checkpoint.compare.compare_checkpoints`; the first
difference is that module's :class:`~trainkit.checkpoint.compare.Difference`, with the file and step it is in.

Side effects: reads both run folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from trainkit.certification.attempts import final_checkpoint, kept_checkpoints

if TYPE_CHECKING:
    from trainkit.checkpoint.compare import Difference

__all__ = ["compare_runs"]


def compare_runs(straight: Path, interrupted: Path) -> tuple[Difference | None, int, int]:
    """Compare two run folders: their kept step checkpoints in step order, ``last``, ``best``, then ``metrics.jsonl``.

    Side effects: reads both folders.

    :param straight: One run folder.
    :param interrupted: The other.
    :returns: The first divergence (None: the same), the step checkpoints compared and the rows compared.
    :raises CheckpointError: When a checkpoint is damaged or unsafe.
    """
    from trainkit.checkpoint.compare import Difference, compare_checkpoints
    from trainkit.run.read_metrics import read_metrics, without_wall_clock

    left, right = kept_checkpoints(straight), kept_checkpoints(interrupted)
    compared = 0
    for step in sorted(set(left) | set(right)):
        if step not in left or step not in right:
            only = "straight" if step in left else "interrupted"
            return Difference(where=f"checkpoints/step-{step}", step=step, section="checkpoint", name="",
                              detail=f"kept by the {only} run only"), compared, 0  # fmt: skip
        compared += 1
        found = compare_checkpoints(left[step], right[step])
        if found is not None:
            return attrs.evolve(found, where=f"checkpoints/{left[step].name}", step=step), compared, 0
    for stem in ("last", "best"):
        a, b = final_checkpoint(straight, stem), final_checkpoint(interrupted, stem)
        if (a is None) != (b is None):
            return Difference(where=stem, step=None, section="checkpoint", name="",
                              detail="written by one run only"), compared, 0  # fmt: skip
        found = None if a is None else compare_checkpoints(a, b)
        if found is not None:
            return attrs.evolve(found, where=a.name, step=None), compared, 0
    rows_a = [without_wall_clock(row) for row in read_metrics(straight)]
    rows_b = [without_wall_clock(row) for row in read_metrics(interrupted)]
    for index, (a_row, b_row) in enumerate(zip(rows_a, rows_b)):
        if a_row != b_row:
            key = next((k for k in [*a_row, *b_row] if a_row.get(k, None) != b_row.get(k, None)), "")
            gap = _gap(a_row.get(key), b_row.get(key))
            detail = f"{a_row.get(key, 'absent')!r} against {b_row.get(key, 'absent')!r}"
            return Difference(where="metrics.jsonl", step=a_row.get("trainer/step"), section=f"row {index + 1}",
                              name=key, detail=detail, max_abs_diff=gap), compared, index  # fmt: skip
    if len(rows_a) != len(rows_b):
        detail = f"{len(rows_a)} rows against {len(rows_b)}"
        return Difference(where="metrics.jsonl", step=None, section="rows", name="", detail=detail), compared, 0
    return None, compared, len(rows_a)


def _gap(a: Any, b: Any) -> float | None:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return abs(float(a) - float(b)) if numbers else None
