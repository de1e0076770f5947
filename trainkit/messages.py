"""The one channel for what trainkit tells the person running it.

A problem the user should act on is a ``RuntimeWarning`` (``warnings.warn``, so it can be filtered or made
an error); everything else trainkit says is one line starting ``trainkit:``, printed by :func:`say` on
rank 0 only (the callers check the rank).
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["say"]


def say(text: str, *, stream: TextIO | None = None) -> None:
    """Print ``trainkit: <text>`` and flush.

    >>> say("resuming runs/x/last.pt: at epoch 3 of 10", stream=sys.stdout)
    trainkit: resuming runs/x/last.pt: at epoch 3 of 10

    :param text: One line.
    :param stream: Where to print; stderr by default (the final summary goes to stdout).
    """
    print(f"trainkit: {text}", file=stream if stream is not None else sys.stderr, flush=True)
