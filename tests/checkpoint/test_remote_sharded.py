"""The remote tier with sharded checkpoints on 2 real gloo ranks: each rank uploads its own shards, rank 0 commits
once both are up, and a rerun on an empty out_dir continues bit for bit."""

from __future__ import annotations

import json
import secrets

import pytest
import torch

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShardTrainer
from trainkit.checkpoint.remote import open_store

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]


def sharded_cfg(out_dir, remote=None, **overrides):
    ckpt = {"format": "sharded", **({"remote": remote} if remote else {})}
    return make_cfg(
        out_dir,
        **{
            "epochs": 3,
            "dist": {"timeout_s": 60},
            "wrap": "fsdp",
            "val": {"patience": 5},
            "test": {"enable": True},
            "ckpt": ckpt,
            **overrides,
        },
    )


@pytest.mark.parametrize("store", ["s3"])  # file:// passes too; one store keeps the suite short
def test_sharded_checkpoints_go_to_the_remote_rank_by_rank_and_resume_on_an_empty_machine(store, tmp_path, request):
    """Two epochs with the remote on leave one committed folder holding both ranks' shards of last.ckpt and
    best.ckpt, the metadata, the engine payload and metrics.jsonl; the same command for three epochs on an empty
    out_dir ends as the uninterrupted run: results, weights and optimizer state."""
    if store == "s3":
        request.getfixturevalue("s3_endpoint")  # before the fork server starts: its processes inherit the variables
    url = f"file://{tmp_path}/remote" if store == "file" else f"s3://trainkit-{secrets.token_hex(4)}/runs/sharded"
    with trainkit.fork_server(preload=["torch.distributed.checkpoint", "torch.distributed.fsdp", "tests.helpers"]):
        expected = trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "whole"), 2)
        trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "first", url, epochs=2), 2)
        fs, root = open_store(url)
        fs.invalidate_cache()
        manifests = [path for path in fs.find(root) if path.endswith("/commit.json")]
        assert len(manifests) == 1
        names = {item["name"] for item in json.loads(fs.cat_file(manifests[0]))["objects"]}
        for top in ("last.ckpt", "best.ckpt"):
            assert {f"{top}/__0_0.distcp", f"{top}/__1_0.distcp", f"{top}/.metadata", f"{top}/trainkit.pt"} <= names
        assert "metrics.jsonl" in names
        got = trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "empty", url), 2)
    assert got == expected
    ref, resumed = torch.load(tmp_path / "whole" / "report2.pt"), torch.load(tmp_path / "empty" / "report2.pt")
    for key in ("weights", "optimizer"):
        assert repr(resumed[key]) == repr(ref[key])
    assert 0 < len(resumed["pushed"]) < len(ref["pushed"])  # it resumed: only the last epoch's rows were pushed
