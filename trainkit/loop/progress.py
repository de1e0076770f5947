"""tqdm progress bars, on rank 0 only. The only trainkit module that imports tqdm, lazily.

Side effects: writes to stderr. When stderr is not a terminal the bars redraw at most every
``NON_TTY_INTERVAL_S`` seconds, so a long run in a log file writes little.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["EpochBar", "step_bar", "NON_TTY_INTERVAL_S"]

T = TypeVar("T")

NON_TTY_INTERVAL_S = 30.0
"""Minimum seconds between redraws when stderr is not a terminal."""

TTY_INTERVAL_S = 0.5
"""Minimum seconds between redraws on a terminal."""


def _is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _interval() -> float:
    return TTY_INTERVAL_S if _is_terminal() else NON_TTY_INTERVAL_S


def _format(metrics: Mapping[str, float]) -> dict[str, str]:
    return {key: f"{value:.4g}" for key, value in metrics.items()}


class EpochBar:
    """The bar over epochs; shows the best validation metrics as its postfix.

    :param total: The configured number of epochs (None: a run measured in steps).
    :param initial: Epochs already done (a resumed run starts there).
    :param enabled: False makes every method a no-op and never imports tqdm.
    """

    def __init__(self, *, total: int | None, initial: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc="epochs", unit="epoch", mininterval=_interval(), dynamic_ncols=True
            )

    @property
    def shown(self) -> bool:
        """Whether the bar is drawn (False: enabled was False, or it was closed)."""
        return self._bar is not None

    def update(self, best_metrics: Mapping[str, float]) -> None:
        """Count one finished epoch and show the best metrics.

        :param best_metrics: What :meth:`trainkit.BaseTrainer.get_best_pbar_metrics` returns.
        """
        if self._bar is not None:
            self._bar.set_postfix(_format(best_metrics), refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def step_bar(
    iterable: Iterable[T], *, desc: str | None, total: int | None, enabled: bool, initial: int = 0
) -> Iterable[T]:
    """Wrap an iterable in a transient per-step bar, or return it untouched when disabled.

    When stderr is not a terminal there is no step bar (the epoch bar alone reports progress), so a run
    redirected to a log file writes a few lines per epoch bar refresh, not two per epoch.

    :param iterable: The batches, usually a DataLoader.
    :param desc: The bar's label.
    :param total: The number of items when ``len(iterable)`` does not give it.
    :param enabled: False returns ``iterable`` itself, at zero cost per step.
    :param initial: Items already done (a resumed epoch's skipped batches).
    :returns: An iterable over the same items.
    """
    if not enabled or not _is_terminal():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(
        iterable, desc=desc, total=total, initial=initial, leave=False, mininterval=_interval(), dynamic_ncols=True
    )
