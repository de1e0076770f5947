"""``inspect URL`` and ``retain URL`` on a hostile prefix: FIFOs and folders where records belong, numbers that do not
fit, a store that never answers, control characters in what the store says, and credentials in the URL. Each command
runs in a thread joined with a timeout, so a hang fails the test instead of the suite."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from trainkit.checkpoint.remote import open_store
from trainkit.checkpoint.remote.manifest import LEASE, MANIFEST
from trainkit.cli import main

pytest.importorskip("fsspec")

HANG_S = 30.0
"""The most seconds a command may take here; a read that blocks for ever fails the test after it."""


def finishes(call: Callable[[], Any], seconds: float = HANG_S) -> Any:
    """``call()`` in a daemon thread; fails the test when it is still running after ``seconds`` (a hang)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def commit_record(step: int, data: bytes, **fields: Any) -> bytes:
    record = {
        "step": step,
        "epoch": 1,
        "kind": "last",
        "objects": [{"name": "last.pt", "size": len(data), "crc32": zlib.crc32(data)}],
        "run_id": "abc",
        "version": "0",
        "description": {"epoch_end": True, "time": 1.0, "scores": {}},
    }
    record.update(fields)
    return json.dumps(record).encode()


def plant_folder(url: str, folder: str, record: bytes | None) -> None:
    fs, root = open_store(url)
    fs.makedirs(f"{root}/{folder}", exist_ok=True)
    fs.pipe_file(f"{root}/{folder}/last.pt", b"weights")
    if record is not None:
        fs.pipe_file(f"{root}/{folder}/{MANIFEST}", record)


def inspect(url: str, capsys) -> tuple[int, str, str, list[str]]:
    """``inspect URL``: its status, stdout, stderr and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = finishes(lambda: main(["inspect", url]))
    out, err = capsys.readouterr()
    return status, out, err, [str(w.message) for w in caught]


def test_a_fifo_or_a_folder_at_a_record_is_refused_without_blocking(tmp_path, capsys):
    """A FIFO planted at the lease and at one folder's commit record, and a folder at another's, on a file:// store
    (a shared mount): ``inspect`` neither blocks nor fails; it warns about each, counts the lease as expired, and
    lists the honest checkpoint. ``retain`` takes the prefix and deletes the FIFO lease's place like any expired one."""
    url = f"file://{tmp_path}/remote"
    root = tmp_path / "remote"
    plant_folder(url, "step-6-0000000a", commit_record(6, b"weights"))
    plant_folder(url, "step-7-0000000b", None)
    os.mkfifo(root / "step-7-0000000b" / MANIFEST)
    plant_folder(url, "step-8-0000000c", None)
    (root / "step-8-0000000c" / MANIFEST).mkdir()
    os.mkfifo(root / LEASE)

    status, out, err, said = inspect(url, capsys)

    assert status == 0, err
    assert "step-6-0000000a: step 6, epoch 1" in out and "lease:        expired by (unreadable)" in out
    assert any("step-7-0000000b is refused" in line and "FIFO" in line for line in said), said
    assert any("step-8-0000000c is refused" in line and "directory" in line for line in said), said
    assert any(f"{LEASE} is unreadable" in line and "FIFO" in line for line in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert finishes(lambda: main(["retain", url, "--keep", "latest:1"])) == 0, capsys.readouterr().err
    assert not (root / LEASE).exists()  # taken over and let go: the FIFO is gone
    assert (root / "step-6-0000000a").is_dir()


def test_a_folder_that_is_a_link_into_another_prefix_is_neither_read_nor_deleted_through(tmp_path, capsys):
    """On a file:// store (a shared mount) a folder of the prefix that is a symbolic link, to another prefix's
    committed checkpoint or to any folder, is refused with a warning: ``retain`` deletes neither the link nor, through
    it, the other prefix's commit record (which would make that run delete the checkpoint as uncommitted)."""
    url = f"file://{tmp_path}/remote"
    root, other = tmp_path / "remote", tmp_path / "other"
    plant_folder(url, "step-8-0000000c", commit_record(8, b"weights"))
    plant_folder(f"file://{other}", "step-5-0000000a", commit_record(5, b"weights"))
    os.symlink(other / "step-5-0000000a", root / "step-5-0000000b")
    (tmp_path / "precious").mkdir()
    os.symlink(tmp_path / "precious", root / "step-1-0000000d")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert finishes(lambda: main(["retain", url, "--keep", "latest:1"])) == 0, capsys.readouterr().err
    said = [str(w.message) for w in caught]

    assert (other / "step-5-0000000a" / MANIFEST).is_file()  # the other prefix's checkpoint is still committed
    assert (root / "step-5-0000000b").is_symlink() and (root / "step-1-0000000d").is_symlink()
    assert (root / "step-8-0000000c" / MANIFEST).is_file()
    assert any("step-5-0000000b is refused" in line and "symbolic link" in line for line in said), said


def test_a_store_that_never_answers_a_read_is_given_up_after_the_deadline(tmp_path, capsys, monkeypatch):
    """A store whose read of one commit record never returns (a hung mount, a stalled connection): that folder is
    refused after ``READ_DEADLINE_S`` and the rest listed; a lease read that never returns is one error line."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from trainkit.checkpoint.remote import store

    stuck = threading.Event()  # never set: the read blocks until the process ends (its thread is a daemon)

    class Hanging(MemoryFileSystem):
        protocol = "hanging"
        store: dict = {}  # noqa: RUF012 - fsspec's own layout: the store is the class's
        pseudo_dirs = [""]  # noqa: RUF012

        def open(self, path, mode="rb", **kwargs):
            if "r" in mode and ("step-9-" in str(path) or (str(path).endswith(LEASE) and hang_lease)):
                stuck.wait()
            return super().open(path, mode, **kwargs)

    fsspec.register_implementation("hanging", Hanging, clobber=True)
    monkeypatch.setattr(store, "READ_DEADLINE_S", 0.5)
    url = f"hanging://trainkit-{os.getpid()}-{time.monotonic_ns()}/runs"
    hang_lease = False
    plant_folder(url, "step-6-0000000a", commit_record(6, b"weights"))
    plant_folder(url, "step-9-0000000b", commit_record(9, b"weights"))

    status, out, err, said = inspect(url, capsys)

    assert status == 0, err
    assert "step-6-0000000a: step 6" in out and "step-9-0000000b: step" not in out
    assert any("step-9-0000000b is refused" in line and "took more than 0.5 s" in line for line in said), said
    fs, root = open_store(url)
    fs.pipe_file(f"{root}/{LEASE}", b'{"holder": "h", "expires": 1.0}')
    hang_lease = True
    status, out, err, said = inspect(url, capsys)
    assert status == 2 and err.count("\n") == 1 and "took more than 0.5 s" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("expires", ["1" + "0" * 400, "1e300", "-5", '"soon"', "NaN"])
def test_a_lease_whose_expiry_does_not_fit_counts_as_expired(tmp_path, capsys, expires):
    """A planted lease whose expiry is an int of 400 digits, 1e300, negative, not a number or NaN locks nothing:
    ``inspect`` shows it expired with a warning, and ``retain`` takes the prefix."""
    url = f"file://{tmp_path}/remote"
    plant_folder(url, "step-6-0000000a", commit_record(6, b"weights"))
    (tmp_path / "remote" / LEASE).write_text(f'{{"holder": "node7:1:ab", "expires": {expires}}}')

    status, out, err, said = inspect(url, capsys)

    assert status == 0, err
    assert "lease:        expired by (unreadable)" in out
    assert any(f"{LEASE} is unreadable" in line and "expires must be" in line for line in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert finishes(lambda: main(["retain", url, "--keep", "latest:1"])) == 0, capsys.readouterr().err
    assert not (tmp_path / "remote" / LEASE).exists()


@pytest.mark.parametrize(
    "fields",
    [
        {"description": {"epoch_end": True, "time": 10**400, "scores": {}}},
        {"description": {"epoch_end": True, "time": 1e300, "scores": {}}},
        {"description": {"epoch_end": True, "time": 1.0, "scores": {"score": 10**400}}},
        {"epoch": 10**400},
    ],
    ids=["time-int", "time-float", "score", "epoch"],
)
def test_one_commit_record_whose_numbers_do_not_fit_is_refused_and_the_rest_used(tmp_path, capsys, fields):
    """A commit record whose time, score or epoch does not fit its range: that folder is refused with a warning,
    the others are listed (and ``retain`` still works)."""
    url = f"file://{tmp_path}/remote"
    plant_folder(url, "step-6-0000000a", commit_record(6, b"weights"))
    plant_folder(url, "step-7-0000000b", commit_record(7, b"weights", **fields))

    status, out, err, said = inspect(url, capsys)

    assert status == 0, err
    assert "step-6-0000000a: step 6" in out and "step-7-0000000b: step" not in out
    assert any("step-7-0000000b is refused" in line for line in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert finishes(lambda: main(["retain", url, "--keep", "latest:1", "--dry-run"])) == 0


def test_what_the_store_says_is_escaped_in_every_line(tmp_path, capsys):
    """A lease holder, a run id and a version holding ANSI escapes and newlines (to forge a checkpoint line): the
    output of ``inspect`` and the lease-held error of ``retain`` carry no control character and no forged line."""
    forged = "\x1b[2J\x1b[31mred\n  step-99-deadbeef: step 99, epoch 9"
    url = f"file://{tmp_path}/remote"
    plant_folder(url, "step-6-0000000a", commit_record(6, b"weights", run_id=forged, version=forged))
    lease = {"holder": forged, "expires": time.time() + 600}
    (tmp_path / "remote" / LEASE).write_text(json.dumps(lease))

    status, out, err, _ = inspect(url, capsys)

    assert status == 0, err
    assert "\x1b" not in out and "step-99-deadbeef: step 99" in out
    assert not [line for line in out.splitlines() if line.lstrip().startswith("step-99")], out
    assert "\\x1b[2J" in out and "\\n" in out
    assert finishes(lambda: main(["retain", url, "--keep", "latest:1"])) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\n") == 1 and "held by another run" in err, err


@pytest.mark.parametrize("command", ["inspect", "retain"])
@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAKEY:hun/ter2@bucket/runs",
        "s3://hunter2@bucket/runs",
        "simplecache::s3://AKIAKEY:hunter2@bucket/runs",
        "s3:///AKIAKEY:hunter2@bucket/runs",
    ],
    ids=["key-secret", "token", "chained", "third-slash"],
)
def test_a_url_with_credentials_is_refused_in_one_line_without_them(capsys, command, url):
    """``inspect URL`` and ``retain URL`` with userinfo in the URL: one error line that does not repeat the URL or
    its secret, before the store is touched; a chained URL or a third slash hides it no better (s3fs takes
    ``KEY:SECRET@bucket`` for the bucket and botocore's error repeats it raw)."""
    argv = [command, url] + (["--keep", "latest:1"] if command == "retain" else [])
    assert finishes(lambda: main(argv)) == 2
    out, err = capsys.readouterr()
    assert "hunter2" not in err + out and "hun/ter2" not in err + out
    assert err.count("\n") == 1 and "must not hold credentials" in err, err


def test_an_error_of_the_store_client_is_one_line_with_the_credentials_masked(s3_endpoint, capsys):
    """A URL botocore refuses (a bucket name it will not send) gives one error line, not its traceback, with a
    secret-named query value masked, for ``inspect`` and ``retain``."""
    commands = (
        ["inspect", "s3://Bad:Bucket/runs?api_key=hunter2"],
        ["retain", "s3://Bad:Bucket/r", "--keep", "latest:1"],
    )
    for argv in commands:
        assert finishes(lambda argv=argv: main(argv)) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error: ckpt.remote=s3://Bad:Bucket/") and err.count("\n") == 1, err
        assert "Traceback" not in err and "hunter2" not in err
