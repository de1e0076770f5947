"""Replay a run's validation scores through the pure core under other early-stopping settings, and its recorded grad
norms and losses through the divergence guard's.

Side effects: none but reading ``metrics.jsonl`` in :func:`replay_run`; no torch, no checkpoint. Only a
functional core can offer this: the decisions a trainer made are pure functions of the scores it saw, so the
same scores, fed to :func:`~trainkit.bookkeeping.save_if_best` and
:func:`~trainkit.bookkeeping.step_patience` with other settings, say what that run would have done.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from trainkit.bookkeeping import (
    GUARD_MODES,
    BestState,
    GuardState,
    PatienceState,
    is_finite_value,
    is_real,
    replay_guard,
    save_if_best,
    step_patience,
)
from trainkit.config import GuardConfig, ValConfig, apply_overrides
from trainkit.config.rules import one_of
from trainkit.run.read_metrics import read_metrics

__all__ = [
    "Replay",
    "replay_scores",
    "validation_scores",
    "validation_points",
    "replay_run",
    "format_replay",
    "GUARD_KEYS",
    "guard_steps",
    "GuardReplay",
    "replay_guard_run",
    "format_guard_replay",
]


@attrs.frozen(kw_only=True)
class Replay:
    """What a run would have done under some early-stopping settings.

    :ivar stop_epoch: The epoch it would have stopped after, or None when the recorded scores run out first.
    :ivar best_epoch: The epoch of the best score up to the stop (None when no score was finite).
    :ivar best_score: That score.
    :ivar last_epoch: The last validated epoch the recording holds.
    :ivar stop_step: The optimizer step of the validation it would have stopped at (None: unrecorded, or no stop).
    :ivar best_step: The step of the best score's validation (None: unrecorded, or no best).
    :ivar last_step: The step of the last validation the recording holds (None: unrecorded).
    :ivar per_step: Whether some epoch was validated more than once (``val.every_n_steps``): the replay is then
        told in steps.
    """

    stop_epoch: int | None
    best_epoch: int | None
    best_score: float | None
    last_epoch: int | None
    stop_step: int | None = None
    best_step: int | None = None
    last_step: int | None = None
    per_step: bool = False


def replay_scores(scores: Iterable[tuple[int, float] | tuple[int, int | None, float]], val: ValConfig) -> Replay:
    """Run ``(epoch, score)`` pairs or ``(epoch, step, score)`` triples (a validation each, at step boundaries
    too: ``val.every_n_steps``), in order, through best tracking and patience with ``val``'s settings.

    Pure: the same transitions the trainer makes after each validation.

    :param scores: The validations' epochs (and steps) and their scores, in order.
    :param val: The settings: ``minimize``, ``patience``, ``start_patience``, ``min_delta``.
    :returns: Where the run would have stopped and its best epoch by then.

    >>> val = ValConfig(minimize=True, patience=2)
    >>> r = replay_scores([(0, 3.0), (1, 2.0), (2, 2.5), (3, 2.4), (4, 1.0)], val)
    >>> r.stop_epoch, r.best_epoch, r.best_score, r.last_epoch
    (3, 1, 2.0, 4)
    >>> replay_scores([(0, 3.0), (1, 2.0)], ValConfig(minimize=True, patience=5)).stop_epoch is None
    True
    >>> r = replay_scores([(0, 50, 3.0), (0, 100, 2.0), (0, 150, 2.5), (0, 200, 2.6)], val)
    >>> (r.stop_step, r.best_step, r.per_step)
    (200, 100, True)
    """
    best = BestState(minimize=val.minimize, min_delta=val.min_delta)
    patience = PatienceState(patience=val.patience, start_patience=val.start_patience)
    stop_epoch = stop_step = best_step = last_epoch = last_step = None
    epochs_seen: set[int] = set()
    per_step = False
    for point in scores:
        epoch, step, score = point if len(point) == 3 else (point[0], None, point[1])  # type: ignore[misc]
        per_step = per_step or epoch in epochs_seen
        epochs_seen.add(epoch)
        last_epoch, last_step = epoch, step
        if stop_epoch is not None:
            continue
        best, improved = save_if_best(best, score, epoch=epoch)
        best_step = step if improved else best_step
        patience, stop = step_patience(patience, improved, epoch=epoch)
        if stop:
            stop_epoch, stop_step = epoch, step
    return Replay(
        stop_epoch=stop_epoch, best_epoch=best.epoch, best_score=best.score, last_epoch=last_epoch,
        stop_step=stop_step, best_step=best_step, last_step=last_step, per_step=per_step,
    )  # fmt: skip


def validation_points(rows: Sequence[Mapping[str, Any]], metric: str) -> list[tuple[int, int | None, float]]:
    """The ``(epoch, step, score)`` of every validation that logged ``metric``: one per ``(epoch, step)`` (the
    last value pushed there), in the journal's order; several in an epoch when it validated every N steps.

    Pure.

    :param rows: The rows of ``metrics.jsonl``.
    :param metric: The score's key, e.g. ``"val/loss"``.
    :returns: The triples (the step None when a row has no ``trainer/step``).

    >>> validation_points([{"trainer/epoch": 0, "trainer/step": 50, "val/loss": 2.0},
    ...                    {"trainer/epoch": 0, "trainer/step": 100, "val/loss": 1.5}], "val/loss")
    [(0, 50, 2.0), (0, 100, 1.5)]
    """
    points: dict[tuple[int, int | None], float] = {}
    for row in rows:
        value, epoch, step = row.get(metric), row.get("trainer/epoch"), row.get("trainer/step")
        if is_real(value) and isinstance(epoch, int) and not isinstance(epoch, bool):
            step = step if isinstance(step, int) and not isinstance(step, bool) else None
            points.pop((epoch, step), None)  # a later push at the same point replaces it, in its own place
            points[(epoch, step)] = float(value)
    return sorted(((e, s, v) for (e, s), v in points.items()), key=lambda p: (p[0], -1 if p[1] is None else p[1]))


def validation_scores(rows: Sequence[Mapping[str, Any]], metric: str) -> list[tuple[int, float]]:
    """The ``(epoch, score)`` of every row that logged ``metric``, the last value per epoch, in epoch order.

    Pure. A run that validated every N steps has several per epoch: :func:`validation_points` gives them all.

    :param rows: The rows of ``metrics.jsonl``.
    :param metric: The score's key, e.g. ``"val/loss"``.
    :returns: The pairs.

    >>> validation_scores([{"trainer/epoch": 0, "val/loss": 2.0}, {"trainer/epoch": 0, "train/loss": 1.0},
    ...                    {"trainer/epoch": 1, "val/loss": 1.5}], "val/loss")
    [(0, 2.0), (1, 1.5)]
    """
    return sorted({epoch: score for epoch, _, score in validation_points(rows, metric)}.items())


def replay_run(out_dir: str | Path, overrides: Sequence[str] = (), metric: str = "val/loss") -> tuple[Replay, Replay]:
    """Replay a run folder's ``metrics.jsonl``: what happened, and what the settings in ``overrides`` would do.

    Side effects: reads ``out_dir/metrics.jsonl`` (through :func:`trainkit.run.read_metrics.read_metrics`).

    :param out_dir: The run folder.
    :param overrides: ``val.*=value`` words (``val.patience=5``, ``val.minimize=true``, ...); ``val.minimize``
        defaults to True for a metric whose name says loss or error, else False.
    :param metric: The score the run selected on.
    :returns: The replay with no early stopping (what the recording holds: its best), and the one with the
        settings.
    :raises ConfigError: On an unknown key or a bad value.
    :raises ValueError: When no row logged ``metric``.
    """
    scores = validation_points(read_metrics(out_dir), metric)
    if not scores:
        raise ValueError(f"{Path(out_dir) / 'metrics.jsonl'} holds no {metric!r} values; pick the score with --metric")
    minimize = any(word in metric.lower() for word in ("loss", "error", "err", "perplexity", "mse", "mae"))
    data: dict[str, Any] = {"val": {"minimize": minimize}}
    apply_overrides(_ValOnly, data, [w if w.startswith("val.") else f"val.{w}" for w in overrides])
    val = ValConfig(**data["val"])
    recorded = replay_scores(scores, attrs.evolve(val, patience=None))
    return recorded, replay_scores(scores, val)


@attrs.frozen(kw_only=True)
class _ValOnly:
    """The only section ``replay`` takes overrides for."""

    val: ValConfig = attrs.field(factory=ValConfig)


def format_replay(recorded: Replay, replayed: Replay, val_words: Sequence[str], metric: str) -> list[str]:
    """The lines ``python -m trainkit replay`` prints: what happened, side by side with the replay.

    Pure.

    :param recorded: What the recording holds.
    :param replayed: The replay under the settings.
    :param val_words: The settings as given, for the heading.
    :param metric: The score's key.
    :returns: The lines.
    """

    def score(value: float | None) -> str:
        return "none" if value is None or not math.isfinite(value) else f"{value:.6g}"

    settings = " ".join(val_words) or "the defaults (no early stopping)"
    if recorded.per_step:  # validations at step boundaries (val.every_n_steps): told in steps
        if replayed.stop_step is not None:
            stop = f"would have stopped at the validation of step {replayed.stop_step} (epoch {replayed.stop_epoch})"
        else:
            stop = f"would have continued past step {recorded.last_step} (the recording is too short to tell)"
        return [
            f"metric:       {metric}",
            f"recorded:     validated up to step {recorded.last_step} (epoch {recorded.last_epoch}); best at step "
            f"{recorded.best_step} ({score(recorded.best_score)})",
            f"with {settings}:",
            f"  {stop}",
            f"  best at step {replayed.best_step} ({score(replayed.best_score)})",
        ]
    if replayed.stop_epoch is not None:
        stop = f"would have stopped after epoch {replayed.stop_epoch}"
    else:
        stop = f"would have continued past epoch {recorded.last_epoch} (the recording is too short to tell)"
    return [
        f"metric:       {metric}",
        f"recorded:     validated up to epoch {recorded.last_epoch}; best epoch {recorded.best_epoch} "
        f"({score(recorded.best_score)})",
        f"with {settings}:",
        f"  {stop}",
        f"  best epoch {replayed.best_epoch} ({score(replayed.best_score)})",
    ]


GUARD_KEYS = ("train/grad_norm", "train/loss")
"""What the guard replay reads of each row: a step counts as non-finite when any of them recorded is."""


def guard_steps(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = GUARD_KEYS) -> list[tuple[int, bool]]:
    """``(step, finite)`` for every ``trainer/step`` whose rows recorded one of ``keys``, in step order.

    Pure. A row holds the values of the last step before its push, so the journal samples one step per push.

    :param rows: The rows of ``metrics.jsonl``.
    :param keys: The recorded values to judge.
    :returns: The pairs; a step is finite when every value recorded for it is.

    >>> guard_steps([{"trainer/step": 2, "train/grad_norm": 1.0}, {"trainer/step": 4, "train/grad_norm": float("nan")},
    ...              {"trainer/step": 4, "train/loss": 0.5}, {"trainer/step": 5, "val/loss": 1.0}])
    [(2, True), (4, False)]
    """
    finite: dict[int, bool] = {}
    for row in rows:
        step = row.get("trainer/step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key in keys:
            judged = is_finite_value(row.get(key))
            if judged is not None:
                finite[step] = finite.get(step, True) and judged
    return sorted(finite.items())


@attrs.frozen(kw_only=True)
class GuardReplay:
    """Where a guard would have fired on a recording.

    :ivar steps: Steps the recording judged (one per push).
    :ivar non_finite: Those with a non-finite grad norm or loss.
    :ivar fired: ``(step, verdict)`` where the guard would not have simply taken the step, up to its stop.
    :ivar recorded_skips: The last ``guard/skipped_steps`` the run recorded (None: it ran without a guard).
    """

    steps: int
    non_finite: int
    fired: tuple[tuple[int, str], ...]
    recorded_skips: float | None


@attrs.frozen(kw_only=True)
class _ReplayGuardConfig(GuardConfig):
    """``guard.*`` as the replay takes it: every mode the pure core knows, ``"skip"`` by default."""

    nonfinite: str = attrs.field(default="skip", validator=one_of(*GUARD_MODES))


@attrs.frozen(kw_only=True)
class _GuardOnly:
    """The only section ``replay --guard`` takes overrides for."""

    guard: _ReplayGuardConfig = attrs.field(factory=_ReplayGuardConfig)


def replay_guard_run(out_dir: str | Path, overrides: Sequence[str] = ()) -> GuardReplay:
    """Replay a run folder's recorded grad norms and losses through :func:`~trainkit.bookkeeping.step_guard`.

    Side effects: reads ``out_dir/metrics.jsonl``.

    :param out_dir: The run folder.
    :param overrides: ``guard.*=value`` words (``guard.max_skips=3``, ``guard.nonfinite=rollback``, ...); the
        ``guard.`` may be left out.
    :returns: Where the guard would have fired.
    :raises ConfigError: On an unknown key or a bad value.
    :raises ValueError: When no row recorded a grad norm or a loss.
    """
    rows = read_metrics(out_dir)
    steps = guard_steps(rows)
    if not steps:
        keys = " or ".join(map(repr, GUARD_KEYS))
        raise ValueError(f"{Path(out_dir) / 'metrics.jsonl'} holds no {keys} values to judge")
    data: dict[str, Any] = {"guard": {}}
    apply_overrides(_GuardOnly, data, [w if w.startswith("guard.") else f"guard.{w}" for w in overrides])
    cfg = _ReplayGuardConfig(**data["guard"])
    state = GuardState(mode=cfg.nonfinite, max_skips=cfg.max_skips, window=cfg.window)
    recorded = [row["guard/skipped_steps"] for row in rows if is_real(row.get("guard/skipped_steps"))]
    return GuardReplay(
        steps=len(steps),
        non_finite=sum(not finite for _, finite in steps),
        fired=tuple(replay_guard(steps, state)),
        recorded_skips=float(recorded[-1]) if recorded else None,
    )


def format_guard_replay(replayed: GuardReplay, guard_words: Sequence[str]) -> list[str]:
    """The lines ``python -m trainkit replay --guard`` prints.

    Pure.

    :param replayed: What :func:`replay_guard_run` found.
    :param guard_words: The settings as given, for the heading.
    :returns: The lines.

    >>> print("\\n".join(format_guard_replay(GuardReplay(steps=9, non_finite=2, fired=((4, "skip"), (8, "raise")),
    ...                                                 recorded_skips=None), ["max_skips=2"])))
    recorded:     9 steps judged (one per push: train/grad_norm, train/loss), 2 non-finite; no guard ran
    with max_skips=2:
      would have skipped step 4
      would have stopped (raise) before step 8
    """
    recorded = "no guard ran" if replayed.recorded_skips is None else f"guard/skipped_steps {replayed.recorded_skips:g}"
    lines = [
        f"recorded:     {replayed.steps} steps judged (one per push: {', '.join(GUARD_KEYS)}), "
        f"{replayed.non_finite} non-finite; {recorded}",
        f"with {' '.join(guard_words) or 'guard.nonfinite=skip'}:",
    ]
    skipped = [step for step, verdict in replayed.fired if verdict == "skip"]
    if skipped:
        lines.append(f"  would have skipped step{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))}")
    stops = [(step, verdict) for step, verdict in replayed.fired if verdict != "skip"]
    for step, verdict in stops:
        lines.append(f"  would have stopped ({verdict}) before step {step}")
    if not replayed.fired:
        lines.append("  would never have fired")
    return lines
