"""Throughput between two pushes: samples, optimizer steps and tokens per second, and the model FLOPs
utilization, as pure functions.

The shell (:mod:`trainkit.loop.throughput`) reads the clock and counts; this module only divides and looks up, so
the figures a row carries are property-tested here without a clock or a device.
"""

from __future__ import annotations

import math
import re

import attrs

__all__ = ["ThroughputMark", "throughput_rates", "PERF_KEYS", "PEAK_FLOPS", "peak_flops", "mfu"]

PERF_KEYS = ("perf/samples_per_s", "perf/steps_per_s", "perf/tokens_per_s")
"""The keys a row's throughput rates go under, in the order a row carries them."""

_T = 1e12
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # NVIDIA datasheets' dense figures (the tensor-core figures they mark "with sparsity" halved)
    (r"H100.*(PCIe|PCIE)", {"fp32": 51.2 * _T, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T, "fp8": 1513 * _T}),
    (
        r"H[12]00.*NVL",
        {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp8": 1670.5 * _T},
    ),
    (
        r"H100|H200|GH200",
        {"fp32": 66.9 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T},
    ),
    (r"A100", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T}),
    (r"L40S", {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T, "fp8": 733 * _T}),
    (r"\bL4\b", {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T}),
    (r"\bA10\b", {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}),
    (r"V100.*(PCIe|PCIE)", {"fp32": 14 * _T, "fp16": 112 * _T}),
    (r"V100", {"fp32": 15.7 * _T, "fp16": 125 * _T}),
    (r"\bT4\b", {"fp32": 8.1 * _T, "fp16": 65 * _T}),
)
"""Dense peak FLOP/s of one device, by a pattern searched for in ``torch.cuda.get_device_name()`` (the first
that matches wins) and by the dtype the matrix multiplies run in. From NVIDIA's datasheets (H100 and H200 SXM,
PCIe and NVL; A100 40/80 GB, SXM and PCIe alike; L40S; L4; A10; V100 SXM2 and PCIe; T4), the figures marked
"with sparsity" halved: no training step is 2:4 sparse. A device missing here (an A10G, a consumer card, an AMD
or Intel one) has no peak: set ``throughput.peak_flops``."""

_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of one device from :data:`PEAK_FLOPS`.

    Pure.

    :param device_name: What ``torch.cuda.get_device_name()`` says, e.g. ``"NVIDIA H100 80GB HBM3"``.
    :param dtype: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.
    :returns: The peak, or None when the device or its dtype is not in the table.
    :raises ValueError: When ``dtype`` is none of those.

    >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16"), peak_flops("NVIDIA H100 PCIe", "bf16")
    (989400000000000.0, 756000000000000.0)
    >>> peak_flops("NVIDIA L40S", "fp16") == 362.05e12, peak_flops("Tesla V100-SXM2-16GB", "bf16")
    (True, None)
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, _DTYPES))}, got {dtype!r}")
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return peaks.get(dtype)
    return None


def mfu(flops_per_sample: float, samples_per_s: float, peak: float, world_size: int = 1) -> float:
    """The model FLOPs utilization: the model FLOP/s achieved by all ranks over the peak of all their devices.

    Pure. ``samples_per_s`` is every rank's (as ``perf/samples_per_s``), so gradient accumulation, DDP and FSDP
    need nothing of their own here: each sample's FLOPs are counted once, whichever rank and micro-batch took it.

    :param flops_per_sample: The model's forward and backward FLOPs for one sample.
    :param samples_per_s: Samples trained per second of training time, all ranks together.
    :param peak: One device's peak FLOP/s.
    :param world_size: The number of ranks (one device each).
    :returns: The fraction of the peak reached, in [0, 1] when the figures are right.
    :raises ValueError: When ``peak`` is not > 0 or ``world_size`` is below 1.

    >>> mfu(6e9, 1000.0, 312e12, world_size=4)  # 6 TFLOP/s of model FLOPs over 4 A100s' bf16 peak
    0.004807692307692308
    """
    if not peak > 0 or world_size < 1:
        raise ValueError(f"mfu needs a peak > 0 and world_size >= 1, got peak={peak!r}, world_size={world_size!r}")
    return flops_per_sample * samples_per_s / (peak * world_size)


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
