"""throughput_rates: what a pushed row's perf/* values are, from two marks of the counters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.bookkeeping import PEAK_FLOPS, PERF_KEYS, ThroughputMark, mfu, peak_flops, throughput_rates

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


@given(
    flops=st.floats(1.0, 1e15),
    rate=st.floats(0.0, 1e7),
    peak=st.floats(1e9, 1e16),
    world_size=st.integers(1, 1024),
)
def test_mfu_times_every_peak_over_the_rate_gives_back_the_flops_per_sample(flops, rate, peak, world_size):
    """perf/mfu is the model FLOP/s of all ranks over the peak of all their devices, nothing more."""
    value = mfu(flops, rate, peak, world_size)
    assert math.isclose(value * peak * world_size, flops * rate, rel_tol=1e-9, abs_tol=1e-9)


def test_the_peak_table_names_devices_by_their_cuda_names_and_has_dense_figures_only():
    """Real torch.cuda.get_device_name() strings find their row (an H100 PCIe is not an SXM, an L40S not an L4);
    each row's bf16 is twice its tf32 (dense, as the datasheets' halves); an unknown device or dtype has none."""
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "fp8") == 1978.9e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == peak_flops("NVIDIA A100 80GB PCIe", "tf32") == 156e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362.05e12 and peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA A10", "bf16") == 125e12 and peak_flops("NVIDIA A10G", "bf16") is None
    assert peak_flops("Tesla V100-PCIE-16GB", "fp16") == 112e12 and peak_flops("Tesla T4", "bf16") is None
    for _, peaks in PEAK_FLOPS:
        if "tf32" in peaks:
            assert peaks["bf16"] == pytest.approx(2 * peaks["tf32"], rel=2e-2)  # the L40S sheet: 183, 362.05
    with pytest.raises(ValueError, match="dtype must be one of"):
        peak_flops("NVIDIA H100", "int8")
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)
