"""Counting the tensor methods that move a value to the host (and so wait for the device)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
"""Tensor methods that move a value to the host (and so wait for the device)."""


@contextlib.contextmanager
def count_host_syncs(only_from: str | None = None) -> Iterator[Counter[str]]:
    """Count calls to the host-syncing tensor methods while the block runs.

    :param only_from: Count only calls made directly from files under this folder (e.g. trainkit's).
    :returns: A counter of ``"<method>"`` (or ``"<method> from <file>:<line>"`` with ``only_from``).
    """
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}

    def counting(name: str):
        original = originals[name]

        def wrapper(tensor, *args, **kwargs):
            if only_from is None:
                counts[name] += 1
            else:
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(only_from):
                    counts[f"{name} from {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return original(tensor, *args, **kwargs)

        return wrapper

    try:
        for name in HOST_SYNCS:
            setattr(torch.Tensor, name, counting(name))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
