"""The divergence guard's pure core: step_guard's verdicts, against a brute-force model of its rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.bookkeeping import GuardState, replay_guard, rollback_candidate, step_guard
from trainkit.bookkeeping.guard import CONTINUE, RAISE, ROLLBACK, SKIP
from trainkit.errors import BookkeepingError

steps_and_flags = st.lists(st.tuples(st.integers(1, 5), st.booleans()), max_size=40).map(
    # increasing steps: the gaps are drawn, the flags beside them
    lambda pairs: [(sum(gap for gap, _ in pairs[: i + 1]), finite) for i, (_, finite) in enumerate(pairs)]
)


def verdicts(state, pairs):
    out = []
    for step, finite in pairs:
        state, verdict = step_guard(state, step, finite)
        out.append(verdict)
        if verdict in (RAISE, ROLLBACK):
            break
    return state, out


@given(steps_and_flags, st.sampled_from(["skip", "rollback"]), st.integers(1, 4), st.integers(1, 12))
def test_the_guard_fires_exactly_when_max_skips_non_finite_steps_fall_within_the_window(pairs, mode, k, window):
    """A non-finite step exhausts the guard iff it and the k-1 non-finite steps before it lie within `window`
    steps; every other non-finite step is skipped, every finite one taken; the count is the skips."""
    state, out = verdicts(GuardState(mode=mode, max_skips=k, window=window), pairs)
    bad: list[int] = []
    for (step, finite), verdict in zip(pairs, out, strict=False):
        if finite:
            assert verdict == CONTINUE
            continue
        bad.append(step)
        inside = [s for s in bad if step - s < window]
        expected = (ROLLBACK if mode == "rollback" else RAISE) if len(inside) >= k else SKIP
        assert verdict == expected
    assert state.skipped == out.count(SKIP)


@given(steps_and_flags)
def test_off_never_fires_and_raise_fires_at_the_first_non_finite_step(pairs):
    """'off' takes every step; 'raise' raises at the first non-finite one and nowhere else."""
    assert set(verdicts(GuardState(mode="off"), pairs)[1]) <= {CONTINUE}
    out = verdicts(GuardState(mode="raise"), pairs)[1]
    first_bad = next((i for i, (_, finite) in enumerate(pairs) if not finite), None)
    assert out == [CONTINUE] * len(pairs) if first_bad is None else out == [CONTINUE] * first_bad + [RAISE]


def test_skip_without_max_skips_skips_forever():
    """'skip' with no budget never raises."""
    pairs = [(step, False) for step in range(50)]
    state, out = verdicts(GuardState(mode="skip", window=3), pairs)
    assert out == [SKIP] * 50 and state.skipped == 50
    assert replay_guard(pairs[:2], GuardState(mode="skip")) == [(0, SKIP), (1, SKIP)]


@pytest.mark.parametrize(
    "field, value", [("mode", "panic"), ("max_skips", 0), ("max_skips", True), ("window", 0), ("skipped", -1)]
)
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(BookkeepingError, match=f"GuardState.{field}"):
        GuardState(**{field: value})


def test_steps_must_increase():
    state, _ = step_guard(GuardState(mode="skip"), 4, finite=False)
    with pytest.raises(BookkeepingError, match="not after"):
        step_guard(state, 4, finite=False)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 100)), max_size=8), st.integers(0, 100))
def test_the_rollback_candidate_is_the_newest_checkpoint_not_after_the_first_bad_step(candidates, first_bad):
    found = rollback_candidate(candidates, first_bad)
    before = [step for _, step in candidates if step <= first_bad]
    if not before:
        assert found is None
    else:
        assert any(path == found and step == max(before) for path, step in candidates)
