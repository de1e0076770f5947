"""EpochPosition with lengths left unknown (a loader that carries its own position, a stream): pure record checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.bookkeeping import EpochPosition, position_mismatch
from trainkit.errors import BookkeepingError

lengths = st.one_of(st.none(), st.integers(1, 50))


@given(st.integers(0, 5), st.integers(1, 60), lengths, st.one_of(st.none(), st.integers(0, 99)))
def test_a_position_with_unknown_lengths_round_trips_and_says_what_it_needs(epoch, batches, per_epoch, dataset):
    """Any valid position survives its JSON dict exactly; the dict is version 1 (what an older trainkit reads) when
    every length is known, version 2 when one is unknown; batches may exceed no known length."""
    values = dict(
        epoch=epoch, batches=batches, batches_per_epoch=per_epoch, batch_size=4, dataset_length=dataset, world_size=1
    )
    if per_epoch is not None and batches > per_epoch:
        with pytest.raises(BookkeepingError, match=f"at most batches_per_epoch={per_epoch}, got {batches}"):
            EpochPosition(**values)
        return
    position = EpochPosition(**values)
    data = json.loads(json.dumps(position.to_dict()))
    assert EpochPosition.from_dict(data) == position
    assert data["schema_version"] == (1 if per_epoch is not None and dataset is not None else 2)
    assert position_mismatch(position, world_size=1, loader=(4, dataset, per_epoch)) is None


def test_a_position_written_before_unknown_lengths_still_loads():
    """A version-1 dict, as trainkit wrote it before lengths could be unknown, reads as it did."""
    old = {
        "kind": "EpochPosition",
        "schema_version": 1,
        "epoch": 1,
        "batches": 3,
        "batches_per_epoch": 8,
        "batch_size": 4,
        "dataset_length": 30,
        "world_size": 2,
    }
    assert EpochPosition.from_dict(old) == EpochPosition(
        epoch=1, batches=3, batches_per_epoch=8, batch_size=4, dataset_length=30, world_size=2
    )


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("batches_per_epoch", 0, "None \\(unknown\\) or an int >= 1"),
        ("batches_per_epoch", True, "None \\(unknown\\) or an int >= 1"),
        ("dataset_length", -1, "an int >= 0"),
        ("batches", None, "an int >= 1"),
    ],
)
def test_an_impossible_length_is_refused_naming_the_field(field, value, rule):
    values = {
        "epoch": 0,
        "batches": 1,
        "batches_per_epoch": None,
        "batch_size": None,
        "dataset_length": None,
        "world_size": 1,
        field: value,
    }
    with pytest.raises(BookkeepingError, match=f"EpochPosition.{field} must be {rule}, got {value!r}"):
        EpochPosition(**values)


def test_a_length_that_became_known_or_unknown_is_named_as_a_change():
    position = EpochPosition(
        epoch=0, batches=2, batches_per_epoch=None, batch_size=4, dataset_length=None, world_size=1
    )
    assert position_mismatch(position, world_size=1, loader=(4, None, 8)) == "batches per epoch: None then, 8 now"
    assert position.done == "2 batches"
