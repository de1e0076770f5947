"""The W&B sink in real offline mode: run folders, the run id across a resume, config, history, fallback, rank 0.

Each offline run costs a few seconds, so the tests share few runs and check several things on each. The
``.wandb`` files are read back with a small reader of their framing (a LevelDB-style log of protobuf
``Record`` messages), since wandb ships no reader of its own.
"""

from __future__ import annotations

import json
import re
import struct
import time
import warnings
from pathlib import Path

import attrs
import pytest
import torch

import trainkit
from tests.trainers import TinyConfig, TinyTrainer

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@pytest.fixture(autouse=True)
def wandb_env(monkeypatch, tmp_path):
    """Quiet, offline-friendly W&B settings that no user file or variable can change."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "wandb-home"
    home.mkdir()
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc"))


def read_records(path: Path):
    """Yield the protobuf records of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B datastore"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


@attrs.frozen
class OfflineRun:
    """What one offline run folder holds."""

    folder: Path
    run_id: str
    config: dict
    history: list[dict]
    summary: dict
    exit_code: int | None

    @classmethod
    def read(cls, folder: Path) -> OfflineRun:
        (datastore,) = folder.glob("run-*.wandb")
        run_id, config, history, summary, exit_code = None, {}, [], {}, None
        for record in read_records(datastore):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({item_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({item_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                history.append({item_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                summary.update({item_key(i): json.loads(i.value_json) for i in record.summary.update if item_key(i)})
            elif kind == "exit":
                exit_code = record.exit.exit_code
        return cls(folder=folder, run_id=run_id, config=config, history=history, summary=summary, exit_code=exit_code)


def named_for(folder: Path, run_id: str) -> bool:
    """Whether an offline run folder is named for ``run_id`` (W&B adds ``-1`` to a name taken that second)."""
    return re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", folder.name) is not None


def offline_runs(out_dir: Path, timeout_s: float = 30.0) -> list[OfflineRun]:
    """Every finished offline run under ``out_dir/wandb``, oldest first.

    ``run.finish()`` returns before W&B's service has written the run's records, so this waits until each
    datastore holds its exit record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [OfflineRun.read(folder) for folder in sorted((out_dir / "wandb").glob("offline-run-*"))]
        if all(part.exit_code is not None for part in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


@attrs.frozen(kw_only=True)
class SecretConfig(TinyConfig):
    """TinyConfig with a credential-looking key that must not reach W&B."""

    api_token: str = "not-for-wandb"


class CrashingTrainer(TinyTrainer):
    """TinyTrainer that dies at the start of epoch ``crash_at``, before it logs anything."""

    config_class = SecretConfig
    crash_at: int | None = None

    def train_epoch(self):
        if self.epoch == self.crash_at:
            raise RuntimeError(f"injected crash at epoch {self.epoch}")
        super().train_epoch()


class CrashAt1(CrashingTrainer):
    crash_at = 1


def config(tmp_path, mode="offline", **overrides):
    return {"epochs": 3, "out_dir": str(tmp_path), "wandb": {"mode": mode}, "progress": {"enable": False}, **overrides}


def run(trainer):
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_offline_run_is_resumed_under_the_same_id(tmp_path):
    """A crashed offline run and its resume write two run folders with last.pt's run id, the config, ordered history."""
    cfg = config(tmp_path)
    with pytest.raises(RuntimeError, match="injected crash"):
        run(CrashAt1(cfg))
    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_run_id"]
    (first,) = offline_runs(tmp_path)
    assert named_for(first.folder, run_id)
    assert first.run_id == run_id
    assert first.exit_code == 1  # the crash marks the run failed

    resumed = CrashingTrainer(cfg)
    assert resumed._sink.run_id == run_id
    result = run(resumed)

    first, second = offline_runs(tmp_path)
    assert named_for(second.folder, run_id) and second.run_id == run_id
    assert second.exit_code == 0

    for part in (first, second):
        assert part.config["epochs"] == 3 and part.config["lr"] == 0.05
        assert part.config["out_dir"] == str(tmp_path)
        assert part.config["wandb"]["mode"] == "offline"
        assert "api_token" not in part.config
    assert b"not-for-wandb" not in b"".join(p.read_bytes() for p in tmp_path.glob("wandb/**/*") if p.is_file())

    assert [row["trainer/epoch"] for row in first.history] == [0]
    assert [row["trainer/epoch"] for row in second.history] == [1, 2]
    # trainkit never passes step=: W&B's own counter numbers the rows 0, 1, ... within each run folder
    for part in (first, second):
        assert [row["_step"] for row in part.history] == list(range(len(part.history)))
    steps = [row["trainer/step"] for part in (first, second) for row in part.history]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    wandb_rows = [{k: v for k, v in row.items() if not k.startswith("_")} for p in (first, second) for row in p.history]
    assert wandb_rows == jsonl
    assert second.summary["best/val/loss"] == pytest.approx(result["best/val/loss"])
    assert second.summary["stop_reason"] == "max_epochs" and second.summary["epochs_run"] == 3

    again = CrashingTrainer(cfg)  # the run has finished: resuming it only returns its results
    assert run(again) == result
    assert len(offline_runs(tmp_path)) == 2


def test_disabled_mode_creates_no_wandb_folder(tmp_path):
    """wandb.mode=disabled runs without creating out_dir/wandb."""
    run(TinyTrainer(config(tmp_path, mode="disabled", epochs=1)))
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "wandb").exists()


def test_failing_online_init_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch):
    """When W&B cannot start online (no API key, unreachable server) the run logs offline and warns exactly once."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = TinyTrainer(config(tmp_path, mode="online", epochs=1))
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert "online" in str(runtime[0].message) and "offline" in str(runtime[0].message)
    run(trainer)
    (part,) = offline_runs(tmp_path)
    assert [row["trainer/epoch"] for row in part.history] == [0]
    assert part.config["wandb"]["mode"] == "online"


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_only_rank_zero_creates_a_run(tmp_path):
    """In a 2-process run only rank 0 starts W&B: out_dir/wandb holds one offline run, with one row per epoch."""
    result = trainkit.spawn(TinyTrainer, config(tmp_path, epochs=2, dist={"backend": "gloo"}), 2)
    assert result is not None
    (part,) = offline_runs(tmp_path)
    assert [row["trainer/epoch"] for row in part.history] == [0, 1]
    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_run_id"]
    assert part.run_id == run_id


class StopsOnSigterm(CrashingTrainer):
    """TinyTrainer that receives SIGTERM during epoch 1: it finishes the epoch, saves and stops."""

    def train_epoch(self):
        super().train_epoch()
        if self.epoch == 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_a_clean_signal_stop_is_not_a_failed_wandb_run(tmp_path):
    """SIGTERM stops the run at the epoch's end, saved and resumable: its offline run is recorded with exit code 0."""
    from trainkit import TrainingInterrupted

    with pytest.raises(TrainingInterrupted):
        run(StopsOnSigterm(config(tmp_path)))
    (first,) = offline_runs(tmp_path)
    assert first.exit_code == 0
    assert [row["trainer/epoch"] for row in first.history] == [0, 1]
