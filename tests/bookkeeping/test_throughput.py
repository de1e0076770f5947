"""throughput_rates: what a pushed row's perf/* values are, from two marks of the counters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.bookkeeping import PERF_KEYS, ThroughputMark, throughput_rates

counts = st.integers(min_value=0, max_value=10**9)
seconds = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False)


@given(start=seconds, elapsed=seconds, steps=st.integers(1, 10**6), samples=counts, before_samples=counts,
       tokens=st.none() | st.floats(0, 1e12), world_size=st.integers(1, 64))
def test_rates_times_the_interval_give_back_the_counts(start, elapsed, steps, samples, before_samples, tokens,
                                                       world_size):
    """Each rate is the interval's count (samples and tokens of every rank) over its seconds."""
    before = ThroughputMark(seconds=start, steps=10, samples=before_samples, tokens=0.0 if tokens is not None else None)
    now = ThroughputMark(seconds=start + elapsed, steps=10 + steps, samples=before_samples + samples, tokens=tokens)
    rates = throughput_rates(before, now, world_size)
    took = now.seconds - before.seconds
    assert set(rates) <= set(PERF_KEYS)
    assert math.isclose(rates["perf/steps_per_s"] * took, steps, rel_tol=1e-9)
    assert math.isclose(rates["perf/samples_per_s"] * took, samples * world_size, rel_tol=1e-9, abs_tol=1e-9)
    assert ("perf/tokens_per_s" in rates) == (tokens is not None)
    if tokens is not None:
        assert math.isclose(rates["perf/tokens_per_s"] * took, tokens * world_size, rel_tol=1e-9, abs_tol=1e-6)


@given(start=seconds, elapsed=st.floats(-1e3, 1e3, allow_nan=False), steps=st.integers(0, 100))
def test_no_rate_without_a_step_or_without_time(start, elapsed, steps):
    """A push with no optimizer step since the last rates (a validation row), or no time passed, carries none."""
    before = ThroughputMark(seconds=start, steps=5, samples=0)
    now = ThroughputMark(seconds=start + elapsed, steps=5 + steps, samples=0)
    rates = throughput_rates(before, now)
    assert (rates == {}) == (steps == 0 or not (start + elapsed) - start > 0)


def test_samples_unknown_on_either_side_are_left_out():
    """A loop whose batch size is unknown (None) reports steps only."""
    rates = throughput_rates(ThroughputMark(seconds=0.0, steps=0, samples=0), ThroughputMark(seconds=2.0, steps=4))
    assert rates == {"perf/steps_per_s": 2.0}


@pytest.mark.parametrize(
    "before, now, world_size, match",
    [
        (ThroughputMark(seconds=0.0, steps=5), ThroughputMark(seconds=1.0, steps=4), 1, "backwards"),
        (ThroughputMark(seconds=0.0, steps=0, samples=9), ThroughputMark(seconds=1.0, steps=1, samples=3), 1,
         "backwards"),
        (ThroughputMark(seconds=0.0, steps=0), ThroughputMark(seconds=1.0, steps=1), 0, "world_size"),
    ],
)
def test_impossible_counters_are_refused(before, now, world_size, match):
    """Counters that went backwards, or no rank at all, are a bug upstream: refused with what was seen."""
    with pytest.raises(ValueError, match=match):
        throughput_rates(before, now, world_size)
