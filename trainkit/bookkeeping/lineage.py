"""A checkpoint's lineage: which history of lives it belongs to, so a resume never takes an abandoned one.

Pure: stdlib only. A *life* is one process's stretch of training between a start (fresh, or from a checkpoint)
and its end; its checkpoints follow one another at increasing steps. Each life draws a random *token* and every
checkpoint it writes records its lineage, a short list of *segments* ``(token, first_step)``:

- a fresh start (no checkpoint, ``ckpt.resume=never``) is ``((token, 0),)``;
- every resume from a checkpoint ``C`` (an automatic one, a named one, a rollback of the divergence guard) starts
  a new segment, ``C.lineage + ((token, C.step),)``: so a deliberate rewind and an ordinary requeue both branch,
  and two lives resumed from the same checkpoint never look like one history.

A checkpoint ``A`` is *in the history* of a checkpoint ``D`` (:func:`in_history`) when ``D``'s lineage runs
through ``A``: ``D`` continues ``A``'s life at a step ``>= A.step``, or forks off ``A``'s life at a step
``>= A.step``. The list is bounded (:data:`MAX_SEGMENTS`, the newest kept): the rule then compares the retained
segments, so a checkpoint more than :data:`MAX_SEGMENTS` resumes behind another is no longer recognized as its
ancestor (the safe side: a resume keeps its local checkpoint rather than take one whose history it cannot tell).
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Sequence
from typing import Any

from trainkit.errors import BookkeepingError

__all__ = ["MAX_SEGMENTS", "Segment", "Lineage", "fresh_lineage", "branch_lineage", "in_history", "lineage_from"]

MAX_SEGMENTS = 64
"""The most segments a lineage keeps (the newest): one per resume, so 64 resumes of history."""

Segment = tuple[str, int]
"""``(token, first_step)``: one life, and the step it started at."""

Lineage = tuple[Segment, ...]
"""A checkpoint's segments, oldest first; ``()`` for a checkpoint written before lineages existed."""

_TOKEN = re.compile(r"[0-9a-f]{8,64}")
_STEP_LIMIT = 2**63


def fresh_lineage(token: str) -> Lineage:
    """The lineage of a fresh start.

    :param token: The new life's token (lowercase hex, 8 to 64 digits).
    :returns: ``((token, 0),)``.
    :raises BookkeepingError: On a token that is not lowercase hex.

    >>> fresh_lineage("0a1b2c3d")
    (('0a1b2c3d', 0),)
    """
    return lineage_from([[token, 0]])


def branch_lineage(lineage: Sequence[Segment], token: str, step: int) -> Lineage:
    """The lineage of a life resumed from a checkpoint of ``lineage`` at ``step``: one more segment, the oldest
    dropped beyond :data:`MAX_SEGMENTS`.

    :param lineage: The resumed checkpoint's lineage (``()``: one written before lineages existed).
    :param token: The new life's token.
    :param step: The resumed checkpoint's step.
    :returns: The new lineage.
    :raises BookkeepingError: On a token that is not lowercase hex, or a step before the last segment's start.

    >>> branch_lineage((("0a1b2c3d", 0),), "ffffffff", 12)
    (('0a1b2c3d', 0), ('ffffffff', 12))
    >>> len(branch_lineage(tuple((f"{i:08x}", i) for i in range(MAX_SEGMENTS)), "ffffffff", 99))
    64
    """
    return lineage_from([*lineage, (token, step)][-MAX_SEGMENTS:])


def in_history(ancestor: Sequence[Segment], ancestor_step: int, lineage: Sequence[Segment], step: int) -> bool:
    """Whether the checkpoint ``(ancestor, ancestor_step)`` is in the history of the checkpoint ``(lineage, step)``.

    True when ``lineage`` holds the ancestor's last segment (the same life), the segments both retain before it
    agree, and ``lineage`` goes on from that life at a step ``>= ancestor_step``: the same life at such a step, or
    the next segment forking off it there. A checkpoint is in its own history. A lineage that is empty (written
    before lineages existed) is in no history and has none.

    :param ancestor: The older checkpoint's lineage.
    :param ancestor_step: Its step.
    :param lineage: The newer checkpoint's lineage.
    :param step: Its step.
    :returns: Whether the newer one descends from the older one.

    >>> a = (("0000000a", 0),)
    >>> in_history(a, 4, a, 9), in_history(a, 9, a, 4)  # one life: later steps continue earlier ones
    (True, False)
    >>> rewound = a + (("0000000b", 4),)  # resumed from step 4 of life a
    >>> in_history(a, 4, rewound, 6), in_history(a, 9, rewound, 12)  # step 9 of life a was abandoned
    (True, False)
    >>> in_history((("0000000c", 0),), 0, a, 9)  # another fresh start
    False
    """
    if not ancestor or not lineage:
        return False
    token, first = ancestor[-1]
    at = next((i for i, segment in enumerate(lineage) if segment[0] == token), None)
    if at is None or lineage[at][1] != first:
        return False
    before = min(at, len(ancestor) - 1)  # the retained segments before the shared one must agree
    if tuple(lineage[at - before : at]) != tuple(ancestor[len(ancestor) - 1 - before : -1]):
        return False
    goes_on_at = step if at == len(lineage) - 1 else lineage[at + 1][1]
    return goes_on_at >= ancestor_step


def lineage_from(value: Any) -> Lineage:
    """A lineage from plain values read from a checkpoint or a commit record, checked: a list of at most
    :data:`MAX_SEGMENTS` ``[token, first_step]`` pairs, tokens lowercase hex (8 to 64 digits) and distinct, steps
    ints in ``[0, 2**63)`` that never decrease.

    :param value: The value read (a list or tuple of pairs).
    :returns: The lineage as a tuple of tuples.
    :raises BookkeepingError: Naming the rule and the value.

    >>> lineage_from([["0a1b2c3d", 0], ["ffffffff", 12]])
    (('0a1b2c3d', 0), ('ffffffff', 12))
    >>> lineage_from([["../x", 0]])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.BookkeepingError: a lineage must be a list of at most 64 [token, first_step] pairs...
    """
    rule = (
        f"a lineage must be a list of at most {MAX_SEGMENTS} [token, first_step] pairs (tokens of 8 to 64 lowercase "
        "hex digits, each once; steps ints in [0, 2**63) that never decrease)"
    )
    if not isinstance(value, list | tuple) or len(value) > MAX_SEGMENTS:
        raise BookkeepingError(f"{rule}, got {_short(value)}")
    segments: list[Segment] = []
    for pair in value:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise BookkeepingError(f"{rule}, got {_short(value)}")
        token, first = pair
        if (
            not isinstance(token, str)
            or _TOKEN.fullmatch(token) is None
            or type(first) is not int
            or not 0 <= first < _STEP_LIMIT
            or (segments and (first < segments[-1][1] or any(token == seen for seen, _ in segments)))
        ):
            raise BookkeepingError(f"{rule}, got {_short(value)}")
        segments.append((token, first))
    return tuple(segments)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxstring, _REPR.maxother = 3, 4, 4, 40, 40


def _short(value: Any) -> str:
    """A bounded repr: a few levels and entries (a hostile value may nest thousands deep)."""
    return _REPR.repr(value)
