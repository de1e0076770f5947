"""The W&B sink in real offline mode: run folders, the run id across a resume, config, history, fallback, rank 0.

Each offline run costs a few seconds, so the tests share few runs and check several things on each. The
``.wandb`` files are read back with a small reader of their framing (a LevelDB-style log of protobuf
``Record`` messages), since wandb ships no reader of its own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import trainkit
from tests.helpers import ROOT
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import CrashingTrainer, PerStepTrainer, TinyTrainer, train_and_close
from tests.helpers.wandb_files import BLOCK, OfflineRun, history_record, leveldb_log, offline_runs, run_record

pytestmark = pytest.mark.usefixtures("wandb_env")  # conftest's isolated W&B home, for every test here

OFFLINE = {"epochs": 3, "wandb": {"mode": "offline"}, "val": {"minimize": False}}
"""What this module's runs put over make_cfg's defaults: 3 epochs, W&B offline, and the engine's default direction
(the validation loss maximized), as these runs have always had."""


def named_for(folder: Path, run_id: str) -> bool:
    """Whether an offline run folder is named for ``run_id`` (W&B adds ``-1`` to a name taken that second)."""
    return re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", folder.name) is not None


class CrashAt1(CrashingTrainer):
    crash_at = 1


def test_offline_run_is_resumed_under_the_same_id(tmp_path):
    """A crashed offline run and its resume write two run folders with last.pt's run id, the config, ordered history."""
    cfg = make_cfg(tmp_path, OFFLINE)
    with pytest.raises(RuntimeError, match="injected crash"):
        train_and_close(CrashAt1(cfg))
    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_run_id"]
    (first,) = offline_runs(tmp_path)
    assert named_for(first.folder, run_id)
    assert first.run_id == run_id
    assert first.exit_code == 1  # the crash marks the run failed

    resumed = CrashingTrainer(cfg)
    result = train_and_close(resumed)

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
    # W&B's step of a row is its line in metrics.jsonl: it continues in the second folder
    assert [row["_step"] for part in (first, second) for row in part.history] == [0, 1, 2]
    steps = [row["trainer/step"] for part in (first, second) for row in part.history]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    wandb_rows = [{k: v for k, v in row.items() if not k.startswith("_")} for p in (first, second) for row in p.history]
    assert wandb_rows == jsonl
    assert second.summary["best/val/loss"] == pytest.approx(result["best/val/loss"])
    assert second.summary["stop_reason"] == "max_epochs" and second.summary["epochs_run"] == 3

    again = CrashingTrainer(cfg)  # the run has finished: resuming it only returns its results
    assert train_and_close(again) == result
    assert len(offline_runs(tmp_path)) == 2


def test_disabled_mode_creates_no_wandb_folder(tmp_path):
    """wandb.mode=disabled runs without creating out_dir/wandb."""
    train_and_close(TinyTrainer(make_cfg(tmp_path, OFFLINE, wandb={"mode": "disabled"}, epochs=1)))
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "wandb").exists()


def test_failing_online_init_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch):
    """When W&B cannot start online (no API key, unreachable server) the run logs offline and warns exactly once."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = TinyTrainer(make_cfg(tmp_path, OFFLINE, wandb={"mode": "online"}, epochs=1))
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert "online" in str(runtime[0].message) and "offline" in str(runtime[0].message)
    train_and_close(trainer)
    (part,) = offline_runs(tmp_path)
    assert [row["trainer/epoch"] for row in part.history] == [0]
    assert part.config["wandb"]["mode"] == "online"


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_only_rank_zero_creates_a_run(tmp_path):
    """In a 2-process run only rank 0 starts W&B: out_dir/wandb holds one offline run, with one row per epoch."""
    result = trainkit.spawn(TinyTrainer, make_cfg(tmp_path, OFFLINE, epochs=2, dist={"backend": "gloo"}), 2)
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
        train_and_close(StopsOnSigterm(make_cfg(tmp_path, OFFLINE)))
    (first,) = offline_runs(tmp_path)
    assert first.exit_code == 0
    assert [row["trainer/epoch"] for row in first.history] == [0, 1]


# ------------------------------------------------------------------ one run across offline folders


PER_STEP_SCRIPT = f"""
import os, sys
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import PerStepTrainer, train_and_close
every = os.environ.get("EVERY_N_STEPS")
steps = {{"ckpt": {{"every_n_steps": int(every)}}}} if every else {{}}
train_and_close(PerStepTrainer(make_cfg(sys.argv[1], {OFFLINE!r}, **steps)))
"""


def per_step_run(out_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """Run PerStepTrainer in a child process (so a SIGKILL takes W&B's unwritten rows with it).

    The child starts its own W&B service: this process's (``WANDB_SERVICE``, set by wandb in the
    environment) would outlive a killed child and keep its run id in use.
    """
    parent = {key: value for key, value in os.environ.items() if key != "WANDB_SERVICE"}
    return subprocess.run(
        [sys.executable, "-c", PER_STEP_SCRIPT, str(out_dir)],
        cwd=ROOT,
        env={**parent, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def wandb_cli(*args: str) -> str:
    """Run wandb's own command line; its stdout and stderr together."""
    wandb = Path(sys.executable).with_name("wandb")
    done = subprocess.run([str(wandb), *args], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def leet_records(datastore: Path) -> list[dict]:
    """The records of a ``.wandb`` file as wandb's own reader (``wandb leet inspect --json``) prints them."""
    return [json.loads(line) for line in wandb_cli("leet", "inspect", "--json", str(datastore)).splitlines()
            if line.startswith("{")]


def folders_when_written(out_dir: Path, count: int, timeout_s: float = 60.0) -> list[OfflineRun]:
    """The ``count`` offline run folders of ``out_dir``, oldest first, once the newest holds its exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [OfflineRun.read(folder) for folder in sorted((out_dir / "wandb").glob("offline-run-*"))]
        if (len(runs) == count and runs[-1].exit_code is not None) or time.monotonic() > deadline:
            assert len(runs) == count, [r.folder.name for r in runs]
            return runs
        time.sleep(0.05)


def journal_rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def without_wandb_keys(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith("_")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("every_n_steps", [None, 2], ids=["epoch-checkpoints", "step-checkpoints"])
def test_a_killed_and_resumed_run_syncs_as_one_history(tmp_path, every_n_steps):
    """kill -9 mid-epoch, then resume: across both folders every line of metrics.jsonl is in W&B once, at its step.

    W&B's service buffers what it writes, so a kill takes the rows it had not written yet (in a run this
    small, all of them: the killed folder holds no run record at all). The resumed run sends the rows the
    file kept and W&B lost, skips the ones W&B holds, and numbers the rest on; an empty folder is marked
    synced so that ``wandb sync`` (which stops at a file without a run) skips it. Checked with wandb's
    own tools: ``wandb leet inspect`` reads the records and ``wandb sync --dry-run`` lists the folders.
    """
    steps = {"EVERY_N_STEPS": str(every_n_steps)} if every_n_steps else {}
    killed = per_step_run(tmp_path, KILL_AT="1,4", KILL_HOW="sigkill", **steps)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = per_step_run(tmp_path, **steps)
    assert resumed.returncode == 0, resumed.stderr
    assert "not bit-exact" not in resumed.stderr
    if every_n_steps:  # resumed from the step checkpoint after batch 3 of epoch 1, not from epoch 1's start
        assert "inside it: 4 of 6 batches done" in resumed.stderr, resumed.stderr

    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_run_id"]
    first, second = folders_when_written(tmp_path, 2)
    assert first.exit_code is None  # killed: W&B never finished it
    assert second.run_id == run_id and second.exit_code == 0
    rows = journal_rows(tmp_path)
    assert len(rows) == 3 * (6 + 1)  # six batch rows and one epoch row per epoch

    steps = [row["_step"] for part in (first, second) for row in part.history]
    assert sorted(steps) == list(range(len(rows)))  # every line once: no gap, no row twice
    assert steps == sorted(steps)  # and W&B's step never goes back, also from one folder to the next
    for part in (first, second):
        for row in part.history:
            assert without_wandb_keys(row) == rows[row["_step"]]

    written = [part for part in (first, second) if part.run_id is not None]
    empty = [part for part in (first, second) if part.run_id is None]
    for part in empty:
        assert not part.history and next(part.folder.glob("run-*.wandb.synced"))
    # wandb's own reader agrees with what trainkit and this test read
    starts = []
    for part in written:
        (datastore,) = part.folder.glob("run-*.wandb")
        records = leet_records(datastore)
        assert [r["run"]["run_id"] for r in records if r["type"] == "run"] == [run_id]
        assert [r["history"]["step"].get("num", 0) for r in records if r["type"] == "history"] == [
            row["_step"] for row in part.history
        ]
        starts += [r["run"]["start_time"] for r in records if r["type"] == "run"]
    assert starts == sorted(starts)  # wandb sync uploads the folders of one run in this order

    # the README's upload command, pointed at this run and dry
    readme = (ROOT / "README.md").read_text()
    (command,) = [line for line in readme.splitlines() if line.startswith(".venv/bin/wandb sync ")]
    program, *args = shlex.split(command)
    assert args == ["sync", "runs/digits/wandb"], command
    listing = wandb_cli("sync", "--dry-run", args[1].replace("runs/digits", str(tmp_path)))
    assert f"Would sync {len(written)} run(s)" in listing, listing
    assert listing.count(f"run-{run_id}.wandb") == len(written), listing
    if empty:
        assert f"Skipped {len(empty)} synced run(s)" in listing, listing


@pytest.mark.timeout(300)
def test_rows_wandb_holds_are_not_sent_again_and_a_changed_rerun_is_reported(tmp_path, capsys, monkeypatch):
    """A crash after W&B got rows of the epoch: the rerun's rows at those steps stay out of W&B.

    Values of the rerun that differ from the rows W&B keeps are reported in one line.
    """
    monkeypatch.setenv("KILL_AT", "1,3")
    with pytest.raises(RuntimeError, match="injected crash"):
        train_and_close(PerStepTrainer(make_cfg(tmp_path, OFFLINE)))
    monkeypatch.delenv("KILL_AT")
    (first,) = offline_runs(tmp_path)
    held = [row["_step"] for row in first.history]
    assert held == list(range(7 + 4))  # epoch 0 (6 batches, 1 epoch row) and batches 0-3 of epoch 1
    lost = {row["_step"]: without_wandb_keys(row) for row in first.history if row["trainer/epoch"] == 1}

    monkeypatch.setenv("BIAS", "1.0")  # the rerun logs other values: not bit-exact
    capsys.readouterr()
    train_and_close(PerStepTrainer(make_cfg(tmp_path, OFFLINE)))
    err = capsys.readouterr().err
    assert "W&B already held steps 7-10 of this run" in err and "4 of those 4 rows differ" in err, err

    first, second = offline_runs(tmp_path)
    rows = journal_rows(tmp_path)
    steps = [row["_step"] for part in (first, second) for row in part.history]
    assert steps == list(range(len(rows)))
    for step, kept in lost.items():  # W&B keeps what it got first; the file has the rerun's rows
        assert rows[step]["train/batch_loss"] == pytest.approx(kept["train/batch_loss"] + 1.0, abs=0.5)
        assert rows[step] != kept
    assert all(without_wandb_keys(row) == rows[row["_step"]] for row in second.history)


def test_reading_wandb_folders_survives_torn_and_garbage_files(tmp_path):
    """read_wandb_history counts complete records only: a file cut anywhere, or random bytes, never raises."""
    import random

    from trainkit.run.wandb_run import read_wandb_history

    train_and_close(TinyTrainer(make_cfg(tmp_path, OFFLINE, epochs=2)))
    (part,) = offline_runs(tmp_path)
    (datastore,) = part.folder.glob("run-*.wandb")
    whole = read_wandb_history([tmp_path / "wandb"], part.run_id)
    assert whole.next_step == 2 and sorted(whole.rows) == [0, 1]
    assert whole.rows[1] == without_wandb_keys(part.history[1])
    assert read_wandb_history([tmp_path / "wandb"], part.run_id, since=1).rows.keys() == {1}
    assert read_wandb_history([tmp_path / "wandb"], "otherid1").next_step == 0

    data = datastore.read_bytes()
    rng = random.Random(0)
    seen = set()
    for cut in sorted(rng.sample(range(len(data)), 40)):
        datastore.write_bytes(data[:cut])
        seen.add(read_wandb_history([tmp_path / "wandb"], part.run_id).next_step)
    assert seen <= {0, 1, 2}
    for _ in range(20):
        noisy = bytearray(data)
        for _ in range(8):
            noisy[rng.randrange(7, len(noisy))] = rng.randrange(256)
        datastore.write_bytes(bytes(noisy))
        assert read_wandb_history([tmp_path / "wandb"], part.run_id).next_step in {0, 1, 2}
    datastore.write_bytes(os.urandom(5000))
    assert read_wandb_history([tmp_path / "wandb"], part.run_id).next_step == 0


def test_wandb_history_is_read_across_block_ends(tmp_path):
    """Records that span blocks, and a first chunk with no byte of its record at a block's end, are all read.

    A hand-framed ``.wandb`` file (W&B's writer's layout, a run record first): the first history record is sized
    so that exactly one chunk header fits after it, so the next record starts with an empty first chunk; then
    records of up to three blocks. A torn tail gives the records before it and nothing made up.
    """
    import random

    from trainkit.run.wandb_run import read_wandb_history

    rng = random.Random(1)
    # file header, the run record (W&B writes it first) and its chunk header, the first record's chunk header,
    # and exactly one chunk header's room after it
    target = BLOCK - 7 - (7 + len(run_record("abcd1234"))) - 7 - 7
    padding = target
    for _ in range(8):  # protobuf's length prefixes grow with the padding: settle on the exact size
        first = history_record(0, padding)
        padding += target - len(first)
    assert len(first) == target
    records = [first] + [history_record(step, rng.randrange(1, 3 * BLOCK)) for step in range(1, 30)]
    data = leveldb_log([run_record("abcd1234"), *records])
    folder = tmp_path / "wandb" / "offline-run-20260101_000000-abcd1234"
    folder.mkdir(parents=True)
    datastore = folder / "run-abcd1234.wandb"
    datastore.write_bytes(data)
    history = read_wandb_history([tmp_path / "wandb"], "abcd1234", since=28)
    assert history.next_step == 30 and sorted(history.rows) == [28, 29]
    assert history.rows[29]["trainer/step"] == 290
    datastore.write_bytes(data[: len(data) - 10])  # the last record torn
    assert read_wandb_history([tmp_path / "wandb"], "abcd1234").next_step == 29


def planted_record(step: int | None, items: dict[str, str]) -> bytes:
    """A serialized W&B history record with raw ``value_json`` strings (``step`` None: no step field)."""
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    if step is not None:
        record.history.step.num = step
    for key, value in items.items():
        item = record.history.item.add()
        item.key = key
        item.value_json = value
    return record.SerializeToString()


PLANTED_WANDB = {
    "unparsable": [planted_record(7, {"train/loss": "{"})],
    "deep": [planted_record(8, {"train/loss": "[" * 20_000 + "]" * 20_000})],
    "step-not-a-number": [planted_record(None, {"_step": '"abc"', "train/loss": "1.0"})],
    "step-2**62": [planted_record(2**62, {"train/loss": "1.0"})],
}
"""W&B files that no trainkit run writes, each of which stopped or silenced a resume before."""


def plant_wandb_files(out_dir: Path, run_id: str) -> dict[str, Path]:
    """Plant one folder per hostile ``.wandb`` file next to the run's own: the FIFO, the /dev/zero link and the
    files of PLANTED_WANDB."""
    planted = {}
    for second, name in enumerate(["fifo", "dev-zero", *PLANTED_WANDB]):
        folder = out_dir / "wandb" / f"offline-run-20200101_0000{second:02d}-{run_id}"
        folder.mkdir(parents=True)
        path = folder / f"run-{run_id}.wandb"
        if name == "fifo":
            os.mkfifo(path)
        elif name == "dev-zero":
            path.symlink_to("/dev/zero")
        else:
            path.write_bytes(leveldb_log(PLANTED_WANDB[name]))
        planted[name] = path
    return planted


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="needs FIFOs and /dev/zero")
def test_hostile_wandb_files_are_skipped_with_a_warning_and_every_row_reaches_wandb(tmp_path):
    """A FIFO as run-<id>.wandb, a link to /dev/zero, a value that is not JSON, 20000-deep JSON, a step that is not
    a number and a record at step 2**62: each file is skipped with one warning naming it, the resume runs to its end
    (none hangs, none raises), and W&B gets every row of metrics.jsonl (the 2**62 record silenced them all before)."""
    from trainkit.run.wandb_run import read_wandb_history

    cfg = make_cfg(tmp_path, OFFLINE)
    with pytest.raises(RuntimeError, match="injected crash"):
        train_and_close(CrashAt1(cfg))
    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_run_id"]
    # run.finish() returns before W&B's service has written the run's records (a busy host showed an empty
    # datastore here): wait for its exit record, as the resume below and every other test does, before planting
    (crashed,) = offline_runs(tmp_path)
    assert crashed.exit_code == 1 and [row["_step"] for row in crashed.history] == [0]
    planted = plant_wandb_files(tmp_path, run_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = read_wandb_history([tmp_path / "wandb"], run_id)
    assert history.next_step == 1 and sorted(history.rows) == [0]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    for name, path in planted.items():
        assert sum(str(path) in message for message in messages) == 1, (name, messages)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train_and_close(CrashingTrainer(cfg))
    parts = [OfflineRun.read(folder) for folder in sorted((tmp_path / "wandb").glob("offline-run-*"))
             if not folder.name.startswith("offline-run-20200101_")]
    deadline = time.monotonic() + 30
    while any(part.exit_code is None for part in parts) and time.monotonic() < deadline:
        time.sleep(0.1)
        parts = [OfflineRun.read(part.folder) for part in parts]
    sent = [row for part in parts for row in part.history]
    assert [row["_step"] for row in sent] == [0, 1, 2]
    assert [without_wandb_keys(row) for row in sent] == journal_rows(tmp_path)
