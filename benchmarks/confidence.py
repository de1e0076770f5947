"""Gates decided by confidence: bootstrap intervals, the verdict rule, and the per-step/epoch/run cost fit.

Pure functions (numpy only, no side effects), shared by ``overhead.py``'s modules and their tests. A gate is judged
on the 95 % interval of its statistic, never on the point estimate alone: PASS when the whole interval is
under the limit, FAIL when the whole interval is over it, UNDECIDED when it straddles the limit or rests on
fewer than :data:`MIN_PAIRS` pairs (more pairs would decide it; :func:`pairs_to_decide` says about how many,
:func:`why_undecided` which of the two it is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "LEVEL",
    "MIN_PAIRS",
    "bootstrap_median",
    "judge",
    "pairs_to_decide",
    "why_undecided",
    "design_matrix",
    "fit_costs",
    "bootstrap_costs",
    "bootstrap_cost_fractions",
]

LEVEL = 0.95
"""The confidence level of every interval."""

MIN_PAIRS = 8
"""Fewer pairs than this decide nothing: a bootstrap of a handful of values says little about its median's spread."""

DEFAULT_RESAMPLES = 4000
"""Bootstrap resamples: enough that the interval's ends move by well under their own width from seed to seed."""


def _percentiles(draws: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The two percentile ends of a bootstrap distribution, along its last axis."""
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.percentile(draws, [tail, 100.0 - tail], axis=-1)
    return lo, hi


def bootstrap_median(
    values: Sequence[float], resamples: int = DEFAULT_RESAMPLES, seed: int = 0, level: float = LEVEL
) -> tuple[float, float, float]:
    """The median of ``values`` and its percentile-bootstrap interval.

    The values are the paired samples of one gate (a ratio or a difference per pair of runs that ran back to
    back), so resampling them resamples pairs.

    :param values: One value per pair; at least one.
    :param resamples: Bootstrap resamples.
    :param seed: Seed of the resampling, so a report can be reproduced from its samples.
    :param level: Confidence level.
    :returns: ``(median, lower end, upper end)``.
    :raises ValueError: When ``values`` is empty.

    >>> bootstrap_median([1.0, 1.0, 1.0])
    (1.0, 1.0, 1.0)
    >>> med, lo, hi = bootstrap_median([0.99, 1.00, 1.01, 1.02, 1.03] * 8)
    >>> med, lo <= med <= hi, hi - lo < 0.03
    (1.01, True, True)
    """
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap_median needs at least one value")
    rng = np.random.default_rng(seed)
    draws = np.median(data[rng.integers(0, data.size, size=(resamples, data.size))], axis=1)
    lo, hi = _percentiles(draws, level)
    return float(np.median(data)), float(lo), float(hi)


def judge(lo: float, hi: float, limit: float, pairs: int | None = None) -> str:
    """The verdict on a gate ``statistic <= limit`` from the statistic's interval ``[lo, hi]``.

    :param lo: The interval's lower end.
    :param hi: The interval's upper end.
    :param limit: The gate's limit (the statistic must be at most this).
    :param pairs: The pairs the interval came from; fewer than :data:`MIN_PAIRS` decide nothing.
    :returns: ``"PASS"`` when the upper end is under the limit, ``"FAIL"`` when the lower end is over it,
        ``"UNDECIDED"`` when the interval straddles it (or rests on too few pairs).

    >>> judge(0.99, 1.01, 1.02)
    'PASS'
    >>> judge(1.01, 1.03, 1.02)  # the median may well be under the limit: not enough to pass
    'UNDECIDED'
    >>> judge(1.03, 1.05, 1.02)
    'FAIL'
    >>> judge(-0.4, 1.9, 2.0), judge(-0.4, 2.1, 2.0)
    ('PASS', 'UNDECIDED')
    >>> judge(1.03, 1.05, 1.02, pairs=3)  # three pairs: an interval that narrow means nothing yet
    'UNDECIDED'
    """
    if pairs is not None and pairs < MIN_PAIRS:
        return "UNDECIDED"
    if hi < limit:
        return "PASS"
    if lo > limit:
        return "FAIL"
    return "UNDECIDED"


def pairs_to_decide(estimate: float, lo: float, hi: float, limit: float, pairs: int) -> int | None:
    """About how many pairs would decide an UNDECIDED gate, were the estimate to stay where it is.

    An interval's half-width shrinks as one over the square root of the pairs, so the side of the interval
    that reaches over the limit (the upper half when the estimate is under the limit, the lower half when it
    is over) must shrink to the estimate's distance from the limit.

    :param estimate: The point estimate (the median, or the fitted cost).
    :param lo: The interval's lower end.
    :param hi: The interval's upper end.
    :param limit: The gate's limit.
    :param pairs: The pairs the interval came from.
    :returns: The pair count (at least :data:`MIN_PAIRS`), the current count when the gate is decided already,
        or None when the estimate sits on the limit or the interval is unbounded (no pair count decides it).

    >>> pairs_to_decide(1.01, 1.00, 1.03, 1.02, 50)  # upper half 0.02 must shrink to 0.01: 4x the pairs
    200
    >>> pairs_to_decide(1.03, 1.01, 1.04, 1.02, 50)  # lower half 0.02, distance 0.01
    200
    >>> pairs_to_decide(1.00, 0.99, 1.01, 1.02, 50)  # decided already
    50
    >>> pairs_to_decide(1.02, 1.01, 1.03, 1.02, 50) is None
    True
    >>> pairs_to_decide(1.00, 0.99, 1.01, 1.02, 3)  # decided by its interval, but on too few pairs
    8
    """
    if judge(lo, hi, limit, pairs) != "UNDECIDED":
        return pairs
    if judge(lo, hi, limit) != "UNDECIDED":
        return MIN_PAIRS
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(estimate)):
        return None  # an unbounded interval (bootstrap_cost_fractions) does not shrink as one over sqrt(pairs)
    if estimate < limit:
        half, gap = hi - estimate, limit - estimate
    elif estimate > limit:
        half, gap = estimate - lo, estimate - limit
    else:
        return None
    return max(pairs, MIN_PAIRS, math.ceil(pairs * (half / gap) ** 2))


def why_undecided(estimate: float, lo: float, hi: float, limit: float, pairs: int) -> str:
    """Why an UNDECIDED gate is undecided, in words, with about the pairs that would decide it.

    An interval can leave a gate undecided for two reasons, and the line says which: it rests on fewer
    than :data:`MIN_PAIRS` pairs (a ``--quick`` run has one or three), or it straddles the limit.

    :param estimate: The point estimate (the median, or the fitted cost).
    :param lo: The interval's lower end.
    :param hi: The interval's upper end.
    :param limit: The gate's limit.
    :param pairs: The pairs the interval came from.
    :returns: One sentence: the estimate, the interval, the limit, the reason and what would decide it.
    :raises ValueError: When the gate is not undecided (it has nothing to explain).

    >>> why_undecided(1.027, 1.027, 1.027, 3.0, 1)
    'estimate 1.027, 95% interval [1.027, 1.027] under the limit 3, but on 1 pair, fewer than the 8 that decide a gate'
    >>> why_undecided(1.01, 1.00, 1.03, 1.02, 50)
    'estimate 1.01, 95% interval [1, 1.03] straddles the limit 1.02; about 200 pairs (this run had 50) would decide it'
    >>> print(why_undecided(1.02, 1.01, 1.03, 1.02, 50).split("; ")[1])
    the estimate sits on the limit: no number of pairs decides it
    >>> why_undecided(0.99, 0.98, 1.0, 1.02, 50)
    Traceback (most recent call last):
    ...
    ValueError: the gate is PASS, not UNDECIDED: interval [0.98, 1] against the limit 1.02 on 50 pairs
    """
    verdict = judge(lo, hi, limit, pairs)
    if verdict != "UNDECIDED":
        raise ValueError(
            f"the gate is {verdict}, not UNDECIDED: interval [{lo:.4g}, {hi:.4g}] against the limit {limit:g} "
            f"on {pairs} pairs"
        )
    shown = f"estimate {estimate:.4g}, 95% interval [{lo:.4g}, {hi:.4g}]"
    if judge(lo, hi, limit) != "UNDECIDED":
        side = "under" if hi < limit else "over"
        noun = "pair" if pairs == 1 else "pairs"
        few = f"fewer than the {MIN_PAIRS} that decide a gate"
        return f"{shown} {side} the limit {limit:g}, but on {pairs} {noun}, {few}"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{shown} is unbounded: what it is a fraction of did not come out above zero in every resample"
    decide = pairs_to_decide(estimate, lo, hi, limit, pairs)
    if decide is None:
        return f"{shown} straddles the limit {limit:g}; the estimate sits on the limit: no number of pairs decides it"
    return f"{shown} straddles the limit {limit:g}; about {decide} pairs (this run had {pairs}) would decide it"


def design_matrix(shapes: Sequence[tuple[int, int]]) -> np.ndarray:
    """The least-squares design of the cost model ``time = run + epoch * epochs + step * steps``.

    :param shapes: ``(epochs, batches per epoch)`` of each run length; one step per batch.
    :returns: One row ``[1, epochs, steps]`` per shape.

    >>> design_matrix([(2, 10), (2, 100), (20, 10)]).tolist()
    [[1.0, 2.0, 20.0], [1.0, 2.0, 200.0], [1.0, 20.0, 200.0]]
    """
    return np.array([[1.0, float(epochs), float(epochs * batches)] for epochs, batches in shapes])


def fit_costs(deltas: np.ndarray, design: np.ndarray) -> np.ndarray:
    """Per-run, per-epoch and per-step cost fitted to the median paired difference at each run length.

    :param deltas: ``(shapes, pairs)``: contestant minus baseline, seconds, for each pair of runs at each shape.
    :param design: :func:`design_matrix` of the shapes; the design must have full column rank.
    :returns: ``[per run, per epoch, per step]`` in seconds (least squares over the per-shape medians).

    >>> design = design_matrix([(1, 10), (1, 100), (10, 10)])
    >>> truth = np.array([1e-3, 2e-5, 5e-6])  # 1 ms per run, 20 us per epoch, 5 us per step
    >>> deltas = (design @ truth)[:, None] + np.array([[-1e-6, 0.0, 1e-6]])  # symmetric noise around it
    >>> np.round(fit_costs(deltas, design) * 1e6, 3).tolist()
    [1000.0, 20.0, 5.0]
    """
    medians = np.median(np.asarray(deltas, dtype=float), axis=1)
    coefs, *_ = np.linalg.lstsq(design, medians, rcond=None)
    return coefs


def bootstrap_costs(
    deltas: np.ndarray,
    design: np.ndarray,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fit_costs` with a percentile-bootstrap interval for each coefficient.

    The runs of one repetition (every shape, every contestant) ran back to back, so a resample draws whole
    repetitions: pair ``i`` of every shape comes along together, which keeps what they share (the state of the
    machine at that moment) together.

    :param deltas: ``(shapes, pairs)`` paired differences, seconds; pair ``i`` of each shape is repetition ``i``.
    :param design: :func:`design_matrix` of the shapes.
    :param resamples: Bootstrap resamples.
    :param seed: Seed of the resampling.
    :param level: Confidence level.
    :returns: ``(estimate, lower ends, upper ends)``, each ``[per run, per epoch, per step]`` in seconds.

    >>> design = design_matrix([(1, 10), (1, 100), (10, 10)])
    >>> rng = np.random.default_rng(1)
    >>> noise = rng.normal(0.0, 1e-5, size=(3, 60))
    >>> est, lo, hi = bootstrap_costs((design @ np.array([0.0, 0.0, 5e-6]))[:, None] + noise, design)
    >>> bool(lo[2] < 5e-6 < hi[2]), bool(lo[2] > 0.0)  # the 5 us per step is found, and it is not nothing
    (True, True)
    """
    data = np.asarray(deltas, dtype=float)
    lo, hi = _percentiles(_fitted_draws(data, design, _repetitions(data.shape[1], resamples, seed)), level)
    return fit_costs(data, design), lo, hi


def _repetitions(n: int, resamples: int, seed: int) -> np.ndarray:
    """``(resamples, n)``: the repetitions each resample draws, with replacement."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _fitted_draws(data: np.ndarray, design: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """``(3, resamples)``: :func:`fit_costs` of every resample of ``(shapes, pairs)`` samples."""
    return np.linalg.pinv(design) @ np.median(data[:, picks], axis=2)


def bootstrap_cost_fractions(
    deltas: np.ndarray,
    base: np.ndarray,
    design: np.ndarray,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`bootstrap_costs` of ``deltas`` over the per-step cost of ``base``: a cost in the baseline's own steps.

    A microsecond figure holds only on the host that measured it: a host twice as slow pays every line twice.
    Divided by a reference loop's own cost per step, measured in the same runs, the figure reads the same on any
    host. Each resample draws whole repetitions, the same for both (and, with the same ``seed``, the same as
    :func:`bootstrap_costs` draws for ``deltas`` alone): the ratio's interval comes from the same pairs as the
    microseconds, and a repetition the machine slowed down counts in both its numerator and its denominator.

    :param deltas: ``(shapes, pairs)`` paired differences, seconds; pair ``i`` of each shape is repetition ``i``.
    :param base: ``(shapes, pairs)`` the reference loop's own times, seconds, from the same repetitions.
    :param design: :func:`design_matrix` of the shapes.
    :param resamples: Bootstrap resamples.
    :param seed: Seed of the resampling.
    :param level: Confidence level.
    :returns: ``(estimate, lower ends, upper ends)``, each ``[per run, per epoch, per step]`` in reference steps;
        the interval is ``[-inf, inf]`` where the reference's cost per step is not above zero in every resample.
    :raises ValueError: When ``deltas`` and ``base`` differ in shape.

    >>> design = design_matrix([(1, 10), (1, 100), (10, 10)])
    >>> rng = np.random.default_rng(2)
    >>> base = (design @ np.array([5e-4, 4e-5, 3e-5]))[:, None] * rng.uniform(0.9, 1.1, size=(3, 40))
    >>> deltas = (design @ np.array([0.0, 0.0, 1.5e-6]))[:, None] + rng.normal(0.0, 2e-6, size=(3, 40))
    >>> est, lo, hi = bootstrap_cost_fractions(deltas, base, design)
    >>> bool(lo[2] < 0.05 < hi[2])  # 1.5 us over a 30 us step
    True
    >>> est2, lo2, hi2 = bootstrap_cost_fractions(2 * deltas, 2 * base, design)  # a host twice as slow
    >>> bool(np.allclose(est2, est) and np.allclose(lo2, lo) and np.allclose(hi2, hi))
    True
    """
    data = np.asarray(deltas, dtype=float)
    own = np.asarray(base, dtype=float)
    if data.shape != own.shape:
        raise ValueError(f"deltas {data.shape} and base {own.shape} must hold the same repetitions")
    picks = _repetitions(data.shape[1], resamples, seed)
    costs = _fitted_draws(data, design, picks)
    steps = _fitted_draws(own, design, picks)[2]
    step = fit_costs(own, design)[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = fit_costs(data, design) / step
    if step <= 0.0 or np.any(steps <= 0.0):
        return estimate, np.full(3, -np.inf), np.full(3, np.inf)
    lo, hi = _percentiles(costs / steps, level)
    return estimate, lo, hi
