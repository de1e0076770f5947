"""Replay a run's validation scores through the pure core under other early-stopping settings.

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

from trainkit.bookkeeping import BestState, PatienceState, is_real, save_if_best, step_patience
from trainkit.config import ValConfig, apply_overrides
from trainkit.metrics_file import read_metrics

__all__ = ["Replay", "replay_scores", "validation_scores", "replay_run", "format_replay"]


@attrs.frozen(kw_only=True)
class Replay:
    """What a run would have done under some early-stopping settings.

    :ivar stop_epoch: The epoch it would have stopped after, or None when the recorded scores run out first.
    :ivar best_epoch: The epoch of the best score up to the stop (None when no score was finite).
    :ivar best_score: That score.
    :ivar last_epoch: The last validated epoch the recording holds.
    """

    stop_epoch: int | None
    best_epoch: int | None
    best_score: float | None
    last_epoch: int | None


def replay_scores(scores: Iterable[tuple[int, float]], val: ValConfig) -> Replay:
    """Run ``(epoch, score)`` pairs, in order, through best tracking and patience with ``val``'s settings.

    Pure: the same transitions the trainer makes after each validation.

    :param scores: Validated epochs and their scores, in order.
    :param val: The settings: ``minimize``, ``patience``, ``start_patience``, ``min_delta``.
    :returns: Where the run would have stopped and its best epoch by then.

    >>> val = ValConfig(minimize=True, patience=2)
    >>> replay_scores([(0, 3.0), (1, 2.0), (2, 2.5), (3, 2.4), (4, 1.0)], val)
    Replay(stop_epoch=3, best_epoch=1, best_score=2.0, last_epoch=4)
    >>> replay_scores([(0, 3.0), (1, 2.0)], ValConfig(minimize=True, patience=5)).stop_epoch is None
    True
    """
    best = BestState(minimize=val.minimize, min_delta=val.min_delta)
    patience = PatienceState(patience=val.patience, start_patience=val.start_patience)
    stop_epoch = None
    last_epoch = None
    for epoch, score in scores:
        last_epoch = epoch
        if stop_epoch is not None:
            continue
        best, improved = save_if_best(best, score, epoch=epoch)
        patience, stop = step_patience(patience, improved, epoch=epoch)
        if stop:
            stop_epoch = epoch
    return Replay(stop_epoch=stop_epoch, best_epoch=best.epoch, best_score=best.score, last_epoch=last_epoch)


def validation_scores(rows: Sequence[Mapping[str, Any]], metric: str) -> list[tuple[int, float]]:
    """The ``(epoch, score)`` of every row that logged ``metric``, the last value per epoch, in epoch order.

    Pure.

    :param rows: The rows of ``metrics.jsonl``.
    :param metric: The score's key, e.g. ``"val/loss"``.
    :returns: The pairs.

    >>> validation_scores([{"trainer/epoch": 0, "val/loss": 2.0}, {"trainer/epoch": 0, "train/loss": 1.0},
    ...                    {"trainer/epoch": 1, "val/loss": 1.5}], "val/loss")
    [(0, 2.0), (1, 1.5)]
    """
    by_epoch: dict[int, float] = {}
    for row in rows:
        value = row.get(metric)
        epoch = row.get("trainer/epoch")
        if is_real(value) and isinstance(epoch, int):
            by_epoch[epoch] = float(value)
    return sorted(by_epoch.items())


def replay_run(out_dir: str | Path, overrides: Sequence[str] = (), metric: str = "val/loss") -> tuple[Replay, Replay]:
    """Replay a run folder's ``metrics.jsonl``: what happened, and what the settings in ``overrides`` would do.

    Side effects: reads ``out_dir/metrics.jsonl`` (through :func:`trainkit.metrics_file.read_metrics`).

    :param out_dir: The run folder.
    :param overrides: ``val.*=value`` words (``val.patience=5``, ``val.minimize=true``, ...); ``val.minimize``
        defaults to True for a metric whose name says loss or error, else False.
    :param metric: The score the run selected on.
    :returns: The replay with no early stopping (what the recording holds: its best), and the one with the
        settings.
    :raises ConfigError: On an unknown key or a bad value.
    :raises ValueError: When no row logged ``metric``.
    """
    scores = validation_scores(read_metrics(out_dir), metric)
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
