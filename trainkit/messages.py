"""The one channel for what trainkit tells the person running it.

A problem the user should act on is a ``RuntimeWarning`` (``warnings.warn``, so it can be filtered or made
an error); everything else trainkit says is one line starting ``trainkit:``, printed by :func:`say` on
rank 0 only (the callers check the rank).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TextIO

__all__ = ["say", "warn_user", "printable"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def say(text: str, *, stream: TextIO | None = None) -> None:
    """Print ``trainkit: <text>`` and flush.

    >>> say("resuming runs/x/last.pt: at epoch 3 of 10", stream=sys.stdout)
    trainkit: resuming runs/x/last.pt: at epoch 3 of 10

    :param text: One line.
    :param stream: Where to print; stderr by default (the final summary goes to stdout).
    """
    print(f"trainkit: {text}", file=stream if stream is not None else sys.stderr, flush=True)


def warn_user(message: str) -> None:
    """Warn (a ``RuntimeWarning``) pointing at the first line outside trainkit: the user's code that led here.

    However deep inside trainkit's parts the problem is found, the warning names the line the user can change
    (the ``progress()`` call, the loop over it), and filters keyed on that module match it.

    :param message: What is wrong and what to do.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def printable(text: object, *, limit: int = 512) -> str:
    r"""Text from elsewhere (a remote store, a file trainkit did not write) made safe to show on one line.

    Pure. Every character Python does not call printable (control characters such as ESC and newline, Unicode
    format characters such as a right-to-left override, unassigned code points) is written as its escape, as
    ``repr`` writes it, and so is a backslash (so an escape shown is never mistaken for one in the text): a
    planted value can neither move the cursor, recolour the terminal, nor forge a line of trainkit's output. At
    most ``limit`` characters of the text are shown, then ``...``.

    >>> print(printable("run\x1b[2J\nstep-9: forged"))
    run\x1b[2J\nstep-9: forged
    >>> printable("x" * 10, limit=4)
    'xxxx...'

    :param text: The text (anything else is shown as ``str`` of it).
    :param limit: The most characters of ``text`` shown.
    :returns: The text, escaped, on one line.
    """
    text = str(text)
    shown = "".join(_escaped(char) for char in text[:limit])
    return shown + "..." if len(text) > limit else shown


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    return char if char.isprintable() else repr(char)[1:-1]
