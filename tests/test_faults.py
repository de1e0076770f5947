"""Fault injection on real processes and real files: signals, SIGKILL, torn writes, bit rot, a full disk.

The training processes run ``tests/faults/train.py`` (a TinyTrainer behind ``trainkit.launch``); each
ends with its model, optimizer, best checkpoint and metrics.jsonl compared bit for bit with an
uninterrupted run's. Set ``TRAINKIT_SLOW=1`` for the long fuzz variants.
"""

from __future__ import annotations

import errno
import os
import random
import re
import select
import shutil
import signal
import subprocess
import time
import warnings
import zipfile
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

import trainkit.checkpoint.formats.async_save
from tests.faults.harness import SIGTERM_CODE, assert_equal_state, assert_same_training, load, train, write_run
from tests.helpers.checkpoint_files import flip_bit_in_tensor_data
from tests.helpers.configs import make_cfg
from tests.helpers.slow import SLOW
from tests.helpers.trainers import Crash, TinyTrainer, dying, param_digest
from trainkit import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, RegistryError
from trainkit.checkpoint import (
    TEMP_SUFFIX,
    atomic_save,
    load_checkpoint,
    payload_nbytes,
    previous_path,
    remove_stale_temp_files,
    verify_checkpoint,
    warn_if_low_on_space,
)

BATCH_SLEEP = 0.02
"""Seconds slept after each of the 6 batches of an epoch, so an epoch lasts ~0.15 s and signals land anywhere."""

BALLAST = 1_000_000
"""Float32 elements of a dummy checkpoint item: a 4 MB last.pt, so a save is slow enough to be killed mid-write."""


def fault_cfg(out_dir: Path, **overrides):
    """The config of the subprocess runs: 10 epochs, validation every epoch, a test at the end.

    A signal or kill at most 0.3 s into a run ends it within 3 epochs, so the planned interruptions
    all land before the end.
    """
    return make_cfg(out_dir, epochs=10, test={"enable": True}, **overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted subprocess run with the same config; its folder."""
    base = tmp_path_factory.mktemp("reference")
    run = train(write_run(base / "run.json", fault_cfg(base / "run")), base / "log")
    assert run.wait() == 0, run.stderr
    return base / "run"


def checkpoints_load(out: Path) -> list[str]:
    """Assert every checkpoint file in ``out`` loads with trainkit's verified loader; return their names."""
    names = []
    for name in ("last.pt", "last.prev.pt", "best.pt", "best.prev.pt"):
        if (out / name).exists():
            load_checkpoint(out / name)
            names.append(name)
    return names


def temp_files(out: Path) -> list[str]:
    """The names of the temp files of unfinished saves in ``out``."""
    return [p.name for p in out.glob(f".*{TEMP_SUFFIX}")] if out.exists() else []


# ---------------------------------------------------------------------------------------------- signals

Interruption = namedtuple("Interruption", "signals batch_sleep expected")

INTERRUPTIONS = [
    Interruption([signal.SIGTERM], BATCH_SLEEP, SIGTERM_CODE),
    Interruption([signal.SIGUSR1], BATCH_SLEEP, 128 + signal.SIGUSR1),
    # the second Ctrl-C aborts mid-batch: 10 s batches keep the first one pending then, and far from the epoch end
    Interruption([signal.SIGINT, signal.SIGINT], 10.0, -signal.SIGINT),
]

ABORT_WITHIN = 30.0
"""Seconds from the second Ctrl-C to the process's end. Waiting for the epoch to end would take 6 batches of 10 s
(~60 s left after the second Ctrl-C; the aborted epoch missing from last.pt says the same without a clock); the
bound leaves a loaded host ~30 s for Python and torch to tear down. An abort costs no batch's sleep."""


@pytest.mark.timeout(240)
def test_signals_at_random_moments_resume_bit_identically(tmp_path, reference):
    """SIGTERM/SIGUSR1 at random moments exit 128+signum, a double Ctrl-C aborts at once; reruns end bit-identical."""
    rng = random.Random(20240601)
    out = tmp_path / "run"
    plans = INTERRUPTIONS + ([Interruption([signal.SIGTERM], BATCH_SLEEP, SIGTERM_CODE)] * 7 if SLOW else [])
    codes = []
    for attempt, plan in enumerate([*plans, None]):
        fault = {"batch_sleep": plan.batch_sleep if plan else BATCH_SLEEP}
        run = train(write_run(tmp_path / "run.json", fault_cfg(out), fault), tmp_path / f"log{attempt}")
        before = load(out / "last.pt")["epoch"] if (out / "last.pt").exists() else 0
        if plan is not None and run.wait_for("epoch "):  # training is under way: the handlers are installed
            time.sleep(rng.uniform(0.0, 0.1) if len(plan.signals) > 1 else rng.uniform(0.0, 0.3))
            run.signal(plan.signals[0])
            if len(plan.signals) > 1:
                time.sleep(0.2)
                sent = time.monotonic()
                run.signal(plan.signals[1])
        code = run.wait()
        codes.append(code)
        if code == 0:
            break
        assert plan is not None and code == plan.expected, (code, run.stderr[-3000:])
        after = load(out / "last.pt")["epoch"] if (out / "last.pt").exists() else 0
        if len(plan.signals) > 1:
            assert run.ended - sent < ABORT_WITHIN, "a second Ctrl-C must not wait for the epoch to end"
            assert "KeyboardInterrupt" in run.stderr
            assert after == before, "the aborted epoch must not be in last.pt"
        else:
            name = signal.Signals(plan.signals[0]).name
            assert f"{name} received: stopped after epoch {after - 1}" in run.stderr
            assert after > before
        assert not temp_files(out)
    assert codes[-1] == 0 and len([c for c in codes if c != 0]) >= 3, codes
    assert_same_training(out, reference)


@pytest.mark.timeout(120)
def test_a_sigint_inherited_as_ignored_is_left_ignored(tmp_path):
    """A run started with SIGINT ignored (a shell's background job, nohup) is not stopped by SIGINT: it trains to
    its last epoch and exits 0, as Python leaves such a SIGINT ignored."""
    out = tmp_path / "run"
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the disposition the child inherits through exec
    try:
        run = train(write_run(tmp_path / "run.json", make_cfg(out, epochs=4), {"batch_sleep": BATCH_SLEEP}),
                    tmp_path / "log")
    finally:
        signal.signal(signal.SIGINT, before)
    assert run.wait_for("epoch 1 ")
    run.signal(signal.SIGINT)
    assert run.wait() == 0, run.stderr[-3000:]
    assert "SIGINT received" not in run.stderr
    assert load(out / "last.pt")["epoch"] == 4


# ---------------------------------------------------------------------------------------------- SIGKILL


def kill_when_a_save_is_in_flight(run, out: Path, timeout: float = 60.0) -> bool:
    """SIGKILL the run as soon as a temp file of a save appears; True when the kill left it torn."""
    run.wait_for("epoch ")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        if any(name.startswith(".last.pt.") for name in temp_files(out)):
            run.signal(signal.SIGKILL)
            run.wait()
            return any(name.startswith(".last.pt.") for name in temp_files(out))
        time.sleep(0.001)
    raise AssertionError("no save was seen in flight")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kills", "async_save"),
    [(3, False), (3, True), *(pytest.param(20, a, marks=pytest.mark.slow) for a in (False, True))],
)
def test_sigkill_fuzz_resumes_bit_identically(tmp_path, reference, kills, async_save):
    """SIGKILL before the first save, mid-write and at random: every file stays loadable, reruns end bit-identical."""
    rng = random.Random(1000 + kills)
    fault = {"batch_sleep": BATCH_SLEEP, "ballast_numel": BALLAST}
    ckpt = {"async_save": async_save}
    plans = ["before_first_checkpoint", "mid_write"] + ["random"] * (kills - 2)
    rounds, survived, torn, attempt = 0, 0, 0, 0
    out = tmp_path / "round0"
    while plans:
        plan = plans[0]
        attempt += 1
        run = train(write_run(tmp_path / "run.json", fault_cfg(out, ckpt=ckpt), fault), tmp_path / f"log{attempt}")
        if plan == "mid_write":
            was_torn = kill_when_a_save_is_in_flight(run, out)
        else:
            if run.wait_for("epoch "):
                time.sleep(0.0 if plan == "before_first_checkpoint" else rng.uniform(0.0, 0.3))
            run.signal(signal.SIGKILL)
            was_torn = False
        code = run.wait()
        if code == 0:  # the run finished before the kill: check it, then go on killing a fresh run
            assert_same_training(out, reference)
            rounds += 1
            out = tmp_path / f"round{rounds}"
            continue
        assert code == -signal.SIGKILL, run.stderr[-3000:]
        survived += 1
        torn += was_torn
        if plan == "before_first_checkpoint":
            assert not (out / "last.pt").exists()
        checkpoints_load(out)
        if plan != "mid_write" or was_torn or attempt > 10:  # a save may finish before the kill lands: retry
            plans.pop(0)
    assert torn >= 1 and survived >= kills
    run = train(write_run(tmp_path / "run.json", fault_cfg(out, ckpt=ckpt), fault), tmp_path / "final.log")
    assert run.wait() == 0, run.stderr[-3000:]
    assert not temp_files(out), "temp files of killed saves must be cleaned up by the next run"
    assert_same_training(out, reference)
    print(f"SIGKILL fuzz: {survived} kills survived ({torn} mid-write) over {rounds + 1} run(s) to the end")


FIRST_SAVE_WITHIN = 60.0
"""Seconds a forked child may take to finish its first save: far beyond a loaded host's, as a hang's bound."""


def wait_for_a_save(ready: int, pid: int) -> None:
    """Block until the child ``pid`` reports a finished save on the pipe ``ready`` (an event, not a clock)."""
    readable, _, _ = select.select([ready], [], [], FIRST_SAVE_WITHIN)
    if not readable:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the child finished no save within {FIRST_SAVE_WITHIN} s")
    os.read(ready, 1)


@pytest.mark.timeout(240)
def test_atomic_save_survives_sigkill_at_random_moments(tmp_path):
    """A process looping atomic_save(keep_previous=True) is SIGKILLed 120 times; last.pt and its .prev always load.

    Three kills in four wait for the child's report of a finished save, then land at a random moment of the saves
    that follow; the fourth lands at a random moment after the fork. So every kill lands on a save under way however
    loaded the host is, and the child gets saves done between the kills by construction, not by the clock."""
    kills = 1000 if SLOW else 120
    rng = random.Random(7)
    path = tmp_path / "last.pt"
    block = torch.arange(4096, dtype=torch.float32)  # made here: the forked child runs no torch kernels

    def payload(counter: int) -> dict:
        return {"counter": counter, "stamp": torch.tensor([counter]), "block": block}

    atomic_save(payload(0), path, keep_previous=True)
    seen, torn, between, stale = 0, 0, 0, set()
    for _ in range(kills):
        ready, saved = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child rewrites until it is killed; it never returns into pytest
            try:
                os.close(ready)
                counter = seen
                while True:
                    counter += 1
                    atomic_save(payload(counter), path, keep_previous=True)
                    os.write(saved, b".")  # a byte a save: the pipe's 64 KiB outlast any test's kill
            finally:
                os._exit(1)
        os.close(saved)
        if rng.random() < 0.75:
            wait_for_a_save(ready, pid)
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(ready)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        left = set(temp_files(tmp_path))
        torn += bool(left - stale)
        stale = left
        now = load_checkpoint(path)
        assert now["stamp"].item() == now["counter"] >= seen and torch.equal(now["block"], block)
        if previous_path(path).exists():
            previous = load_checkpoint(previous_path(path))
            assert previous["stamp"].item() == previous["counter"] in (now["counter"] - 1, now["counter"])
            between += previous["counter"] == now["counter"]
        else:
            assert now["counter"] == 0  # nothing was replaced yet
        seen = now["counter"]
    assert seen > kills / 10, "the child must get saves done between the kills"
    assert torn > kills / 10, f"only {torn} of {kills} kills landed mid-write"
    assert len(remove_stale_temp_files(tmp_path)) == len(stale) and not temp_files(tmp_path)
    print(f"atomic_save: {kills} kills, {torn} mid-write, {between} between link and replace, {seen} saves")


# ---------------------------------------------------------------------------------------------- bit rot


def tensor_data_spans(path: Path) -> list[tuple[str, int, int]]:
    """(member, start, size) of every tensor storage's bytes inside a torch zip checkpoint."""
    raw = path.read_bytes()
    spans = []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if "/data/" not in info.filename or info.file_size == 0:
                continue
            header = info.header_offset
            name_len = int.from_bytes(raw[header + 26 : header + 28], "little")
            extra_len = int.from_bytes(raw[header + 28 : header + 30], "little")
            spans.append((info.filename, header + 30 + name_len + extra_len, info.file_size))
    return spans


@pytest.fixture(scope="module")
def real_last_pt(tmp_path_factory):
    """A real last.pt of a 2-epoch TinyTrainer run with a best.pt and optimizer state."""
    out = tmp_path_factory.mktemp("bitrot")
    TinyTrainer(make_cfg(out, epochs=2)).train()
    return out / "last.pt"


def test_random_bit_flips_in_tensor_data_are_all_detected(tmp_path, real_last_pt):
    """50 random single-bit flips in the tensor data of a real last.pt are each refused with CheckpointCorruptError."""
    rng = random.Random(50)
    spans = tensor_data_spans(real_last_pt)
    assert len(spans) >= 8  # model, optimizer momenta, RNG states
    original = real_last_pt.read_bytes()
    weights = [size for _, _, size in spans]
    detected = 0
    for trial in range(50):
        member, start, size = rng.choices(spans, weights=weights)[0]
        offset, bit = rng.randrange(size), rng.randrange(8)
        copy = tmp_path / f"flip{trial}.pt"
        raw = bytearray(original)
        raw[start + offset] ^= 1 << bit
        copy.write_bytes(bytes(raw))
        with pytest.raises(CheckpointCorruptError, match=rf"{copy.name} is corrupted: CRC mismatch in '{member}'"):
            verify_checkpoint(copy)
        with pytest.raises(CheckpointCorruptError, match="CRC mismatch"):
            load_checkpoint(copy)
        detected += 1
        copy.unlink()
    assert detected == 50


def bits_to_flip(path: Path, rng: random.Random) -> list[int]:
    """Bit positions to flip outside tensor data: random ones, or (TRAINKIT_SLOW=1) every one."""
    size = path.stat().st_size
    in_data = {start + i for _, start, length in tensor_data_spans(path) for i in range(length)}
    outside = [pos for pos in range(size) if pos not in in_data]
    if SLOW:
        return [pos * 8 + bit for pos in outside for bit in range(8)]
    return [pos * 8 + rng.randrange(8) for pos in rng.sample(outside, 60)]


def test_bit_flips_outside_tensor_data_are_refused_or_harmless(tmp_path, real_last_pt):
    """A bit flip in the zip headers, the pickle or the directory is refused as corrupt or loads the same payload."""
    original = real_last_pt.read_bytes()
    reference = load_checkpoint(real_last_pt)
    refused = harmless = 0
    copy = tmp_path / "flipped.pt"
    for position in bits_to_flip(real_last_pt, random.Random(51)):
        raw = bytearray(original)
        raw[position // 8] ^= 1 << position % 8
        copy.write_bytes(bytes(raw))
        try:
            payload = load_checkpoint(copy)
        except CheckpointCorruptError:
            refused += 1
        else:
            assert_equal_state(payload, reference, f"payload after flipping bit {position}")
            harmless += 1
    assert refused > harmless


def test_a_tensor_member_flagged_as_a_directory_is_refused(tmp_path, real_last_pt):
    """A flipped DOS directory bit in a tensor member's entry is refused (torch alone loads uninitialized memory)."""
    raw = bytearray(real_last_pt.read_bytes())
    member, _, _ = tensor_data_spans(real_last_pt)[0]
    entry = raw.find(b"PK\x01\x02")  # the central directory entries: 46 fixed bytes, then the name
    while raw[entry + 46 : entry + 46 + int.from_bytes(raw[entry + 28 : entry + 30], "little")] != member.encode():
        entry = raw.find(b"PK\x01\x02", entry + 1)
        assert entry > 0, f"no central directory entry for {member}"
    raw[entry + 38] ^= 0x10  # external attributes: MS-DOS directory
    copy = tmp_path / "folder_flag.pt"
    copy.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=rf"'{member}' is marked as a directory"):
        load_checkpoint(copy)


def test_auto_resume_from_a_flipped_last_pt_falls_back_and_still_ends_identically(tmp_path):
    """A bit flip in last.pt makes auto-resume fall back to last.prev.pt, and the run still ends bit-identical."""
    ref = TinyTrainer(make_cfg(tmp_path / "ref", epochs=4))
    ref.train()
    out = tmp_path / "run"
    with pytest.raises(Crash):
        dying(3)(make_cfg(out, epochs=4)).train()
    flip_bit_in_tensor_data(out / "last.pt", offset_in_member=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = TinyTrainer(make_cfg(out, epochs=4))
    messages = [str(w.message) for w in caught]
    assert any(re.search("CRC mismatch.*resuming from the previous checkpoint .*last.prev.pt", m) for m in messages)
    assert any("best.pt did not match" in m for m in messages)  # best.pt of epoch 2 is newer than last.prev.pt
    assert resumed.epoch == 2
    resumed.train()
    assert param_digest(resumed.model) == param_digest(ref.model)
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()


# ---------------------------------------------------------------------------------------------- full disk


class LimitedFile:
    """A writable file that fails with ENOSPC once ``limit`` bytes were written through it."""

    def __init__(self, handle, limit: int) -> None:
        self._handle = handle
        self._left = limit

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._left:
            self._handle.write(data[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= len(data)
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._handle.close()


def limit_writes(monkeypatch, limit: int, after_saves: int = 0) -> None:
    """Make checkpoint writes hit a full disk after ``limit`` bytes, from save number ``after_saves`` on."""
    real_fdopen = os.fdopen
    count = {"saves": 0}

    def fdopen(fd, mode="r", *args, **kwargs):
        handle = real_fdopen(fd, mode, *args, **kwargs)
        if "w" not in mode:
            return handle
        count["saves"] += 1
        return LimitedFile(handle, limit) if count["saves"] > after_saves else handle

    monkeypatch.setattr(os, "fdopen", fdopen)


ENOSPC_MESSAGE = re.compile(r"no space left after (\d+) bytes; about (\d+) bytes are needed and (\d+) bytes are free")


def test_full_disk_leaves_the_previous_checkpoint_and_names_the_numbers(tmp_path, monkeypatch):
    """ENOSPC mid-save raises CheckpointError naming path, bytes needed and free; last.pt intact, no temp file."""
    path = tmp_path / "last.pt"
    old = {"weights": torch.zeros(1000)}
    atomic_save(old, path, keep_previous=True)
    before = path.read_bytes()
    new = {"weights": torch.ones(100_000)}
    for limit in (0, 64, 4096, 200_000):
        limit_writes(monkeypatch, limit)
        with pytest.raises(CheckpointError) as info:
            atomic_save(new, path, keep_previous=True)
        monkeypatch.undo()
        message = str(info.value)
        assert str(path) in message and "was left unchanged" in message
        written, needed, free = map(int, ENOSPC_MESSAGE.search(message).groups())
        assert written <= limit + 8192  # what the buffered writer had flushed when the disk filled
        assert needed >= payload_nbytes(new) == 400_000
        assert abs(free - shutil.disk_usage(tmp_path).free) < 512 * 2**20
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        assert path.read_bytes() == before
        assert not temp_files(tmp_path)
        assert not (tmp_path / "last.prev.pt").exists()


def test_full_disk_during_training_stops_with_last_pt_intact_and_resumes(tmp_path, monkeypatch):
    """A trainer whose fifth save hits a full disk raises CheckpointError; the rerun resumes bit-identically."""
    ref = TinyTrainer(make_cfg(tmp_path / "ref"))
    ref.train()
    out = tmp_path / "run"
    limit_writes(monkeypatch, limit=1000, after_saves=4)  # best 0, last 0, last 1, best 2, then last 2 fails
    trainer = TinyTrainer(make_cfg(out))
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*last\.pt: no space left"):
        trainer.train()
    monkeypatch.undo()
    assert load(out / "last.pt")["epoch"] == 2 and load(out / "best.pt")["epoch"] == 2
    assert not temp_files(out)
    with pytest.warns(RuntimeWarning, match="best.pt did not match"):  # best.pt of epoch 2 got out, last.pt did not
        resumed = TinyTrainer(make_cfg(out))
    resumed.train()
    assert param_digest(resumed.model) == param_digest(ref.model)
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs, mounted for the test and always unmounted; skipped where mounting is not allowed."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def test_real_full_tmpfs(small_tmpfs):
    """On a real 1 MiB tmpfs a save that does not fit raises CheckpointError; last.pt stays intact, no temp file."""
    path = small_tmpfs / "last.pt"
    atomic_save({"weights": torch.zeros(64_000)}, path, keep_previous=True)  # 256 KB fits
    before = path.read_bytes()
    too_big = {"weights": torch.ones(200_000)}  # 800 KB does not fit next to it
    with pytest.warns(RuntimeWarning, match=r"bytes free, less than twice"):
        warn_if_low_on_space(too_big, path)
    with pytest.raises(CheckpointError) as info:
        atomic_save(too_big, path, keep_previous=True)
    written, needed, free = map(int, ENOSPC_MESSAGE.search(str(info.value)).groups())
    assert str(path) in str(info.value) and needed >= 800_000 and free < 1 << 20
    assert path.read_bytes() == before
    assert not temp_files(small_tmpfs)
    assert load_checkpoint(path)["weights"].shape == (64_000,)
    atomic_save({"weights": torch.ones(64_000)}, path, keep_previous=True)  # space came back
    assert load_checkpoint(previous_path(path))["weights"].sum() == 0


def test_low_space_warns_once_before_the_first_save(tmp_path, monkeypatch):
    """With less than twice a checkpoint's size free the trainer warns once, naming the directory, and still saves."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TinyTrainer(make_cfg(tmp_path, epochs=3)).train()
    low = [w for w in caught if "less than twice" in str(w.message)]
    assert len(low) == 1 and issubclass(low[0].category, RuntimeWarning)
    assert f"{tmp_path} has 1000 bytes free" in str(low[0].message)
    assert load(tmp_path / "last.pt")["epoch"] == 3


# ---------------------------------------------------------------------------------------------- best.pt vs last.pt


def test_crash_between_best_and_last_is_repaired_on_resume(tmp_path, monkeypatch):
    """A crash between the best.pt and last.pt writes is repaired from best.prev.pt on resume; the run ends as usual."""
    scores = (3.0, 2.0, 2.5, 1.0, 1.5)
    kwargs = dict(epochs=5, scripted_scores=scores, test={"enable": True})
    ref = TinyTrainer(make_cfg(tmp_path / "ref", **kwargs))
    expected = ref.train()
    real_save = atomic_save

    def crash_before_last_of_epoch_3(payload, path, **kwargs):
        if Path(path).name == "last.pt" and payload["epoch"] == 4:
            raise Crash
        return real_save(payload, path, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(trainkit.checkpoint.formats.async_save, "atomic_save", crash_before_last_of_epoch_3)
    with pytest.raises(Crash):
        TinyTrainer(make_cfg(out, **kwargs)).train()
    monkeypatch.undo()
    assert load(out / "best.pt")["best"]["epoch"] == 3 and load(out / "last.pt")["best"]["epoch"] == 1

    with pytest.warns(RuntimeWarning, match=r"best.pt did not match the best recorded in .*last.pt \(epoch 1\); "
                                            r"repaired it from .*best.prev.pt"):
        resumed = TinyTrainer(make_cfg(out, **kwargs))
    repaired = load(out / "best.pt")
    assert repaired["best"]["epoch"] == 1
    best_of_epoch_1 = load(tmp_path / "ref" / "best.prev.pt")  # ref's best.pt moved on to epoch 3
    assert best_of_epoch_1["best"]["epoch"] == 1
    for key, value in best_of_epoch_1["model"].items():
        assert torch.equal(resumed.best_model[key].cpu(), value) and torch.equal(repaired["model"][key], value)
    assert resumed.train() == expected
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()


def test_test_after_resume_uses_the_repaired_best_weights(tmp_path):
    """A stray newer best.pt is replaced by best.prev.pt on resume, and test() then scores the true best weights."""
    scores = (3.0, 1.0, 2.0, 2.5)
    kwargs = dict(epochs=4, scripted_scores=scores, test={"enable": True})
    expected = TinyTrainer(make_cfg(tmp_path / "ref", **kwargs)).train()
    out = tmp_path / "run"
    with pytest.raises(Crash):
        dying(3)(make_cfg(out, **kwargs)).train()
    stray = load(out / "best.pt")
    stray["best"] = {**stray["best"], "epoch": 2, "score": 0.5}
    stray["model"] = {key: torch.randn_like(value) for key, value in stray["model"].items()}
    atomic_save(stray, out / "best.pt", keep_previous=True)
    with pytest.warns(RuntimeWarning, match="repaired it from"):
        resumed = TinyTrainer(make_cfg(out, **kwargs))
    result = resumed.train()
    assert result["test/loss"] == expected["test/loss"] and result == expected
    assert load(out / "best.pt")["best"]["epoch"] == 1


# ---------------------------------------------------------------------------------------------- mismatches


@pytest.mark.parametrize("what", ["schema"])
def test_mismatched_checkpoint_is_refused_naming_both_sides(tmp_path, what):
    """A last.pt from a newer schema is refused, naming both values, and is left untouched (an epoch's end resumes on
    any world size; the refusals of a mid-epoch one: tests/distributed/test_elastic_resume.py)."""
    TinyTrainer(make_cfg(tmp_path, epochs=1)).train()
    payload = load(tmp_path / "last.pt")
    payload.update(schema_version=7) if what == "schema" else payload.update(world_size=4)
    atomic_save(payload, tmp_path / "last.pt")
    written = (tmp_path / "last.pt").read_bytes()
    expected = (r"schema version 7, newer than this trainkit's 1" if what == "schema"
                else r"world_size=4, this run has world_size=1")
    for resume in ("auto", str(tmp_path / "last.pt")):
        with pytest.raises(CheckpointMismatchError, match=expected):
            TinyTrainer(make_cfg(tmp_path, ckpt={"resume": resume}))
    assert (tmp_path / "last.pt").read_bytes() == written


class RenamedTrainer(TinyTrainer):
    """TinyTrainer whose model holds the same layers under other names (``encoder.0.weight``, ...)."""

    def make_ddp(self, module, find_unused_parameters=False):
        return super().make_ddp(torch.nn.Sequential(OrderedDict(encoder=module)), find_unused_parameters)


class WiderTrainer(TinyTrainer):
    """TinyTrainer whose hidden layer is wider: the same names with other shapes."""

    def make_ddp(self, module, find_unused_parameters=False):
        module[0], module[3] = torch.nn.Linear(8, 48), torch.nn.Linear(48, 1)
        return super().make_ddp(module, find_unused_parameters)


def test_renamed_or_reshaped_parameters_are_refused_naming_them(tmp_path):
    """Resuming into renamed or reshaped parameters raises RegistryError naming the item and the parameters."""
    TinyTrainer(make_cfg(tmp_path, epochs=1)).train()
    written = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(RegistryError) as info:
        RenamedTrainer(make_cfg(tmp_path))
    message = str(info.value)
    assert "checkpoint item 'model'" in message
    assert "Missing key(s)" in message and '"encoder.0.weight"' in message
    assert "Unexpected key(s)" in message and '"0.weight"' in message
    with pytest.raises(RegistryError, match=r"(?s)checkpoint item 'model'.*size mismatch for 0.weight: .*\[32, 8\]"):
        WiderTrainer(make_cfg(tmp_path))
    assert (tmp_path / "last.pt").read_bytes() == written
