"""The remote checkpoint tier (``ckpt.remote``) in real runs, against a real S3 API server (moto, on localhost),
fsspec's ``file://`` and ``memory://``: resume on an empty machine, planted objects, the lease, retention, kills,
and credentials."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.configs import make_cfg
from tests.helpers.remote_store import ACCESS_KEY_ID, SECRET, committed_steps, failing_store, remote_files
from tests.helpers.trainers import TinyTrainer, param_digest
from trainkit import OutDirError, UsageError
from trainkit.checkpoint import load_checkpoint
from trainkit.checkpoint.kept import read_kept
from trainkit.checkpoint.remote import LEASE_LOCK, RemoteTier, open_store
from trainkit.checkpoint.remote.manifest import LEASE, MANIFEST, Lease, lease_bytes

pytest.importorskip("fsspec")



def run(out_dir: Path, epochs: int, **ckpt) -> tuple[str, TinyTrainer]:
    trainer = TinyTrainer(make_cfg(out_dir, epochs=epochs, ckpt=ckpt))
    try:
        trainer.train()
        return param_digest(trainer.model), trainer
    finally:
        trainer.close()


def test_a_rerun_on_an_empty_machine_continues_from_the_remote_bit_for_bit(remote_url, tmp_path):
    """Two epochs with the remote on, then the same command (three epochs) on an empty out_dir: the weights, the
    metrics rows and the W&B run id equal an uninterrupted run's; the remote holds only committed checkpoints, no
    lease after the run, and no credential in any file either run wrote or uploaded."""
    whole, _ = run(tmp_path / "whole", 3)
    run(tmp_path / "first", 2, remote=remote_url)
    assert committed_steps(remote_url) == [12]
    resumed, trainer = run(tmp_path / "empty", 3, remote=remote_url)

    assert resumed == whole
    assert trainer.epochs_trained == [2]  # resumed, not trained again from scratch
    first, again = load_checkpoint(tmp_path / "first" / "last.pt"), load_checkpoint(tmp_path / "empty" / "last.pt")
    assert again["wandb_run_id"] == first["wandb_run_id"]

    def rows(folder):
        lines = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "time" not in k and "/s" not in k} for line in lines]

    assert [r.get("val/loss") for r in rows("empty")] == [r.get("val/loss") for r in rows("whole")]
    objects = remote_files(remote_url)
    assert LEASE not in objects
    assert committed_steps(remote_url) == [18]
    assert all(name.split("/")[0].startswith("step-18-") or name == LEASE_LOCK for name in objects)
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()] + list(objects.values())
    assert not [data for data in written if SECRET.encode() in data or ACCESS_KEY_ID.encode() in data]


def plant(url: str, folder: str, files: dict[str, bytes], manifest: dict | None) -> None:
    fs, root = open_store(url)
    fs.makedirs(f"{root}/{folder}", exist_ok=True)
    for name, data in files.items():
        fs.pipe_file(f"{root}/{folder}/{name}", data)
    if manifest is not None:
        fs.pipe_file(f"{root}/{folder}/{MANIFEST}", json.dumps(manifest).encode())


def manifest_of(step: int, objects: dict[str, bytes], lineage=None, **lie) -> dict:
    """A commit record of ``objects``; with ``lineage``, one of that history committed now (the newest)."""
    import zlib

    listed = [{"name": n, "size": len(d), "crc32": zlib.crc32(d)} for n, d in objects.items()]
    listed = [{**item, **lie} for item in listed]
    manifest = {"step": step, "epoch": 9, "kind": "last", "objects": listed, "run_id": None, "version": "0"}
    if lineage is not None:
        manifest.update(lineage=lineage, description={"time": time.time()})
    return manifest


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch planted-code-ran",))


@pytest.mark.parametrize("remote_url", ["file", "s3"], indirect=True)
def test_planted_remote_objects_are_refused_and_the_resume_falls_back(remote_url, tmp_path, monkeypatch):
    """Newer planted folders, one per fault (no commit record; a size that lies; a CRC that lies; a pickle that
    runs code; a name with ``..``; a name of out_dir's own, the run's lock), are each refused with a warning,
    nothing is written outside out_dir, no code runs, and the resume takes the newest honest checkpoint."""
    import pickle

    monkeypatch.chdir(tmp_path)
    run(tmp_path / "first", 1, remote=remote_url)
    honest = (tmp_path / "first" / "last.pt").read_bytes()
    line = load_checkpoint(tmp_path / "first" / "last.pt")["lineage"]  # the planted ones claim its history
    evil = pickle.dumps({"x": RunsCode()})
    plant(remote_url, "step-100-0000000a", {"last.pt": honest}, None)
    plant(remote_url, "step-101-0000000b", {"last.pt": honest}, manifest_of(101, {"last.pt": honest}, line, size=7))
    plant(remote_url, "step-102-0000000c", {"last.pt": honest}, manifest_of(102, {"last.pt": honest}, line, crc32=1))
    plant(remote_url, "step-103-0000000d", {"last.pt": evil}, manifest_of(103, {"last.pt": evil}, line))
    plant(remote_url, "step-104-0000000e", {"last.pt": honest}, manifest_of(104, {"../escaped.pt": honest}, line))
    lock = {"last.pt": honest, ".trainkit.lock": b"planted"}  # a name out_dir holds, not a checkpoint's
    plant(remote_url, "step-105-0000000f", lock, manifest_of(105, lock, line))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = run(tmp_path / "empty", 2, remote=remote_url)
    said = "\n".join(str(w.message) for w in caught)
    for refused in ("step-101", "step-102", "step-103", "step-104", "step-105"):
        assert refused in said, said
    assert "step-100" not in said  # uncommitted: never read, not even warned about
    assert trainer.epochs_trained == [1]
    assert not (tmp_path / "planted-code-ran").exists()
    assert not list(tmp_path.rglob("escaped.pt")) and not list((tmp_path / "empty").glob(".remote-*"))
    assert (tmp_path / "empty" / ".trainkit.lock").read_bytes() != b"planted"


def test_the_lease_refuses_a_second_writer_and_an_expired_one_is_taken_over(remote_url, tmp_path):
    """A run holding the prefix refuses a second one, naming the prefix, the holder and when it expires; a lease
    its run stopped renewing (a kill) is taken over once it expires."""
    fs, root = open_store(remote_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{LEASE}", lease_bytes(Lease(holder="node7:4242:ab", expires=time.time() + 600)))
    with pytest.raises(OutDirError, match=r"node7:4242:ab.*until 20\d\d-") as refused:
        TinyTrainer(make_cfg(tmp_path / "second", epochs=1, ckpt={"remote": remote_url})).close()
    assert remote_url.split("://")[1].split("/")[0] in str(refused.value)
    fs.pipe_file(f"{root}/{LEASE}", lease_bytes(Lease(holder="node7:4242:ab", expires=time.time() - 1)))
    run(tmp_path / "third", 1, remote=remote_url)
    assert committed_steps(remote_url) == [6]


@pytest.mark.parametrize("remote_url", ["file"], indirect=True)
def test_remote_retention_keeps_what_the_local_kept_set_keeps(remote_url, tmp_path):
    """With ``ckpt.keep`` the remote keeps the steps the local ``checkpoints/`` keeps (an upload a newer
    checkpoint superseded before it started is the only one it may lack), always the newest; never more."""
    run(tmp_path / "run", 4, remote=remote_url, keep="latest:2,every_epochs:2", every_n_steps=4)
    local = sorted(c.step for c in read_kept(tmp_path / "run" / "checkpoints").described)
    remote = committed_steps(remote_url)
    assert remote[-1] == local[-1] == 24
    assert set(remote) <= set(local), (remote, local)
    assert len(remote) >= 2


KILLED_RUN = """
import sys
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
ckpt = {"remote": sys.argv[2], "remote_lease_s": 1.0, "every_n_steps": 4}
trainer = TinyTrainer(make_cfg(sys.argv[1], epochs=20, ckpt=ckpt))
trainer.train()
"""


@pytest.mark.parametrize("remote_url", ["s3"], indirect=True)
def test_a_kill_at_a_random_moment_of_the_uploads_leaves_a_committed_checkpoint_and_an_exact_resume(
    remote_url, tmp_path, capfd
):
    """SIGKILL at a random moment after the first commit (uploads are in flight at most moments): the remote has a
    committed checkpoint, and the same command on an empty out_dir, once the lease expired, ends as an
    uninterrupted run. About 15 s: a training process must be started and killed mid-run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "killed"), remote_url], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not committed_steps(remote_url) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pause = random.Random().uniform(0.0, 0.5)
        time.sleep(pause)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert committed_steps(remote_url), f"no commit on the remote (killed {pause:.2f}s after the first one)"
    time.sleep(1.2)  # the killed run's lease expires
    assert child.returncode == -signal.SIGKILL, f"the run ended before the kill ({pause:.2f}s after the first commit)"
    steps = committed_steps(remote_url)
    whole, _ = run(tmp_path / "whole", 20, every_n_steps=4)
    capfd.readouterr()
    resumed, _ = run(tmp_path / "empty", 20, remote=remote_url, every_n_steps=4)
    assert f"took step {steps[-1]} from ckpt.remote" in capfd.readouterr().err  # resumed, not trained anew
    assert resumed == whole, f"killed {pause:.2f}s after the first commit; resumed from step {steps[-1]}"


def test_a_store_that_fails_every_upload_neither_fails_nor_stops_training(tmp_path):
    """Every upload fails: the run trains to its end, warns once about the failures, and at its end says which step
    is not on the remote; nothing is committed there."""
    url = failing_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = run(tmp_path / "run", 3, remote=url, remote_wait_s=0.5)
    said = [str(w.message) for w in caught if "ckpt.remote" in str(w.message)]
    assert trainer.epochs_trained == [0, 1, 2]
    assert sum("failed" in line and "retrying" in line for line in said) == 1, said
    assert any("is not on the remote" in line and "18" in line for line in said), said
    assert committed_steps(url) == []


@pytest.mark.parametrize("remote_url", ["memory"], indirect=True)
def test_a_running_writer_renews_its_lease_and_a_failed_construction_lets_the_prefix_go(remote_url, tmp_path):
    """A lease of 0.3 s held by a live writer is still refused after a second (the uploader renews it); a trainer
    whose construction fails after it took the prefix (a damaged checkpoint to resume) lets it go."""
    cfg = make_cfg(tmp_path / "a", epochs=1, ckpt={"remote": remote_url, "remote_lease_s": 0.3})
    writer = RemoteTier.build(TinyTrainer.config_class.from_mapping(cfg).ckpt, tmp_path / "a", rank=0)
    writer.acquire()
    try:
        time.sleep(1.0)
        with pytest.raises(OutDirError, match="is held by another run"):
            TinyTrainer(make_cfg(tmp_path / "b", epochs=1, ckpt={"remote": remote_url})).close()
    finally:
        writer.close()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match="last.pt"):
        TinyTrainer(make_cfg(tmp_path / "c", epochs=1, ckpt={"remote": remote_url}))
    _, trainer = run(tmp_path / "d", 1, remote=remote_url)  # the prefix is free again
    assert trainer.epochs_trained == [0]


def test_a_missing_filesystem_package_is_one_line_naming_it(tmp_path):
    """A store whose fsspec filesystem is not installed (gcsfs here) stops the run before anything else, in one
    line naming the package; an unknown protocol is named too."""
    pytest.importorskip("fsspec")
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(UsageError, match="gcsfs") as refused:
        TinyTrainer(make_cfg(tmp_path, epochs=1, ckpt={"remote": "gs://bucket/runs/a"}))
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="nosuch"):
        TinyTrainer(make_cfg(tmp_path, epochs=1, ckpt={"remote": "nosuch://bucket/runs/a"}))
    assert not list(tmp_path.glob("*.pt"))


@pytest.mark.parametrize("remote_url", ["file"], indirect=True)
def test_a_checkpoint_whose_validation_scored_nan_still_reaches_the_remote(remote_url, tmp_path):
    """A NaN score cannot go into a JSON commit record: it is left out of the description (as the local index
    leaves it out), and the checkpoint is committed like any other."""
    import math

    trainer = TinyTrainer(
        make_cfg(tmp_path / "run", epochs=2, scripted_scores=(1.0, math.nan), ckpt={"remote": remote_url})
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert committed_steps(remote_url)[-1] == 12
