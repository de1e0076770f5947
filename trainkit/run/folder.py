"""The run folder's shared names: ``metrics.jsonl``, and whether two paths are one folder.

Side effects: ``stat`` calls.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "same_directory",
    "METRICS_FILE",
]

METRICS_FILE = "metrics.jsonl"


def same_directory(a: Path, b: Path) -> bool:
    """Whether two paths name the same existing directory (False when either does not exist).

    :param a: A path.
    :param b: Another path.
    :returns: True for one directory under two names.
    """
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
