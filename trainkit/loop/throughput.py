"""``log_throughput``: samples, steps and tokens per second of training time in every pushed row that follows
training, the seconds spent outside it (validation, checkpoint saves, test) and waiting for data, and ``perf/mfu``.

Side effects: reads ``time.perf_counter`` (twice a batch, around the loader's ``next()``). The counting costs a
``len``-free look at each batch's leading dimension (host metadata, no device sync); tokens counted as tensors are
summed on their device and reach the host in the push's one transfer. With ``throughput.mfu`` one batch's loop
body runs under a FLOP-counting dispatch mode, once (:mod:`trainkit.loop.flops`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from trainkit.bookkeeping import is_finite_real
from trainkit.bookkeeping.throughput_rates import ThroughputMark, mfu, throughput_rates
from trainkit.config.schema import ThroughputConfig
from trainkit.loop.flops import ModelFlops
from trainkit.messages import warn_user

__all__ = ["CountedBatches", "Throughput", "check_token_count", "samples_in"]

_TOKENS = "perf/_tokens"  # the device-side token count's key inside the buffer for one push (never pushed)
_LEAST = "perf/_tokens_least"  # the least tensor count since the last push, read with it (never pushed)
_REDUCED = (torch.float16, torch.bfloat16)  # summed in float32: 70000 ones in float16 would sum to inf


def samples_in(batch: Any, depth: int = 0) -> int | None:
    """The number of samples in a batch: the leading dimension of its first tensor (in a tuple, list or mapping).

    :param batch: What the loader yielded.
    :param depth: How deep in nested containers this looks already (it looks 3 levels deep at most).
    :returns: The sample count, or None when the batch holds no tensor with a leading dimension.

    >>> samples_in((torch.zeros(32, 8), torch.zeros(32)))
    32
    >>> samples_in({"ids": torch.zeros(4, 128, dtype=torch.long)}), samples_in([1, 2]), samples_in(torch.zeros(()))
    (4, None, None)
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if depth >= 3:
        return None
    if isinstance(batch, Mapping):  # a dict, or a mapping such as a tokenizer's batch
        batch = list(batch.values())
    if isinstance(batch, list | tuple) and batch:
        return samples_in(batch[0], depth + 1)
    return None


_END = object()


class CountedBatches:
    """The batches of ``progress()``, each one's samples counted and the wait for it timed as it is fetched;
    anything else is the wrapped iterable's (``len``, ``consumed``, ...).

    A loop iterated outside training (inside :meth:`Throughput.outside_training`: the trainer's validation and
    test) is neither counted nor timed: its samples are not trained on.

    :param batches: What ``progress()`` would have returned.
    :param throughput: Where the samples are counted.
    """

    def __init__(self, batches: Iterable[Any], throughput: Throughput) -> None:
        self.batches = batches
        self._throughput = throughput

    def __iter__(self) -> Iterator[Any]:
        throughput = self._throughput
        if not throughput.training:
            yield from self.batches
            return
        throughput.started()
        clock, flops, iterator = throughput.clock, throughput.flops, iter(self.batches)
        while True:
            start, outside = clock(), throughput.outside_s
            batch = next(iterator, _END)
            # a step checkpoint or a validation run inside next() (at a step boundary) is not waiting for data
            throughput.waited(clock() - start - (throughput.outside_s - outside))
            if batch is _END:
                return
            samples = throughput.count_batch(batch)
            if flops is not None and flops.pending:
                with flops.counting(samples):
                    yield batch
            else:
                yield batch

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batches, name)


def check_token_count(n: Any) -> None:
    """Refuse what is no count of tokens, without reading a tensor's values (no host sync).

    :meth:`Throughput.count_tokens` runs it, and :meth:`~trainkit.BaseTrainer.count_tokens` runs it alone when
    ``log_throughput`` is off: a bad count is a bug whether or not the rate is logged.

    >>> check_token_count(12); check_token_count(torch.ones(3, dtype=torch.bool))
    >>> check_token_count(-1)
    Traceback (most recent call last):
    ...
    ValueError: count_tokens(n) takes a finite count >= 0, got -1

    :param n: What ``count_tokens`` was given.
    :raises TypeError: When ``n`` is neither a real number nor a real-valued (or bool) tensor.
    :raises ValueError: When the number ``n`` is NaN, infinite, too large for a float, or negative.
    """
    if isinstance(n, torch.Tensor):
        if n.is_complex():
            raise TypeError(f"count_tokens takes a real-valued tensor (a count), got dtype {n.dtype}")
    elif isinstance(n, int | float) and not isinstance(n, bool):
        if not is_finite_real(n) or n < 0:
            shown = repr(n) if len(repr(n)) <= 40 else f"an int of {len(repr(n))} digits"
            raise ValueError(f"count_tokens(n) takes a finite count >= 0, got {shown}")
    else:
        raise TypeError(f"count_tokens takes a number or a tensor, got {n!r}")


class Throughput:
    """Counts what the training loop does between pushes and turns it into ``perf/*`` figures.

    The rates are over training time: the clock's seconds less those spent inside :meth:`outside_training`
    (validation, checkpoint saves, the test), each of which a row reports as ``perf/<kind>_s``. Waiting for the
    loader is training time (a starved loop trains slowly), reported as ``perf/data_wait_s`` too.

    :param step: Reads the trainer's optimizer step counter.
    :param world_size: The number of ranks (samples and tokens are this rank's, scaled by it).
    :param clock: A monotonic clock in seconds; None: ``time.perf_counter``.
    :param flops: The model FLOPs and peak for ``perf/mfu``; None: no ``perf/mfu``.
    """

    def __init__(
        self,
        step: Callable[[], int],
        world_size: int,
        clock: Callable[[], float] | None = None,
        flops: ModelFlops | None = None,
    ) -> None:
        self._step = step
        self._world_size = world_size
        self.clock = clock or time.perf_counter  # looked up here, not at import: a test may plant a clock
        self.flops = flops
        self._samples: int | None = 0
        self._tokens: float | None = None
        self._tokens_on_device: torch.Tensor | None = None
        self._least_on_device: torch.Tensor | None = None  # the least tensor count since the last push
        self._tokens_poisoned = False  # the next row with rates leaves perf/tokens_per_s out
        self._counted_any_batch = False
        self._rated_any_row = False
        self.outside_s = 0.0  # seconds spent outside training so far, every kind together
        self._frozen: list[float] = []  # the training clock at each open outside_training(), outermost first
        self._outside: dict[str, float] = {}  # seconds per kind since the last row that carried them
        self._waited = 0.0  # seconds waiting for the loader since the last row with rates
        self._mark = self._now()

    @classmethod
    def build(
        cls, enabled: bool, cfg: ThroughputConfig, step: Callable[[], int], world_size: int, device: torch.device
    ) -> Throughput | None:
        """The counters ``log_throughput`` (or ``throughput.mfu``, which needs the rates) turns on, else None.

        :param enabled: ``log_throughput``.
        :param cfg: The ``throughput`` config section.
        :param step: Reads the trainer's optimizer step counter.
        :param world_size: The number of ranks.
        :param device: The trainer's device (its name picks the peak FLOP/s).
        :returns: The counters, or None when neither is on.
        """
        if not (enabled or cfg.mfu):
            return None
        return cls(step, world_size, flops=ModelFlops(cfg, device) if cfg.mfu else None)

    def _training_seconds(self) -> float:
        return self._frozen[0] if self._frozen else self.clock() - self.outside_s

    def _now(self) -> ThroughputMark:
        return ThroughputMark(
            seconds=self._training_seconds(), steps=self._step(), samples=self._samples, tokens=self._tokens
        )

    @property
    def training(self) -> bool:
        """Whether the training clock runs (no :meth:`outside_training` is open)."""
        return not self._frozen

    @contextlib.contextmanager
    def outside_training(self, kind: str) -> Iterator[None]:
        """Stop the training clock inside: the time goes to ``perf/<kind>_s`` in the next pushed row, and the
        loops of ``progress()`` iterated inside are not counted. Nested ones count their own time only.

        :param kind: What is done: ``"val"``, ``"ckpt"``, ``"test"``.
        """
        start, before = self.clock(), self.outside_s
        self._frozen.append(start - before)
        try:
            yield
        finally:
            self._frozen.pop()
            own = self.clock() - start - (self.outside_s - before)
            self.outside_s += own
            self._outside[kind] = self._outside.get(kind, 0.0) + own

    def waited(self, seconds: float) -> None:
        """Add ``seconds`` spent waiting for the loader's next batch."""
        self._waited += seconds

    def started(self) -> None:
        """A counted loop starts: before the first row with rates, the interval starts here (not at setup)."""
        if not self._rated_any_row and not self._counted_any_batch:
            self._mark = self._now()

    def count_batch(self, batch: Any) -> int | None:
        """Count one fetched batch's samples (unknown from the first batch whose size is not found).

        :returns: The batch's samples, None when not found.
        """
        self._counted_any_batch = True
        n = samples_in(batch)
        if self._samples is not None:
            self._samples = None if n is None else self._samples + n
        return n

    def count_tokens(self, n: Any) -> None:
        """Add ``n`` tokens: a number, or a tensor summed on its device (read at the next push).

        A number is checked here: it must be finite and >= 0. A tensor's values are on its device, where reading
        them would wait for it: its dtype is checked here, its values at the next push, where a NaN, infinite or
        negative count since the previous push leaves ``perf/tokens_per_s`` out of the next row with rates (with
        a warning), and the count goes on from there: later rows are not poisoned.

        :param n: A count of tokens: an int or a float, or a tensor of a real or bool dtype (summed).
        :raises TypeError: When ``n`` is neither a real number nor a real-valued (or bool) tensor.
        :raises ValueError: When the number ``n`` is NaN, infinite, too large for a float, or negative.
        """
        check_token_count(n)
        if isinstance(n, torch.Tensor):
            total = n.detach().sum(dtype=torch.float32 if n.dtype in _REDUCED else None)
            if self._tokens_on_device is None or self._least_on_device is None:
                self._tokens_on_device, self._least_on_device = total, total
            else:
                self._tokens_on_device = self._tokens_on_device + total
                # the least count, on the device (one op, no sync): a negative one hides in a positive sum
                self._least_on_device = torch.minimum(self._least_on_device, total)
        else:
            self._tokens = (self._tokens or 0.0) + float(n)

    def drain(self, buffer: Any) -> dict[str, float]:
        """Drain ``buffer`` (the device-side token count in its one transfer) and add the rates since the last
        row that carried them, and the seconds outside training since the last row that carried those.

        :param buffer: The trainer's log buffer (a :class:`~trainkit.loop.trainer_metrics.LogBuffer`).
        :returns: The drained metrics, with the rates, ``perf/mfu``, ``perf/train_s`` and ``perf/data_wait_s`` when
            steps were taken since, and ``perf/<kind>_s`` for each kind of time outside training since; empty when
            nothing was logged.
        """
        if self._tokens_on_device is not None:
            buffer.add({_TOKENS: self._tokens_on_device, _LEAST: self._least_on_device})
            self._tokens_on_device = self._least_on_device = None
        metrics = buffer.drain()
        on_device = metrics.pop(_TOKENS, None)
        negative = metrics.pop(_LEAST, 0.0) < 0
        if on_device is not None:
            if negative or not math.isfinite(on_device):
                self._tokens_poisoned = True
                what = "negative" if negative and math.isfinite(on_device) else f"{on_device}"
                warn_user(
                    f"count_tokens got a tensor whose count is {what} since the last push (a float16 sum that "
                    "overflowed, a mask of the wrong sign?); perf/tokens_per_s is left out of the next row, and "
                    "counting goes on after it"
                )
            else:
                self._tokens = (self._tokens or 0.0) + on_device
        if not metrics:
            return metrics
        now = self._now()
        rates = throughput_rates(self._mark, now, self._world_size)
        if rates:
            if self._tokens_poisoned:  # that interval's tokens are unknown: no rate rather than a wrong one
                rates.pop("perf/tokens_per_s", None)
                self._tokens_poisoned = False
            metrics.update(rates)
            metrics.update(self._mfu(rates))
            metrics["perf/train_s"], metrics["perf/data_wait_s"] = now.seconds - self._mark.seconds, self._waited
            self._mark, self._rated_any_row, self._waited = now, True, 0.0
        metrics.update({f"perf/{kind}_s": seconds for kind, seconds in self._outside.items()})
        self._outside.clear()
        return metrics

    def _mfu(self, rates: dict[str, float]) -> dict[str, float]:
        flops, samples_per_s = self.flops, rates.get("perf/samples_per_s")
        if flops is None or flops.flops_per_sample is None or samples_per_s is None:
            return {}
        peak = flops.peak()
        return {} if peak is None else {"perf/mfu": mfu(flops.flops_per_sample, samples_per_s, peak, self._world_size)}
