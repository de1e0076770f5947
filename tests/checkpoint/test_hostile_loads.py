"""Careless and hostile files at a checkpoint path: non-regular files, crafted zips, payloads of the wrong shape.

Every one is a CheckpointCorruptError naming the path and what was wrong, refused promptly and in bounded
memory: loads that could hang or grow without limit run in a thread with a timeout or a child process with a
memory limit, so a regression fails instead of hanging the suite. The payload validators run on real
checkpoints of a TinyTrainer and on those checkpoints with one value broken.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import trainkit.files.weights_only_load as safe_load
from tests.faults.harness import ROOT, child_env
from tests.helpers.checkpoint_files import members_of, rewrite, small_checkpoint
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit import CheckpointCorruptError, CheckpointUnsafeError
from trainkit.bookkeeping import RESERVED_NAMES
from trainkit.checkpoint import load_checkpoint, verify_checkpoint
from trainkit.checkpoint.payload import BEST_PT, LAST_PT, MAX_ITEM_DEPTH, SCHEMA_VERSION, validate_best, validate_last
from trainkit.trainer import CHECKPOINT_SCHEMA_VERSION

GiB = 2**30
LINUX = sys.platform.startswith("linux")
needs_linux = pytest.mark.skipif(not LINUX, reason="the child's memory is measured through /proc and RLIMIT_AS")
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real last.pt and best.pt of a 2-epoch TinyTrainer run, and their loaded payloads."""
    out = tmp_path_factory.mktemp("real")
    TinyTrainer(make_cfg(out, epochs=2)).train()
    last, best = out / "last.pt", out / "best.pt"
    return {"last": last, "best": best, "last_payload": load_checkpoint(last), "best_payload": load_checkpoint(best)}


# --------------------------------------------------------------------------------------------------- helpers


def load_in_thread(path: Path, seconds: float = 5.0) -> BaseException | None:
    """Run load_checkpoint(path) in a thread; fail the test if it has not returned within ``seconds``."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            load_checkpoint(path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if path.is_fifo():  # give the blocked open its writer, so the thread ends
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"load_checkpoint({path}) was still running after {seconds} s")
    return outcome[0]


CHILD = r"""
import json, resource, sys, time
import trainkit.checkpoint
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    getattr(trainkit.checkpoint, sys.argv[1])(sys.argv[2])
    outcome = {"error": None, "message": ""}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
outcome["seconds"] = time.perf_counter() - start
outcome["rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps(outcome))
"""
"""Loads a file in a fresh process whose address space may grow by 1 GiB at most; prints what happened."""


def run_in_child(function: str, path: Path) -> dict:
    """Call trainkit.checkpoint.<function>(path) in a child process limited to 1 GiB more memory, within 60 s."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, function, str(path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Entry:
    """One member of a hand-written archive and what its directory entry declares."""

    name: str
    data: bytes | None  # None: a hole of ``size`` bytes (a sparse file)
    size: int | None = None  # the declared size; len(data) when None
    crc: int | None = None  # the declared CRC-32; the data's when None
    same_as: str | None = None  # declare the local header and data of another member


def write_zip(path: Path, entries: list[Entry]) -> None:
    """Write a zip64 archive by hand, laid out as torch.save lays one out, declaring whatever the entries say."""
    declared = {}
    with open(path, "wb") as file:
        for entry in entries:
            size = len(entry.data) if entry.size is None else entry.size
            crc = zlib.crc32(entry.data or b"") if entry.crc is None else entry.crc
            if entry.same_as is not None:
                declared[entry.name] = (*declared[entry.same_as][:2], crc)
                continue
            name = entry.name.encode()
            offset = file.tell()
            extra = struct.pack("<2H2Q", 1, 16, size, size)
            header = struct.pack(
                "<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0, crc, 2**32 - 1, 2**32 - 1, len(name), 16 + 4
            )
            file.write(header + name + extra)
            if entry.data is None:
                file.seek(size, os.SEEK_CUR)
            else:
                file.write(entry.data)
            declared[entry.name] = (offset, size, crc)
        cd_offset = file.tell()
        for name, (offset, size, crc) in declared.items():
            raw = name.encode()
            extra = struct.pack("<2H3Q", 1, 24, size, size, offset)
            fields = (b"PK\x01\x02", 45, 45, 0, 0, 0, 0, crc, 2**32 - 1, 2**32 - 1, len(raw), len(extra), 0, 0, 0, 0)
            file.write(struct.pack("<4s6H3L5H2L", *fields, 2**32 - 1) + raw + extra)
        cd_size = file.tell() - cd_offset
        end64 = file.tell()
        count = len(declared)
        file.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset))
        file.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1))
        file.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 2**32 - 1, 2**32 - 1, 0))


def refused(path: Path, *fragments: str) -> str:
    """Assert that load_checkpoint(path) is a CheckpointCorruptError naming the path and each fragment."""
    with pytest.raises(CheckpointCorruptError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --------------------------------------------------------------------------------------------- not a file


@needs_fifo
@pytest.mark.parametrize("name", ["last.pt", "best.pt", "last.prev.pt"])
def test_a_fifo_at_a_checkpoint_path_is_refused_at_once(tmp_path, name):
    """A FIFO at last.pt, best.pt or last.prev.pt is refused at once, without waiting for a writer."""
    path = tmp_path / name
    os.mkfifo(path)
    error = load_in_thread(path)
    assert isinstance(error, CheckpointCorruptError), error
    assert str(error) == f"checkpoint {path} is a FIFO (named pipe), not a regular file; it was not read"
    with pytest.raises(CheckpointCorruptError, match="FIFO"):
        verify_checkpoint(path)


@needs_fifo
def test_a_fifo_swapped_in_after_the_stat_is_refused_without_blocking(tmp_path, monkeypatch):
    """A regular file replaced by a FIFO between the stat and the open is refused by the fstat, and never blocks."""
    path = tmp_path / "last.pt"
    path.write_bytes(b"placeholder")
    real_stat = os.stat

    def stat_then_swap(target, *args, **kwargs):
        result = real_stat(target, *args, **kwargs)
        if os.fspath(target) == str(path) and stat.S_ISREG(result.st_mode):
            os.unlink(path)
            os.mkfifo(path)
        return result

    monkeypatch.setattr(os, "stat", stat_then_swap)
    error = load_in_thread(path)
    assert isinstance(error, CheckpointCorruptError) and "is a FIFO (named pipe), not a regular file" in str(error)


@needs_linux
def test_a_symlink_to_dev_zero_is_refused_without_reading_it(tmp_path):
    """last.pt -> /dev/zero is refused before it is opened, in well under a second, naming the link and its target."""
    path = tmp_path / "last.pt"
    path.symlink_to("/dev/zero")
    outcome = run_in_child("load_checkpoint", path)
    assert outcome["error"] == "CheckpointCorruptError", outcome
    assert outcome["message"] == (
        f"checkpoint {path} is a symbolic link to a character device (/dev/zero), not a regular file; it was not read"
    )
    assert outcome["seconds"] < 1 and outcome["rss_growth_mb"] < 64, outcome


def test_a_directory_at_a_checkpoint_path_is_refused(tmp_path):
    """A directory named last.pt is refused as not a regular file."""
    path = tmp_path / "last.pt"
    path.mkdir()
    refused(path, "is a directory, not a regular file")


def test_a_missing_checkpoint_still_says_so(tmp_path):
    """A path with nothing there keeps its message."""
    path = tmp_path / "last.pt"
    assert refused(path) == f"checkpoint {path} does not exist"


def test_a_symlink_to_a_real_checkpoint_still_loads(tmp_path, real):
    """A symbolic link to a regular checkpoint file is followed and loads like the file itself."""
    link = tmp_path / "last.pt"
    link.symlink_to(real["last"])
    assert load_checkpoint(link)["step"] == real["last_payload"]["step"]


# --------------------------------------------------------------------------------------------- crafted zips


def test_a_deflate_compressed_member_is_refused_before_anything_is_decompressed(tmp_path):
    """A real checkpoint rewritten with DEFLATE members is refused from its directory (torch.save stores members)."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "deflated.pt"
    rewrite(source, path, zipfile.ZIP_DEFLATED)
    refused(path, "is not a torch checkpoint: member", "is compressed (zip method 8)")


def test_a_zip_bomb_is_refused_in_bounded_time(tmp_path):
    """A 64 KiB file whose DEFLATE member expands to 64 MiB is refused without inflating it."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "bomb.pt"
    rewrite(source, path, zipfile.ZIP_DEFLATED, data_0=bytes(64 * 2**20))
    assert path.stat().st_size < 2**20
    start = time.perf_counter()
    refused(path, "is compressed (zip method 8)")
    assert time.perf_counter() - start < 0.5


def test_the_hand_written_archive_of_a_real_checkpoint_loads(tmp_path):
    """The test's own zip writer lays out a real checkpoint so that it verifies and loads: the crafted files below
    differ from a loadable one only in what they declare."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "hand.pt"
    write_zip(path, [Entry(name, data) for name, data in members_of(source).items()])
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["n"] == 3


@needs_linux
def test_a_member_declaring_12_gib_in_a_small_file_is_refused_at_once_in_bounded_memory(tmp_path):
    """A 2 KB file whose directory declares a 12 GiB member is refused from the directory alone: at once, and
    without the child's memory growing."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "declared.pt"
    entries = [
        Entry(name, data, size=12 * GiB if "/data/" in name else None) for name, data in members_of(source).items()
    ]
    write_zip(path, entries)
    assert path.stat().st_size < 4096
    for function in ("verify_checkpoint", "load_checkpoint"):
        outcome = run_in_child(function, path)
        assert outcome["error"] == "CheckpointCorruptError", outcome
        assert str(path) in outcome["message"] and "declares 12884901888 bytes" in outcome["message"], outcome
        assert outcome["seconds"] < 1 and outcome["rss_growth_mb"] < 64, outcome


def sparse_checkpoint(tmp_path: Path, hole: int, crc: int | None) -> Path:
    """A hand-written checkpoint whose tensor member is a hole of ``hole`` bytes; skip where holes take disk."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "sparse.pt"
    entries = [
        Entry(name, None, size=hole, crc=crc) if name.endswith("/data/0") else Entry(name, data)
        for name, data in members_of(source).items()
    ]
    write_zip(path, entries)
    if path.stat().st_blocks * 512 > 64 * 2**20:
        path.unlink()
        pytest.skip("this filesystem does not keep holes")
    return path


@needs_linux
def test_a_sparse_12_gib_member_is_checked_without_reading_its_hole(tmp_path):
    """A sparse file claiming 12 GiB of tensor data (a few KB on disk) is checked in a moment and bounded memory:
    its hole enters the CRC arithmetically, and the forged CRC is refused."""
    path = sparse_checkpoint(tmp_path, 12 * GiB, crc=0x1234)
    try:
        outcome = run_in_child("verify_checkpoint", path)
    finally:
        path.unlink()
    assert outcome["error"] == "CheckpointCorruptError", outcome
    assert "CRC mismatch in 'small/data/0'" in outcome["message"], outcome
    assert outcome["seconds"] < 2 and outcome["rss_growth_mb"] < 64, outcome


def test_a_sparse_copy_of_a_checkpoint_verifies_and_loads_like_the_dense_one(tmp_path):
    """A checkpoint copied sparsely (its zero blocks left as holes, as cp --sparse=always or ZFS do) verifies and
    loads the same values as the original."""
    dense = small_checkpoint(tmp_path, {"zeros": torch.zeros(2**21), "ones": torch.ones(1000)})
    sparse = tmp_path / "sparse_copy.pt"
    block = 2**16
    with open(dense, "rb") as src, open(sparse, "wb") as dst:
        while chunk := src.read(block):
            if chunk.count(0) == len(chunk):
                dst.seek(len(chunk), os.SEEK_CUR)
            else:
                dst.write(chunk)
        dst.truncate()
    assert sparse.read_bytes() == dense.read_bytes()
    if sparse.stat().st_blocks * 512 >= dense.stat().st_blocks * 512 - 2**20:
        pytest.skip("this filesystem does not keep holes")
    loaded = load_checkpoint(sparse)
    assert torch.equal(loaded["zeros"], torch.zeros(2**21)) and torch.equal(loaded["ones"], torch.ones(1000))


def end_records(raw: bytearray) -> tuple[int, int]:
    """Where a torch.save file's zip64 end record and zip end record start."""
    return raw.rindex(b"PK\x06\x06"), raw.rindex(b"PK\x05\x06")


def test_more_members_than_the_directory_can_hold_are_refused(tmp_path):
    """End records that declare a million members for a directory of a few hundred bytes are refused unread."""
    path = small_checkpoint(tmp_path)
    raw = bytearray(path.read_bytes())
    end64, end = end_records(raw)
    struct.pack_into("<2Q", raw, end64 + 24, 10**6, 10**6)
    struct.pack_into("<2H", raw, end + 8, 0xFFFF, 0xFFFF)  # the counts are in the zip64 record
    path.write_bytes(bytes(raw))
    refused(path, "declaring 1000000 members")


def test_a_central_directory_larger_than_the_file_is_refused(tmp_path):
    """A directory declared larger than the bytes before the end records is refused before it is read."""
    path = small_checkpoint(tmp_path)
    raw = bytearray(path.read_bytes())
    end64, end = end_records(raw)
    struct.pack_into("<Q", raw, end64 + 40, 2**40)
    struct.pack_into("<L", raw, end + 12, 2**32 - 1)  # the size is in the zip64 record
    path.write_bytes(bytes(raw))
    refused(path, "is truncated or not a torch checkpoint (its central directory is declared as 1099511627776 bytes")


def test_members_that_overlap_are_refused(tmp_path):
    """Two directory entries pointing at the same bytes (each byte checked and loaded twice) are refused."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "overlap.pt"
    members = members_of(source)
    entries = [Entry(name, data) for name, data in members.items()]
    entries.append(Entry("small/data/1", members["small/data/0"], same_as="small/data/0"))
    write_zip(path, entries)
    refused(path, "member 'small/data/1' overlapping the member before it")


@pytest.mark.parametrize(
    "name", ["small/constants.pkl", "small/code/__torch__/m.py", "other/data/0", "small/data/../data.pkl"]
)
def test_member_names_torch_save_never_writes_are_refused(tmp_path, name):
    """A TorchScript record, a member outside the archive's folder, or a name with ``..`` is refused by name."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "named.pt"
    write_zip(path, [*(Entry(n, d) for n, d in members_of(source).items()), Entry(name, b"x")])
    refused(path, f"a member named {name!r}")


def test_an_encrypted_member_is_refused(tmp_path):
    """A member whose directory entry says it is encrypted is refused before it is read."""
    path = small_checkpoint(tmp_path)
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")
    raw[entry + 8] |= 0x01
    path.write_bytes(bytes(raw))
    refused(path, "is encrypted")


def test_data_before_the_first_member_is_refused(tmp_path):
    """An archive behind a prefix (which torch.load would read in its legacy, non-zip format) is refused."""
    source = small_checkpoint(tmp_path)
    path = tmp_path / "prefixed.pt"
    with open(path, "wb") as file:
        file.write(pickle.dumps({"legacy": True}))
        with zipfile.ZipFile(file, "w") as archive:
            for name, data in members_of(source).items():
                archive.writestr(name, data)
    refused(path, "not a torch checkpoint")


def test_a_file_swapped_at_the_path_after_verification_is_not_the_one_loaded(tmp_path, monkeypatch):
    """torch.load reads the file that was verified, even when another file is renamed over the path meanwhile."""
    path = tmp_path / "last.pt"
    torch.save({"which": "verified"}, path)
    other = tmp_path / "other.pt"
    torch.save({"which": "swapped in"}, other)
    verify = safe_load.verify_open

    def verify_then_swap(*args):
        verify(*args)
        os.replace(other, path)

    monkeypatch.setattr(safe_load, "verify_open", verify_then_swap)
    assert load_checkpoint(path) == {"which": "verified"}


def test_a_file_written_into_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """A checkpoint changed in place between verification and load (size or mtime) is refused as corrupt."""
    path = small_checkpoint(tmp_path)
    verify = safe_load.verify_open

    def verify_then_write(*args):
        verify(*args)
        with open(path, "r+b") as file:  # the same bytes, written again: only the modification time tells
            first = file.read(1)
            file.seek(0)
            file.write(first)
        info = path.stat()
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))

    monkeypatch.setattr(safe_load, "verify_open", verify_then_write)
    refused(path, "was written into while it was being read")


# --------------------------------------------------------------------------------------------- deep nesting


def nested_pickle(depth: int, leaf: bytes = b"") -> bytes:
    """A protocol-2 pickle of ``{"config": {"a": [[[...leaf...]]]}}``, ``depth`` lists deep (no pickler writes one)."""
    inner = b"]" * depth + leaf + b"a" * (depth - (0 if leaf else 1))
    return b"\x80\x02}X\x06\x00\x00\x00config}X\x01\x00\x00\x00a" + inner + b"ss."


def test_a_pickle_nested_100000_deep_is_refused_before_it_is_unpickled(tmp_path):
    """A CRC-valid last.pt whose config is 100000 nested lists is refused by the pre-scan of its pickle, as unsafe
    (it is what somebody wrote, not damage), before torch's unpickler builds anything."""
    path = tmp_path / "deep.pt"
    rewrite(small_checkpoint(tmp_path, {"config": 0}), path, data_pkl=nested_pickle(100_000))
    with pytest.raises(CheckpointUnsafeError, match=r"before it was unpickled: its pickle nests values more than 1000"):
        load_checkpoint(path)


def test_a_pickle_nested_below_the_scan_limit_loads_and_is_refused_by_validation_not_by_recursion(tmp_path, real):
    """A CRC-valid last.pt whose config is 900 nested lists passes the pre-scan, loads (torch's unpickler is
    iterative) and is then a CheckpointCorruptError naming config, never a RecursionError."""
    path = tmp_path / "deep.pt"
    rewrite(small_checkpoint(tmp_path, {"config": 0}), path, data_pkl=nested_pickle(900))
    payload = load_checkpoint(path)
    last = {**real["last_payload"], "config": payload["config"]}
    with pytest.raises(
        CheckpointCorruptError, match=r"config\['a'\]\[0\]\[0\]\[0\]\[0\]\.\.\. must be nested at most 32 deep"
    ) as info:
        validate_last(last, path=path)
    assert len(str(info.value)) < 1000


def test_a_numpy_array_at_the_bottom_of_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    """A numpy array under 20000 nested lists is refused by the pickle's pre-scan; under 990 (below the scan's
    limit, beyond Python's recursion limit for putting arrays back in place) it is corrupt, not a RecursionError."""
    array = pickle.dumps(np.zeros(2), protocol=2)[2:-1]  # without PROTO and STOP
    path = tmp_path / "deep_numpy.pt"
    rewrite(small_checkpoint(tmp_path, {"config": 0}), path, data_pkl=nested_pickle(20_000, array))
    with pytest.raises(CheckpointUnsafeError, match="its pickle nests values more than 1000 deep"):
        load_checkpoint(path)
    rewrite(small_checkpoint(tmp_path, {"config": 0}), path, data_pkl=nested_pickle(990, array))
    refused(path, "could not be read: maximum recursion depth exceeded")


# --------------------------------------------------------------------------------------------- validators


def test_real_last_and_best_checkpoints_validate(real):
    """A last.pt and a best.pt written by the trainer pass their validators."""
    validate_last(real["last_payload"], path=real["last"], world_size=1)
    validate_best(real["best_payload"], path=real["best"])


def test_a_last_pt_from_before_training_modes_and_last_validated_still_validates(real):
    """A last.pt written before training_modes and loop.last_validated existed still validates."""
    old = dict(real["last_payload"])
    del old["training_modes"]
    old["loop"] = {key: value for key, value in old["loop"].items() if key != "last_validated"}
    old["rng"] = [{**state, "python": [3, list(range(624)) + [624], None]} for state in old["rng"]]
    validate_last(old, path="old/last.pt")


def test_the_schema_names_every_engine_key_and_the_trainers_version(real):
    """LAST_PT names exactly the reserved engine keys, which a real last.pt holds, and the trainer's schema version."""
    assert {key.name for key in LAST_PT} == RESERVED_NAMES
    assert {key.name for key in LAST_PT} <= set(real["last_payload"])
    assert [key.name for key in BEST_PT] == list(real["best_payload"])
    assert SCHEMA_VERSION == CHECKPOINT_SCHEMA_VERSION


def deep_list(depth: int) -> list:
    """A list nested ``depth`` deep, built without recursion."""
    root = current = []
    for _ in range(depth - 1):
        current.append([])
        current = current[0]
    return root


def broken_rng(real_state: dict, **changes) -> list:
    return [{**real_state, **changes}]


LAST_CASES = {
    "loop_is_an_int": ("loop", 5, "loop must be a LoopState dict, got int 5"),
    "loop_breaks_a_rule": ("loop", "negative epoch", "LoopState.epoch must be an int >= 0, got -1"),
    "config_is_a_list": ("config", [1, 2], "config must be a dict of str keys"),
    "config_holds_an_object": ("config", {"a": {1, 2}}, "config['a'] must be None, a bool, a number"),
    "config_is_100000_deep": ("config", {"a": deep_list(100_000)}, "must be nested at most 32 deep"),
    "rng_is_empty": ("rng", [], "rng must be a non-empty list"),
    "rng_per_rank_is_a_list": ("rng", [[1, 2]], "rng[0] must be a dict of generator states"),
    "rng_python_is_garbage": ("rng", "python", "rng[0]['python'] must be [version, state"),
    "rng_torch_is_garbage": ("rng", "torch", "rng[0]['torch'] must be torch's CPU generator state"),
    "rng_for_two_ranks": ("rng", "two ranks", "rng must be a list of 1 states (world_size=1, one per rank)"),
    "rank_items_is_a_list": ("rank_items", [1], "rank_items must be None or {'means': {item name:"),
    "rank_items_names_no_item": (
        "rank_items",
        {"means": {}, "differ": ["ghost"]},
        "the names of items listed in items",
    ),
    "rank_items_mean_is_a_float": (
        "rank_items",
        {"means": {"model": [{"sum": 1.0, "count": 1}]}, "differ": []},
        "rank_items['means']['model'][0]['sum'] must be None or a 0-d floating tensor",
    ),
    "rank_items_mean_for_two_ranks": (
        "rank_items",
        {"means": {"model": [{"sum": None, "count": 0}] * 2}, "differ": []},
        "rank_items['means']['model'] must be a list of 1 states (world_size=1, one per rank)",
    ),
    "latest_metrics_is_an_int": (
        "latest_metrics",
        3,
        "latest_metrics must be a dict of str to int or float, got int 3",
    ),
    "latest_metrics_holds_a_str": ("latest_metrics", {"a": "x"}, "latest_metrics['a'] must be an int or a float"),
    "results_is_a_list": ("results", [1.0], "results must be None or a dict of str to int or float"),
    "run_id_walks_up": ("wandb_run_id", "../../x", "wandb_run_id must be None or a W&B run id"),
    "run_id_is_200_chars": ("wandb_run_id", "a" * 200, "wandb_run_id must be None or a W&B run id"),
    "run_id_is_an_int": ("wandb_run_id", 7, "wandb_run_id must be None or a W&B run id"),
    "step_is_a_bool": ("step", True, "step must be an int in [0, 2**63), got bool True"),
    "epoch_is_negative": ("epoch", -1, "epoch must be an int in [0, 2**63), got int -1"),
    "epoch_is_huge": ("epoch", 2**70, "epoch must be an int in [0, 2**63)"),
    "world_size_is_zero": ("world_size", 0, "world_size must be an int in [1, 2**63), got int 0"),
    "schema_version_is_a_str": ("schema_version", "1", "schema_version must be an int in [1, 2**63), got str '1'"),
    "best_is_a_loop_record": ("best", "loop record", "best must be None or a BestState dict that BestState.from_dict"),
    "best_metrics_is_an_int": ("best", "metrics 5", "best must be None or a BestState dict that BestState.from_dict"),
    "patience_is_an_int": ("patience", 5, "patience must be None or a PatienceState dict, got int 5"),
    "metrics_offset_is_negative": ("metrics_offset", -1, "metrics_offset must be None or an int in [0, 2**63)"),
    "items_repeat_a_name": ("items", ["model", "model", "optimizer"], "items[1] must be an identifier"),
    "items_name_an_engine_key": ("items", ["model", "optimizer", "loop"], "items[2] must be an identifier"),
    "items_name_a_missing_item": ("items", ["model", "optimizer", "sampler"], "'sampler' is not in the payload"),
    "training_modes_hold_an_int": ("training_modes", {"model": {"": 1}}, "training_modes['model'] must be a dict"),
    "training_modes_of_an_unknown_item": ("training_modes", {"other": {}}, "training_modes['other'] must be the mode"),
    "model_is_100000_deep": ("model", deep_list(100_000), "model[0][0][0][0][0][0]... must be nested at most 256 deep"),
    "a_stray_key": ("stray", 1, "key 'stray' must be an engine key or an item listed in items, got int 1"),
}
"""A real last.pt with one value replaced: the key, the value (or a name for one built from the real value), and
what the refusal says."""


def broken_last(real_payload: dict, key: str, value) -> dict:
    payload = copy.copy(real_payload)
    state = real_payload["rng"][0]
    special = {
        ("loop", "negative epoch"): {**real_payload["loop"], "epoch": -1},
        ("rng", "python"): broken_rng(state, python=[3, b"short", None]),
        ("rng", "torch"): broken_rng(state, torch=b"\x00" * 16),
        ("rng", "two ranks"): [state, state],
        ("best", "loop record"): real_payload["loop"],
        ("best", "metrics 5"): {**real_payload["best"], "metrics": 5},
    }
    payload[key] = special.get((key, value), value) if isinstance(value, str) else value
    return payload


@pytest.mark.parametrize("case", sorted(LAST_CASES))
def test_a_last_pt_with_a_value_of_the_wrong_shape_is_corrupt_naming_the_key(real, case):
    """Each malformed engine value of a last.pt is a CheckpointCorruptError naming the path, the key and the rule."""
    key, value, expected = LAST_CASES[case]
    payload = broken_last(real["last_payload"], key, value)
    with pytest.raises(CheckpointCorruptError) as info:
        validate_last(payload, path="run/last.pt", world_size=1)
    message = str(info.value)
    assert message.startswith("checkpoint run/last.pt is not a valid trainkit last.pt: "), message
    assert expected in message, message
    assert len(message) < 1000, message


@pytest.mark.parametrize("missing", ["loop", "rng", "schema_version"])
def test_a_last_pt_missing_an_engine_key_is_corrupt_naming_it(real, missing):
    """A last.pt without one of its engine keys is refused naming the missing key."""
    payload = {key: value for key, value in real["last_payload"].items() if key != missing}
    with pytest.raises(CheckpointCorruptError, match=f"it lacks '{missing}'"):
        validate_last(payload, path="run/last.pt")


def test_a_newer_schema_version_is_left_to_the_caller_in_last_and_refused_in_best(real):
    """validate_last leaves a newer layout to the caller's mismatch error; validate_best refuses it."""
    validate_last({**real["last_payload"], "schema_version": SCHEMA_VERSION + 1, "loop": 5}, path="last.pt")
    with pytest.raises(CheckpointCorruptError, match="schema_version must be at most 1, got 2"):
        validate_best({**real["best_payload"], "schema_version": SCHEMA_VERSION + 1}, path="best.pt")


def test_the_rng_list_is_held_to_the_world_size_only_when_the_caller_shares_it(real):
    """A last.pt of world_size=4 with one RNG state is left to the caller's world-size mismatch when the caller runs
    1 process, and refused when the caller runs 4 or does not say."""
    payload = {**real["last_payload"], "world_size": 4}
    validate_last(payload, path="last.pt", world_size=1)
    for world_size in (4, None):
        with pytest.raises(CheckpointCorruptError, match="rng must be a list of 4 states"):
            validate_last(payload, path="last.pt", world_size=world_size)


def test_a_bare_state_dict_saved_as_best_pt_is_corrupt_and_says_what_it_looks_like(tmp_path):
    """A user's own torch.save(model.state_dict(), "best.pt") is refused naming the missing keys and the cause."""
    path = tmp_path / "best.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(CheckpointCorruptError) as info:
        validate_best(load_checkpoint(path), path=path)
    assert str(info.value) == (
        f"checkpoint {path} is not a valid trainkit best.pt: it lacks 'schema_version', 'model', 'best', 'epoch', "
        "'config'; it looks like a bare state_dict (torch.save(model.state_dict(), ...)), not a file trainkit wrote"
    )


BEST_CASES = {
    "model_is_a_list": ("model", [1], "model must be a state dict"),
    "model_has_int_keys": ("model", {0: torch.zeros(1)}, "model must be a state dict"),
    "model_is_100000_deep": ("model", {"w": deep_list(100_000)}, "model['w'][0][0][0][0][0]... must be nested at most"),
    "best_is_none": ("best", None, "best must be a BestState dict, got NoneType None"),
    "best_score_is_a_str": ("best", {"kind": "BestState", "schema_version": 1, "score": "x"}, "score must be a real"),
    "epoch_is_a_float": ("epoch", 1.0, "epoch must be None or an int in [0, 2**63), got float 1.0"),
    "config_is_none": ("config", None, "config must be a dict of str keys"),
    "a_stray_key": ("optimizer", {}, "key 'optimizer' must be one of schema_version, model, best, epoch, config"),
}
"""A real best.pt with one value replaced, and what the refusal says."""


@pytest.mark.parametrize("case", sorted(BEST_CASES))
def test_a_best_pt_with_a_value_of_the_wrong_shape_is_corrupt_naming_the_key(real, case):
    """Each malformed value of a best.pt is a CheckpointCorruptError naming the path, the key and the rule."""
    key, value, expected = BEST_CASES[case]
    with pytest.raises(CheckpointCorruptError) as info:
        validate_best({**real["best_payload"], key: value}, path="run/best.pt")
    message = str(info.value)
    assert message.startswith("checkpoint run/best.pt is not a valid trainkit best.pt: ") and expected in message


ODD_VALUES = [
    None,
    True,
    -1,
    2**64,
    0.5,
    float("nan"),
    "x",
    b"",
    [],
    {},
    [None],
    {1: 2},
    {"k": object()},
    torch.zeros(2),
]


def test_any_odd_value_under_any_key_is_accepted_or_corrupt_never_another_error(real):
    """Every engine key of both files, set to each of a range of odd values, validates or raises only
    CheckpointCorruptError: no AttributeError, TypeError, KeyError or RecursionError gets through."""
    for payload, validate, schema in (
        (real["last_payload"], validate_last, LAST_PT),
        (real["best_payload"], validate_best, BEST_PT),
    ):
        for key in [k.name for k in schema] + ["model"]:
            for value in [*ODD_VALUES, deep_list(5000)]:
                try:
                    validate({**payload, key: value}, path="p.pt")
                except CheckpointCorruptError as exc:
                    assert "p.pt" in str(exc) and len(str(exc)) < 1200
                    continue


def test_an_item_state_nested_to_the_limit_validates_and_can_still_be_copied(real):
    """An item state nested MAX_ITEM_DEPTH deep is accepted, and copy.deepcopy of it stays within Python's limit."""
    payload = {**real["last_payload"], "model": {"w": deep_list(MAX_ITEM_DEPTH - 1)}}
    validate_last(payload, path="last.pt")
    copy.deepcopy(payload["model"])
    with pytest.raises(CheckpointCorruptError, match="nested at most 256 deep"):
        validate_last({**payload, "model": {"w": deep_list(MAX_ITEM_DEPTH)}}, path="last.pt")


def test_refused_files_never_leave_an_open_descriptor(tmp_path):
    """Refused and loaded files alike are closed: a thousand refusals leave the process's descriptors as they were."""
    if not LINUX:
        pytest.skip("counts /proc/self/fd")
    path = tmp_path / "bad.pt"
    path.write_bytes(b"PK\x03\x04 not a zip")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(1000):
        with pytest.raises(CheckpointCorruptError):
            load_checkpoint(path)
    assert len(os.listdir("/proc/self/fd")) == before
