"""The stop signals of a training run: SIGTERM, SIGINT and a requeue signal, recorded for the loop to read.

Side effects: installs signal handlers (main thread only) for the duration of a ``with`` block and puts the
previous ones back after it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from trainkit.errors import TrainingInterrupted

__all__ = ["StopSignals"]


class StopSignals:
    """Record the stop signal a run receives, for the loop to act on at its next boundary.

    A handler only records the signal (no I/O and no collectives run inside a handler); a second SIGINT
    while one is recorded raises ``KeyboardInterrupt`` at once, so a second Ctrl-C always aborts. Off the
    main thread, where Python cannot install handlers, nothing is installed and nothing is recorded. A signal
    the process inherited as ignored (``SIG_IGN``: SIGINT of a job a shell started in the background, or under
    ``nohup``) stays ignored, as Python itself leaves it: whoever started the run chose that it goes on.

    >>> with StopSignals(["SIGTERM"]) as signals:
    ...     signals.received is None
    True

    :param names: Signal names, e.g. ``["SIGTERM", "SIGINT", "SIGUSR1"]``; repeats are installed once.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._numbers = [getattr(signal, name) for name in dict.fromkeys(names)]
        self._previous: dict[int, Any] = {}
        self.received: int | None = None
        """The number of the latest signal received, or None."""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            try:
                for number in self._numbers:
                    if signal.getsignal(number) is signal.SIG_IGN:
                        continue  # ignored by whoever started this process: theirs to decide, not ours to take
                    self._previous[number] = signal.signal(number, self._record)
            except BaseException:
                self.__exit__(None, None, None)  # the ones already installed go back
                raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    @property
    def name(self) -> str | None:
        """The received signal's name (``"SIGTERM"``), or None."""
        return signal.Signals(self.received).name if self.received is not None else None

    def interrupted(
        self,
        epoch: int,
        save_seconds: float | None,
        *,
        step: int | None = None,
        batches: tuple[int, int | None] | None = None,
    ) -> TrainingInterrupted:
        """The error that stops the run for the received signal (SIGTERM when none was recorded).

        :param epoch: The epoch that finished, or that was stopped inside.
        :param save_seconds: How long the last save took (None: checkpoints are off).
        :param step: The optimizer step it stopped after, inside an epoch.
        :param batches: ``(consumed, per epoch)`` batches, inside an epoch (per epoch None: no length).
        :returns: The :class:`~trainkit.TrainingInterrupted` to raise.
        """
        number = self.received if self.received is not None else signal.SIGTERM
        name = self.name or "SIGTERM"
        return TrainingInterrupted(name, int(number), epoch, save_seconds, step=step, batches=batches)

    def _record(self, number: int, frame: Any) -> None:
        if self.received is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts now
        self.received = number
