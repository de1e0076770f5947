"""Reading a run's ``metrics.jsonl`` back: the rows ``report`` draws and ``replay`` replays.

Side effects: reads the file (a regular file, never blocking). Standard library only: no torch.

The file is input from whoever could write into the run folder, so each line is parsed with
:func:`trainkit.files.bounded_read.load_json` (a line nested deeper than any row is damaged, not a crash), and a
line that is not a JSON object is skipped with one warning for the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainkit.files.bounded_read import UnreadableFile, load_json, open_regular
from trainkit.messages import warn_user

__all__ = [
    "METRICS_FILE",
    "WALL_CLOCK_PREFIXES",
    "WALL_CLOCK_NAMES",
    "is_wall_clock",
    "read_metrics",
    "without_wall_clock",
]

METRICS_FILE = "metrics.jsonl"

WALL_CLOCK_PREFIXES = ("perf/",)
"""Metric keys measured on the wall clock by nature: two runs of the same training never agree on them
(``perf/samples_per_s``, ``perf/train_s``, ``perf/ckpt_s``, ``perf/mfu``, ...)."""

WALL_CLOCK_NAMES = frozenset({"time", "timestamp", "_timestamp", "_runtime", "wall_time", "elapsed_s"})
"""Last path segments of keys that hold a time of day or a duration (``_timestamp`` and ``_runtime`` are W&B's);
trainkit's own rows hold none, but a trainer's ``log()`` may add one."""


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """Read every row of ``out_dir/metrics.jsonl``.

    :param out_dir: The run folder.
    :returns: The rows, in order (a damaged line, e.g. one a crash cut short, is skipped with a warning).
    :raises FileNotFoundError: When the run folder has no metrics file, or it is not a regular file (a FIFO, a
        device, a link to one).
    """
    path = Path(out_dir) / METRICS_FILE
    try:
        fd, _ = open_regular(path, follow_links=True)
    except UnreadableFile as exc:
        if exc.reason == "missing":
            raise FileNotFoundError(
                f"{path} does not exist: is {out_dir} a trainkit run folder (with ckpt.enable=true)?"
            ) from None
        raise FileNotFoundError(f"{exc}; it cannot be read as a trainkit run's metrics") from None
    rows = []
    damaged = []
    with os.fdopen(fd, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = load_json(line)
            except ValueError:  # a row torn by a crash, padding written after one, or nested deeper than any row
                damaged.append(number)
                continue
            if isinstance(row, dict) and not any(_out_of_range(value) for value in row.values()):
                rows.append(row)
            else:  # not an object, or an int no row holds (one that converts to no float, say)
                damaged.append(number)
    if damaged:
        warn_user(
            f"{path}: skipped {len(damaged)} damaged line(s) ({', '.join(map(str, damaged[:5]))}"
            f"{', ...' if len(damaged) > 5 else ''}), e.g. a row cut short by a crash"
        )
    return rows


def is_wall_clock(key: str) -> bool:
    """Tell whether a metric key is wall-clock by nature, so that two runs of the same training differ in it.

    Pure. The rule: a key under :data:`WALL_CLOCK_PREFIXES`, or whose last ``/``-separated segment is one of
    :data:`WALL_CLOCK_NAMES`.

    :param key: A ``metrics.jsonl`` key.
    :returns: Whether the key is excluded when runs are compared.

    >>> is_wall_clock("perf/tokens_per_s"), is_wall_clock("train/loss"), is_wall_clock("eval/timestamp")
    (True, False, True)
    """
    return key.startswith(WALL_CLOCK_PREFIXES) or key.rsplit("/", 1)[-1] in WALL_CLOCK_NAMES


def without_wall_clock(row: dict[str, Any]) -> dict[str, Any]:
    """Drop the wall-clock keys (:func:`is_wall_clock`) from a row, keeping the others in order.

    Pure.

    :param row: A ``metrics.jsonl`` row (or any mapping of metric names).
    :returns: A new dict without them.

    >>> without_wall_clock({"trainer/step": 3, "perf/train_s": 0.1, "train/loss": 0.5})
    {'trainer/step': 3, 'train/loss': 0.5}
    """
    return {key: value for key, value in row.items() if not is_wall_clock(key)}


def _out_of_range(value: Any) -> bool:
    return type(value) is int and not -(2**63) <= value < 2**63
