"""Throughput between two pushes: samples, optimizer steps and tokens per second, as a pure function.

The shell (:mod:`trainkit.loop.throughput`) reads the clock and counts; this module only divides, so the rates a
row carries are property-tested here without a clock.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["ThroughputMark", "throughput_rates", "PERF_KEYS"]

PERF_KEYS = ("perf/samples_per_s", "perf/steps_per_s", "perf/tokens_per_s")
"""The keys a row's throughput goes under, in the order a row carries them."""


@attrs.frozen(kw_only=True)
class ThroughputMark:
    """The counters at one moment: the clock and what was trained until then (on this rank).

    :ivar seconds: A monotonic clock's reading, in seconds.
    :ivar steps: The optimizer step counter.
    :ivar samples: Samples fetched by the counted training loop; None when a batch's size is not known.
    :ivar tokens: Tokens counted with ``count_tokens``; None when none were ever counted.
    """

    seconds: float
    steps: int
    samples: int | None = None
    tokens: float | None = None


def throughput_rates(before: ThroughputMark, now: ThroughputMark, world_size: int = 1) -> dict[str, float]:
    """The rates from ``before`` to ``now``, for the row pushed at ``now``.

    Steps are counted once (every rank takes the same optimizer steps); samples and tokens are this rank's,
    times ``world_size`` (each rank trains its own share: a ``DistributedSampler`` gives every rank the same
    number of samples). Nothing is reported for an interval with no optimizer step, or no time, in it (a
    validation-only push), nor for a counter either mark does not know.

    :param before: The counters at the previous row that carried rates (or at the start).
    :param now: The counters now.
    :param world_size: The number of ranks.
    :returns: ``perf/steps_per_s``, and ``perf/samples_per_s`` / ``perf/tokens_per_s`` where counted; empty
        when no step was taken.
    :raises ValueError: When ``world_size`` is below 1 or a counter went backwards.

    >>> throughput_rates(ThroughputMark(seconds=10.0, steps=0, samples=0),
    ...                  ThroughputMark(seconds=12.0, steps=50, samples=3200), world_size=2)
    {'perf/samples_per_s': 3200.0, 'perf/steps_per_s': 25.0}
    >>> throughput_rates(ThroughputMark(seconds=1.0, steps=5), ThroughputMark(seconds=2.0, steps=5))
    {}
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    steps = now.steps - before.steps
    elapsed = now.seconds - before.seconds
    if steps < 0 or (now.samples is not None and before.samples is not None and now.samples < before.samples):
        raise ValueError(f"the throughput counters went backwards: {before} then {now}")
    if steps == 0 or not elapsed > 0 or not math.isfinite(elapsed):
        return {}
    rates: dict[str, float] = {}
    if now.samples is not None and before.samples is not None:
        rates["perf/samples_per_s"] = (now.samples - before.samples) * world_size / elapsed
    rates["perf/steps_per_s"] = steps / elapsed
    if now.tokens is not None:
        rates["perf/tokens_per_s"] = (now.tokens - (before.tokens or 0.0)) * world_size / elapsed
    return rates
