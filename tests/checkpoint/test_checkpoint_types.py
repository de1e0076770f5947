"""What a checkpoint may hold: plain values from common libraries round-trip, the rest is refused before a save.

Every file here is real (pytest's tmp_path), written by ``atomic_save`` or, for files trainkit would not write,
by a plain ``torch.save``; nothing is mocked.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import enum
import fractions
import os
import pathlib
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from tests.faults.harness import ROOT, child_env
from trainkit import CheckpointCorruptError, CheckpointError, CheckpointUnsafeError
from trainkit.checkpoint import atomic_save, check_loadable, load_checkpoint
from trainkit.checkpoint.formats.async_save import StagingBuffers

np = pytest.importorskip("numpy")

NUMPY_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
"""The numpy dtypes a checkpoint may hold."""

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128, torch.uint16, torch.float8_e4m3fn,
]  # fmt: skip


def numpy_values() -> dict[str, object]:
    """Scalars, arrays (2-d, 0-d, empty, non-contiguous, Fortran-ordered, big-endian) and dtypes of each dtype."""
    values: dict[str, object] = {}
    for name in NUMPY_DTYPES:
        dtype = np.dtype(name)
        top = True if name == "bool" else (np.iinfo(dtype).max if dtype.kind in "iu" else 1.5)
        values[f"scalar_{name}"] = dtype.type(top)
        values[f"array_{name}"] = (np.arange(12) % 3).astype(name).reshape(3, 4)
        values[f"zero_d_{name}"] = np.array(top, dtype=name)
        values[f"empty_{name}"] = np.zeros((0, 3), dtype=name)
        values[f"strided_{name}"] = (np.arange(24) % 5).astype(name).reshape(4, 6)[::2, 1::3]
        values[f"fortran_{name}"] = np.asfortranarray((np.arange(6) % 2).astype(name).reshape(2, 3))
        values[f"dtype_{name}"] = dtype
    values["big_endian"] = np.arange(5, dtype=">f8")
    values["big_endian_dtype"] = np.dtype(">i4")
    values["nan"] = np.float64("nan")
    values["negative_zero"] = np.float32(-0.0)
    return values


def full_payload() -> dict[str, object]:
    """A payload holding every type a checkpoint may hold, nested the way state_dicts nest them."""
    state = collections.OrderedDict(weight=torch.randn(2, 3), bias=torch.zeros(2))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined] - what Module.state_dict() attaches
    shared = np.arange(4.0)
    return {
        "pipeline": numpy_values(),
        "scheduler": {
            "milestones": collections.Counter({30: 1, 60: 2}),
            "window": slice(1, 5, 2),
            "open_window": slice(None, np.int64(7)),
            "shape": torch.Size([2, 3]),
            "dtypes": list(TORCH_DTYPES),
            "device": torch.device("cpu"),
            "layout": torch.strided,
            "seen": {1, 2, 3},
            "empty_bytes": b"",
            "bytes": b"\x00\x01",
            "bytearray": bytearray(b"ab"),
            "plain": [None, True, 3, 2.5, 1 + 2j, "text", 2**70, float("inf")],
            "nested": {"a": [({"b": (np.float32(1), np.ones(2, dtype=np.int16))},)], 7: {(1, "k"): np.bool_(False)}},
            "shared": [shared, shared],
        },
        "model": state,
        "params": {"w": torch.nn.Parameter(torch.ones(3)), "frozen": torch.nn.Parameter(torch.ones(2), False)},
    }


def assert_same(got: object, want: object, where: str = "payload") -> None:
    """Assert ``got`` equals ``want`` with the same types all the way down, numpy dtypes included."""
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, np.ndarray):
        # byte order aside: numpy 2's own unpickling turns a big-endian array native, and so does the load
        assert got.dtype.newbyteorder("=") == want.dtype.newbyteorder("=") and got.shape == want.shape, where
        assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"), where
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype, where
        assert (np.isnan(got) and np.isnan(want)) if want.dtype.kind == "f" and np.isnan(want) else got == want, where
        assert np.signbit(got) == np.signbit(want) if want.dtype.kind == "f" else True, where
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
        assert got.requires_grad == want.requires_grad, where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key, value in want.items():
            assert_same(got[key], value, f"{where}[{key!r}]")
        assert getattr(got, "__dict__", {}) == getattr(want, "__dict__", {}), where
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(want, float) and want != want:
        assert got != got, where
    else:
        assert got == want, where


def test_every_allowed_type_round_trips_with_its_type(tmp_path):
    """Every allowed type passes check_loadable, saves with atomic_save and loads back equal, with the same type."""
    payload = full_payload()
    check_loadable(payload)
    atomic_save(payload, tmp_path / "last.pt")
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert_same(loaded, payload)
    shared = loaded["scheduler"]["shared"]
    assert shared[0] is shared[1], "an array saved twice is one array after the load, as with pickle"
    assert all(value.flags.writeable for value in loaded["pipeline"].values() if isinstance(value, np.ndarray))


def test_loading_leaves_torchs_allowlist_as_it_was(tmp_path):
    """A load, including one that fails, takes trainkit's names back off torch's weights_only allowlist."""
    before = list(torch.serialization.get_safe_globals())
    atomic_save({"x": {"a": np.arange(3), "s": slice(2)}}, tmp_path / "ok.pt")
    torch.save({"x": Unlisted()}, tmp_path / "bad.pt")
    load_checkpoint(tmp_path / "ok.pt")
    with pytest.raises(CheckpointUnsafeError):
        load_checkpoint(tmp_path / "bad.pt")
    assert set(torch.serialization.get_safe_globals()) == set(before)  # torch keeps them in a set: order varies
    with pytest.raises(Exception, match="numpy"):  # outside load_checkpoint, torch's own rules apply
        torch.load(tmp_path / "ok.pt", weights_only=True)


def rewrite_pickle(path: pathlib.Path, edit) -> None:
    """Rewrite the ``data.pkl`` member of a torch checkpoint with ``edit(bytes)``, keeping valid CRCs."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for member, data in members.items():
            archive.writestr(member, edit(data) if member.endswith("/data.pkl") else data)


@pytest.mark.parametrize("spelling", ["numpy.core.multiarray", "numpy._core.multiarray"])
def test_numpy_values_load_under_either_numpy_spelling(tmp_path, spelling):
    """A file naming numpy 1.x's numpy.core.multiarray, or numpy 2.x's numpy._core.multiarray, loads the same."""
    payload = {"pipeline": {"scalar": np.float32(2.5), "array": np.arange(6, dtype=np.int16).reshape(2, 3)}}
    path = tmp_path / "last.pt"
    atomic_save(payload, path)
    numpy1, numpy2 = b"numpy.core.multiarray", b"numpy._core.multiarray"
    rewrite_pickle(path, lambda data: data.replace(numpy2, numpy1).replace(numpy1, spelling.encode()))
    with zipfile.ZipFile(path) as archive:
        pickled = next(archive.read(name) for name in archive.namelist() if name.endswith("/data.pkl"))
    assert pickled.count(spelling.encode()) == 2, "the file names _reconstruct and scalar in that spelling only"
    assert_same(load_checkpoint(path), payload)


def test_loads_in_several_threads_do_not_take_the_allowlist_from_each_other(tmp_path):
    """Loads running in four threads at once all get numpy values back, and torch's allowlist ends as it began."""
    before = list(torch.serialization.get_safe_globals())
    payload = {"pipeline": {"array": np.arange(1000.0), "scalar": np.int64(7), "window": slice(3)}}
    atomic_save(payload, tmp_path / "last.pt")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: load_checkpoint(tmp_path / "last.pt"), range(40)))
    for result in loaded:
        assert_same(result, payload)
    assert set(torch.serialization.get_safe_globals()) == set(before)  # torch keeps them in a set: order varies


def test_a_cyclic_payload_is_checked_once_and_round_trips(tmp_path):
    """A list that contains itself is walked once by check_loadable and loads back as the same cycle."""
    loop: list[object] = [np.int64(1)]
    loop.append(loop)
    check_loadable({"item": {"loop": loop}})
    atomic_save({"item": {"loop": loop}}, tmp_path / "loop.pt")
    loaded = load_checkpoint(tmp_path / "loop.pt")["item"]["loop"]
    assert loaded[1] is loaded and loaded[0] == np.int64(1) and type(loaded[0]) is np.int64


class Unlisted:
    """A harmless user class: not on any allowlist."""

    def __init__(self) -> None:
        self.value = 1


class Colour(enum.Enum):
    """An enum a state_dict might hold by mistake."""

    RED = 1


Point = collections.namedtuple("Point", "x y")


def plain_function() -> int:
    """A module-level function a state_dict might hold by mistake."""
    return 0


class MyTensor(torch.Tensor):
    """A tensor subclass that is not on torch's allowlist."""


def _matrix() -> object:
    with warnings.catch_warnings():  # numpy discourages the matrix class; it is here to be refused
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(np.eye(2))


REFUSED = {
    "numpy_object_array": (np.array([1, "a"], dtype=object), "numpy.ndarray of dtype object"),
    "numpy_generator": (np.random.default_rng(0), "numpy.random._generator.Generator"),
    "numpy_random_state": (np.random.RandomState(0), "numpy.random.mtrand.RandomState"),
    "lambda": (lambda: 0, "function"),
    "function": (plain_function, "function"),
    "user_class": (Unlisted(), f"{__name__}.Unlisted"),
    "datetime": (datetime.datetime(2024, 1, 2), "datetime.datetime"),
    "timedelta": (datetime.timedelta(seconds=3), "datetime.timedelta"),
    "path": (pathlib.Path("/data/x"), "pathlib."),
    "fraction": (fractions.Fraction(1, 3), "fractions.Fraction"),
    "enum": (Colour.RED, f"{__name__}.Colour"),
    "namedtuple": (Point(1, 2), f"{__name__}.Point"),
    "frozenset": (frozenset({1}), "frozenset"),
    "range": (range(3), "range"),
    "defaultdict": (collections.defaultdict(int), "collections.defaultdict"),
    "class_object": (int, "type"),
    "torch_generator": (torch.Generator(), "torch._C.Generator"),
    "tensor_subclass": (torch.ones(2).as_subclass(MyTensor), f"{__name__}.MyTensor"),
    "datetime64_array": (np.array(["2024-01-02"], dtype="datetime64[D]"), "dtype datetime64[D]"),
    "structured_array": (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "numpy.ndarray of dtype"),
    "string_array": (np.array(["ab"]), "numpy.ndarray of dtype <U2"),
    "numpy_string": (np.str_("a"), "numpy.str_"),
    "longdouble": (np.zeros(2, dtype=np.longdouble), "numpy.ndarray of dtype float128"),
    "numpy_matrix": (_matrix(), "numpy.matrix"),
}
"""Values a checkpoint may not hold, and what the refusal calls them."""


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_check_loadable_refuses_what_would_not_load_naming_item_and_key_path(name):
    """A value that would not load is refused before the save, naming the item, the key path, the type and a fix."""
    value, type_name = REFUSED[name]
    payload = {"model": {"w": torch.ones(1)}, "sampler": {"rng": {"gen": [0, {"state": value}]}}}
    with pytest.raises(CheckpointUnsafeError) as info:
        check_loadable(payload)
    message = str(info.value)
    assert message.startswith("checkpoint item 'sampler' holds a "), message
    assert "at sampler['rng']['gen'][1]['state'] that cannot be loaded safely" in message, message
    assert type_name in message and type_name in info.value.type_name, message
    assert "; " in message.split("weights_only=True)", 1)[1], f"no fix in {message}"
    assert info.value.location == "sampler['rng']['gen'][1]['state']"
    assert not isinstance(info.value, CheckpointCorruptError)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_check_loadable_refuses_really_does_not_load(tmp_path, name):
    """Each refused value, saved anyway with torch.save, is refused by load_checkpoint as unsafe, not as corrupt."""
    value, _ = REFUSED[name]
    path = tmp_path / f"{name}.pt"
    try:
        torch.save({"sampler": {"state": value}}, path)
    except Exception:  # noqa: BLE001 - a value torch cannot even save needs no load check
        pytest.skip(f"torch.save cannot write a {type(value).__name__}")
    with pytest.raises(CheckpointUnsafeError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "the file is intact, not corrupt" in str(info.value)


def test_refused_keys_set_members_and_attributes_are_located():
    """A refused dict key, set member or module metadata entry is located by its container's key path."""
    cases = [
        ({"sched": {"by": {Colour.RED: 1}}}, "sched['by'][<key>]"),
        ({"sched": {"seen": {1, Colour.RED}}}, "sched['seen']{<member>}"),
        ({"sched": {"window": slice(0, fractions.Fraction(1, 2))}}, "sched['window'].stop"),
    ]
    metadata = collections.OrderedDict(w=torch.ones(1))
    metadata._metadata = {"": {"when": datetime.date(2024, 1, 1)}}  # type: ignore[attr-defined]
    cases.append(({"model": metadata}, "model._metadata['']['when']"))
    for payload, location in cases:
        with pytest.raises(CheckpointUnsafeError) as info:
            check_loadable(payload)
        assert info.value.location == location, str(info.value)


def test_ints_load_up_to_the_size_torchs_unpickler_reads():
    """Ints below 2**2039 in size round-trip; larger ones, which torch's unpickler cannot read, are refused."""
    for value in (2**2039 - 1, -(2**2039) + 1):
        check_loadable({"item": {"n": [value]}})
    for value in (2**2039, -(2**2039)):
        with pytest.raises(CheckpointUnsafeError, match=r"holds a very large int \(2040 bits\) at item\['n'\]\[0\]"):
            check_loadable({"item": {"n": [value]}})


def test_an_intact_file_holding_a_huge_int_is_unsafe_not_corrupt(tmp_path):
    """A file torch.save wrote with an int of 2**2039 or more is refused as unsafe, naming the int, not as corrupt."""
    big, small = tmp_path / "big.pt", tmp_path / "small.pt"
    torch.save({"item": {"n": 2**2039}}, big)
    atomic_save({"item": {"n": 2**2039 - 1}}, small)
    assert load_checkpoint(small)["item"]["n"] == 2**2039 - 1
    with pytest.raises(CheckpointUnsafeError, match=r"it holds an int of 2\*\*2039 or more"):
        load_checkpoint(big)


def test_check_loadable_refuses_a_payload_that_is_not_a_dict():
    """A payload that is not a dict of items is refused: load_checkpoint only returns dicts."""
    with pytest.raises(CheckpointUnsafeError, match="must be a dict of items, got a list"):
        check_loadable([1, 2])  # type: ignore[arg-type]


def test_check_loadable_accepts_types_the_caller_allowlisted_in_torch():
    """A class the caller put on torch's process-wide allowlist loads, so check_loadable accepts it."""
    with torch.serialization.safe_globals([Unlisted]):
        check_loadable({"item": {"obj": Unlisted()}})
    with pytest.raises(CheckpointUnsafeError):
        check_loadable({"item": {"obj": Unlisted()}})


def test_an_intact_file_holding_a_refused_type_is_unsafe_not_corrupt(tmp_path):
    """An intact file holding a user class raises CheckpointUnsafeError naming the type and the fix, never corrupt."""
    path = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.ones(2)}, "sampler": {"rng": Unlisted()}}, path)  # bypasses check_loadable
    with pytest.raises(CheckpointUnsafeError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} was refused: it holds {__name__}.Unlisted")
    assert "return plain values" in message and "weights_only=True" in message
    assert info.value.type_name == f"{__name__}.Unlisted"
    assert isinstance(info.value, CheckpointError) and not isinstance(info.value, CheckpointCorruptError)


class RunsCode:
    """An object whose unpickling runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """A file whose pickle calls os.system is refused (as unsafe) and the command never runs."""
    marker = tmp_path / "FILE"
    path = tmp_path / "hostile.pt"
    torch.save({"sampler": {"hook": RunsCode(f"echo pwned > {marker}")}}, path)
    with pytest.raises(CheckpointUnsafeError, match=r"it holds (posix|nt)\.system"):
        load_checkpoint(path)
    assert not marker.exists()


def test_an_object_array_whose_element_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """A numpy object array holding a code-running element is refused and the command never runs."""
    marker = tmp_path / "FILE"
    path = tmp_path / "hostile.pt"
    torch.save({"pipeline": {"cache": np.array([RunsCode(f"echo pwned > {marker}")], dtype=object)}}, path)
    with pytest.raises(CheckpointUnsafeError):
        load_checkpoint(path)
    assert not marker.exists()


class Crafted:
    """An object that pickles as ``func(*args)`` followed by ``BUILD state``, as a hand-made file would."""

    def __init__(self, func, args, state=None) -> None:
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.reduced


def _dtype(state=(3, "<", None, None, None, -1, -1, 0), code="f8"):
    return Crafted(np.dtype, (code, False, True), state)


_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_SCALAR = np.float64(0).__reduce__()[0]

CRAFTED = {
    "dtype_flags_claim_object_pointers": (_dtype((3, "<", None, None, None, -1, -1, 63)), "numpy dtype state"),
    "dtype_fields_hide_an_object": (
        _dtype((3, "|", None, ("a",), {"a": (np.dtype("f8"), 0)}, 8, 1, 63)),
        "numpy dtype state",
    ),
    "dtype_with_extra_arguments": (Crafted(np.dtype, ("f8", True, True)), "malformed numpy dtype"),
    "array_from_a_list": (
        Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (1,), _dtype(), False, [1.0])),
        "malformed numpy array state",
    ),
    "array_bytes_too_short": (
        Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (9,), _dtype(), False, b"x")),
        "bytes do not match",
    ),
    "array_of_another_class": (
        Crafted(_RECONSTRUCT, (collections.OrderedDict, (0,), b"b"), (1, (1,), _dtype(), False, b"1" * 8)),
        "numpy array of a subclass",
    ),
    "ndarray_called_directly": (Crafted(np.ndarray, ((2,), "O")), "direct call of numpy.ndarray"),
    "scalar_bytes_too_long": (Crafted(_SCALAR, (_dtype(), b"123456789")), "bytes do not match its dtype"),
    "bytes_of_a_chosen_size": (Crafted(bytes, (10**6,)), "builtins.bytes called with arguments"),
}
"""Hand-made pickles no torch.save of a plain value writes, aimed at numpy's and trainkit's builders, and what
the refusal says about each."""


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_numpy_pickles_are_refused_before_numpy_sees_them(tmp_path, name):
    """A hand-made numpy state (pointer-claiming dtype flags, list data, wrong sizes) is refused as corrupt."""
    value, reason = CRAFTED[name]
    path = tmp_path / f"{name}.pt"
    torch.save({"pipeline": {"state": value}}, path)
    with pytest.raises(CheckpointCorruptError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and reason in str(info.value)


def test_an_intact_file_with_a_garbage_pickle_is_still_corrupt(tmp_path):
    """A CRC-valid file whose data.pkl is not a pickle torch.save writes stays CheckpointCorruptError (refused by the
    pre-scan of its pickle, which names the opcode, before torch reads it)."""
    path = tmp_path / "garbage.pt"
    torch.save({"placeholder": 0}, path)
    rewrite_pickle(path, lambda data: b"\x80\x02\xff.")
    with pytest.raises(CheckpointCorruptError, match=r"its pickle is truncated or malformed .*opcode b'\\xff' unknown"):
        load_checkpoint(path)


def test_numpy_values_without_numpy_installed_say_so(tmp_path):
    """Loading numpy values in a process without numpy is a clear CheckpointUnsafeError that says to install it."""
    path = tmp_path / "numpy.pt"
    atomic_save({"sched": {"lr": np.float64(0.1)}}, path)
    script = (
        "import sys; sys.modules['numpy'] = None\n"  # how a process without numpy looks to an import
        "import warnings; warnings.simplefilter('ignore')\n"
        "from trainkit.checkpoint import load_checkpoint\n"
        "from trainkit import CheckpointUnsafeError\n"
        "try:\n"
        f"    load_checkpoint({str(path)!r})\n"
        "except CheckpointUnsafeError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "numpy is not installed; install numpy to load it" in proc.stdout, proc.stdout + proc.stderr


def test_staging_keeps_types_and_copies_numpy_arrays():
    """Async staging returns numpy values, slices, torch.Size, dtypes, Counter and Parameters unchanged, not aliased."""
    payload = full_payload()
    staged = StagingBuffers().stage(payload)
    assert_same(staged, payload)
    array = payload["pipeline"]["array_int64"]
    array[0, 0] = 99  # the caller changing its array after the submit must not change what is written
    assert staged["pipeline"]["array_int64"][0, 0] != 99


def test_what_torch_registers_during_a_load_stays_registered(tmp_path):
    """A type torch (or anyone) adds to the allowlist while a load runs is still there after it: only trainkit's
    own entries are taken out again."""
    atomic_save({"pipeline": {"scalar": np.int64(1)}}, tmp_path / "last.pt")

    class Registered:
        pass

    original = torch.load

    def load_and_register(*args, **kwargs):
        torch.serialization.add_safe_globals([Registered])  # what a lazily imported torch module does
        return original(*args, **kwargs)

    torch.load = load_and_register
    try:
        load_checkpoint(tmp_path / "last.pt")
    finally:
        torch.load = original
    try:
        assert Registered in torch.serialization.get_safe_globals()
        assert not any(  # none of trainkit's own builders (the slice's, numpy's) is left behind
            isinstance(entry, tuple) and getattr(entry[0], "__module__", "").startswith("trainkit")
            for entry in torch.serialization.get_safe_globals()
        )
    finally:
        kept = [entry for entry in torch.serialization.get_safe_globals() if entry is not Registered]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(kept)
