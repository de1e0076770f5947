"""Point tests shared by every bookkeeping record: dict round trips, from_dict checks, error types."""

from __future__ import annotations

import json

import pytest

from trainkit.bookkeeping import BestState, LoopState, PatienceState, save_if_best
from trainkit.errors import BookkeepingError, ConfigError, RegistryError, TrainkitError

RECORDS = [
    save_if_best(BestState(minimize=True, min_delta=0.1), 0.5, epoch=2, metrics={"val/loss": 0.5})[0],
    PatienceState(patience=3, start_patience=1, remaining=2),
    LoopState(epoch=4, step=40, stop_reason="early_stop"),
]
IDS = ["BestState", "PatienceState", "LoopState"]


@pytest.mark.parametrize("record", RECORDS, ids=IDS)
def test_to_dict_is_plain_json_and_round_trips(record):
    """to_dict gives plain JSON values tagged with kind and schema_version, and from_dict rebuilds an equal record."""
    data = record.to_dict()
    assert data["kind"] == type(record).__name__
    assert data["schema_version"] == 1
    assert json.loads(json.dumps(data)) == data
    assert type(record).from_dict(json.loads(json.dumps(data))) == record


@pytest.mark.parametrize("record", RECORDS, ids=IDS)
def test_from_dict_refuses_a_newer_schema_version(record):
    """A dict written by a newer trainkit is refused with an error naming its schema version."""
    data = {**record.to_dict(), "schema_version": 99}
    with pytest.raises(BookkeepingError, match="schema_version 99 is newer"):
        type(record).from_dict(data)


@pytest.mark.parametrize("record", RECORDS, ids=IDS)
def test_from_dict_refuses_a_foreign_kind(record):
    """A dict written by another record class is refused with an error naming its kind."""
    data = {**record.to_dict(), "kind": "OtherState"}
    with pytest.raises(BookkeepingError, match="of kind 'OtherState'"):
        type(record).from_dict(data)


@pytest.mark.parametrize("record", RECORDS, ids=IDS)
def test_from_dict_refuses_an_unexpected_field(record):
    """A dict with a field the record does not have is refused with an error naming the field."""
    data = {**record.to_dict(), "surprise": 1}
    with pytest.raises(BookkeepingError, match="unexpected fields \\['surprise'\\]"):
        type(record).from_dict(data)


@pytest.mark.parametrize("version", [None, "1", True])
def test_from_dict_refuses_a_missing_or_non_int_schema_version(version):
    """schema_version must be present and an int."""
    data = {**PatienceState().to_dict(), "schema_version": version}
    with pytest.raises(BookkeepingError, match="schema_version must be an int"):
        PatienceState.from_dict(data)


def test_from_dict_refuses_a_non_mapping():
    """from_dict expects a mapping, not a list or a string."""
    with pytest.raises(BookkeepingError, match="expects a mapping"):
        LoopState.from_dict([("epoch", 1)])  # type: ignore[arg-type]


def test_from_dict_reruns_validators():
    """A dict with a field value that breaks a rule is refused, as building the record directly would be."""
    data = {**PatienceState(patience=2).to_dict(), "remaining": 5}
    with pytest.raises(BookkeepingError, match="remaining"):
        PatienceState.from_dict(data)


def test_errors_are_also_the_builtin_they_refine():
    """Bookkeeping, registry and config errors are TrainkitErrors and ValueErrors, so either except clause works."""
    for error in (BookkeepingError, RegistryError, ConfigError):
        assert issubclass(error, TrainkitError)
        assert issubclass(error, ValueError)
    with pytest.raises(ValueError):
        PatienceState(patience=0)
