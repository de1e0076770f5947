"""The remote tier's lease takeover, retention faults, the direction of ``best`` rules, a failing run's last upload
and transfer leftovers in ``out_dir``: real runs against a real S3 API server (moto, on localhost), fsspec's
``file://`` and ``memory://``."""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import threading
import time
import warnings
from pathlib import Path

import pytest

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer, param_digest, train_and_close
from trainkit import ConfigError, OutDirError
from trainkit.checkpoint.remote import FETCH_PREFIX, STAGING_DIR, RemoteTier, open_store
from trainkit.checkpoint.remote.manifest import LEASE, MANIFEST, Lease, lease_bytes, parse_manifest
from trainkit.cli.retain import retain_remote

pytest.importorskip("fsspec")




def run(out_dir: Path, epochs: int, *, url: str, **cfg) -> TinyTrainer:
    ckpt = {"remote": url, **cfg.pop("ckpt", {})}
    trainer = TinyTrainer(make_cfg(out_dir, epochs=epochs, ckpt=ckpt, **cfg))
    train_and_close(trainer)
    return trainer


def committed(url: str) -> dict[int, str]:
    """The committed folders under the prefix, by step."""
    fs, root = open_store(url)
    fs.invalidate_cache()
    found = {}
    for path in fs.find(root):
        if path.endswith("/" + MANIFEST):
            folder = path[len(root) + 1 :].split("/")[0]
            data = fs.cat_file(path)
            if data:  # on file:// a record being written reads empty for an instant: committed at the next look
                found[parse_manifest(data).step] = folder
    return found


def plant_committed(url: str, folder: str, step: int, description: dict | None = None) -> None:
    """A committed folder of a ``last.pt`` that is never read (retention only reads commit records)."""
    import zlib

    fs, root = open_store(url)
    data = b"x"
    fs.makedirs(f"{root}/{folder}", exist_ok=True)
    fs.pipe_file(f"{root}/{folder}/last.pt", data)
    manifest = {
        "step": step,
        "epoch": 0,
        "kind": "last",
        "objects": [{"name": "last.pt", "size": len(data), "crc32": zlib.crc32(data)}],
        "run_id": None,
        "version": "0",
        "description": description or {},
    }
    fs.pipe_file(f"{root}/{folder}/{MANIFEST}", json.dumps(manifest).encode())


def memory_store(protocol: str, **overrides):
    """A fresh fsspec memory store under its own protocol, with some methods replaced (a store with a fault)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    store = type(protocol.title(), (MemoryFileSystem,), {"protocol": protocol, "store": {}, "pseudo_dirs": [""]})
    for name, method in overrides.items():
        setattr(store, name, method)
    fsspec.register_implementation(protocol, store, clobber=True)
    return f"{protocol}://trainkit-{secrets.token_hex(4)}/runs/a"


# ---------------------------------------------------------------------- 14: the lease's takeover


def test_two_runs_taking_over_one_expired_lease_at_once_leave_exactly_one_holder(remote_url, tmp_path):
    """Two runs read the same expired lease, then both take it over (the second a moment after the first wrote
    its own): exactly one holds the prefix, the other is refused naming the holder, and the lease is the winner's."""
    fs, root = open_store(remote_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{LEASE}", lease_bytes(Lease(holder="killed:1:ab", expires=time.time() - 5)))
    both_read = threading.Barrier(2, timeout=30)
    outcome: dict[int, object] = {}

    def take(index: int) -> None:
        store = type(fs)

        class ReadsThenWaits(store):  # the same store, pausing once after its first read of the lease
            paused = False

            def open(self, path, mode="rb", **kwargs):
                if mode != "rb" or not str(path).endswith(LEASE) or self.paused:
                    return super().open(path, mode, **kwargs)
                self.paused = True
                with super().open(path, mode, **kwargs) as handle:
                    data = handle.read()
                both_read.wait()  # both runs have the expired lease in hand
                time.sleep(0.3 * index)  # the second writes after the first wrote
                return io.BytesIO(data)

        own = ReadsThenWaits(**fs.storage_options, skip_instance_cache=True)
        tier = RemoteTier(remote_url, own, root, out_dir=tmp_path, lease_s=60.0, wait_s=0.0)
        try:
            tier.acquire(uploads=False)
            outcome[index] = tier.lease()
        except OutDirError as exc:
            outcome[index] = exc

    threads = [threading.Thread(target=take, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    won = [value for value in outcome.values() if isinstance(value, Lease)]
    refused = [value for value in outcome.values() if isinstance(value, OutDirError)]
    assert len(won) == 1 and len(refused) == 1, outcome
    assert "is held by another run" in str(refused[0]) and won[0].holder in str(refused[0])
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{root}/{LEASE}"))["holder"] == won[0].holder


def test_many_runs_taking_over_one_expired_lease_on_a_file_system_leave_exactly_one_holder(tmp_path):
    """Six runs at once on an expired lease of a file:// prefix (a shared mount), forty times: a takeover renames the
    lease aside and puts back one it should not have taken, and a third run created its own in between, so two or
    three runs held the prefix (about one time in three here). Each time exactly one holds it now, and the lease is
    that run's (its end deletes it: a run deletes only its own)."""
    url = f"file://{tmp_path}/remote"
    fs, root = open_store(url)
    fs.makedirs(root, exist_ok=True)
    for attempt in range(40):
        fs.pipe_file(f"{root}/{LEASE}", lease_bytes(Lease(holder="killed:1:ab", expires=time.time() - 5)))
        tiers = [RemoteTier(url, fs, root, out_dir=tmp_path / f"run-{i}", lease_s=60.0, wait_s=0.0) for i in range(6)]
        start = threading.Barrier(len(tiers), timeout=30)
        holders: list[RemoteTier] = []

        def take(tier: RemoteTier, start: threading.Barrier, holders: list[RemoteTier]) -> None:
            start.wait()
            with contextlib.suppress(OutDirError):
                tier.acquire(uploads=False)
                holders.append(tier)

        threads = [threading.Thread(target=take, args=(tier, start, holders)) for tier in tiers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(holders) == 1, (attempt, len(holders))
        holders[0].close()
        assert not fs.exists(f"{root}/{LEASE}"), attempt


# ---------------------------------------------------------------------- 10: retention apart from the commit


def _undeletable(folder: str):
    def rm_file(self, path):
        if folder in str(path):
            raise PermissionError(f"access denied to {path}")
        return type(self).__mro__[1].rm_file(self, path)

    def rm(self, path, recursive=False, maxdepth=None):
        if folder in str(path):
            raise PermissionError(f"access denied to {path}")
        return type(self).__mro__[1].rm(self, path, recursive=recursive, maxdepth=maxdepth)

    return {"rm_file": rm_file, "rm": rm}


STUCK = "step-1-00000001"


def test_a_retention_that_cannot_delete_one_folder_neither_uploads_again_nor_stops_deleting(tmp_path):
    """One old folder of the run cannot be deleted: every checkpoint is committed once (no upload is repeated), the
    failure is warned about once, and every other folder retention drops is still deleted. (Retention judges only
    the run's own history, so the stuck folder is the run's own step 6, not a planted one.)"""
    url = memory_store("nodelete", **_undeletable("step-6-"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(tmp_path / "run", 3, url=url)
    said = [str(w.message) for w in caught if "ckpt.remote" in str(w.message)]
    assert sorted(committed(url)) == [6, 18]  # 12 deleted after the next commit
    fs, root = open_store(url)
    assert len([name for name in fs.ls(root, detail=False) if "/step-" in name]) == 2  # no second upload anywhere
    assert len(said) == 1 and "step-6-" in said[0] and "access denied" in said[0], said
    assert "retrying" not in said[0]


def test_retain_url_with_a_folder_it_cannot_delete_deletes_the_rest_and_says_which_in_one_line():
    """``retain URL``: the folders it can delete are deleted; the error is one line naming the folder, its cause
    and what is left."""
    url = memory_store("nodelete2", **_undeletable(STUCK))
    plant_committed(url, STUCK, 1)
    plant_committed(url, "step-2-00000002", 2)
    plant_committed(url, "step-3-00000003", 3)
    with pytest.raises(OutDirError) as refused:
        retain_remote(url, "latest:1", dry_run=False)
    message = str(refused.value)
    assert "\n" not in message
    assert f"could not delete {STUCK}" in message and "access denied" in message and "left: " + STUCK in message
    assert sorted(committed(url)) == [1, 3]


# ---------------------------------------------------------------------- 13: the direction of best rules


@pytest.mark.parametrize("remote_url", ["file"], indirect=True)
def test_retain_url_best_rule_follows_the_direction_the_run_recorded(remote_url, tmp_path):
    """A maximizing run's scores 0.1, 0.9, 0.5: ``retain URL --keep best:1`` keeps the 0.9 checkpoint (and the
    newest), not the lowest score's."""
    run(tmp_path / "run", 3, url=remote_url, ckpt={"keep": "latest:3"}, scripted_scores=(0.1, 0.9, 0.5),
        val={"minimize": False})  # fmt: skip
    assert sorted(committed(remote_url)) == [6, 12, 18]
    lines = retain_remote(remote_url, "best:1", dry_run=False)
    assert sorted(committed(remote_url)) == [12, 18], lines


@pytest.mark.parametrize("remote_url", ["memory"], indirect=True)
def test_retain_url_refuses_a_best_rule_without_a_direction_on_older_commit_records(remote_url):
    """Commit records written before the direction was recorded: a ``best:N`` rule without ``:min``/``:max`` is
    refused in one line naming the rule and what to write, and nothing is deleted; with a direction it works."""
    for step in (1, 2, 3):
        plant_committed(remote_url, f"step-{step}-0000000{step}", step, {"scores": {"score": float(step)}})
    with pytest.raises(ConfigError, match=r"best:1.*best:N:score:min") as refused:
        retain_remote(remote_url, "best:1", dry_run=False)
    assert "\n" not in str(refused.value)
    assert sorted(committed(remote_url)) == [1, 2, 3]
    retain_remote(remote_url, "best:1:score:max", dry_run=False)
    assert sorted(committed(remote_url)) == [3]


# ---------------------------------------------------------------------- 12: a failing run's last upload


def test_a_run_that_fails_still_commits_the_checkpoint_it_just_published(tmp_path):
    """The run raises at epoch 2 while epoch 0's upload (slow) is still in flight and epoch 1's waits for it: the
    same exception propagates, and epoch 1's checkpoint is committed on the remote (waited for up to
    ckpt.remote_wait_s, as at a normal end), not abandoned in the queue."""
    from fsspec.implementations.memory import MemoryFileSystem

    puts = []

    def first_put_slow(self, lpath, rpath, **kwargs):
        puts.append(rpath)
        if len(puts) == 1:
            time.sleep(2.0)
        return MemoryFileSystem.put(self, lpath, rpath, **kwargs)

    url = memory_store("slowput", put=first_put_slow)
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at epoch 2"):
        run(tmp_path / "run", 3, url=url, fail_epoch=2, fail_rank=0, fail_in="train")
    assert sorted(committed(url)) == [12]


# ---------------------------------------------------------------------- 15: leftovers of killed runs


@pytest.mark.parametrize("remote_url", ["file"], indirect=True)
def test_a_run_clears_the_staged_and_fetched_leftovers_of_killed_runs_when_it_starts(remote_url, tmp_path):
    """Staged hard links and a download that killed runs left in out_dir are gone once the next run holds the
    folder (before it trains), and a link there is removed, never followed."""
    out = tmp_path / "run"
    run(out, 1, url=remote_url)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.pt").write_bytes(b"not yours")
    for staged in ("0123abcd", "rank-0/4567ef01", "rank-1/89ab2345"):
        (out / STAGING_DIR / staged).mkdir(parents=True)
        (out / STAGING_DIR / staged / "last.pt").hardlink_to(out / "last.pt")
    (out / f"{FETCH_PREFIX}deadbeef").mkdir()
    (out / f"{FETCH_PREFIX}deadbeef" / "last.pt").write_bytes(b"half")
    (out / f"{FETCH_PREFIX}linked").symlink_to(outside)
    trainer = TinyTrainer(make_cfg(out, epochs=2, ckpt={"remote": remote_url}))
    try:
        assert not (out / STAGING_DIR).exists()
        assert not list(out.glob(f"{FETCH_PREFIX}*"))
        assert (outside / "keep.pt").read_bytes() == b"not yours"
    finally:
        trainer.close()


# ---------------------------------------------------------------------- issue 56, 4: a requeue after a kill

REQUEUED_RUN = """
import sys
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
trainer = TinyTrainer(make_cfg(sys.argv[1], epochs=20, ckpt={"remote": sys.argv[2], "every_n_steps": 4}))
trainer.train()
"""


def kill_after_first_commit(out_dir: Path, url: str, tmp_path: Path) -> None:
    """Run :data:`REQUEUED_RUN` (the default ``ckpt.remote_lease_s``, 60 s) in a process of its own and SIGKILL it
    once the remote holds a committed checkpoint: it leaves its unexpired lease on the prefix."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import ROOT

    script = tmp_path / "requeued.py"
    script.write_text(REQUEUED_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(out_dir), url], env=env, cwd=ROOT)

    def any_committed() -> bool:
        try:
            return bool(committed(url))
        except FileNotFoundError:  # no bucket yet, or a folder deleted while it was listed
            return False

    try:
        deadline = time.monotonic() + 120
        while not any_committed() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL, "the run ended before the kill"
    assert committed(url), "no commit on the remote before the kill"


@pytest.mark.parametrize("remote_url", ["file", "s3"], indirect=True)
def test_a_requeue_right_after_a_kill_takes_its_own_lease_over_and_resumes_bit_for_bit(remote_url, tmp_path, capfd):
    """SIGKILL a run (default lease, 60 s) after its first commit: its lease is still unexpired. At once, a run in
    another folder on the same prefix is refused naming the killed holder; the same command in the killed run's
    folder takes the lease over (saying so), resumes, and ends bit for bit as an uninterrupted run."""
    out = tmp_path / "run"
    kill_after_first_commit(out, remote_url, tmp_path)
    fs, root = open_store(remote_url)
    fs.invalidate_cache()
    left = json.loads(fs.cat_file(f"{root}/{LEASE}"))
    assert left["expires"] > time.time() + 10  # the killed run's lease is far from expiry
    with pytest.raises(OutDirError, match="is held by another run") as refused:
        run(tmp_path / "elsewhere", 20, url=remote_url, ckpt={"every_n_steps": 4})
    assert left["holder"] in str(refused.value)
    capfd.readouterr()
    requeued = run(out, 20, url=remote_url, ckpt={"every_n_steps": 4})
    err = capfd.readouterr().err
    assert "took over the lease that a killed run of" in err and left["holder"] in err, err
    assert f"trainkit: resuming {out / 'last.pt'}" in err, err  # resumed, not trained again from the start
    whole = run(tmp_path / "whole", 20, url=f"memory://trainkit-{secrets.token_hex(4)}/w", ckpt={"every_n_steps": 4})
    assert param_digest(requeued.model) == param_digest(whole.model)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{LEASE}")  # released at the requeued run's end


FOLDER = "0123456789abcdef0123456789abcdef"


def plant_lease(url: str, **fields) -> None:
    """An unexpired lease (10 minutes) of a holder that no longer runs, with these extra fields."""
    fs, root = open_store(url)
    fs.makedirs(root, exist_ok=True)
    data = {"holder": "node7:4242:ab", "expires": time.time() + 600, **fields}
    fs.pipe_file(f"{root}/{LEASE}", json.dumps(data).encode())


def test_an_unexpired_lease_is_taken_over_only_by_a_run_of_the_folder_it_names(remote_url, tmp_path):
    """A lease naming a run folder's identity: a run in a folder of another identity, or in a new folder, is
    refused naming the holder; a run in the folder it names takes it over at once, and its lease names it too."""
    plant_lease(remote_url, folder=FOLDER)
    other = tmp_path / "other"
    other.mkdir()
    (other / ".trainkit-folder-id").write_text("f" * 32)
    for folder in (other, tmp_path / "new"):
        with pytest.raises(OutDirError, match=r"held by another run \(node7:4242:ab\)"):
            run(folder, 1, url=remote_url)
    assert (tmp_path / "new" / ".trainkit-folder-id").read_text().strip() != FOLDER  # a fresh identity, kept
    own = tmp_path / "own"
    own.mkdir()
    (own / ".trainkit-folder-id").write_text(FOLDER + "\n")
    trainer = TinyTrainer(make_cfg(own, epochs=1, ckpt={"remote": remote_url}))
    try:
        fs, root = open_store(remote_url)
        fs.invalidate_cache()
        lease = json.loads(fs.cat_file(f"{root}/{LEASE}"))
        assert lease["folder"] == FOLDER and lease["holder"] != "node7:4242:ab"
        trainer.train()
    finally:
        trainer.close()
    assert sorted(committed(remote_url)) == [6]


@pytest.mark.parametrize("remote_url", ["file", "memory"], indirect=True)
@pytest.mark.parametrize(
    "forged",
    [
        "x" * 100_000,  # huge
        FOLDER.upper(),  # not lowercase hex
        FOLDER + "0",  # too long
        [FOLDER],  # not a string
        {"folder": FOLDER},
        12345678901234567890123456789012,
        None,
    ],
    ids=["huge", "upper", "long", "list", "mapping", "int", "null"],
)
def test_a_lease_with_a_forged_folder_still_holds_and_is_taken_over_by_no_run_early(remote_url, tmp_path, forged):
    """A lease whose ``folder`` is malformed (huge, not 32 lowercase hex digits, not a string) is read safely: its
    holder and expiry hold, its folder is ignored, and even a run whose folder identity file holds the same text
    is refused naming the holder."""
    plant_lease(remote_url, folder=forged)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".trainkit-folder-id").write_text(forged if isinstance(forged, str) else json.dumps(forged))
    with pytest.raises(OutDirError, match=r"held by another run \(node7:4242:ab\)") as refused:
        run(out, 1, url=remote_url)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("remote_url", ["file"], indirect=True)
def test_a_linked_folder_identity_is_not_followed(remote_url, tmp_path):
    """``out_dir/.trainkit-folder-id`` as a link to a file holding the lease's folder identity: not followed (the
    run is refused naming the holder), the link is replaced by a fresh identity, and its target is untouched."""
    plant_lease(remote_url, folder=FOLDER)
    target = tmp_path / "elsewhere-id"
    target.write_text(FOLDER)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".trainkit-folder-id").symlink_to(target)
    with pytest.raises(OutDirError, match=r"held by another run \(node7:4242:ab\)"):
        run(out, 1, url=remote_url)
    assert not (out / ".trainkit-folder-id").is_symlink()
    assert (out / ".trainkit-folder-id").read_text().strip() != FOLDER
    assert target.read_text() == FOLDER
