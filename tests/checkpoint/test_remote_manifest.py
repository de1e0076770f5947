"""The remote tier's pure records: manifests round-trip, and whatever bytes a remote holds, reading them either
gives a manifest of safe names and bounded numbers or refuses them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainkit.checkpoint.remote.manifest import (
    MAX_OBJECT_BYTES,
    MAX_UNIX_TIME,
    Lease,
    Manifest,
    RemoteObject,
    check_name,
    folder_name,
    folder_step,
    lease_bytes,
    manifest_bytes,
    parse_lease,
    parse_manifest,
)
from trainkit.errors import CheckpointUnsafeError

NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}(/[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}){0,2}", fullmatch=True)
OBJECTS = st.builds(RemoteObject, name=NAMES, size=st.integers(0, MAX_OBJECT_BYTES), crc32=st.integers(0, 0xFFFFFFFF))


@given(
    step=st.integers(0, 1 << 40),
    epoch=st.integers(0, 1 << 20),
    objects=st.lists(OBJECTS, min_size=1, max_size=5, unique_by=lambda o: o.name),
    run_id=st.none() | st.text(max_size=20),
    scores=st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
)
def test_a_manifest_reads_back_as_written(step, epoch, objects, run_id, scores):
    manifest = Manifest(
        step=step,
        epoch=epoch,
        kind="last",
        objects=tuple(objects),
        run_id=run_id,
        version="0.1.0",
        description={"epoch_end": False, "time": 1.5, "scores": scores},
    )
    assert parse_manifest(manifest_bytes(manifest)) == manifest


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_are_a_safe_manifest_or_refused(data):
    try:
        manifest = parse_manifest(data)
    except CheckpointUnsafeError:
        return
    assert all(".." not in o.name.split("/") and not o.name.startswith("/") for o in manifest.objects)


@pytest.mark.parametrize(
    "name", ["../x", "..", "/etc/passwd", "a/../b", "a//b", "a/./b", "a\\b", "", "a/", 3, None, "x" * 200]
)
def test_unsafe_object_names_are_refused(name):
    with pytest.raises(CheckpointUnsafeError, match="remote object name"):
        check_name(name)
    listed = {"step": 1, "epoch": 0, "kind": "last", "version": "0", "objects": [{"name": name, "size": 1, "crc32": 0}]}
    with pytest.raises(CheckpointUnsafeError):
        parse_manifest(json.dumps(listed).encode())


@pytest.mark.parametrize(
    ("field", "value"),
    [("size", -1), ("size", MAX_OBJECT_BYTES + 1), ("size", True), ("crc32", 1 << 32), ("size", "1")],
)
def test_out_of_range_sizes_and_crcs_are_refused(field, value):
    item = {"name": "last.pt", "size": 1, "crc32": 0, field: value}
    listed = {"step": 1, "epoch": 0, "kind": "last", "version": "0", "objects": [item]}
    with pytest.raises(CheckpointUnsafeError, match=field):
        parse_manifest(json.dumps(listed).encode())


@given(step=st.integers(0, 10**17), token=st.from_regex(r"[0-9a-f]{8,64}", fullmatch=True))
def test_folder_names_carry_their_step(step, token):
    assert folder_step(folder_name(step, token)) == step


@given(holder=st.text(max_size=50), expires=st.floats(0, MAX_UNIX_TIME))
def test_a_lease_reads_back_and_expires_after_its_time(holder, expires):
    lease = parse_lease(lease_bytes(Lease(holder=holder, expires=expires)))
    assert lease == Lease(holder=holder, expires=expires)
    assert not lease.expired(expires) and lease.expired(expires + 1)


def test_a_lineage_reads_back_and_a_record_without_one_still_parses():
    """The lineage of a commit record round-trips; one written before lineages (no key) reads as None; a hostile one
    (not hex, decreasing steps, nested deep) is refused as unsafe, naming the field."""
    base = {"step": 12, "epoch": 2, "kind": "last", "objects": [{"name": "last.pt", "size": 1, "crc32": 0}]}
    old = parse_manifest(json.dumps({**base, "run_id": None, "version": "0"}).encode())
    assert old.lineage is None and "lineage" not in json.loads(manifest_bytes(old))
    lineage = (("0a1b2c3d", 0), ("ffffffff", 6))
    again = parse_manifest(
        manifest_bytes(Manifest(**{**base, "objects": old.objects}, run_id=None, version="0", lineage=lineage))
    )
    assert again.lineage == lineage
    deep: list = []
    for _ in range(40):  # within the JSON reader's nesting bound (64): the lineage's own check refuses it
        deep = [deep]
    for bad in ([["../x", 0]], [["0a1b2c3d", 6], ["ffffffff", 0]], "0a1b2c3d", deep):
        with pytest.raises(CheckpointUnsafeError, match="remote manifest: lineage: a lineage must be"):
            parse_manifest(json.dumps({**base, "run_id": None, "version": "0", "lineage": bad}).encode())
