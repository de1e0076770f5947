"""The remote tier in real runs on a hostile prefix: FIFOs and folders where records belong, numbers that do not fit
their range, a store client's own errors, control characters in a store's messages, and the extreme config values.
A run that could hang is guarded by an alarm, so a hang fails the test instead of the suite."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.configs import make_cfg
from tests.helpers.remote_store import failing_store
from tests.helpers.trainers import TinyTrainer
from trainkit import OutDirError
from trainkit.checkpoint.remote import RemoteTier, open_store
from trainkit.checkpoint.remote.manifest import (
    LEASE,
    MANIFEST,
    MAX_UNIX_TIME,
    UNREADABLE_LEASE,
    parse_lease,
    parse_manifest,
    read_lease,
)
from trainkit.config.schema import MAX_REMOTE_LEASE_S, MAX_REMOTE_WAIT_S
from trainkit.errors import CheckpointUnsafeError

pytest.importorskip("fsspec")


@contextlib.contextmanager
def hang_guard(seconds: int = 60) -> Iterator[None]:
    """Fail (an ``AssertionError`` raised by SIGALRM, which also ends a blocked ``open``) after ``seconds``."""

    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(out_dir: Path, epochs: int, **ckpt) -> tuple[TinyTrainer, list[str]]:
    """A run, guarded against hangs; the trainer and every warning it gave."""
    with hang_guard(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = TinyTrainer(make_cfg(out_dir, epochs=epochs, ckpt=ckpt))
        try:
            trainer.train()
        finally:
            trainer.close()
    return trainer, [str(w.message) for w in caught]


def committed(root: Path) -> list[int]:
    """The steps of the regular commit records under a file:// prefix (never opening anything else)."""
    return sorted(parse_manifest(path.read_bytes()).step for path in root.glob(f"step-*/{MANIFEST}") if path.is_file())


def test_a_run_on_a_prefix_with_fifos_and_folders_at_its_records_neither_hangs_nor_fails(tmp_path):
    """A FIFO at the lease and at a newer folder's commit record, a folder at another's (a shared mount): the run
    takes the prefix (the unreadable lease counts as expired), refuses both folders with a warning naming what they
    are, trains from scratch and commits its own checkpoint."""
    root = tmp_path / "remote"
    for folder in ("step-98-0000000a", "step-99-0000000b"):
        (root / folder).mkdir(parents=True)
        (root / folder / "last.pt").write_bytes(b"weights")
    os.mkfifo(root / "step-99-0000000b" / MANIFEST)
    (root / "step-98-0000000a" / MANIFEST).mkdir()
    os.mkfifo(root / LEASE)

    trainer, said = run(tmp_path / "run", 1, remote=f"file://{root}")

    assert trainer.epochs_trained == [0]
    assert committed(root) == [6]
    assert any("step-99-0000000b is refused" in line and "FIFO" in line for line in said), said
    assert any("step-98-0000000a is refused" in line and "directory" in line for line in said), said
    assert any(f"{LEASE} is unreadable" in line for line in said), said
    assert not (root / LEASE).exists()  # taken over, then let go at the end


@pytest.mark.parametrize("expires", [10**400, 1e300])
def test_a_planted_lease_whose_expiry_does_not_fit_is_taken_over_with_a_warning(tmp_path, expires):
    """A lease expiring at an int of 400 digits or at 1e300 would overflow the clock's arithmetic: it counts as
    expired (with a warning), and the run takes the prefix and commits."""
    root = tmp_path / "remote"
    root.mkdir()
    (root / LEASE).write_text(json.dumps({"holder": "node7:1:ab", "expires": expires}))

    trainer, said = run(tmp_path / "run", 1, remote=f"file://{root}")

    assert trainer.epochs_trained == [0] and committed(root) == [6]
    assert any(f"{LEASE} is unreadable" in line and "expires must be" in line for line in said), said


def test_a_commit_record_whose_time_does_not_fit_is_refused_and_the_resume_takes_the_previous(tmp_path):
    """A newer folder whose commit record says ``time`` = 10**400: that folder is refused with a warning, and the
    resume on an empty machine takes the honest older checkpoint."""
    root = tmp_path / "remote"
    url = f"file://{root}"
    run(tmp_path / "first", 1, remote=url)
    (honest,) = root.glob("step-6-*")
    planted = root / "step-12-0000000c"
    planted.mkdir()
    (planted / "last.pt").write_bytes((honest / "last.pt").read_bytes())
    record = json.loads((honest / MANIFEST).read_text())
    record = {**record, "step": 12, "description": {**record["description"], "time": 10**400}}
    (planted / MANIFEST).write_text(json.dumps(record))

    trainer, said = run(tmp_path / "empty", 2, remote=url)

    assert trainer.epochs_trained == [1]  # resumed from step 6, not from the planted 12, not from scratch
    assert any("step-12-0000000c is refused" in line and "description.time" in line for line in said), said


def test_an_error_of_the_store_client_stops_the_run_in_one_line_without_its_traceback(s3_endpoint, tmp_path):
    """A URL the store's client refuses (botocore will not send that bucket name) stops the run at its start with
    one line naming the prefix, credentials masked, and no chained traceback of the client's."""
    url = "s3://Bad:Bucket/runs?secret_key=hunter2"
    with hang_guard(), pytest.raises(OutDirError, match=r"ckpt.remote=s3://Bad:Bucket/.*failed") as refused:
        TinyTrainer(make_cfg(tmp_path / "run", epochs=1, ckpt={"remote": url})).close()
    message = str(refused.value)
    assert "\n" not in message and "hunter2" not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_what_a_failing_store_says_is_escaped_in_the_warning(tmp_path):
    """A store whose error message holds ANSI escapes and a newline: the uploader's warning shows them escaped."""
    url = failing_store("\x1b[2J\x1b[31mdown\ntrainkit: forged line", protocol="shouting")
    _, said = run(tmp_path / "run", 1, remote=url, remote_wait_s=0.5)

    failed = [line for line in said if "failed" in line]
    assert failed and all("\x1b" not in line and "\n" not in line for line in failed), failed
    assert any("\\x1b[31mdown" in line for line in failed), failed


def test_the_longest_lease_and_wait_the_config_accepts_do_not_overflow(tmp_path):
    """``remote_lease_s`` and ``remote_wait_s`` at their bounds: the lease is taken and read back, the wait at the
    end returns, nothing overflows (1e10 and 1e11 did, and are refused by the config)."""
    url = f"memory://trainkit-bounds-{os.getpid()}/runs"
    fs, root = open_store(url)
    tier = RemoteTier(url, fs, root, out_dir=tmp_path, lease_s=MAX_REMOTE_LEASE_S, wait_s=MAX_REMOTE_WAIT_S)
    with hang_guard(30):
        tier.acquire()
        try:
            assert not tier.lease().expired(0.0)
            tier.finish()
        finally:
            tier.close()


@pytest.mark.parametrize(
    "expires", ["1" + "0" * 400, "1e300", "1e400", "NaN", "-Infinity", "-1", str(MAX_UNIX_TIME + 1), '"x"', "true"]
)
def test_a_lease_whose_expiry_does_not_fit_is_refused_by_the_reader(expires):
    data = f'{{"holder": "h", "expires": {expires}}}'.encode()
    with pytest.raises(CheckpointUnsafeError, match="expires must be"):
        read_lease(data)
    assert parse_lease(data) == UNREADABLE_LEASE


def test_a_lease_nested_too_deep_is_refused_by_the_reader():
    with pytest.raises(CheckpointUnsafeError, match="not JSON"):
        read_lease(b'{"holder": "h", "expires": 1, "x": ' + b"[" * 100 + b"]" * 100 + b"}")


BIG = 10**400
HONEST = {
    "step": 7,
    "epoch": 1,
    "kind": "last",
    "objects": [{"name": "last.pt", "size": 1, "crc32": 0}],
    "run_id": None,
    "version": "0",
    "description": {"epoch_end": True, "time": 1.0, "scores": {"score": 0.5}},
}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"step": BIG}, "step"),
        ({"epoch": BIG}, "epoch"),
        ({"objects": [{"name": "last.pt", "size": BIG, "crc32": 0}]}, "size"),
        ({"objects": [{"name": "last.pt", "size": 1, "crc32": BIG}]}, "crc32"),
        ({"description": {"time": BIG}}, "description.time"),
        ({"description": {"time": 1e300}}, "description.time"),
        ({"description": {"time": -1.0}}, "description.time"),
        ({"description": {"time": 1.0, "scores": {"score": BIG}}}, "description.scores"),
        ({"description": {"time": 1.0, "scores": {"score": float("nan")}}}, "description.scores"),
        ({"description": {"time": 1.0, "epoch_end": "yes"}}, "description.epoch_end"),
    ],
)
def test_every_number_of_a_commit_record_must_fit_its_range(change, named):
    data = json.dumps({**HONEST, **change}).encode()
    with pytest.raises(CheckpointUnsafeError, match=named) as refused:
        parse_manifest(data)
    assert len(str(refused.value)) < 300  # an int of 400 digits is named by its size, not printed
    assert parse_manifest(json.dumps(HONEST).encode()).description["scores"] == {"score": 0.5}


@pytest.mark.parametrize("kind", ["best", "", None, 7])
def test_a_commit_record_of_another_kind_is_refused(kind):
    """``kind`` is checked: trainkit writes only ``"last"`` records, and a record of any other kind (or none) is
    refused with one line rather than taken for a ``last`` checkpoint."""
    with pytest.raises(CheckpointUnsafeError, match="kind must be 'last'"):
        parse_manifest(json.dumps({**HONEST, "kind": kind}).encode())
    missing = {key: value for key, value in HONEST.items() if key != "kind"}
    with pytest.raises(CheckpointUnsafeError, match="kind must be 'last'"):
        parse_manifest(json.dumps(missing).encode())


def test_a_commit_record_nested_too_deep_is_refused():
    data = json.dumps({**HONEST, "extra": 1}).encode()[:-1] + b', "deep": ' + b"[" * 100 + b"]" * 100 + b"}"
    with pytest.raises(CheckpointUnsafeError, match="not JSON"):
        parse_manifest(data)
