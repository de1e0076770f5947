"""The pickle pre-scan: every pickle a pickler writes passes; each kind of pickle built to crash or stall fails."""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainkit.files.pickle_scan import MAX_COLLISIONS, MAX_PICKLE_DEPTH, PickleRefused, PickleUnsafe, check_pickle

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(deadline=None)
@given(value=plain, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_every_pickle_of_plain_values_passes(value, protocol):
    """A pickle of nested plain values, at any protocol, passes the scan (no false alarm)."""
    check_pickle(pickle.dumps(value, protocol=protocol))


def data_pkl(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl")))


def test_torch_saves_of_state_dicts_pass():
    """What torch.save writes for models, optimizers, bytes, bytearrays, sets, Sizes and cycles passes."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    loop: list = [1]
    loop.append(loop)
    extra = {"b": b"\x00\xff", "ba": bytearray(b"xy"), "s": {1, 2}, "size": torch.Size([2, 3]), "loop": loop}
    for obj in (model.state_dict(), optimizer.state_dict(), extra, collections.OrderedDict(a=1)):
        check_pickle(data_pkl(obj))


REFUSED = {
    "too deep": (b"\x80\x02}K\x01" + b"\x85" * (MAX_PICKLE_DEPTH + 5) + b"K\x02s.", "more than 1000 deep"),
    "filled after nesting": (b"\x80\x02]\x94\x85h\x00K\x01a.", "fills a value after nesting it"),
    "huge memo index": (b"\x80\x02K\x01r\xff\xff\xff\x7f.", "names memo entry 2147483647"),
    "codec": (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x08\x00\x00\x00punycode\x86R.", "_codecs.encode"),
    "bytearray size": (
        b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R.",
        r"calls bytearray with \(1073741824,\)",
    ),
    "colliding keys": (
        b"\x80\x02}("
        + b"".join(b"\x8a\x09" + (k * (2**61 - 1)).to_bytes(9, "little") + b"N" for k in range(1, 100))
        + b"u.",
        f"more than {MAX_COLLISIONS} keys",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_pickles_built_to_crash_or_stall_are_unsafe(name):
    """Each kind of hostile pickle is PickleUnsafe, naming what it does and where."""
    data, fragment = REFUSED[name]
    with pytest.raises(PickleUnsafe, match=fragment):
        check_pickle(data)


@pytest.mark.parametrize("data", [b"\x80\x02K\x01", b"\x80\x02a.", b"\x80\x02\x82\x01.", b"\x80\x02\xff."])
def test_pickles_no_pickler_writes_are_refused_but_not_called_unsafe(data):
    """Truncated, unbalanced, extension-opcode and unknown-opcode pickles are PickleRefused (damage), not unsafe."""
    with pytest.raises(PickleRefused) as info:
        check_pickle(data)
    assert type(info.value) is PickleRefused


def test_legit_bytes_forms_of_every_protocol_pass():
    """bytes and bytearray as protocols 0-5 write them (_codecs.encode(text, 'latin1'), BINBYTES) pass."""
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        check_pickle(pickle.dumps({"b": b"\xff" * 3, "a": bytearray(b"\x00\xff")}, protocol=protocol))
