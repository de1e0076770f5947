"""ckpt.async_save: the same files and exact resume as synchronous saves, failures surfaced, buffers reused."""

from __future__ import annotations

import pytest
import torch

import trainkit.checkpoint.formats.async_save
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, TinyTrainer, dying
from trainkit.checkpoint.formats.async_save import AsyncCheckpointWriter, StagingBuffers


def test_async_run_writes_the_same_checkpoints_as_a_sync_run(tmp_path):
    """With async_save on, last.pt and best.pt hold exactly what a synchronous run writes."""
    sync = TinyTrainer(make_cfg(tmp_path / "sync", test={"enable": True}))
    expected = sync.train()
    trainer = TinyTrainer(make_cfg(tmp_path / "async", test={"enable": True}, ckpt={"async_save": True}))
    assert trainer.train() == expected
    for name in ("last.pt", "best.pt"):
        # read to the CPU: on a GPU, async files hold the staged host copies and sync ones the device tensors
        want = torch.load(tmp_path / "sync" / name, weights_only=True, map_location="cpu")
        got = torch.load(tmp_path / "async" / name, weights_only=True, map_location="cpu")
        assert list(got["model"]) == list(want["model"]) and got.get("best") == want.get("best")
        assert all(torch.equal(got["model"][key], value) for key, value in want["model"].items())


def test_async_resume_is_bit_identical(tmp_path):
    """A crash during an async run resumes to the same weights as an uninterrupted synchronous run."""
    reference = TinyTrainer(make_cfg(tmp_path / "ref"))
    reference.train()
    cfg = make_cfg(tmp_path / "run", ckpt={"async_save": True})
    with pytest.raises(Crash):
        dying(2)(cfg).train()
    resumed = TinyTrainer(cfg)
    assert resumed.epoch == 2
    resumed.train()
    for key, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value)


def test_background_failure_surfaces_at_the_next_save_with_the_original_error(tmp_path, monkeypatch):
    """A write that fails in the background raises its own error from the next save, and last.pt stays loadable."""
    calls = {"n": 0}
    real_save = trainkit.checkpoint.formats.async_save.atomic_save

    def flaky(payload, path, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "injected: no space left on device")
        return real_save(payload, path, **kwargs)

    monkeypatch.setattr(trainkit.checkpoint.formats.async_save, "atomic_save", flaky)
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=4, ckpt={"async_save": True}))
    with pytest.raises(OSError, match="injected: no space left"):
        trainer.train()
    torch.load(tmp_path / "last.pt", weights_only=True)


def test_staging_reuses_its_buffers_and_shares_nothing_with_the_payload():
    """Staging the same layout twice reuses the same host buffers, and later changes to the source stay out."""
    staging = StagingBuffers()
    source = {"model": {"w": torch.ones(3, 3)}, "step": 4, "names": ["a"]}
    first = staging.stage(source)
    pointer = first["model"]["w"].data_ptr()
    source["model"]["w"].add_(1)
    assert torch.equal(first["model"]["w"], torch.ones(3, 3))
    second = staging.stage(source)
    assert second["model"]["w"].data_ptr() == pointer and torch.equal(second["model"]["w"], 2 * torch.ones(3, 3))
    assert second["names"] == ["a"] and second["names"] is not source["names"]
    assert staging.nbytes == 9 * 4


def test_staging_keeps_a_tensors_attributes_as_a_synchronous_save_does_and_never_leaves_them_on_a_buffer(tmp_path):
    """A tensor's Python attributes go into the background save as torch.save writes them for a synchronous one (and
    come back through the safe loader); a later save of a bare tensor in the same slot carries none."""
    from trainkit.checkpoint import load_checkpoint

    staging = StagingBuffers()
    tagged, parameter = torch.ones(2), torch.nn.Parameter(torch.zeros(3))
    tagged.meta, parameter.note = {"a": 1}, "kept"
    first = staging.stage({"t": tagged, "p": parameter})
    tagged.meta["a"] = 2  # changed after staging: the save keeps what was staged
    torch.save(first, tmp_path / "first.pt")
    loaded = load_checkpoint(tmp_path / "first.pt")
    assert loaded["t"].meta == {"a": 1} and loaded["p"].note == "kept" and type(loaded["p"]) is torch.nn.Parameter
    second = staging.stage({"t": torch.ones(2), "p": torch.nn.Parameter(torch.zeros(3))})
    assert second["t"].data_ptr() == first["t"].data_ptr()  # the same buffer, reused
    torch.save(second, tmp_path / "second.pt")
    again = load_checkpoint(tmp_path / "second.pt")
    assert not hasattr(again["t"], "meta") and not hasattr(again["p"], "note")


def test_writer_keeps_at_most_one_job_in_flight(tmp_path):
    """submit() waits for the previous job, so two writes never overlap, and wait() leaves nothing running."""
    writer = AsyncCheckpointWriter()
    big = {"x": torch.zeros(2_000_000)}
    writer.submit([(big, tmp_path / "a.pt")])
    writer.submit([({"x": torch.ones(1)}, tmp_path / "a.pt")])
    writer.wait()
    assert not writer.busy
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["x"], torch.ones(1))
    assert (tmp_path / "a.prev.pt").exists()
