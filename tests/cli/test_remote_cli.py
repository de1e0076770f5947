"""``python -m trainkit inspect URL`` and ``retain URL``: a remote prefix listed, one remote checkpoint verified and
described, retention applied under the prefix's lease."""

from __future__ import annotations

import time

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer, train_and_close
from trainkit.checkpoint.remote import LEASE_LOCK, open_store
from trainkit.checkpoint.remote.manifest import LEASE, Lease, lease_bytes
from trainkit.cli import main


def test_inspect_and_retain_take_a_remote_url(tmp_path, capsys):
    """inspect lists the committed checkpoints and describes one after verifying it; retain refuses a prefix a run
    holds, says what it keeps and why, and deletes the rest and an uncommitted folder."""
    url = f"file://{tmp_path}/remote"
    train_and_close(TinyTrainer(make_cfg(tmp_path / "run", epochs=3, ckpt={"remote": url, "keep": "every_epochs:1"})))
    fs, root = open_store(url)
    fs.makedirs(f"{root}/step-99-0000abcd", exist_ok=True)
    fs.pipe_file(f"{root}/step-99-0000abcd/last.pt", b"cut short")
    assert main(["inspect", url]) == 0
    listing = capsys.readouterr().out
    folders = sorted(p.name for p in (tmp_path / "remote").iterdir() if p.name.startswith("step-18-"))
    assert f"{folders[0]}: step 18, epoch 3" in listing and "uncommitted" in listing and "step-99-0000abcd" in listing
    assert main(["inspect", f"{url}/{folders[0]}"]) == 0
    described = capsys.readouterr().out
    assert "verified" in described and "epoch:        3 done, step 18" in described
    assert main(["inspect", f"{url}/step-99-0000abcd"]) == 2
    assert "not a committed remote checkpoint" in capsys.readouterr().err

    fs.pipe_file(f"{root}/{LEASE}", lease_bytes(Lease(holder="node7:1:ab", expires=time.time() + 600)))
    assert main(["retain", url, "--keep", "latest:1"]) == 2
    assert "node7:1:ab" in capsys.readouterr().err
    fs.rm_file(f"{root}/{LEASE}")
    assert main(["retain", url, "--keep", "latest:1"]) == 0
    said = capsys.readouterr().out
    assert "newest, latest:1" in said and "delete step-99-0000abcd" in said
    assert sorted(p.name for p in (tmp_path / "remote").iterdir() if p.name != LEASE_LOCK) == folders


def test_inspect_describes_a_sharded_runs_remote_checkpoint(tmp_path, capsys):
    """A sharded run's remote folder holds last.ckpt/, not last.pt: inspect URL/FOLDER describes it after verifying
    it (it said a temporary last.pt 'does not exist')."""
    url = f"file://{tmp_path}/remote"
    train_and_close(TinyTrainer(make_cfg(tmp_path / "run", epochs=1, ckpt={"remote": url, "format": "sharded"})))
    (folder,) = (p.name for p in (tmp_path / "remote").iterdir() if p.name.startswith("step-"))
    capsys.readouterr()
    assert main(["inspect", f"{url}/{folder}"]) == 0, capsys.readouterr().err
    described = capsys.readouterr().out
    assert "verified" in described and "epoch:        1 done, step 6" in described
    assert "model: in the DCP shards" in described
