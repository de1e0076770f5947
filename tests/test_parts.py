"""The trainer's parts on their own, without a trainer: stop signals, the run's files, the checkpoint payloads."""

from __future__ import annotations

import os
import signal
import threading
import warnings

import attrs
import pytest
import torch

from trainkit.bookkeeping import RESERVED_NAMES, BestState, LoopState, PatienceState
from trainkit.checkpoint.formats.dcp import DcpStorage
from trainkit.checkpoint.formats.dcp_directory import SHARDED
from trainkit.checkpoint.formats.pt import PtStorage
from trainkit.checkpoint.payload import BEST_PT, LAST_PT, best_payload, last_payload, validate_best, validate_last
from trainkit.errors import CheckpointError, OutDirError
from trainkit.loop.stop_signals import StopSignals
from trainkit.state.rng import capture_rng

# ---------------------------------------------------------------------------------- signals


def test_stop_signals_record_the_signal_and_put_the_handlers_back():
    """Inside the block a signal is recorded, not acted on (the latest one wins); after it the old handlers are back."""
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(["SIGTERM", "SIGUSR1", "SIGUSR1"]) as signals:
        assert signal.getsignal(signal.SIGUSR1) != before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == signal.SIGUSR1 and signals.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_second_ctrl_c_aborts_at_once():
    """The first SIGINT is recorded; a second raises KeyboardInterrupt where the program is; the handler before the
    block comes back (Python's default: tests/conftest.py puts it back where the suite started in the background)."""
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(["SIGINT"]) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_a_signal_inherited_as_ignored_stays_ignored():
    """SIGINT ignored when the block starts (a shell's background job, nohup) stays ignored inside it and after it;
    the other signals are installed as ever."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals(["SIGINT", "SIGUSR1"]) as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.received is None
            os.kill(os.getpid(), signal.SIGUSR1)
            assert signals.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_off_the_main_thread_nothing_is_installed():
    """Python installs handlers only on the main thread: elsewhere the block changes nothing."""
    seen = []

    def body():
        with StopSignals(["SIGUSR1"]) as signals:
            seen.append(signal.getsignal(signal.SIGUSR1))
            seen.append(signals.received)

    before = signal.getsignal(signal.SIGUSR1)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before, None]


# ---------------------------------------------------------------------------------- payloads


def engine_payload(**overrides):
    values = dict(
        items={"model": {"w": torch.ones(2)}},
        epoch=1,
        step=10,
        world_size=1,
        config={"lr": 0.1},
        loop=LoopState(epoch=1, step=10),
        best=BestState(minimize=True, score=0.5, epoch=0),
        patience=PatienceState(patience=3),
        rng=[capture_rng()],
        wandb_run_id="abc12345",
        latest_metrics={"val/loss": 0.5},
        results=None,
        metrics_offset=0,
        training_modes={"model": {"": True}},
    )
    values.update(overrides)
    return last_payload(**values)


def test_the_engine_keys_are_the_reserved_names():
    """One list: the keys last_payload writes, LAST_PT validates and the registry reserves are the same names."""
    payload = engine_payload()
    engine_keys = [key for key in payload if key != "model"]
    assert engine_keys == [key.name for key in LAST_PT]
    assert set(engine_keys) == RESERVED_NAMES  # "trainkit" holds the state of a step checkpoint inside an epoch
    assert payload["items"] == ["model"]
    validate_last(payload, path="last.pt", world_size=1)
    best = best_payload(model={"w": torch.ones(2)}, best=BestState(minimize=True, score=0.5, epoch=0), config={})
    assert list(best) == [key.name for key in BEST_PT]
    validate_best(best, path="best.pt")


# ---------------------------------------------------------------------------------- run files


def files(tmp_path, **kwargs):
    return PtStorage(tmp_path, enabled=True, writer=True, async_save=False, **kwargs)


def test_a_save_writes_best_then_last_and_keeps_the_previous(tmp_path):
    """save(last, best): both files atomically, the earlier ones kept as .prev; the seconds cover both writes."""
    run = files(tmp_path)
    order = []
    seconds = run.save(
        engine_payload(epoch=1),
        best_payload(model={}, best=BestState(), config={}),
        before=lambda: order.append("before"),
    )
    assert order == ["before"] and seconds is not None and seconds > 0
    assert run.last_seconds == seconds
    run.save(engine_payload(epoch=2))
    assert torch.load(run.last_path, weights_only=True)["epoch"] == 2
    assert torch.load(tmp_path / "last.prev.pt", weights_only=True)["epoch"] == 1
    assert run.best_path.exists() and not (tmp_path / "best.prev.pt").exists()


def test_background_saves_report_seconds_like_synchronous_ones(tmp_path):
    """With async_save the save returns at once (None) and last_seconds, after wait(), means the same."""
    sync_run = files(tmp_path / "sync")
    async_run = PtStorage(tmp_path / "async", enabled=True, writer=True, async_save=True)
    for run in (sync_run, async_run):
        run.out_dir.mkdir()
    best = best_payload(model={"w": torch.ones(1000)}, best=BestState(), config={})
    assert sync_run.save(engine_payload(), best) is not None
    assert async_run.save(engine_payload(), best) is None
    async_run.wait()
    assert async_run.last_seconds is not None and async_run.last_seconds > 0
    assert torch.load(async_run.best_path, weights_only=True)["best"] == torch.load(sync_run.best_path)["best"]


def test_a_payload_that_would_not_load_is_refused_before_anything_is_written(tmp_path):
    """A value torch.load(weights_only=True) refuses stops the save; the files on disk stay as they were."""
    run = files(tmp_path)
    run.save(engine_payload(epoch=1))
    before = run.last_path.read_bytes()
    with pytest.raises(CheckpointError):
        run.save(engine_payload(epoch=2, items={"model": {}, "opaque": object()}))
    assert run.last_path.read_bytes() == before


def test_resume_falls_back_to_the_previous_checkpoint_and_keeps_the_damaged_one(tmp_path):
    """ckpt.resume=auto: a damaged last.pt falls back to last.prev.pt (warned), kept as last.corrupt.pt."""
    run = files(tmp_path)
    assert run.load_resume("auto", world_size=1) == (None, None)
    run.save(engine_payload(epoch=1))
    run.save(engine_payload(epoch=2))
    run.last_path.write_bytes(b"not a checkpoint")
    with pytest.warns(RuntimeWarning, match="resuming from the previous checkpoint"):
        ckpt, path = run.load_resume("auto", world_size=1)
    assert ckpt["epoch"] == 1 and path == tmp_path / "last.prev.pt"
    assert (tmp_path / "last.corrupt.pt").read_bytes() == b"not a checkpoint"
    assert run.load_resume(str(path), world_size=2)[0]["epoch"] == 1  # an epoch's end resumes on any world size
    with pytest.raises(CheckpointError, match="there is no file at"):
        run.load_resume("sometimes", world_size=1)


def test_read_best_repairs_only_its_own_folder(tmp_path):
    """best.pt a step ahead of last.pt (a crash between them): best.prev.pt is used; put back only in out_dir."""
    record = BestState(minimize=True, score=0.5, epoch=0)
    writer = files(tmp_path / "run")
    (tmp_path / "run").mkdir()
    writer.save(engine_payload(), best_payload(model={"w": torch.zeros(1)}, best=record, config={}))
    ahead = BestState(minimize=True, score=0.1, epoch=3)
    writer.save(engine_payload(), best_payload(model={"w": torch.ones(1)}, best=ahead, config={}))

    elsewhere = files(tmp_path / "other")
    (tmp_path / "other").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert elsewhere.read_best(tmp_path / "run", record)["best"]["epoch"] == 0
    assert not [w for w in caught if "repaired" in str(w.message)]
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=True)["best"]["epoch"] == 3  # not touched

    with pytest.warns(RuntimeWarning, match="repaired it from"):
        assert writer.read_best(tmp_path / "run", record)["best"]["epoch"] == 0
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=True)["best"]["epoch"] == 0


def test_a_directory_in_a_checkpoints_place_is_refused(tmp_path):
    """check_writable names the directory that would stop a save."""
    (tmp_path / "last.prev.pt").mkdir()
    with pytest.raises(OutDirError, match="last.prev.pt is a directory"):
        files(tmp_path).check_writable()
    PtStorage(tmp_path, enabled=True, writer=False, async_save=False).check_writable()  # a reader never writes


def test_a_handler_that_cannot_be_installed_puts_the_others_back():
    """SIGKILL cannot be caught: entering fails, and the handler installed before it is restored."""
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(OSError), StopSignals(["SIGUSR1", "SIGKILL"]):
        pass
    assert signal.getsignal(signal.SIGUSR1) == before


# ---------------------------------------------------------------------------------- sharded files


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sharded_files_save_resume_fall_back_and_read_the_matching_best(tmp_path, async_save):
    """DcpStorage on one process: save() writes best.ckpt then last.ckpt (with async_save in the background,
    published by the next save or wait()); load_resume() returns the newest whole checkpoint and falls back to
    last.prev.ckpt, with a warning, when a shard of last.ckpt is damaged; read_best() reads the best.ckpt whose
    record matches into a copy of the template, and says so when none does; release() leaves nothing stray."""
    shards = DcpStorage(tmp_path, enabled=True, rank=0, world_size=1, async_save=async_save, timeout_s=60)
    best = BestState(minimize=True, score=0.5, epoch=0)
    for epoch in (1, 2):
        changed = epoch == 1
        shards.save(
            epoch=epoch,
            step=10 * epoch,
            last_state={"model": {"w": torch.full((64,), float(epoch))}},
            last_engine=engine_payload(epoch=epoch, items={"model": SHARDED}),
            best_state={"model": {"w": torch.full((64,), -1.0)}} if changed else None,
            best_engine=best_payload(model={}, best=best, config={}) if changed else None,
        )
    shards.wait()
    ckpt, path = shards.load_resume("auto")
    assert path == shards.last_path and ckpt["epoch"] == 2
    assert shards.load_resume("never") == (None, None)
    shard = next(shards.last_path.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="resuming from the previous checkpoint"):
        ckpt, path = shards.load_resume("auto")
    assert path == tmp_path / "last.prev.ckpt" and ckpt["epoch"] == 1
    template = {"w": torch.zeros(64)}
    loaded = shards.read_best(tmp_path, best, template)
    assert torch.equal(loaded["w"], torch.full((64,), -1.0)) and torch.equal(template["w"], torch.zeros(64))
    with pytest.warns(RuntimeWarning, match="no best checkpoint .* matches"):
        assert shards.read_best(tmp_path, attrs.evolve(best, epoch=3), template) is None
    shards.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt", "last.ckpt", "last.prev.ckpt"]
