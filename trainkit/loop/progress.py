"""tqdm progress bars, on rank 0 only. The only trainkit module that imports tqdm, lazily.

Side effects: writes to stderr. When stderr is not a terminal the bars redraw at most every
``NON_TTY_INTERVAL_S`` seconds, so a long run in a log file writes little; a run with ``max_steps`` writes plain
``trainkit: step ...`` lines there instead (:class:`StepBar`, at most one every ``progress.plain_interval_s``).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from trainkit.messages import say

__all__ = ["EpochBar", "StepBar", "step_bar", "NON_TTY_INTERVAL_S"]

T = TypeVar("T")

NON_TTY_INTERVAL_S = 30.0
"""Minimum seconds between redraws (or plain lines) when stderr is not a terminal."""

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


class StepBar:
    """The bar over a run's optimizer steps, for a run with ``max_steps``: its total is the step budget.

    On a terminal it is a tqdm bar (rate, ETA, the latest logged loss as its postfix). Off a terminal (a job's log
    file, where tqdm's redraws pile up on one line) it prints a plain ``trainkit: step 50/150 ...`` line at most
    every ``plain_interval_s`` seconds, and one when it closes.

    :param total: The run's step budget (``max_steps``).
    :param initial: The steps already taken (a resumed run starts there; the rate and ETA count this run's only).
    :param enabled: False makes every method a no-op and never imports tqdm.
    :param plain_interval_s: The fewest seconds between two plain lines off a terminal.
    :param clock: Seconds, monotonic (a test's fake clock).
    """

    def __init__(
        self,
        *,
        total: int,
        initial: int,
        enabled: bool,
        plain_interval_s: float = NON_TTY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bar: Any = None
        self._plain = enabled and not _is_terminal()
        self._total, self._initial, self._n = total, initial, initial
        self._interval, self._clock = plain_interval_s, clock
        self._started = self._printed_at = clock()
        self._printed_n = initial
        self._postfix: dict[str, str] = {}
        if enabled and not self._plain:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc="steps", unit="step", mininterval=TTY_INTERVAL_S,
                dynamic_ncols=True,
            )  # fmt: skip

    @property
    def shown(self) -> bool:
        """Whether the bar reports anything (False: enabled was False, or it was closed)."""
        return self._bar is not None or self._plain

    def advance(self, step: int, metrics: Mapping[str, float]) -> None:
        """Move the bar to ``step`` and show ``metrics``; the step it stands at already changes nothing.

        :param step: The optimizer steps taken so far (fewer than before after a rollback: the bar moves back).
        :param metrics: What to show beside the count, e.g. ``{"loss": 2.31}``.
        """
        if not self.shown or step == self._n:
            return
        self._postfix = _format(metrics)
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(step - self._n)
        self._n = step
        if self._plain and self._clock() - self._printed_at >= self._interval:
            self._print_line()

    def follow(self, iterable: Iterable[T], step: Callable[[], int], latest: Mapping[str, float]) -> Any:
        """Wrap a training loop's batches so that fetching each one moves the bar to the steps taken so far.

        :param iterable: The batches (``len()`` and attributes read through).
        :param step: The optimizer steps taken so far.
        :param latest: The latest pushed metrics, read at each move: its ``train/*loss*`` are shown (``train/loss``
            as ``loss``).
        :returns: An iterable over the same items.
        """
        return _Following(iterable, lambda: self.advance(step(), _losses(latest)))

    def line(self) -> str:
        """The plain line for where the bar stands: ``step 50/150 (33%), 2.1 steps/s, ETA 0:00:47, loss=2.31``.

        :returns: The line, without the ``trainkit:`` prefix.
        """
        done = self._n - self._initial
        elapsed = self._clock() - self._started
        parts = [f"step {self._n}/{self._total} ({100 * self._n / self._total:.0f}%)"]
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            left = max(self._total - self._n, 0) / rate
            parts.append(f"{rate:.3g} steps/s, ETA {datetime.timedelta(seconds=round(left))}")
        parts += [f"{key}={value}" for key, value in self._postfix.items()]
        return ", ".join(parts)

    def _print_line(self) -> None:
        say(self.line())
        self._printed_at, self._printed_n = self._clock(), self._n

    def close(self) -> None:
        """Close the bar; off a terminal, print where it ended unless the last line said so (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._plain and self._n != self._printed_n:
            self._print_line()
        self._plain = False


def _losses(latest: Mapping[str, float]) -> dict[str, float]:
    losses = (key for key in latest if key.startswith("train/") and "loss" in key)
    return {key.removeprefix("train/"): latest[key] for key in losses}


class _Following:
    """A loop's batches that call ``moved`` before each one is fetched and once at the end (the steps the
    previous batch took are counted then); anything else is the wrapped iterable's (``len``, ``dataset``, ...)."""

    def __init__(self, batches: Iterable[Any], moved: Callable[[], None]) -> None:
        self.batches = batches
        self._moved = moved

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self._moved()
            yield batch
        self._moved()

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batches, name)


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
