"""The divergence guard's decisions: what to do with an optimizer step whose gradients are not finite.

Pure: stdlib and attrs only. The trainer's guard part (:mod:`trainkit.loop.divergence_guard`) feeds
:func:`step_guard` one flag per optimizer step (whether the total grad norm was finite); ``python -m trainkit replay
--guard`` feeds it the grad norms and losses a ``metrics.jsonl`` recorded, to show where a guard would have fired.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from trainkit.bookkeeping._records import is_finite_real, is_int, is_real
from trainkit.errors import BookkeepingError

__all__ = [
    "GUARD_MODES",
    "CONTINUE",
    "SKIP",
    "RAISE",
    "ROLLBACK",
    "GuardState",
    "step_guard",
    "replay_guard",
    "is_finite_value",
    "rollback_candidate",
    "unblamable_steps",
    "RollbackStreak",
    "step_rollbacks",
]

GUARD_MODES = ("off", "raise", "skip", "rollback")
"""What the guard does with a non-finite step: nothing, stop with an error, skip the step, roll back."""

CONTINUE = "continue"
"""Verdict: the step is finite (or the guard is off): take it."""
SKIP = "skip"
"""Verdict: drop this optimizer step (no parameter or optimizer-state update)."""
RAISE = "raise"
"""Verdict: stop before the optimizer step with an error."""
ROLLBACK = "rollback"
"""Verdict: ``max_skips`` non-finite steps fell within ``window`` steps: go back to a checkpoint before them."""


def _check_mode(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in GUARD_MODES:
        raise BookkeepingError(f"GuardState.mode must be one of {', '.join(GUARD_MODES)}, got {value!r}")


def _check_max_skips(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise BookkeepingError(f"GuardState.max_skips must be an int >= 1 or None, got {value!r}")


def _check_window(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise BookkeepingError(f"GuardState.window must be an int >= 1, got {value!r}")


def _check_count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class GuardState:
    """The guard's settings and what it has seen.

    :ivar mode: One of :data:`GUARD_MODES`.
    :ivar max_skips: Non-finite steps within ``window`` steps that exhaust the guard: ``"skip"`` then raises,
        ``"rollback"`` rolls back; None: ``"skip"`` skips forever (``"rollback"`` then rolls back at once).
    :ivar window: The width, in optimizer steps, of the window ``max_skips`` counts in.
    :ivar recent: The non-finite steps inside the window behind the last step seen, oldest first.
    :ivar skipped: Optimizer steps skipped so far.

    >>> GuardState(mode="skip", max_skips=3, window=10)
    GuardState(mode='skip', max_skips=3, window=10, recent=(), skipped=0)
    """

    mode: str = attrs.field(default="off", validator=_check_mode)
    max_skips: int | None = attrs.field(default=None, validator=_check_max_skips)
    window: int = attrs.field(default=100, validator=_check_window)
    recent: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    skipped: int = attrs.field(default=0, validator=_check_count)


def step_guard(state: GuardState, step: int, finite: bool) -> tuple[GuardState, str]:
    """Decide what to do with optimizer step ``step`` given whether its gradients are finite.

    A finite step is always taken (``"continue"``). A non-finite one: ``"off"`` takes it anyway,
    ``"raise"`` raises, ``"skip"`` skips it until ``max_skips`` non-finite steps fall within ``window``
    steps (steps ``s`` with ``step - s < window``, this one included), which raises; ``"rollback"`` skips
    until then, and then rolls back. Steps must come in increasing order.

    :param state: The guard so far.
    :param step: The 0-based index of the optimizer step about to be taken.
    :param finite: Whether its total gradient norm is finite.
    :returns: The new state and the verdict (``"continue"``, ``"skip"``, ``"raise"`` or
        ``"rollback"``).
    :raises BookkeepingError: When ``step`` is not an int or goes back behind a recorded step.

    >>> state = GuardState(mode="skip", max_skips=2, window=5)
    >>> state, verdict = step_guard(state, 3, finite=False); verdict, state.recent, state.skipped
    ('skip', (3,), 1)
    >>> step_guard(state, 7, finite=False)[1]
    'raise'
    >>> step_guard(state, 8, finite=False)[1]
    'skip'
    >>> step_guard(GuardState(mode="off"), 0, finite=False)[1]
    'continue'
    """
    if not is_int(step) or step < 0:
        raise BookkeepingError(f"step_guard(): step must be an int >= 0, got {step!r}")
    if state.recent and step <= state.recent[-1]:
        raise BookkeepingError(f"step_guard(): step {step} is not after the last non-finite step {state.recent[-1]}")
    if finite or state.mode == "off":
        return state, CONTINUE
    if state.mode == "raise":
        return state, RAISE
    recent = (*(s for s in state.recent if step - s < state.window), step)
    exhausted = state.max_skips is None and state.mode == "rollback"
    exhausted = exhausted or (state.max_skips is not None and len(recent) >= state.max_skips)
    if exhausted:
        return attrs.evolve(state, recent=recent), ROLLBACK if state.mode == "rollback" else RAISE
    return attrs.evolve(state, recent=recent, skipped=state.skipped + 1), SKIP


def is_finite_value(value: Any) -> bool | None:
    """Whether a recorded value (a grad norm, a loss) is finite: None when it is no number at all.

    ``metrics.jsonl`` writes a non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"``.

    >>> is_finite_value(1.5), is_finite_value("nan"), is_finite_value(float("inf")), is_finite_value(None)
    (True, False, False, None)
    """
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return False
    if not is_real(value):
        return None
    return is_finite_real(value)  # an int too large for a float counts as not finite, never an OverflowError


def replay_guard(steps: Iterable[tuple[int, bool]], state: GuardState) -> list[tuple[int, str]]:
    """Run ``(step, finite)`` pairs through :func:`step_guard` and list the steps where the guard fired.

    Stops at the first ``"raise"`` or ``"rollback"``, as the run would.

    :param steps: Steps and whether they were finite, in increasing step order.
    :param state: The guard's settings.
    :returns: ``(step, verdict)`` for every step whose verdict was not ``"continue"``.

    >>> replay_guard([(0, True), (1, False), (2, True), (3, False)], GuardState(mode="skip", max_skips=2, window=4))
    [(1, 'skip'), (3, 'raise')]
    """
    fired: list[tuple[int, str]] = []
    for step, finite in steps:
        state, verdict = step_guard(state, step, finite)
        if verdict != CONTINUE:
            fired.append((step, verdict))
        if verdict in (RAISE, ROLLBACK):
            break
    return fired


def rollback_candidate(candidates: Sequence[tuple[Any, int]], first_bad_step: int) -> Any | None:
    """The newest checkpoint written before step ``first_bad_step`` was taken, or None.

    A checkpoint at step ``s`` holds the state after ``s`` optimizer steps, i.e. before step index ``s``:
    it qualifies when ``s <= first_bad_step``. Ties keep the first listed.

    :param candidates: ``(path, step)`` pairs, in any order (``last.pt``, ``last.prev.pt``, kept ones).
    :param first_bad_step: The 0-based index of the first non-finite step in the window.
    :returns: The path of the newest qualifying checkpoint.

    >>> rollback_candidate([("last.pt", 40), ("last.prev.pt", 30), ("step-20.pt", 20)], 35)
    'last.prev.pt'
    >>> rollback_candidate([("last.pt", 40)], 35) is None
    True
    """
    best: tuple[Any, int] | None = None
    for path, step in candidates:
        if step <= first_bad_step and (best is None or step > best[1]):
            best = (path, step)
    return None if best is None else best[0]


def unblamable_steps(bad: Sequence[tuple[int, int, Sequence[int]]], *, epoch: int, consumed: int) -> list[int]:
    """The non-finite steps that leaving batches out after a rollback to a checkpoint cannot change.

    A rollback replays from the checkpoint's position (``consumed`` batches into ``epoch``) with the bad steps'
    batches left out; a step whose batches all lie before that position (or that trained on no batch of the
    counted loop: a step after its last batch, say) would be replayed exactly as it failed, for ever.

    :param bad: ``(step, epoch, batches)`` of the window's non-finite steps: the 0-based batch positions each one
        trained on.
    :param epoch: The epoch the checkpoint resumes into (0-based).
    :param consumed: The batches of that epoch the checkpoint had consumed (0 at an epoch's start).
    :returns: The steps, oldest first, none of whose batches the replay would meet.

    >>> unblamable_steps([(7, 1, (3,)), (9, 1, ())], epoch=1, consumed=2)
    [9]
    >>> unblamable_steps([(7, 1, (3,))], epoch=1, consumed=4)
    [7]
    >>> unblamable_steps([(7, 1, (3,))], epoch=2, consumed=0)
    [7]
    """
    return [step for step, e, batches in bad if not any((e, b) >= (epoch, consumed) for b in batches)]


@attrs.frozen(kw_only=True)
class RollbackStreak:
    """Rollbacks in a row to the same checkpoint (or an older one): none written since got the run anywhere.

    :ivar back_to: The step of the checkpoint the latest rollback went back to (None before the first).
    :ivar count: How many rollbacks in a row went back to that checkpoint or an older one.
    """

    back_to: int | None = None
    count: int = attrs.field(default=0, validator=_check_count)


def step_rollbacks(streak: RollbackStreak, back_to: int, *, limit: int) -> tuple[RollbackStreak, bool]:
    """Count one more rollback, to the checkpoint written at optimizer step ``back_to``.

    A rollback to a newer checkpoint than the one before means the run got past that failure and saved its progress:
    the count starts again, so rare divergences far apart never add up. One to the same checkpoint (or an older
    one) adds to it: every retry fails again (a learning rate too high, or most of an epoch's batches bad, each
    replay training the same stretch again); past ``limit`` the run must stop instead.

    :param streak: The current record; left unchanged.
    :param back_to: The step of the checkpoint this rollback goes back to.
    :param limit: ``guard.max_rollbacks``: the most rollbacks in a row to the same checkpoint.
    :returns: The next record, and whether this rollback may go ahead.

    >>> streak, ok = step_rollbacks(RollbackStreak(), 8, limit=2)
    >>> streak, ok = step_rollbacks(streak, 8, limit=2)
    >>> ok, streak.count
    (True, 2)
    >>> step_rollbacks(streak, 8, limit=2)[1], step_rollbacks(streak, 10, limit=2)[0].count
    (False, 1)
    """
    count = streak.count + 1 if streak.back_to is not None and back_to <= streak.back_to else 1
    return RollbackStreak(back_to=back_to, count=count), count <= limit
