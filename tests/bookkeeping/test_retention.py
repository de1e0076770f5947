"""Checkpoint retention: point tests of each policy and property tests over random histories and policies."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainkit.bookkeeping import (
    Checkpoint,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLatest,
    keep_reasons,
    parse_keep,
    retain,
)
from trainkit.bookkeeping.retention import AHEAD, NEWEST, WRITING
from trainkit.errors import BookkeepingError


def history(*steps, **fields):
    """Checkpoints at the given steps, one epoch and ten seconds apart."""
    return [Checkpoint(step=s, epoch=i + 1, time=10.0 * i, **fields) for i, s in enumerate(steps)]


# ----------------------------------------------------------------------------------------------- point tests


def test_keep_latest_keeps_the_largest_steps_whatever_the_order():
    """KeepLatest(n) keeps the n largest steps, however the checkpoints are listed."""
    cs = history(500, 100, 300, 200, 400)
    assert retain(KeepLatest(2), cs) == {400, 500}


def test_keep_every_steps_keeps_the_multiples_and_the_newest():
    """KeepEvery(steps=k) keeps the multiples of k; the newest is kept anyway."""
    cs = history(250, 500, 750, 1000, 1100)
    assert retain(KeepEvery(steps=500), cs) == {500, 1000, 1100}


def test_keep_every_epochs_ignores_checkpoints_inside_an_epoch():
    """KeepEvery(epochs=k) keeps epoch-end checkpoints of every k-th epoch, never a step checkpoint inside one."""
    cs = [
        Checkpoint(step=10, epoch=1),
        Checkpoint(step=15, epoch=2, epoch_end=False),
        Checkpoint(step=20, epoch=2),
        Checkpoint(step=30, epoch=3),
        Checkpoint(step=40, epoch=4),
        Checkpoint(step=45, epoch=4, epoch_end=False),
    ]
    assert retain(KeepEvery(epochs=2), cs) == {20, 40, 45}


def test_keep_every_seconds_counts_from_the_first_and_from_each_kept_one():
    """KeepEverySeconds keeps the first, then one at least s seconds after the last one it kept."""
    times = [0.0, 30.0, 59.0, 61.0, 100.0, 125.0, 200.0]
    cs = [Checkpoint(step=i, time=t) for i, t in enumerate(times)]
    kept = retain(KeepEverySeconds(60), cs)
    assert sorted(kept) == [0, 3, 5, 6]  # 0; 61 (>= 60 after 0); 125 (64 after 61); 200 newest (and 75 after)


def test_keep_every_seconds_restarts_when_the_clock_goes_back():
    """A checkpoint whose time lies before the last kept one (clock set back) is kept and counts from there."""
    cs = [Checkpoint(step=1, time=1000.0), Checkpoint(step=2, time=5.0), Checkpoint(step=3, time=30.0)]
    assert retain(KeepEverySeconds(60), cs[:2] + [Checkpoint(step=4, time=70.0), cs[2]]) == {1, 2, 4}


@pytest.mark.parametrize(("minimize", "expected"), [(True, {20, 40}), (False, {10, 30})])
def test_keep_best_follows_its_direction(minimize, expected):
    """KeepBest ranks lower first when minimizing and higher first when maximizing (the newest is kept too)."""
    scores = {10: 0.9, 20: 0.1, 30: 0.8, 40: 0.2, 50: 0.5}
    cs = [Checkpoint(step=s, scores={"score": x}) for s, x in scores.items()]
    assert retain(KeepBest(2, minimize=minimize), cs) == expected | {50}


def test_keep_best_never_ranks_nan_inf_or_a_missing_score():
    """NaN, +-inf and a missing score are never among the best, even when nothing else is scored."""
    cs = [
        Checkpoint(step=1, scores={"score": math.nan}),
        Checkpoint(step=2, scores={"score": -math.inf}),
        Checkpoint(step=3),
        Checkpoint(step=4, scores={"score": 5.0}),
        Checkpoint(step=5, scores={"other": 0.0}),
        Checkpoint(step=6),
    ]
    assert retain(KeepBest(3, minimize=True), cs) == {4, 6}


def test_keep_best_breaks_ties_by_the_earlier_step():
    """Of equal scores the earlier checkpoint ranks first: a tie never improves."""
    cs = [Checkpoint(step=s, scores={"score": 1.0}) for s in (1, 2, 3, 4)]
    assert keep_reasons(KeepBest(2), cs) == {1: ("best:2:score:max",), 2: ("best:2:score:max",), 3: (), 4: (NEWEST,)}


def test_keep_best_ranks_by_the_named_metric():
    """KeepBest with a metric ranks by that score, not the selection score."""
    cs = [
        Checkpoint(step=1, scores={"score": 0.0, "val/acc": 0.9}),
        Checkpoint(step=2, scores={"score": 9.0, "val/acc": 0.1}),
        Checkpoint(step=3),
    ]
    assert retain(KeepBest(1, "val/acc", minimize=False), cs) == {1, 3}


def test_a_checkpoint_being_written_is_never_deleted():
    """A checkpoint a background save is writing is kept whatever the policy, and says why."""
    cs = [Checkpoint(step=1), Checkpoint(step=2, writing=True), Checkpoint(step=3)]
    assert retain(KeepAny(), cs) == {2, 3}
    assert keep_reasons(KeepAny(), cs)[2] == (WRITING,)


def test_empty_history_keeps_nothing():
    """No checkpoints: nothing to keep, nothing to delete."""
    assert retain(KeepLatest(3), []) == frozenset()
    assert keep_reasons(KeepBest(1), []) == {}


def test_duplicate_steps_are_refused():
    """Two checkpoints with one step cannot both be files named by it: refused."""
    with pytest.raises(BookkeepingError, match="two checkpoints have step 5"):
        retain(KeepLatest(1), [Checkpoint(step=5), Checkpoint(step=5, epoch=1)])


@pytest.mark.parametrize(
    "build",
    [
        lambda: KeepLatest(0),
        lambda: KeepLatest(True),
        lambda: KeepLatest(1.5),
        lambda: KeepEvery(),
        lambda: KeepEvery(steps=2, epochs=2),
        lambda: KeepEvery(steps=0),
        lambda: KeepEverySeconds(0),
        lambda: KeepEverySeconds(math.inf),
        lambda: KeepBest(0),
        lambda: KeepBest(1, ""),
        lambda: KeepBest(1, minimize=1),
        lambda: KeepAny(3),
        lambda: Checkpoint(step=-1),
        lambda: Checkpoint(step=1, time=math.nan),
    ],
)
def test_invalid_records_are_refused(build):
    """Counts below 1, bools as counts, neither or both of steps/epochs, bad seconds and bad fields are refused."""
    with pytest.raises(BookkeepingError):
        build()


def test_parse_keep_reads_the_dotted_cli_string_and_a_yaml_list():
    """One comma-separated string and a list of them parse to the same policies, in order."""
    text = parse_keep("latest:3,every_steps:1000,every_epochs:2,every_seconds:90.5,best:2", minimize=True)
    listed = parse_keep(["latest:3", "every_steps:1000", "every_epochs:2", "every_seconds:90.5,best:2:min"])
    assert text == listed
    assert text.policies == (
        KeepLatest(3),
        KeepEvery(steps=1000),
        KeepEvery(epochs=2),
        KeepEverySeconds(90.5),
        KeepBest(2, minimize=True),
    )
    assert parse_keep("") == parse_keep([]) == KeepAny()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("latest", "is not a retention rule"),
        ("latest:0", "'latest:0': the count must be an int >= 1, got '0'"),
        ("latest:-2", "the count must be an int >= 1"),
        ("every_steps:1.5", "the interval must be an int >= 1"),
        ("every_seconds:-1", "must be a number of seconds > 0"),
        ("every_seconds:nan", "must be a number of seconds > 0"),
        ("best:x", "the count must be an int >= 1"),
        ("keep_all", "is not a retention rule"),
        ("best:1:a:b:c", "is not a retention rule"),
        ([3], "must be a string"),
    ],
)
def test_parse_keep_names_the_bad_item(value, message):
    """A bad item is refused with a message naming it and the rule it breaks."""
    with pytest.raises(BookkeepingError, match=message.replace("(", r"\(")):
        parse_keep(value)


# ----------------------------------------------------------------------------------------------- properties

scores = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@st.composite
def histories(draw):
    """Random checkpoint descriptions: unique steps, epochs, times (maybe going back), scores, some in flight."""
    steps = draw(st.lists(st.integers(0, 10_000), unique=True, max_size=25))
    out = []
    for step in steps:
        score = draw(scores)
        out.append(
            Checkpoint(
                step=step,
                epoch=draw(st.integers(0, 50)),
                epoch_end=draw(st.booleans()),
                time=draw(st.floats(0, 1e6)),
                scores={} if score is None else {"score": score},
                writing=draw(st.integers(0, 9)) == 0,
            )
        )
    return out


leaves = st.one_of(
    st.builds(KeepLatest, st.integers(1, 30)),
    st.builds(lambda k: KeepEvery(steps=k), st.integers(1, 3000)),
    st.builds(lambda k: KeepEvery(epochs=k), st.integers(1, 10)),
    st.builds(KeepEverySeconds, st.floats(0.5, 1e5)),
    st.builds(lambda n, m: KeepBest(n, minimize=m), st.integers(1, 30), st.booleans()),
)
policies = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4).map(lambda ps: KeepAny(*ps)), max_leaves=6)


@settings(deadline=None)
@given(histories(), policies, st.randoms(use_true_random=False))
def test_newest_and_in_flight_are_never_deleted_and_order_does_not_matter(cs, policy, rnd):
    """Whatever the history and policy: the newest and every in-flight checkpoint are kept; the answer is a
    subset of the steps and does not depend on the order the checkpoints are listed in."""
    kept = retain(policy, cs)
    steps = {c.step for c in cs}
    assert kept <= steps
    if cs:
        assert max(steps) in kept
    assert {c.step for c in cs if c.writing} <= kept
    shuffled = list(cs)
    rnd.shuffle(shuffled)
    assert retain(policy, shuffled) == kept


@settings(deadline=None)
@given(histories(), st.lists(leaves, max_size=5))
def test_keep_any_is_the_union(cs, parts):
    """KeepAny keeps exactly the union of what its policies keep."""
    union = frozenset().union(*(retain(p, cs) for p in parts)) if parts else frozenset()
    protected = {c.step for c in cs if c.writing} | ({max(c.step for c in cs)} if cs else set())
    assert retain(KeepAny(*parts), cs) == union | protected


@settings(deadline=None)
@given(histories(), st.integers(1, 30))
def test_keep_latest_keeps_exactly_min_n_len_without_in_flight(cs, n):
    """With nothing in flight, KeepLatest(n) keeps exactly min(n, len) checkpoints: the n largest steps."""
    cs = [Checkpoint(step=c.step, epoch=c.epoch, time=c.time) for c in cs]
    kept = retain(KeepLatest(n), cs)
    assert len(kept) == min(n, len(cs))
    assert kept == set(sorted(c.step for c in cs)[-n:])


@settings(deadline=None)
@given(histories(), st.integers(1, 30), st.booleans())
def test_keep_best_keeps_the_n_best_finite_scores(cs, n, minimize):
    """KeepBest keeps min(n, #finite) checkpoints for their score, none with a non-finite or missing score, and
    none that a dropped finite score beats."""
    policy = KeepBest(n, minimize=minimize)
    reasons = keep_reasons(policy, [Checkpoint(step=c.step, scores=c.scores) for c in cs])
    best = {step for step, why in reasons.items() if policy.spec in why}
    finite = {c.step: c.scores["score"] for c in cs if math.isfinite(c.scores.get("score", math.nan))}
    assert best <= set(finite)
    assert len(best) == min(n, len(finite))
    sign = 1 if minimize else -1
    for dropped in set(finite) - best:
        assert all(sign * finite[k] <= sign * finite[dropped] for k in best)


@settings(deadline=None)
@given(histories(), policies)
def test_applying_a_policy_twice_deletes_nothing_more(cs, policy):
    """Deleting what a policy does not keep leaves a history it keeps whole (so a restart deletes nothing more)."""
    cs = [c for c in cs if not c.writing]
    kept = retain(policy, cs)
    survivors = [c for c in cs if c.step in kept]
    assert retain(policy, survivors) == kept


@settings(deadline=None)
@given(histories(), policies)
def test_reasons_agree_with_retain_and_name_the_rules(cs, policy):
    """keep_reasons lists every checkpoint; the kept ones are those with a reason, each a rule's spec."""
    reasons = keep_reasons(policy, cs)
    assert set(reasons) == {c.step for c in cs}
    assert {step for step, why in reasons.items() if why} == retain(policy, cs)
    specs = set(policy.spec.split(",")) | {NEWEST, WRITING}
    assert all(set(why) <= specs for why in reasons.values())


@settings(deadline=None)
@given(policies)
def test_spec_round_trips_through_parse_keep(policy):
    """A policy's spec parses back to the same rules (KeepAny nesting flattened), whatever the default direction."""
    flat = parse_keep(policy.spec, minimize=True)
    assert parse_keep(policy.spec, minimize=False) == flat
    assert flat.spec == policy.spec


@given(histories(), policies, st.integers(0, 10_000))
def test_checkpoints_after_the_newest_the_run_wrote_are_kept_and_ranked_by_no_rule(cs, policy, newest):
    """With newest=n, checkpoints above step n are kept (reason "after the newest" alone) and what the rest keep
    is exactly what the policy keeps of the rest on their own (a planted larger step displaces nothing)."""
    mine = [c for c in cs if c.step <= newest]
    reasons = keep_reasons(policy, cs, newest=newest)
    assert {s for s, why in reasons.items() if why == (AHEAD,)} == {c.step for c in cs if c.step > newest}
    assert retain(policy, cs, newest=newest) == retain(policy, mine) | {c.step for c in cs if c.step > newest}
    assert keep_reasons(policy, cs, newest=None) == keep_reasons(policy, cs)
