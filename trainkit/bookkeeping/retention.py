"""Checkpoint retention: which kept checkpoints stay on disk, decided over plain descriptions.

Pure: stdlib and attrs only. A policy is a frozen record; :func:`retain` says which checkpoints it keeps and
:func:`keep_reasons` which rule keeps each one. The files are the shell's (:mod:`trainkit.checkpoint.kept`):
it describes what is on disk, asks here, and deletes the rest. Two checkpoints are never candidates for
deletion whatever the policy: the newest one (the largest step, or the step the caller says the run wrote last)
and any being written. One with a larger step than that newest (planted, or left by a history that a resume
from an older checkpoint abandoned) is not the run's: it is kept, and no rule ranks it.

Policies, and their spellings in ``ckpt.keep`` (:func:`parse_keep`):

=====================================  ================================  =======================================
record                                 ``ckpt.keep`` item                keeps
=====================================  ================================  =======================================
``KeepLatest(n)``                      ``latest:N``                      the ``n`` largest steps
``KeepEvery(steps=k)``                 ``every_steps:K``                 every step that is a multiple of ``k``
``KeepEvery(epochs=k)``                ``every_epochs:K``                the end of every ``k``-th epoch
``KeepEverySeconds(s)``                ``every_seconds:S``               the first, then one at least ``s``
                                                                         seconds after the last one it kept
``KeepBest(n, metric, minimize)``      ``best:N[:METRIC][:min|max]``     the ``n`` best finite scores
``KeepAny(p, q, ...)``                 ``p,q,...``                       what any of them keeps
=====================================  ================================  =======================================
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from trainkit.bookkeeping._records import as_float, is_finite_real, is_int
from trainkit.errors import BookkeepingError

__all__ = [
    "Checkpoint",
    "KeepLatest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepBest",
    "KeepAny",
    "Policy",
    "retain",
    "keep_reasons",
    "unranked",
    "parse_keep",
    "NEWEST",
    "WRITING",
    "AHEAD",
    "RESUMED",
]

NEWEST = "newest"
"""The reason :func:`keep_reasons` gives for the newest checkpoint, which no policy may delete."""
WRITING = "being written"
"""The reason :func:`keep_reasons` gives for a checkpoint a background save is writing."""
AHEAD = "after the newest"
"""The reason :func:`keep_reasons` gives for a checkpoint with a larger step than the newest the run wrote."""
RESUMED = "resumed from"
"""The reason :func:`keep_reasons` gives for the kept checkpoint the run resumed from (rerunning its command
resumes from it again)."""


def _check_count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be an int >= 1, got {value!r}")


def _check_optional_count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _check_count(instance, attribute, value)


def _check_counter(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be an int >= 0, got {value!r}")


def _check_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise BookkeepingError(f"{type(instance).__name__}.{attribute.name} must be a bool, got {value!r}")


def _check_time(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_finite_real(value):
        raise BookkeepingError(f"Checkpoint.time must be a finite number, got {_short(value)}")


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a hostile index's int of 400 digits is named by its size, not printed whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _scores(value: Mapping[str, Any] | None) -> Mapping[str, float]:
    frozen: dict[str, float] = {}
    for key, score in (value or {}).items():
        frozen[str(key)] = as_float(score, f"Checkpoint.scores[{key!r}]")
    return MappingProxyType(frozen)


@attrs.frozen(kw_only=True)
class Checkpoint:
    """What retention knows of one kept checkpoint: plain values, no path.

    :ivar step: The optimizer step it was written at; it names the checkpoint, so steps are unique.
    :ivar epoch: The number of epochs completed when it was written.
    :ivar epoch_end: Written at an epoch's end (False for a step checkpoint inside an epoch).
    :ivar time: Wall-clock seconds (any origin, e.g. Unix time) when it was written.
    :ivar scores: The validation scores of the weights it holds, by name (``"score"`` is the selection
        score given to ``save_if_best``); empty when it was not validated. NaN may be recorded; it is
        never among the best.
    :ivar writing: A background save is still writing it.

    >>> Checkpoint(step=100, epoch=1, time=0.0, scores={"score": 0.5}).scores["score"]
    0.5
    """

    step: int = attrs.field(validator=_check_counter)
    epoch: int = attrs.field(default=0, validator=_check_counter)
    epoch_end: bool = attrs.field(default=True, validator=_check_bool)
    time: float = attrs.field(default=0.0, validator=_check_time)
    scores: Mapping[str, float] = attrs.field(factory=dict, converter=_scores, hash=False)
    writing: bool = attrs.field(default=False, validator=_check_bool)


@attrs.frozen
class KeepLatest:
    """Keep the ``n`` checkpoints with the largest steps.

    :ivar n: How many (>= 1).

    >>> KeepLatest(3).spec
    'latest:3'
    """

    n: int = attrs.field(validator=_check_count)

    @property
    def spec(self) -> str:
        """The ``ckpt.keep`` item that parses to this policy."""
        return f"latest:{self.n}"

    def _keeps(self, checkpoints: tuple[Checkpoint, ...]) -> frozenset[int]:
        return frozenset(c.step for c in checkpoints[-self.n :])


@attrs.frozen(kw_only=True)
class KeepEvery:
    """Keep every ``steps``-th step, or the end of every ``epochs``-th epoch (exactly one of the two).

    A checkpoint written inside an epoch (``epoch_end`` False) is never kept by ``epochs``.

    :ivar steps: Keep the checkpoints whose step is a multiple of this (>= 1).
    :ivar epochs: Keep the epoch-end checkpoints whose count of completed epochs is a multiple of this (>= 1).

    >>> KeepEvery(steps=1000).spec, KeepEvery(epochs=2).spec
    ('every_steps:1000', 'every_epochs:2')
    """

    steps: int | None = attrs.field(default=None, validator=_check_optional_count)
    epochs: int | None = attrs.field(default=None, validator=_check_optional_count)

    def __attrs_post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise BookkeepingError(
                f"KeepEvery needs exactly one of steps= or epochs=, got steps={self.steps!r}, epochs={self.epochs!r}"
            )

    @property
    def spec(self) -> str:
        """The ``ckpt.keep`` item that parses to this policy."""
        return f"every_steps:{self.steps}" if self.steps is not None else f"every_epochs:{self.epochs}"

    def _keeps(self, checkpoints: tuple[Checkpoint, ...]) -> frozenset[int]:
        if self.steps is not None:
            return frozenset(c.step for c in checkpoints if c.step % self.steps == 0)
        epochs = self.epochs or 1
        return frozenset(c.step for c in checkpoints if c.epoch_end and c.epoch > 0 and c.epoch % epochs == 0)


def _check_seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_finite_real(value) or value <= 0:
        raise BookkeepingError(f"KeepEverySeconds.seconds must be a finite number > 0, got {_short(value)}")


@attrs.frozen
class KeepEverySeconds:
    """Keep the first checkpoint, then each one written at least ``seconds`` after the last one this kept.

    Checkpoints are taken in step order. A checkpoint whose time lies before the last kept one (the clock was
    set back) is kept and counts from there. The decision for a checkpoint depends only on the ones before
    it, so deleting what this does not keep never changes what it keeps.

    :ivar seconds: The interval (> 0).

    >>> KeepEverySeconds(3600).spec
    'every_seconds:3600'
    """

    seconds: float = attrs.field(validator=_check_seconds)

    @property
    def spec(self) -> str:
        """The ``ckpt.keep`` item that parses to this policy."""
        seconds = self.seconds
        return f"every_seconds:{int(seconds) if float(seconds).is_integer() else float(seconds)!r}"

    def _keeps(self, checkpoints: tuple[Checkpoint, ...]) -> frozenset[int]:
        kept: list[int] = []
        last: float | None = None
        for c in checkpoints:
            if last is None or c.time - last >= self.seconds or c.time < last:
                kept.append(c.step)
                last = c.time
        return frozenset(kept)


def _check_metric(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip() or ":" in value or "," in value:
        raise BookkeepingError(f"KeepBest.metric must be a non-empty name without ':' or ',', got {value!r}")


@attrs.frozen
class KeepBest:
    """Keep the ``n`` checkpoints with the best finite ``scores[metric]``.

    A checkpoint without that score, or with a NaN or infinite one, is never among the best. Of equal scores
    the earlier step ranks first (a tie never improves, as in :func:`~trainkit.bookkeeping.save_if_best`).

    :ivar n: How many (>= 1).
    :ivar metric: The score's name in a :class:`Checkpoint`'s ``scores`` (``"score"``: the selection score).
    :ivar minimize: True when a lower score is better.

    >>> KeepBest(2).spec, KeepBest(1, "val/acc", minimize=False).spec
    ('best:2:score:max', 'best:1:val/acc:max')
    """

    n: int = attrs.field(validator=_check_count)
    metric: str = attrs.field(default="score", validator=_check_metric)
    minimize: bool = attrs.field(default=False, kw_only=True, validator=_check_bool)

    @property
    def spec(self) -> str:
        """The ``ckpt.keep`` item that parses to this policy."""
        return f"best:{self.n}:{self.metric}:{'min' if self.minimize else 'max'}"

    def _keeps(self, checkpoints: tuple[Checkpoint, ...]) -> frozenset[int]:
        scored = [
            (c.scores[self.metric], c.step) for c in checkpoints if math.isfinite(c.scores.get(self.metric, math.nan))
        ]
        scored.sort(key=lambda pair: (pair[0] if self.minimize else -pair[0], pair[1]))
        return frozenset(step for _, step in scored[: self.n])


def _policies(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _check_policies(instance: Any, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    for policy in value:
        if not isinstance(policy, _POLICY_TYPES):
            raise BookkeepingError(f"KeepAny takes policies (KeepLatest, KeepEvery, ...), got {policy!r}")


@attrs.frozen(init=False)
class KeepAny:
    """Keep what any of ``policies`` keeps; with none, keep only what is never deleted.

    :ivar policies: The policies, in the order given.

    >>> KeepAny(KeepLatest(2), KeepEvery(steps=100)).spec
    'latest:2,every_steps:100'
    """

    policies: tuple[Any, ...] = attrs.field(converter=_policies, validator=_check_policies)

    def __init__(self, *policies: Any) -> None:
        self.__attrs_init__(policies)  # type: ignore[attr-defined]

    @property
    def spec(self) -> str:
        """The ``ckpt.keep`` value that parses to this policy (empty for no policy)."""
        return ",".join(spec for spec in (policy.spec for policy in self.policies) if spec)

    def _keeps(self, checkpoints: tuple[Checkpoint, ...]) -> frozenset[int]:
        return frozenset().union(*(policy._keeps(checkpoints) for policy in self.policies))


_POLICY_TYPES = (KeepLatest, KeepEvery, KeepEverySeconds, KeepBest, KeepAny)
Policy = KeepLatest | KeepEvery | KeepEverySeconds | KeepBest | KeepAny
"""Any retention policy."""


def _rules(policy: Any) -> list[Any]:
    if isinstance(policy, KeepAny):
        return [rule for inner in policy.policies for rule in _rules(inner)]
    if not isinstance(policy, _POLICY_TYPES):
        raise BookkeepingError(f"a retention policy must be KeepLatest, KeepEvery, ..., got {policy!r}")
    return [policy]


def _in_order(checkpoints: Iterable[Checkpoint]) -> tuple[Checkpoint, ...]:
    ordered = tuple(sorted(checkpoints, key=lambda c: c.step))
    for c in ordered:
        if not isinstance(c, Checkpoint):
            raise BookkeepingError(f"retention takes Checkpoint records, got {c!r}")
    for before, after in zip(ordered, ordered[1:]):
        if before.step == after.step:
            raise BookkeepingError(f"two checkpoints have step {after.step}; a step names one checkpoint")
    return ordered


def keep_reasons(
    policy: Policy, checkpoints: Iterable[Checkpoint], *, newest: int | None = None, resumed_from: int | None = None
) -> dict[int, tuple[str, ...]]:
    """Say, for every checkpoint, which rules keep it (none: it may be deleted).

    Pure. The rules are the policy's items as ``ckpt.keep`` spells them (``"latest:3"``), in the policy's
    order, after ``"newest"`` for the newest checkpoint and ``"being written"`` for one a background save writes.
    A checkpoint with a larger step than ``newest`` gives ``"after the newest"`` alone: the run did not write
    it, so it neither counts for a rule nor is deleted. The checkpoint of step ``resumed_from`` gives
    ``"resumed from"`` first: the run's command names it, so running that command again must find it.

    :param policy: The policy.
    :param checkpoints: The checkpoints, in any order.
    :param newest: The step of the newest checkpoint the run wrote (the largest step at most this one is the
        newest); None: the largest step of all.
    :param resumed_from: The step of the kept checkpoint the run resumed from, if it did.
    :returns: Each checkpoint's step, in step order, mapped to its reasons.
    :raises BookkeepingError: On two checkpoints with the same step, or something that is not a policy.

    >>> cs = [Checkpoint(step=s, scores={"score": x}) for s, x in [(10, 0.9), (20, 0.1), (30, 0.5)]]
    >>> keep_reasons(KeepAny(KeepBest(1, minimize=True), KeepLatest(1)), cs)
    {10: (), 20: ('best:1:score:min',), 30: ('newest', 'latest:1')}
    >>> keep_reasons(KeepLatest(1), cs, newest=20)
    {10: (), 20: ('newest', 'latest:1'), 30: ('after the newest',)}
    >>> keep_reasons(KeepLatest(1), cs, resumed_from=10)
    {10: ('resumed from',), 20: (), 30: ('newest', 'latest:1')}
    """
    for name, value in (("newest", newest), ("resumed_from", resumed_from)):
        if value is not None and not is_int(value):
            raise BookkeepingError(f"{name} must be a step (an int) or None, got {value!r}")
    ordered = _in_order(checkpoints)
    ahead = tuple(c for c in ordered if newest is not None and c.step > newest)
    ordered = ordered[: len(ordered) - len(ahead)]
    rules = _rules(policy)
    keeps = [(rule.spec, rule._keeps(ordered)) for rule in rules]
    reasons: dict[int, tuple[str, ...]] = {}
    for c in ordered:
        own = [RESUMED] if c.step == resumed_from else []
        if c is ordered[-1]:
            own.append(NEWEST)
        if c.writing:
            own.append(WRITING)
        own.extend(spec for spec, steps in keeps if c.step in steps)
        reasons[c.step] = tuple(dict.fromkeys(own))
    for c in ahead:
        reasons[c.step] = (AHEAD,)
    return reasons


def retain(
    policy: Policy, checkpoints: Iterable[Checkpoint], *, newest: int | None = None, resumed_from: int | None = None
) -> frozenset[int]:
    """Decide which checkpoints a policy keeps; the shell deletes the others.

    Pure. The newest checkpoint, any being written, any after the newest and the one the run resumed from (see
    :func:`keep_reasons`) are always kept.

    :param policy: The policy.
    :param checkpoints: The checkpoints, in any order (steps unique).
    :param newest: The step of the newest checkpoint the run wrote; None: the largest step.
    :param resumed_from: The step of the kept checkpoint the run resumed from, if it did.
    :returns: The steps of the checkpoints kept.
    :raises BookkeepingError: On two checkpoints with the same step, or something that is not a policy.

    >>> cs = [Checkpoint(step=s) for s in (100, 200, 300, 400)]
    >>> sorted(retain(KeepLatest(2), cs))
    [300, 400]
    >>> sorted(retain(KeepAny(), cs)), sorted(retain(KeepEvery(steps=200), cs))
    ([400], [200, 400])
    >>> retain(KeepLatest(1), [])
    frozenset()
    """
    reasons = keep_reasons(policy, checkpoints, newest=newest, resumed_from=resumed_from)
    return frozenset(step for step, why in reasons.items() if why)


def unranked(policy: Policy, checkpoints: Iterable[Checkpoint], *, newest: int | None = None) -> tuple[KeepBest, ...]:
    """Name the ``best`` rules of a policy that rank none of the checkpoints: none has a finite score of the rule's
    metric (a misspelt metric, or scores never recorded), so the rule keeps nothing.

    Pure. Checkpoints after ``newest`` do not count, as in :func:`keep_reasons`.

    :param policy: The policy.
    :param checkpoints: The checkpoints, in any order.
    :param newest: The step of the newest checkpoint the run wrote; None: the largest step.
    :returns: Those rules, in the policy's order.

    >>> cs = [Checkpoint(step=10, scores={"score": 0.5, "val/loss": 0.5})]
    >>> unranked(parse_keep("best:1,best:1:val/acc,latest:2"), cs)
    (KeepBest(n=1, metric='val/acc', minimize=False),)
    """
    mine = [c for c in checkpoints if newest is None or c.step <= newest]
    return tuple(
        rule
        for rule in _rules(policy)
        if isinstance(rule, KeepBest) and not any(is_finite_real(c.scores.get(rule.metric)) for c in mine)
    )


def _count(text: str, item: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or not text.strip().isdigit():
        raise BookkeepingError(f"{item!r}: {name} must be an int >= 1, got {text!r}")
    return value


def _parse_item(item: str, minimize: bool) -> Policy:
    kind, _, rest = item.partition(":")
    kind = kind.strip()
    args = [arg.strip() for arg in rest.split(":")] if rest else []
    if kind in ("latest", "every_steps", "every_epochs") and len(args) == 1:
        n = _count(args[0], item, "the count" if kind == "latest" else "the interval")
        if kind == "latest":
            return KeepLatest(n)
        return KeepEvery(steps=n) if kind == "every_steps" else KeepEvery(epochs=n)
    if kind == "every_seconds" and len(args) == 1:
        try:
            seconds = float(args[0])
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise BookkeepingError(f"{item!r}: the interval must be a number of seconds > 0, got {args[0]!r}")
        return KeepEverySeconds(seconds)
    if kind == "best" and 1 <= len(args) <= 3:
        n = _count(args[0], item, "the count")
        rest_args = args[1:]
        direction = minimize
        if rest_args and rest_args[-1] in ("min", "max"):
            direction = rest_args.pop() == "min"
        metric = rest_args[0] if rest_args else "score"
        if not metric:
            raise BookkeepingError(f"{item!r}: the metric name is empty")
        return KeepBest(n, metric, minimize=direction)
    raise BookkeepingError(
        f"{item!r} is not a retention rule; use latest:N, every_steps:N, every_epochs:N, every_seconds:S or "
        "best:N[:METRIC][:min|max]"
    )


def parse_keep(value: str | Iterable[str], *, minimize: bool = False) -> KeepAny:
    """Parse ``ckpt.keep``: one comma-separated string, or a list of such strings (a YAML list).

    Pure. ``best:N`` ranks by the selection score (``"score"``); without ``:min``/``:max`` it follows
    ``minimize`` (the run's ``val.minimize``).

    :param value: E.g. ``"latest:3,every_steps:1000,best:2"`` or ``["latest:3", "best:2:val/acc:max"]``.
    :param minimize: The direction of ``best`` items that name none.
    :returns: The policies, in the order given (an empty :class:`KeepAny` for an empty value).
    :raises BookkeepingError: Naming the item and the rule it breaks.

    >>> parse_keep("latest:3,every_steps:1000,best:2", minimize=True).spec
    'latest:3,every_steps:1000,best:2:score:min'
    >>> parse_keep(["every_seconds:1800", "best:1:val/acc:max"]).policies[1]
    KeepBest(n=1, metric='val/acc', minimize=False)
    >>> parse_keep("latest:0")
    Traceback (most recent call last):
    ...
    trainkit.errors.BookkeepingError: 'latest:0': the count must be an int >= 1, got '0'
    """
    items = [value] if isinstance(value, str) else list(value)
    policies: list[Policy] = []
    for entry in items:
        if not isinstance(entry, str):
            raise BookkeepingError(f"a retention rule must be a string such as 'latest:3', got {entry!r}")
        policies.extend(_parse_item(part.strip(), minimize) for part in entry.split(",") if part.strip())
    return KeepAny(*policies)
