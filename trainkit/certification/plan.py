"""Where certify interrupts the interrupted run: two step boundaries, drawn or given (:func:`plan_interruptions`).

Drawn interruptions each come after a step checkpoint, a validation and an epoch end (:func:`covering_steps`, from
the straight run's own boundaries: a stream has no length to compute them from); :func:`minimum_steps` is the budget
that allows it. Pure: no file, no process.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs

from trainkit.errors import ConfigError

__all__ = [
    "FEWEST_STEPS",
    "Interruption",
    "covering_steps",
    "crossed_lines",
    "minimum_steps",
    "plan_interruptions",
]


@attrs.frozen(kw_only=True)
class Interruption:
    """One interruption of the interrupted run.

    :ivar how: ``"term"`` (``SIGTERM``: the engine stops at that step boundary and saves) or ``"kill"`` (``SIGKILL``
        right after the optimizer step: the boundary's checkpoint is never written).
    :ivar step: The optimizer step (the trainer's ``step`` after it) at which the signal is sent.
    """

    how: str = attrs.field(validator=attrs.validators.in_(("term", "kill")))
    step: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def signal(self) -> str:
        """``SIGTERM`` or ``SIGKILL``."""
        return "SIGTERM" if self.how == "term" else "SIGKILL"


def plan_interruptions(
    total_steps: int,
    *,
    kill_at: Sequence[int] = (),
    term_at: Sequence[int] = (),
    seed: int = 0,
    epoch_ends: Sequence[int] | None = None,
    validations: Sequence[int] | None = None,
) -> tuple[Interruption, ...]:
    """Choose the interrupted run's interruptions, in step order.

    Pure. With neither ``kill_at`` nor ``term_at`` it picks one ``SIGTERM`` and one ``SIGKILL`` at two distinct
    steps drawn from ``random.Random(seed)``: given ``epoch_ends`` (and ``validations``), at steps
    :func:`covering_steps` draws, so that the run before each signal, from its start or its last resume, crosses a
    step checkpoint, an epoch end and a validation; else in ``[1, total_steps - 1]`` (one step of each when the run
    has only 2 steps).

    :param total_steps: The optimizer steps of the straight run.
    :param kill_at: Steps at which the process is SIGKILLed.
    :param term_at: Steps at which it gets SIGTERM.
    :param seed: The seed of the random choice.
    :param epoch_ends: The steps after which the straight run ended an epoch (before its last step).
    :param validations: The steps after which it validated (before its last step).
    :returns: The interruptions, by step.
    :raises ConfigError: When a step is outside ``[1, total_steps - 1]``, given twice, or the run is too short to
        be interrupted (or, with ``epoch_ends``, to cover them).

    >>> plan_interruptions(12, kill_at=[7], term_at=[3])
    (Interruption(how='term', step=3), Interruption(how='kill', step=7))
    >>> [i.how for i in plan_interruptions(12, seed=1)] in (["term", "kill"], ["kill", "term"])
    True
    >>> [i.step for i in plan_interruptions(10, epoch_ends=[4, 8], validations=[4, 8], seed=3)][1]
    9
    """
    if total_steps < 2:
        raise ConfigError(
            "the budget", "must give at least 2 optimizer steps to interrupt the run between", total_steps,
            hint="raise --max-steps or --epochs",
        )  # fmt: skip
    chosen = [("kill", step, "--kill-at") for step in kill_at] + [("term", step, "--term-at") for step in term_at]
    if not chosen:
        chosen = _drawn(total_steps, seed, epoch_ends, validations)
    seen: set[int] = set()
    for _, step, option in chosen:
        if not isinstance(step, int) or not 1 <= step < total_steps:
            raise ConfigError(
                option, f"must name steps in [1, {total_steps - 1}] (the straight run took {total_steps})", step
            )
        if step in seen:
            raise ConfigError(option, "must name each step once", step)
        seen.add(step)
    return tuple(Interruption(how=how, step=step) for how, step, _ in sorted(chosen, key=lambda c: c[1]))


def _drawn(
    total_steps: int, seed: int, epoch_ends: Sequence[int] | None, validations: Sequence[int] | None
) -> list[tuple[str, int, str]]:
    """One ``SIGTERM`` and one ``SIGKILL`` at steps drawn with ``seed`` (:func:`plan_interruptions` without steps
    given), as ``(how, step, option)`` with no option to name."""
    rng = random.Random(seed)
    if epoch_ends is None:
        steps = rng.sample(range(1, total_steps), k=min(2, total_steps - 1))
        return [("term", steps[0], ""), *([("kill", steps[1], "")] if len(steps) > 1 else [])]
    covering = covering_steps(total_steps, epoch_ends, validations or (), seed=seed)
    if covering is None:
        raise ConfigError(
            "the budget", "must let an epoch end and a validation come before each of two interruptions",
            total_steps, hint="raise --max-steps or --epochs",
        )  # fmt: skip
    hows = rng.sample(["term", "kill"], k=2)
    return [(hows[0], covering[0], ""), (hows[1], covering[1], "")]


def _crossed(boundaries: Sequence[int], start: int, stop: int) -> bool:
    """Whether a boundary (a step after which something happened) falls in a segment that resumed from ``start`` and
    is interrupted at ``stop``: the step ``start`` itself counts (its epoch end or validation comes after the resume),
    ``stop`` does not (the signal comes first)."""
    return any(start <= step < stop for step in boundaries)


def covering_steps(
    total_steps: int, epoch_ends: Sequence[int], validations: Sequence[int], *, seed: int = 0
) -> tuple[int, int] | None:
    """Draw two interruption steps ``s1 < s2 < total_steps`` such that the run from its start to ``s1``, and from
    ``s1`` to ``s2``, each crosses an epoch end and (when ``validations`` has any) a validation; every step has a step
    checkpoint under certify, so each crosses one when it is 2 steps or more.

    A state lost at a resume often shows only once it has built up across such a boundary: a dataset whose generator
    a resume makes afresh draws the same first epoch again, which a resume inside the first epoch cannot tell apart.

    Pure.

    :param total_steps: The straight run's optimizer steps.
    :param epoch_ends: The steps after which an epoch ended.
    :param validations: The steps after which the run validated.
    :param seed: The seed of the draw.
    :returns: The two steps, or None when the run is too short.

    >>> first, second = covering_steps(10, [4, 8], [4, 8])
    >>> 5 <= first <= 7 and second == 9
    True
    >>> covering_steps(8, [4], [4]) is None
    True
    """
    kinds = [sorted(set(epoch_ends))] + ([sorted(set(validations))] if validations else [])

    def ok(start: int, stop: int) -> bool:
        return stop - start >= 2 and all(_crossed(kind, start, stop) for kind in kinds)

    pairs = [(a, b) for a in range(2, total_steps) for b in range(a + 1, total_steps) if ok(0, a) and ok(a, b)]
    if not pairs:
        return None
    rng = random.Random(seed)
    first = rng.choice(sorted({a for a, _ in pairs}))
    return first, rng.choice([b for a, b in pairs if a == first])


def minimum_steps(epoch_ends: Sequence[int], validations: Sequence[int]) -> int | None:
    """The fewest optimizer steps a run needs for :func:`covering_steps` to find its two steps, extrapolated from the
    first epoch end and the first validation a run saw (epochs of that many steps, validations that often).

    Pure.

    :param epoch_ends: The steps after which an epoch ended (at least one, else None: the length is unknown).
    :param validations: The steps after which the run validated (none: no validation to cover).
    :returns: The budget in steps, or None.

    >>> minimum_steps([4, 8], [4, 8]), minimum_steps([5], [2, 4]), minimum_steps([], [])
    (10, 12, None)
    """
    if not epoch_ends:
        return None
    periods = [min(epoch_ends)] + ([min(validations)] if validations else [])
    first = max(max(periods) + 1, 2)
    second = max(max(-(-first // p) * p for p in periods) + 1, first + 2)
    return second + 1


FEWEST_STEPS = 5
"""The fewest steps two interruptions can each come after a step checkpoint, an epoch end and a validation in
(epochs of one step, validated at each end: :func:`minimum_steps`)."""


def crossed_lines(
    plan: Sequence[Interruption], resumes: Sequence[tuple[int, int]], ends: list[int], validations: list[int]
) -> tuple[str, ...]:
    """What the run crossed before each interruption, from its start or its last resume (the report's lines).

    Pure.

    :param plan: The interruptions, in step order.
    :param resumes: For each: the step it fired at and the step the next attempt resumed from.
    :param ends: The steps after which the straight run ended an epoch.
    :param validations: The steps after which it validated.
    :returns: One line per interruption.

    >>> crossed_lines([Interruption(how="term", step=3)], [(3, 2)], [1], [])[0].split(": ", 1)[1]
    'step checkpoints after steps 1-2, no validation, epoch end after step 1'
    """
    lines = []
    start = 0
    for interruption, (fired, resumed) in zip(plan, resumes):
        saved = [step for step in range(start + 1, fired)]
        parts = [
            f"step checkpoints after steps {saved[0]}-{saved[-1]}" if saved else "no step checkpoint",
            _listed("validation", [v for v in validations if start <= v < fired]),
            _listed("epoch end", [e for e in ends if start <= e < fired]),
        ]
        lines.append(f"before the {interruption.signal} at step {fired} (from step {start}): {', '.join(parts)}")
        start = resumed
    return tuple(lines)


def _listed(what: str, steps: list[int]) -> str:
    if not steps:
        return f"no {what}"
    shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    return f"{what}{'s' if len(steps) > 1 else ''} after step{'s' if len(steps) > 1 else ''} {shown}"
