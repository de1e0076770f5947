"""``ckpt.resume=auto`` with ``ckpt.remote`` takes a remote checkpoint only from the run's own history (its lineage),
and replaces nothing in ``out_dir`` before a fetched checkpoint passed every check (issue 52, defect 6)."""

from __future__ import annotations

import json
import secrets
import shutil
import warnings
from pathlib import Path

import pytest

from tests.helpers.configs import make_cfg
from tests.helpers.remote_store import committed_steps, remote_files
from tests.helpers.trainers import TinyTrainer, param_digest, train_and_close
from trainkit import CheckpointMismatchError, OutDirError
from trainkit.checkpoint import load_checkpoint
from trainkit.checkpoint.checkpointer import LINEAGE_RECORD
from trainkit.checkpoint.remote import RemoteTier, open_store
from trainkit.checkpoint.remote.manifest import MANIFEST, Manifest, RemoteObject, manifest_bytes, parse_manifest
from trainkit.files.durable import atomic_save

pytest.importorskip("fsspec")


@pytest.fixture
def url(tmp_path):
    return f"file://{tmp_path}/remote/runs/a"


def run(out_dir: Path, epochs: int, **overrides) -> TinyTrainer:
    ckpt = overrides.pop("ckpt", {})
    trainer = TinyTrainer(make_cfg(out_dir, epochs=epochs, ckpt=ckpt, **overrides))
    train_and_close(trainer)
    return trainer


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (its lock aside: the OS lock's holder line changes with each run)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".trainkit.lock"
    }


def test_a_rewind_is_not_undone_by_the_abandoned_remote_branch(url, tmp_path, capfd):
    """Three epochs with every epoch kept (local and remote), then a deliberate rewind to step 6 that trains one
    epoch: the remote still holds the abandoned step 18, and a rerun with ``resume=auto`` continues the rewound
    history (epoch 2 trained) instead of taking step 18; retention never deletes the abandoned branch."""
    out = tmp_path / "run"
    run(out, 3, ckpt={"remote": url, "keep": "latest:9"})
    assert committed_steps(url) == [6, 12, 18]
    run(out, 2, ckpt={"remote": url, "keep": "latest:9", "resume": str(out / "checkpoints" / "step-6.pt")})
    assert sorted(committed_steps(url)) == [6, 12, 12, 18]  # the rewound step 12 beside the abandoned 12 and 18
    capfd.readouterr()
    trainer = run(out, 3, ckpt={"remote": url, "keep": "latest:9"})
    err = capfd.readouterr().err
    assert trainer.epochs_trained == [2], err
    assert "took step" not in err
    assert "is not taken: it is not in the history of the local checkpoint (step 12)" in err
    assert 18 in committed_steps(url)  # another history's: neither counted nor deleted


def test_a_fresh_start_on_a_prefix_of_an_older_run_keeps_its_own_history(url, tmp_path, capfd):
    """An older run committed step 12 on the prefix. A ``resume=never`` run in another folder trains one epoch;
    ``resume=auto`` there continues its own step 6 (not the older run's 12); the older run's folders are left
    alone by its retention; and a run killed before its first save (here: built and closed) records its start, so
    ``resume=auto`` on that folder starts fresh instead of taking the older run's step 12."""
    run(tmp_path / "older", 2, ckpt={"remote": url})
    assert committed_steps(url) == [12]
    run(tmp_path / "fresh", 1, ckpt={"remote": url, "resume": "never"})
    assert committed_steps(url) == [6, 12]  # the older run's 12 is not this history's: not deleted, not newest
    trainer = run(tmp_path / "fresh", 2, ckpt={"remote": url})
    assert trainer.epochs_trained == [1]
    assert committed_steps(url) == [12, 12]  # each history keeps its newest

    killed = tmp_path / "killed"
    TinyTrainer(make_cfg(killed, epochs=1, ckpt={"remote": url, "resume": "never"})).close()
    assert (killed / LINEAGE_RECORD).is_file() and not (killed / "last.pt").exists()
    capfd.readouterr()
    trainer = run(killed, 2, ckpt={"remote": url})
    assert trainer.epochs_trained == [0, 1], capfd.readouterr().err


@pytest.mark.parametrize("store", ["file", "s3"])
def test_an_empty_machine_continues_the_most_recently_committed_history(store, tmp_path, request):
    """An older run committed step 12; a fresh start (``resume=never``) on the same prefix committed step 6 after
    it. The same command on an empty machine continues the fresh start's history (one more epoch from step 6), as
    the run it requeues would have: not the older run's larger step."""
    if store == "s3":
        request.getfixturevalue("s3_endpoint")
        url = f"s3://trainkit-{secrets.token_hex(4)}/runs/a"
    else:
        url = f"file://{tmp_path}/remote/runs/a"
    run(tmp_path / "older", 2, ckpt={"remote": url})
    whole = run(tmp_path / "whole", 2)
    run(tmp_path / "fresh", 1, ckpt={"remote": url, "resume": "never"})
    trainer = run(tmp_path / "empty", 2, ckpt={"remote": url})
    assert trainer.epochs_trained == [1]
    assert param_digest(trainer.model) == param_digest(whole.model)  # bit for bit the fresh start continued
    assert committed_steps(url) == [12, 12]


def descendant_on_the_remote(url: str, tmp_path: Path, **ckpt) -> Path:
    """A local folder whose checkpoint (step 6) has a committed descendant (step 12) on the remote: one epoch,
    a copy of the folder, then one more epoch from the original. Returns the copy."""
    out = tmp_path / "run"
    run(out, 1, ckpt={"remote": url, **ckpt})
    shutil.copytree(out, tmp_path / "copy")
    run(out, 2, ckpt={"remote": url, **ckpt})
    assert sorted(committed_steps(url))[-1] == 12
    return tmp_path / "copy"


@pytest.mark.parametrize("form", ["file", "sharded"])
def test_a_fetched_checkpoint_that_a_later_check_refuses_leaves_out_dir_byte_for_byte(form, url, tmp_path):
    """The remote's step 12 descends from the local step 6 and passes its commit record and the safe reader; the
    config now flips ``val.minimize``, which the checkpoint's best refuses. The run fails naming it, and every file
    of out_dir (``last``, ``best``, ``metrics.jsonl``, the lineage record) is as it was: no download folder left."""
    copy = descendant_on_the_remote(url, tmp_path, format=form)
    before = snapshot(copy)
    cfg = make_cfg(copy, epochs=3, ckpt={"remote": url, "format": form}, val={"minimize": False})
    with pytest.raises(CheckpointMismatchError, match="val.minimize"):
        TinyTrainer(cfg)
    assert snapshot(copy) == before
    assert not list(copy.glob(".remote-*"))


def test_a_fetched_descendant_is_taken_and_ends_as_one_longer_run(url, tmp_path, capfd):
    """The ordinary requeue on a machine with an older out_dir: the remote's step 12 descends from the local step 6,
    so it is taken, and three epochs end bit for bit as an uninterrupted run."""
    copy = descendant_on_the_remote(url, tmp_path)
    whole = run(tmp_path / "whole", 3)
    capfd.readouterr()
    trainer = run(copy, 3, ckpt={"remote": url})
    assert "took step 12" in capfd.readouterr().err
    assert trainer.epochs_trained == [2]
    assert param_digest(trainer.model) == param_digest(whole.model)
    lineage = load_checkpoint(copy / "last.pt")["lineage"]
    assert len(lineage) == 3 and lineage[-1][1] == 12  # fresh, resumed at 6, resumed at 12


def strip_lineages(url: str) -> None:
    """Rewrite every commit record as trainkit wrote them before lineages (no ``lineage``)."""
    fs, root = open_store(url)
    for name, data in remote_files(url).items():
        if name.endswith("/" + MANIFEST):
            record = json.loads(data)
            if record.pop("lineage", None) is None:
                continue
            parse_manifest(json.dumps(record).encode())  # an old record still parses
            fs.pipe_file(f"{root}/{name}", json.dumps(record).encode())


def test_checkpoints_from_before_lineages_still_load_and_old_remote_ones_need_an_empty_folder(url, tmp_path):
    """A local ``last.pt`` and commit records without lineages (an older trainkit): the local one resumes, and the
    remote one is not taken over it (its history cannot be told); on an empty folder the old remote one is taken,
    and the checkpoints written from there carry a lineage that starts at its step."""
    copy = descendant_on_the_remote(url, tmp_path)
    strip_lineages(url)
    payload = load_checkpoint(copy / "last.pt")
    del payload["lineage"]
    atomic_save(payload, copy / "last.pt")
    (copy / LINEAGE_RECORD).unlink()
    trainer = run(copy, 2, ckpt={"remote": url})
    assert trainer.epochs_trained == [1]  # from the local step 6, not the remote step 12
    assert [segment[1] for segment in load_checkpoint(copy / "last.pt")["lineage"]] == [6]
    strip_lineages(url)  # the run's own upload carries one: gone again, so no committed folder has one
    trainer = run(tmp_path / "empty", 3, ckpt={"remote": url})
    assert trainer.epochs_trained == [2]
    assert load_checkpoint(tmp_path / "empty" / "last.pt")["lineage"][-1][1] == 12


def test_a_hostile_lineage_record_takes_no_remote_checkpoint_and_a_directory_there_is_named(url, tmp_path):
    """A record that is not a lineage (garbage, a link) is warned about and no remote checkpoint is taken (the run
    starts fresh rather than take another history); a directory in the record's place stops the run naming it."""
    run(tmp_path / "older", 1, ckpt={"remote": url})
    for name, plant in (
        ("garbage", lambda p: p.write_text('{"lineage": [["../x", 0]], "step": 0}')),
        ("link", lambda p: p.symlink_to(tmp_path / "older" / "last.pt")),
    ):
        out = tmp_path / name
        out.mkdir()
        plant(out / LINEAGE_RECORD)
        with pytest.warns(RuntimeWarning, match="cannot be read"):
            trainer = run(out, 1, ckpt={"remote": url})
        assert trainer.epochs_trained == [0]
    (tmp_path / "dir" / LINEAGE_RECORD).mkdir(parents=True)
    with pytest.raises(OutDirError, match=LINEAGE_RECORD):
        TinyTrainer(make_cfg(tmp_path / "dir", epochs=1, ckpt={"remote": url, "resume": "never"}))


def test_an_empty_machine_takes_a_steps_newest_save_whatever_its_folder_is_named(tmp_path):
    """A step saved inside the epoch by one life and again at the epoch's end by the life that resumed it (a kill cut
    the first life's end-of-epoch commit): a resume on an empty out_dir takes the end-of-epoch save, the tip, even
    when the older copy's random folder name sorts after it (the kill fuzz met it: the older copy was taken, and the
    newer, of a sibling history then, stayed on the remote for good)."""
    prefix = tmp_path / "remote"
    first, second = ("0a1b2c3d", 0), ("4e5f6a7b", 18)

    def commit(name: str, *, epoch_end: bool, time: float, lineage) -> None:
        (prefix / name).mkdir(parents=True)
        (prefix / name / "last.pt").write_bytes(b"x")
        manifest = Manifest(
            step=18, epoch=2, kind="last", run_id=None, version="0", lineage=lineage,
            objects=(RemoteObject(name="last.pt", size=1, crc32=0),),
            description={"epoch_end": epoch_end, "time": time, "scores": {}},
        )  # fmt: skip
        (prefix / name / MANIFEST).write_bytes(manifest_bytes(manifest))

    commit("step-18-ffffffff00000000", epoch_end=False, time=100.0, lineage=(first,))
    commit("step-18-0000000000000000", epoch_end=True, time=200.0, lineage=(first, second))
    fs, root = open_store(f"file://{prefix}")
    reader = RemoteTier(f"file://{prefix}", fs, root, out_dir=tmp_path / "run", lease_s=60.0, wait_s=1.0)
    names = [name for name, _ in reader.candidates(None)]
    assert names == ["step-18-0000000000000000", "step-18-ffffffff00000000"]


def test_a_checkpoint_taken_from_the_remote_into_an_empty_folder_is_kept_saying_so(tmp_path, capfd):
    """Under ckpt.keep, the checkpoint an empty machine takes from the remote is kept like the resumed one of a
    killed run, and the line says where it came from (not that "the run before stopped after publishing it")."""
    url = f"file://{tmp_path}/remote"
    run(tmp_path / "first", 1, ckpt={"remote": url, "keep": "latest:2"})
    capfd.readouterr()
    run(tmp_path / "empty", 2, ckpt={"remote": url, "keep": "latest:2"})
    printed = "".join(capfd.readouterr())
    assert "as checkpoints/step-6: it was taken from ckpt.remote (ckpt.keep)" in printed, printed
    assert "the run before stopped after publishing it" not in printed


def test_a_commit_record_being_written_on_a_file_system_is_neither_refused_nor_taken_for_a_leftover(tmp_path):
    """On file:// a commit record is visible, empty, for an instant while it is written: a reader then (another
    machine's resume, inspect, retain) neither refuses the folder for good nor lists it as an uncommitted leftover
    (which a lease holder deletes); its next look finds it committed."""
    prefix = tmp_path / "remote"
    folder = prefix / "step-6-0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "last.pt").write_bytes(b"x")
    (folder / MANIFEST).write_bytes(b"")
    fs, root = open_store(f"file://{prefix}")
    reader = RemoteTier(f"file://{prefix}", fs, root, out_dir=tmp_path / "run", lease_s=60.0, wait_s=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal would warn
        assert (reader.committed(), reader.uncommitted()) == ([], [])
    manifest = Manifest(
        step=6, epoch=0, kind="last", run_id=None, version="0", objects=(RemoteObject(name="last.pt", size=1, crc32=0),)
    )
    (folder / MANIFEST).write_bytes(manifest_bytes(manifest))
    assert [name for name, _ in reader.committed()] == ["step-6-0123456789abcdef"]
