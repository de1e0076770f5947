"""The one channel for what trainkit tells the person running it.

A problem the user should act on is a ``RuntimeWarning`` (``warnings.warn``, so it can be filtered or made
an error); everything else trainkit says is one line starting ``trainkit:``, printed by :func:`say` on
rank 0 only (the callers check the rank). A refusal that ends the program (a config error on the command line,
a :class:`~trainkit.errors.TrainkitError` out of :func:`trainkit.launch`) is one line, ``PROGRAM: error: ...``, and
exit status 2, as ``argparse`` reports a bad argument (:func:`exit_refused`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NoReturn, TextIO

__all__ = ["say", "warn_user", "refusal_line", "exit_refused", "REFUSED_EXIT_CODE", "printable"]

REFUSED_EXIT_CODE = 2
"""The exit status of a refusal (a bad config, a checkpoint this run cannot resume), as ``argparse`` exits on a bad
argument: a scheduler tells it from a crash (1) and from a signal (``128 + signal number``)."""

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


def refusal_line(error: BaseException, program: str | None = None) -> str:
    """The one line a refusal prints: ``PROGRAM: error: MESSAGE``, the program's file name as ``argparse`` gives it.

    >>> refusal_line(ValueError("epochs must be >= 1,\\ngot 0"), "/home/me/train.py")
    'train.py: error: epochs must be >= 1, got 0'

    :param error: What was refused; its message, its lines joined (a message is meant to be one line already).
    :param program: The program's path; None reads ``sys.argv[0]`` (``trainkit`` when there is none).
    :returns: The line, without its newline.
    """
    if program is None:
        program = sys.argv[0] if sys.argv else ""
    program = os.path.basename(program)
    message = " ".join(str(error).split("\n")).strip() or type(error).__name__
    return f"{program or 'trainkit'}: error: {message}"


def exit_refused(error: BaseException, *, show: bool = True) -> NoReturn:
    """End the program on a refusal: its one line on stderr (:func:`refusal_line`), exit status 2, no traceback.

    The line goes out in one ``write()``: the ranks of a ``torchrun`` job share stderr, and a line written in pieces
    could interleave with another rank's.

    :param error: What was refused (a :class:`~trainkit.errors.TrainkitError`).
    :param show: False to exit without the line (another process of the job printed the same one).
    :raises SystemExit: Always, with :data:`REFUSED_EXIT_CODE`, its context suppressed (no traceback is chained).
    """
    if show:
        sys.stderr.flush()
        line = (refusal_line(error) + "\n").encode(errors="replace")
        try:
            os.write(sys.stderr.fileno(), line)
        except (OSError, AttributeError, ValueError):  # stderr replaced by an object without a descriptor (a test's)
            print(line.decode().rstrip("\n"), file=sys.stderr, flush=True)
    raise SystemExit(REFUSED_EXIT_CODE) from None


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
