"""FSDP2 (make_fsdp) on real gloo processes: the same training as DDP, and the helpers correct over shards."""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShardTrainer
from trainkit.cli import main as cli_main

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def one_fork_server():
    """One fork server for the module's ~30 spawns: torch imported once, not once per call (~4 s of CPU each)."""
    preload = ["torch.distributed.checkpoint", "torch.distributed.fsdp", "tests.helpers.trainers"]
    with trainkit.fork_server(preload=preload):
        yield


def run(out_dir, world_size=2, **overrides):
    """Train a ShardTrainer; return (result, every push_logs() result on rank 0, the final whole weights)."""
    cfg = make_cfg(out_dir, **{"epochs": 3, "dist": {"timeout_s": 60}, "grad_clip": 0.5, "log_grad_stats": True,
                               "log_weight_stats": True, "test": {"enable": True}, "ckpt": {"enable": False},
                               **overrides})
    out_dir.mkdir(parents=True, exist_ok=True)
    result = trainkit.spawn(ShardTrainer, cfg, world_size)
    report = torch.load(out_dir / f"report{world_size}.pt")
    return result, report["pushed"], report["weights"]


def test_fsdp2_trains_as_ddp_does(tmp_path):
    """Same data, same initial weights: losses, grad norms (clipped over every shard), per-parameter statistics,
    validation, early stopping, the best epoch and the test score agree with DDP to float tolerance."""
    stopping = {"epochs": 8, "val": {"patience": 1}}
    ddp_result, ddp_rows, ddp_weights = run(tmp_path / "ddp", wrap="ddp", **stopping)
    fsdp_result, fsdp_rows, fsdp_weights = run(tmp_path / "fsdp", wrap="fsdp", **stopping)
    assert 1 < max(row["epoch"] for row in ddp_rows) < 7  # stopped early, after more than one epoch
    assert [sorted(row) for row in fsdp_rows] == [sorted(row) for row in ddp_rows]
    assert any("params/0.weight/grad_norm" in row for row in ddp_rows)
    for ddp_row, fsdp_row in zip(ddp_rows, fsdp_rows, strict=True):
        for key, value in ddp_row.items():
            if isinstance(value, float):
                assert fsdp_row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
            else:
                assert fsdp_row[key] == value, key
    assert fsdp_result.keys() == ddp_result.keys()
    for key, value in ddp_result.items():
        assert fsdp_result[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert fsdp_weights.keys() == ddp_weights.keys()
    for name, weight in ddp_weights.items():
        torch.testing.assert_close(fsdp_weights[name], weight, rtol=1e-4, atol=1e-5)


def sharded_cfg(out_dir, **overrides):
    return make_cfg(out_dir, **{"epochs": 3, "dist": {"timeout_s": 60}, "wrap": "fsdp", "val": {"patience": 5},
                                "test": {"enable": True}, "ckpt": {"format": "sharded"}, **overrides})


def assert_same_state(got, ref):
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        if isinstance(value, dict):
            assert_same_state(got[name], value)
        else:
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_an_fsdp2_run_killed_mid_way_resumes_bit_identically_from_its_sharded_checkpoint(tmp_path, background):
    """A rank fails at epoch 2; the rerun resumes from last.ckpt (every rank's shards) and ends bit-identical to
    the uninterrupted run: weights, optimizer state, logged values, best epoch and test score. With
    ckpt.async_save the shards are written in the background and published at the next save; each write is
    slowed so that the next epoch trains (changing the weights) while it runs, and what is published must still
    be the weights of the save's moment."""
    ref_dir, out = tmp_path / "ref", tmp_path / "resumed"
    ckpt = {"format": "sharded", "async_save": background}
    expected = trainkit.spawn(ShardTrainer, sharded_cfg(ref_dir, ckpt={"format": "sharded"}), 2)
    slow = {"slow_write": 0.5} if background else {}
    with pytest.raises(Exception, match="injected failure on rank 1 at epoch 2"):
        trainkit.spawn(ShardTrainer, sharded_cfg(out, ckpt=ckpt, fail_rank=1, fail_epoch=2, **slow), 2)
    written = {p.name for p in out.iterdir() if p.is_dir()}
    torn = [name for name in written if ".tmp-" in name]
    if background:  # epoch 1's save was in flight, never published: the resume starts from epoch 0's
        assert {"best.ckpt", "last.ckpt"} <= written and len(torn) == 1
        assert torch.load(out / "last.ckpt" / "trainkit.pt", weights_only=False)["epoch"] == 1
    else:
        assert {"best.ckpt", "last.ckpt", "last.prev.ckpt"} <= written and not torn
    assert {p.name for p in (out / "last.ckpt").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp",
                                                             "trainkit.pt", "manifest.json"}
    got = trainkit.spawn(ShardTrainer, sharded_cfg(out, ckpt=ckpt), 2)
    assert got == expected
    ref, resumed = torch.load(ref_dir / "report2.pt"), torch.load(out / "report2.pt")
    assert_same_state(resumed["weights"], ref["weights"])
    assert_same_state(resumed["optimizer"], ref["optimizer"])
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_sharded_checkpoint_of_two_ranks_loads_on_one_and_on_three(tmp_path, world_size):
    """Written by 2 FSDP2 ranks at an epoch's end, read by 1 (a plain module) and by 3 (resharded): the whole
    weights and AdamW state are bitwise those the 2 ranks held."""
    out = tmp_path / "run"
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=2, test={"enable": False}), 2)
    saved = torch.load(out / "report2.pt")
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=3, dump_loaded=True), world_size)
    loaded = torch.load(out / f"loaded{world_size}.pt")
    assert loaded["epoch"] == 2 and loaded["step"] > 0
    assert_same_state(loaded["weights"], saved["weights"])
    assert_same_state(loaded["optimizer"], saved["optimizer"])


def test_kept_sharded_directories_of_two_ranks_follow_the_policy_and_resume_on_one(tmp_path):
    """ckpt.keep=latest:2 with 2 FSDP2 ranks (background saves, then synchronous ones): rank 0 keeps each published
    last.ckpt as checkpoints/step-<step>.ckpt/ and deletes the older ones whole; a kept one resumes on 1 process
    (resharded at its epoch's end) with bitwise the weights and AdamW state the 2 ranks saved at that step."""
    out = tmp_path / "run"
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=2, test={"enable": False}, ckpt={
        "format": "sharded", "keep": "latest:2", "async_save": True}), 2)
    saved = torch.load(out / "report2.pt")
    first, second = sorted(int(p.name[5:-5]) for p in (out / "checkpoints").glob("step-*.ckpt"))
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=3, test={"enable": False}, ckpt={
        "format": "sharded", "keep": "latest:2"}), 2)
    third = 2 * second - first
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "index.json", f"step-{second}.ckpt", f"step-{third}.ckpt"]
    kept = out / "checkpoints" / f"step-{second}.ckpt"
    again = tmp_path / "again"
    again.mkdir()
    trainkit.spawn(ShardTrainer, sharded_cfg(again, epochs=3, dump_loaded=True, ckpt={
        "format": "sharded", "resume": str(kept)}), 1)
    loaded = torch.load(again / "loaded1.pt")
    assert loaded["epoch"] == 2 and loaded["step"] == second
    assert_same_state(loaded["weights"], saved["weights"])
    assert_same_state(loaded["optimizer"], saved["optimizer"])


def test_a_damaged_or_unpublished_sharded_checkpoint_is_never_resumed(tmp_path, capfd):
    """A flipped byte in last.ckpt's shard: the resume falls back to last.prev.ckpt (warned) and still ends
    bit-identical to the uninterrupted run. A temporary directory a killed save left is ignored, then removed."""
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    trainkit.spawn(ShardTrainer, sharded_cfg(ref_dir, epochs=3, test={"enable": False}), 2)
    with pytest.raises(Exception, match="injected failure on rank 0 at epoch 2"):
        trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=3, test={"enable": False}, fail_rank=0, fail_epoch=2), 2)
    # last.ckpt holds epoch 2's start, last.prev.ckpt epoch 1's: damage the newest, leave a torn save beside it
    shard = out / "last.ckpt" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    torn = out / ".last.ckpt.tmp-9-99"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half a shard")
    capfd.readouterr()
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=3, test={"enable": False}), 2)
    warned = capfd.readouterr().err  # the ranks' warnings, on their stderr
    assert re.search(r"last.ckpt is damaged or incomplete: __1_0.distcp: \d+ bytes with CRC-32 0x[0-9a-f]{8}, "
                     r"the manifest says \d+ bytes with CRC-32 0x[0-9a-f]{8}; resuming from the previous checkpoint "
                     r"\S+last.prev.ckpt instead", warned), warned[-2000:]
    assert_same_state(torch.load(out / "report2.pt")["weights"], torch.load(ref_dir / "report2.pt")["weights"])
    assert not torn.exists()


def test_a_sharded_model_is_refused_where_it_cannot_be_saved_or_resumed(tmp_path):
    """An FSDP2 model with ckpt.format='file' (rank 0 alone would be written), a folder of the other format,
    and a mid-epoch sharded checkpoint on another world size with another global batch: each a clear error."""
    with pytest.raises(Exception, match=r"sharded by make_fsdp\(\).*set ckpt.format='sharded'"):
        trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "file", ckpt={"format": "file"}), 2)
    files = tmp_path / "files"
    ShardTrainer(sharded_cfg(files, wrap="ddp", epochs=1, ckpt={"format": "file"})).train()
    with pytest.raises(trainkit.CheckpointMismatchError, match=r"last.pt was written with ckpt.format='file'"):
        ShardTrainer(sharded_cfg(files, wrap="ddp", epochs=2))
    # save_if_best under a rank guard, which file checkpoints allow: a sharded best.ckpt needs every rank's shards
    started = time.monotonic()
    with pytest.raises(Exception, match=r"new best on ranks \[0\] only.*call save_if_best\(\) on every rank"):
        trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "guarded", best_on_rank0=True, report=False), 2)
    # ... also when the only improvement is in the last epoch, whose state the end of the run saves
    with pytest.raises(Exception, match=r"new best on ranks \[0\] only"):
        trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "guarded1", best_on_rank0=True, epochs=1, report=False,
                                                 test={"enable": False}), 2)
    assert time.monotonic() - started < 80  # every rank raised; none waited in a collective
    steps, stepping = tmp_path / "steps", {"format": "sharded", "every_n_steps": 4}
    # 6 batches per rank and epoch: step 8 is written after batch 2 of epoch 1, then rank 1 fails at batch 4
    with pytest.raises(Exception, match="injected failure on rank 1 at epoch 1"):
        trainkit.spawn(ShardTrainer, sharded_cfg(steps, ckpt=stepping, fail_rank=1, fail_epoch=1, fail_batch=4), 2)
    # its global batch of 32 resumes on 1 process only with a per-rank batch of 32: refused as the epoch starts
    refused = r"on 2 ranks, and this run has 1: the per-rank batch_size is 16"
    with pytest.raises(trainkit.CheckpointMismatchError, match=refused):
        ShardTrainer(sharded_cfg(steps, ckpt=stepping)).train()


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_sharded_step_checkpoints_resume_inside_the_epoch_bit_identically(tmp_path, background):
    """ckpt.every_n_steps with sharded checkpoints, sync and in the background: a failure mid-epoch resumes from
    the step checkpoint inside it, on the same 2 ranks, and ends bit-identical to the uninterrupted run."""
    stepping = {"format": "sharded", "every_n_steps": 4, "async_save": background}
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    expected = trainkit.spawn(ShardTrainer, sharded_cfg(ref_dir, ckpt=stepping), 2)
    with pytest.raises(Exception, match="injected failure on rank 0 at epoch 1"):
        trainkit.spawn(ShardTrainer, sharded_cfg(out, ckpt=stepping, fail_rank=0, fail_epoch=1, fail_batch=4), 2)
    resumed = trainkit.spawn(ShardTrainer, sharded_cfg(out, ckpt=stepping), 2)
    assert resumed == expected
    ref, got = torch.load(ref_dir / "report2.pt"), torch.load(out / "report2.pt")
    assert_same_state(got["weights"], ref["weights"])
    assert_same_state(got["optimizer"], ref["optimizer"])


def test_export_writes_the_whole_weights_of_a_sharded_or_file_checkpoint(tmp_path, capsys):
    """`python -m trainkit export` turns last.ckpt / best.ckpt of a 2-rank FSDP2 run, and a DDP run's last.pt,
    into one plain state dict that a bare module loads; a missing item and a damaged directory are errors."""
    out = tmp_path / "run"
    trainkit.spawn(ShardTrainer, sharded_cfg(out, epochs=2, test={"enable": False}), 2)
    final = torch.load(out / "report2.pt")["weights"]

    def command(*args):
        # the CLI's own entry point in this process: what `python -m trainkit` runs, without a torch import per call
        capsys.readouterr()
        code = cli_main([str(arg) for arg in args])
        return code, *capsys.readouterr()

    code, printed, errors = command("export", out / "last.ckpt", tmp_path / "last-weights.pt")
    assert code == 0 and "wrote" in printed, errors
    weights = torch.load(tmp_path / "last-weights.pt")
    assert_same_state(weights, final)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 1))
    net.load_state_dict(weights)
    assert command("export", out / "best.ckpt", tmp_path / "best-weights.pt")[0] == 0
    assert torch.load(tmp_path / "best-weights.pt").keys() == final.keys()
    for kind in ("last", "best"):
        code, printed, errors = command("inspect", out / f"{kind}.ckpt")
        assert code == 0, errors
        assert f"a sharded trainkit {kind} checkpoint, 5 files" in printed
        assert "model: in the DCP shards (python -m trainkit export" in printed
    code, _, errors = command("export", out / "last.ckpt", tmp_path / "x.pt", "--item", "encoder")
    assert code == 2 and "holds no sharded item 'encoder'" in errors
    (out / "last.ckpt" / "__0_0.distcp").write_bytes(b"torn")
    code, _, errors = command("export", out / "last.ckpt", tmp_path / "y.pt")
    assert code == 2 and "damaged or incomplete: __0_0.distcp" in errors
    assert not (tmp_path / "y.pt").exists()

    files = tmp_path / "ddp"
    trainkit.spawn(ShardTrainer, sharded_cfg(files, wrap="ddp", epochs=1, ckpt={"format": "file"}), 2)
    assert command("export", files / "last.pt", tmp_path / "ddp.pt")[0] == 0
    assert_same_state(torch.load(tmp_path / "ddp.pt"), torch.load(files / "report2.pt")["weights"])


@pytest.mark.parametrize("where", ["before_publish", "after_publish"])
def test_a_kill_during_a_sharded_save_resumes_from_a_published_checkpoint(tmp_path, where):
    """Rank 0 is SIGKILLed in its second save of last.ckpt, after every shard is written, before or after the
    rename that publishes it: the other rank fails within the timeout instead of hanging, the rerun resumes
    from the newest published checkpoint and ends bit-identical to the uninterrupted run, and the next save
    removes the torn directory."""
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    options = {"epochs": 3, "test": {"enable": False}, "dist": {"timeout_s": 30}}
    trainkit.spawn(ShardTrainer, sharded_cfg(ref_dir, **options), 2)
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017, PT011 - rank 0 dies without a traceback, rank 1 errors
        trainkit.spawn(ShardTrainer, sharded_cfg(out, kill_in_save=where, kill_at_save=2, **options), 2)
    assert time.monotonic() - started < 60
    torn = [p for p in out.iterdir() if ".tmp-" in p.name]
    assert len(torn) == (1 if where == "before_publish" else 0)
    engine = torch.load(out / "last.ckpt" / "trainkit.pt", weights_only=False)
    assert engine["epoch"] == (1 if where == "before_publish" else 2)
    trainkit.spawn(ShardTrainer, sharded_cfg(out, **options), 2)
    assert_same_state(torch.load(out / "report2.pt")["weights"], torch.load(ref_dir / "report2.pt")["weights"])
    assert_same_state(torch.load(out / "report2.pt")["optimizer"], torch.load(ref_dir / "report2.pt")["optimizer"])
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_failed_shard_write_fails_every_rank_and_publishes_nothing(tmp_path, background):
    """Rank 1's second write of shards fails (a full disk). Sync: that save raises on every rank. Async: the next
    save (or the end of the run) raises it, on every rank. Either way last.ckpt stays the checkpoint before."""
    out = tmp_path / "run"
    cfg = sharded_cfg(out, epochs=3, test={"enable": False}, fail_write=2,
                      ckpt={"format": "sharded", "async_save": background})
    with pytest.raises(Exception, match=r"No space left on device \(injected\)|a rank failed to write"):
        trainkit.spawn(ShardTrainer, cfg, 2)
    engine = torch.load(out / "last.ckpt" / "trainkit.pt", weights_only=False)
    assert engine["epoch"] == 1  # epoch 0's save published; epoch 1's never
    assert not (out / "last.prev.ckpt").exists()


def test_a_ddp_file_checkpoint_continues_as_fsdp2_and_back(tmp_path):
    """A DDP run's last.pt named by an FSDP2 run with sharded checkpoints (and an FSDP2 run's last.ckpt named by a
    DDP run with file checkpoints) loads whole weights and AdamW state bit for bit, best weights included."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    trainkit.spawn(ShardTrainer, sharded_cfg(ddp, wrap="ddp", epochs=2, test={"enable": False},
                                             ckpt={"format": "file"}), 2)
    saved = torch.load(ddp / "report2.pt")
    into_fsdp = sharded_cfg(tmp_path / "as_fsdp", epochs=3, dump_loaded=True,
                            ckpt={"format": "sharded", "resume": str(ddp / "last.pt")})
    trainkit.spawn(ShardTrainer, into_fsdp, 2)
    loaded = torch.load(tmp_path / "as_fsdp" / "loaded2.pt")
    assert loaded["epoch"] == 2
    assert_same_state(loaded["weights"], saved["weights"])
    assert_same_state(loaded["optimizer"], saved["optimizer"])
    assert loaded["best"].keys() == saved["weights"].keys()
    assert_same_state(loaded["best"], saved["best"])

    trainkit.spawn(ShardTrainer, sharded_cfg(fsdp, epochs=2, test={"enable": False}), 2)
    saved = torch.load(fsdp / "report2.pt")
    into_ddp = sharded_cfg(tmp_path / "as_ddp", wrap="ddp", epochs=3, dump_loaded=True,
                           ckpt={"format": "file", "resume": str(fsdp / "last.ckpt")})
    trainkit.spawn(ShardTrainer, into_ddp, 2)
    loaded = torch.load(tmp_path / "as_ddp" / "loaded2.pt")
    assert_same_state(loaded["weights"], saved["weights"])
    assert_same_state(loaded["optimizer"], saved["optimizer"])
    assert_same_state(loaded["best"], saved["best"])


def test_saving_an_optimizer_that_has_not_stepped_leaves_training_alone(tmp_path):
    """No optimizer step in epoch 0, then a sharded save: DCP would initialise AdamW's state by stepping it with
    zero gradients (step count 1, and the trainer's step moved); trainkit keeps such an optimizer out of the DCP
    files, so the run ends exactly as the same run without checkpoints, and it resumes from that save."""
    options = {"epochs": 2, "test": {"enable": False}, "step_from_epoch": 1}
    (tmp_path / "plain").mkdir()  # a run without checkpoints makes no out_dir; the report goes there
    trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "plain", ckpt={"enable": False}, **options), 2)
    trainkit.spawn(ShardTrainer, sharded_cfg(tmp_path / "saved", **options), 2)
    plain, saved = torch.load(tmp_path / "plain" / "report2.pt"), torch.load(tmp_path / "saved" / "report2.pt")
    assert_same_state(saved["weights"], plain["weights"])
    assert_same_state(saved["optimizer"], plain["optimizer"])
    assert [row["step"] for row in saved["pushed"]] == [row["step"] for row in plain["pushed"]]
    resumed = tmp_path / "resumed"
    with pytest.raises(Exception, match="injected failure on rank 0 at epoch 1"):
        trainkit.spawn(ShardTrainer, sharded_cfg(resumed, fail_rank=0, fail_epoch=1, **options), 2)
    trainkit.spawn(ShardTrainer, sharded_cfg(resumed, **options), 2)
    assert_same_state(torch.load(resumed / "report2.pt")["weights"], plain["weights"])
    assert_same_state(torch.load(resumed / "report2.pt")["optimizer"], plain["optimizer"])


def test_a_background_save_reuses_its_host_copy_and_never_writes_a_stale_one(tmp_path, monkeypatch):
    """Background sharded saves copy into the same host buffers from one save to the next. Each write is slowed
    and the tensors change while it waits (as training goes on); a tensor is replaced by one of another size
    between saves, and the copy is freed and made again: every published checkpoint holds exactly the values
    of its own save's moment. Fails with a stager that aliases the live tensors, or one whose copy lags."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainkit.checkpoint.formats import dcp_directory, dcp_read

    real_write = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(0.2)
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    weights, moment = torch.zeros(64, 64), torch.zeros(100)
    saver = dcp_directory.BackgroundSave(timeout_s=60)
    final = tmp_path / "last.ckpt"
    for save, value in enumerate([1.0, 2.0, 3.0, 4.0]):
        if save == 2:
            moment = torch.zeros(300)  # a new storage of another size: a copy of its own, never the old one's
        if save == 3:
            saver.release()  # freed at a run's end; the next save makes a new copy
        weights.fill_(value)
        moment.fill_(-value)
        saver.start(final, {"model": {"w": weights}, "opt": {"m": moment}}, {"epoch": save}, rank=0, world_size=1,
                    tag=str(save))
        weights.fill_(100.0)  # training changes the weights while the shards are written
        moment.fill_(100.0)
        saver.finish(rank=0, world_size=1)
        assert dcp_read.verify_directory(final, rank=0, world_size=1) is None
        read = {"model": {"w": torch.empty(64, 64)}, "opt": {"m": torch.empty(moment.numel())}}
        dcp.load(read, checkpoint_id=str(final), no_dist=True)
        assert torch.equal(read["model"]["w"], torch.full((64, 64), value)), save
        assert torch.equal(read["opt"]["m"], torch.full((moment.numel(),), -value)), save
    saver.release()
    assert not saver.pending


def test_publishing_keeps_the_previous_checkpoint_and_deletes_the_older_one_off_the_loop(tmp_path):
    """Each publish keeps the checkpoint it replaces as last.prev.ckpt and deletes the one before in the
    background; once that is waited for, only the two newest are left, each whole, and a directory a killed
    run left half-deleted is removed by the next save."""
    import torch.distributed.checkpoint as dcp

    from trainkit.checkpoint.formats import dcp_directory, dcp_read

    final = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.tmp-0-0-1-old").mkdir()  # a kill during an earlier run's background delete
    (tmp_path / ".last.ckpt.tmp-0-0-1-old" / "__0_0.distcp").write_bytes(b"x" * 1000)
    for save in range(4):
        state = {"model": {"w": torch.full((32,), float(save))}}
        dcp_directory.save_directory(final, state, {"epoch": save}, rank=0, world_size=1, tag=f"{save}-0-{save}")
    dcp_directory.wait_discarded()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    for directory, save in ((final, 3), (tmp_path / "last.prev.ckpt", 2)):
        assert dcp_read.verify_directory(directory, rank=0, world_size=1) is None
        read = {"model": {"w": torch.empty(32)}}
        dcp.load(read, checkpoint_id=str(directory), no_dist=True)
        assert torch.equal(read["model"]["w"], torch.full((32,), float(save)))


def test_make_fsdp_on_a_torch_without_fsdp2_says_which_torch_it_needs(monkeypatch):
    """Before torch 2.6 there is no torch.distributed.fsdp.fully_shard: a UsageError names the version needed
    and the way out, instead of an ImportError from inside trainkit."""
    from trainkit.distributed import fsdp as sharding
    from trainkit.errors import UsageError

    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # what an import of a missing module meets
    with pytest.raises(UsageError, match=r"needs FSDP2 .*torch >= 2\.6.*this is torch .*make_ddp"):
        sharding.shard_module(torch.nn.Linear(2, 2), mesh=None)
