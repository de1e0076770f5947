"""Lineages: ``in_history`` against a model of trees of lives (each a fresh start or a resume from a checkpoint of
another life), with the bound on segments, and the checks of hostile values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainkit.bookkeeping import MAX_SEGMENTS, branch_lineage, fresh_lineage, in_history, lineage_from
from trainkit.errors import BookkeepingError


@st.composite
def forests(draw):
    """Lives: each a fresh start or a resume from a checkpoint of an earlier life; each writes checkpoints at
    increasing steps from where it started. Returns ``(parents, checkpoints)``: the life and step each life resumed
    from (None: fresh), and every checkpoint as ``(life, step)``."""
    parents: list[tuple[int, int] | None] = []
    saved: list[list[int]] = []
    for life in range(draw(st.integers(1, 9))):
        resumable = [(other, step) for other in range(life) for step in saved[other]]
        parent = draw(st.none() | st.sampled_from(resumable)) if resumable else None
        start = 0 if parent is None else parent[1]
        steps = sorted(set(draw(st.lists(st.integers(start, start + 6), max_size=4))))
        parents.append(parent)
        saved.append(steps)
    return parents, [(life, step) for life, steps in enumerate(saved) for step in steps]


def path_of(parents, life, step):
    """Every ``(life, step)`` a checkpoint's history holds: the model the lineage rule must agree with."""
    path = []
    while True:
        path.append((life, step))
        if parents[life] is None:
            return path
        life, step = parents[life]


def is_ancestor(parents, older, newer):
    """``older`` is in ``newer``'s history: the path from ``newer`` back passes ``older``'s life at a step >= its."""
    return any(life == older[0] and step >= older[1] for life, step in path_of(parents, *newer))


def lineages(parents, bound):
    """The lineage each life's checkpoints carry, as the checkpointer builds them (with ``bound`` segments)."""
    built = []
    for life, parent in enumerate(parents):
        token = f"{life:08x}"
        if parent is None:
            built.append(fresh_lineage(token))
        else:
            built.append(tuple([*built[parent[0]], (token, parent[1])][-bound:]))
    return built


@settings(deadline=None)
@given(forests())
def test_in_history_is_the_model_without_a_bound(forest):
    """Unbounded (as with fewer resumes than MAX_SEGMENTS): the rule says exactly what the tree says."""
    parents, checkpoints = forest
    built = lineages(parents, MAX_SEGMENTS)
    for older in checkpoints:
        for newer in checkpoints:
            got = in_history(built[older[0]], older[1], built[newer[0]], newer[1])
            assert got == is_ancestor(parents, older, newer), (parents, older, newer)


@settings(deadline=None)
@given(forests(), st.integers(1, 3))
def test_with_a_bound_it_never_takes_another_history_and_misses_only_far_ancestors(forest, bound):
    """With a bound of a few segments: never True for a checkpoint outside the history (the safe side); False for
    one inside it only when the newer lineage dropped the older one's life (more than ``bound`` resumes ago)."""
    parents, checkpoints = forest
    built = lineages(parents, bound)
    for older in checkpoints:
        for newer in checkpoints:
            got = in_history(built[older[0]], older[1], built[newer[0]], newer[1])
            truth = is_ancestor(parents, older, newer)
            assert not got or truth, (parents, older, newer)
            dropped = all(token != f"{older[0]:08x}" for token, _ in built[newer[0]])
            assert got or not truth or dropped, (parents, older, newer)


def test_the_two_cases_of_issue_52_are_not_in_history():
    """A rewind to step 4 abandons steps after it; a fresh start on a prefix shares nothing with the older run."""
    old = fresh_lineage("0000000a")
    rewound = branch_lineage(old, "0000000b", 4)
    assert not in_history(rewound, 6, old, 18)  # the abandoned step 18 is no candidate for the rewound step 6
    assert in_history(old, 4, rewound, 6)  # the step it rewound to is in its history
    assert not in_history(fresh_lineage("0000000c"), 0, old, 18)
    assert not in_history((), 5, old, 18) and not in_history(old, 5, (), 18)  # no lineage: no history


def test_a_requeue_branches_and_still_continues_its_history():
    """A normal requeue (resume from the newest checkpoint) is a new segment that continues the same history."""
    first = fresh_lineage("0000000a")
    requeued = branch_lineage(first, "0000000b", 12)
    assert in_history(first, 12, requeued, 18) and not in_history(requeued, 18, first, 24)
    twice = branch_lineage(first, "0000000c", 12)  # a second life from the same checkpoint: a sibling
    assert not in_history(requeued, 12, twice, 18) and not in_history(twice, 12, requeued, 18)


def test_the_bound_keeps_the_newest_segments():
    lineage = fresh_lineage("00000000")
    for step in range(1, 100):
        lineage = branch_lineage(lineage, f"{step:08x}", step)
    assert len(lineage) == MAX_SEGMENTS and lineage[-1] == ("00000063", 99)
    assert in_history(lineage[:-1], 98, lineage, 99)  # a truncated ancestor compares on what both retain


@pytest.mark.parametrize(
    "value",
    [
        None,
        "0a1b2c3d",
        [["0a1b2c3d"]],
        [["0A1B2C3D", 0]],
        [["../../etc", 0]],
        [["0a1b2c3d", -1]],
        [["0a1b2c3d", True]],
        [["0a1b2c3d", 2**63]],
        [["0a1b2c3d", 5], ["0a1b2c3e", 4]],
        [["0a1b2c3d", 0], ["0a1b2c3d", 4]],
        [[f"{i:08x}", i] for i in range(MAX_SEGMENTS + 1)],
    ],
)
def test_a_hostile_lineage_is_refused_naming_the_rule(value):
    with pytest.raises(BookkeepingError, match=r"a lineage must be a list of at most 64 \[token, first_step\] pairs"):
        lineage_from(value)
