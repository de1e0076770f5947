"""log() and push_logs(): a device-side buffer drained in one transfer, and metrics.jsonl across a resume."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.configs import make_cfg
from tests.helpers.host_syncs import count_host_syncs
from tests.helpers.trainers import TinyTrainer
from trainkit.loop.trainer_metrics import LogBuffer

RUNS = {"epochs": 3, "val": {"minimize": False}}
"""What this module's runs put over make_cfg's defaults: 3 epochs and the engine's default direction (the validation
loss maximized)."""


@pytest.fixture
def trainer(tmp_path):
    trainer = TinyTrainer(make_cfg(tmp_path, RUNS, log_weight_stats=True))
    yield trainer
    trainer.close()


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------- the buffer


def test_log_waits_for_no_device(trainer):
    """log() of floats, ints and CPU tensors (mapping or keywords) reads each CPU tensor once, at log time.

    A CPU tensor is on the host already: its one ``item()`` waits for nothing and is the snapshot of its value.
    Numbers and the per-parameter vectors touch no tensor-to-host method.
    """
    loss = torch.tensor(0.25) * 2
    with count_host_syncs() as counts:
        trainer.log({"train/loss": loss, "train/acc": 0.75, "train/count": 3})
        trainer.log(extra=torch.tensor([4.0]))
        trainer.log_param_grad_stats()
    assert counts == Counter({"item": 2})


def test_log_keeps_an_accelerator_tensor_on_its_device(trainer, monkeypatch):
    """A tensor that is not read at log time stays on its device until the push: log() reads nothing from it.

    ``LogBuffer.read_cpu_at_log = False`` runs the accelerator path with CPU tensors; the ``meta`` device (it
    holds no data, so nothing could be read from it) takes that path with the default too.
    """
    monkeypatch.setattr(LogBuffer, "read_cpu_at_log", False)
    running = torch.tensor(0.25, requires_grad=True) * 2
    with count_host_syncs() as counts:
        trainer.log({"train/loss": running, "train/acc": 0.75, "train/count": 3})
        trainer.log(extra=torch.tensor([4.0]))
        trainer.log_param_grad_stats()
    assert counts == Counter()
    with torch.no_grad():
        running.zero_()  # the buffer holds a copy, not the tensor
    with count_host_syncs() as counts:
        pushed = trainer.push_logs()
    assert counts == Counter({"tolist": 1})  # every tensor of the one device in one transfer
    assert pushed["train/loss"] == 0.5 and pushed["extra"] == 4.0 and pushed["train/count"] == 3.0
    monkeypatch.undo()
    buffer = LogBuffer()
    with count_host_syncs() as counts:
        buffer.add({"train/loss": torch.tensor(0.5, device="meta") * 2, "train/acc": 0.75})
    assert counts == Counter() and len(buffer) == 2
    with pytest.raises(TypeError, match="train/matrix"):
        buffer.add({"train/matrix": torch.ones(2, 2, device="meta")})


def test_push_moves_everything_in_one_transfer_and_clears(trainer, monkeypatch):
    """push_logs() turns every buffered tensor into a float with one tolist() and empties the buffer.

    The scalars logged from the CPU were read at log time; the vector of weight norms is the one transfer.
    """
    device = trainer.device  # every tensor on the model's device: one transfer in all
    trainer.log({"train/loss": torch.tensor(0.5, device=device), "train/acc": 0.75, "train/count": 3})
    trainer.log(extra=torch.tensor([4.0], dtype=torch.float16, device=device), n=torch.tensor(7, device=device))
    trainer.log_param_grad_stats()  # a vector of four weight norms, from the same device
    with count_host_syncs() as counts:
        pushed = trainer.push_logs()
    assert counts == Counter({"tolist": 1})
    weight_keys = {f"params/{name}/weight_norm" for name, _ in trainer.model.named_parameters()}
    assert set(pushed) == {"train/loss", "train/acc", "train/count", "extra", "n"} | weight_keys
    assert pushed["train/loss"] == 0.5 and pushed["train/acc"] == 0.75 and pushed["train/count"] == 3.0
    assert pushed["extra"] == 4.0 and pushed["n"] == 7.0
    assert all(type(value) is float for value in pushed.values())
    assert trainer.push_logs() == {}


@pytest.mark.parametrize(
    "value, expected",
    [(torch.tensor(0.1), 0.10000000149011612), (torch.tensor([3], dtype=torch.int64), 3.0), (0.25, 0.25),
     (torch.tensor(True), 1.0), (torch.tensor(2.5, dtype=torch.bfloat16), 2.5)],
)
def test_a_push_of_one_metric_is_one_transfer_and_exact(trainer, value, expected):
    """The one-metric push (a push per step) returns the same float as the general path, in one transfer."""
    with count_host_syncs() as counts:
        trainer.log({"train/loss": value})
        pushed = trainer.push_logs()
    assert pushed == {"train/loss": expected} and type(pushed["train/loss"]) is float
    assert sum(counts.values()) == (1 if isinstance(value, torch.Tensor) else 0)
    trainer.log({"train/loss": value, "train/other": 1.0})  # the general path agrees
    assert trainer.push_logs()["train/loss"] == expected


def test_a_key_logged_twice_keeps_its_last_value(trainer):
    """Logging a key again before a push replaces the earlier value."""
    trainer.log({"val/loss": torch.tensor(1.0)})
    trainer.log({"val/loss": 2.0})
    trainer.log({"train/loss": 3.0})
    trainer.log({"train/loss": torch.tensor(4.0)})
    assert trainer.push_logs() == {"val/loss": 2.0, "train/loss": 4.0}


def test_a_logged_tensor_keeps_its_value_at_log_time(trainer):
    """A tensor changed in place after log() is pushed with the value it had when it was logged."""
    running = torch.zeros(())
    running += 2.0
    trainer.log({"train/loss_sum": running})
    running.zero_()  # e.g. an accumulator reset by the next phase before the end-of-epoch push
    assert trainer.push_logs() == {"train/loss_sum": 2.0}


@pytest.mark.parametrize(
    "value",
    [torch.ones(2), torch.zeros(0), torch.ones(1, 2), "abc", "1.5", None, [1.0], {"a": 1.0}],
    ids=["vector", "empty", "matrix", "word", "numeric-string", "none", "list", "dict"],
)
def test_log_rejects_non_scalars_naming_the_key(trainer, value):
    """log() raises TypeError naming the key for a tensor of other than one element, or a value that is no number."""
    with pytest.raises(TypeError, match="train/bad"):
        trainer.log({"train/bad": value})


def test_push_writes_one_jsonl_row_with_step_and_epoch(trainer):
    """Each non-empty push appends a metrics.jsonl row with trainer/step and trainer/epoch; an empty one writes none."""
    path = trainer.out_dir / "metrics.jsonl"
    trainer.log({"train/loss": torch.tensor(1.5)})
    assert trainer.push_logs() == {"train/loss": 1.5}
    trainer.step, trainer.epoch = 7, 2
    trainer.log(a=1.0)
    trainer.push_logs()
    trainer.push_logs()
    assert read_rows(path) == [
        {"trainer/step": 0, "trainer/epoch": 0, "train/loss": 1.5},
        {"trainer/step": 7, "trainer/epoch": 2, "a": 1.0},
    ]


def test_a_run_writes_one_row_per_epoch(tmp_path):
    """A plain run pushes once per epoch: rows with epochs 0..n-1 and the step after each epoch's optimizer steps."""
    trainer = TinyTrainer(make_cfg(tmp_path, RUNS))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [row["trainer/epoch"] for row in rows] == [0, 1, 2]
    assert [row["trainer/step"] for row in rows] == [6, 12, 18]  # 192 training samples in batches of 32
    assert all({"train/loss", "train/grad_norm", "train/grad_norm_epoch", "val/loss"} <= row.keys() for row in rows)
    assert result["val/loss"] == rows[-1]["val/loss"]


# ---------------------------------------------------------------------------------- metrics.jsonl across a resume


class Crash(Exception):
    """The injected failure."""


class PushingTrainer(TinyTrainer):
    """TinyTrainer that also pushes after training, mid-epoch, then crashes at ``crash_at`` after that push."""

    crash_at: int | None = None

    def train_epoch(self):
        super().train_epoch()
        self.push_logs()  # rows the next checkpoint covers; lost if the epoch dies
        if self.epoch == self.crash_at:
            raise Crash(f"injected crash after epoch {self.epoch}'s training push")


def run(cls, cfg):
    trainer = cls(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def crashing(at):
    return type(f"CrashAt{at}", (PushingTrainer,), {"crash_at": at})


def check_monotone(rows):
    keys = [(row["trainer/epoch"], row["trainer/step"], tuple(sorted(row))) for row in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    steps = [row["trainer/step"] for row in rows]
    epochs = [row["trainer/epoch"] for row in rows]
    assert steps == sorted(steps) and epochs == sorted(epochs), "rows went backwards"


def test_resume_after_a_crash_leaves_no_duplicate_or_backward_rows(tmp_path):
    """After a crash mid-epoch and a resume with the same config, metrics.jsonl equals an uninterrupted run's."""
    cfg_a = make_cfg(tmp_path / "a", RUNS, epochs=4)
    cfg_b = make_cfg(tmp_path / "b", RUNS, epochs=4)
    run(PushingTrainer, cfg_a)
    with pytest.raises(Crash):
        run(crashing(2), cfg_b)
    crashed = read_rows(tmp_path / "b" / "metrics.jsonl")
    assert [row["trainer/epoch"] for row in crashed] == [0, 0, 1, 1, 2]  # epoch 2's training row was written

    run(PushingTrainer, cfg_b)

    reference = read_rows(tmp_path / "a" / "metrics.jsonl")
    resumed = read_rows(tmp_path / "b" / "metrics.jsonl")
    check_monotone(resumed)

    def when(rows):
        return [(row["trainer/epoch"], row["trainer/step"]) for row in rows]

    assert when(resumed) == when(reference)
    assert resumed == reference  # exact resume: same values too


def test_resume_twice_and_after_finishing_adds_no_rows(tmp_path):
    """Two crashes and resumes give the uninterrupted file; resuming a finished run appends nothing."""
    cfg_a = make_cfg(tmp_path / "a", RUNS, epochs=4)
    cfg_b = make_cfg(tmp_path / "b", RUNS, epochs=4)
    run(PushingTrainer, cfg_a)
    for at in (1, 3):
        with pytest.raises(Crash):
            run(crashing(at), cfg_b)
    run(PushingTrainer, cfg_b)
    path = tmp_path / "b" / "metrics.jsonl"
    size = path.stat().st_size
    run(PushingTrainer, cfg_b)
    assert path.stat().st_size == size
    assert read_rows(path) == read_rows(tmp_path / "a" / "metrics.jsonl")


def test_crash_before_the_first_checkpoint_leaves_no_stale_rows(tmp_path):
    """A run that died in epoch 0 (before any last.pt) and is started again leaves no rows of the dead attempt."""
    cfg = make_cfg(tmp_path, RUNS, epochs=2)
    with pytest.raises(Crash):
        run(crashing(0), cfg)
    assert not (tmp_path / "last.pt").exists()
    run(PushingTrainer, cfg)
    rows = read_rows(tmp_path / "metrics.jsonl")
    check_monotone(rows)
    assert [row["trainer/epoch"] for row in rows] == [0, 0, 1, 1]


def test_nan_and_inf_metrics_reach_the_file(trainer):
    """Non-finite values are written as such, not dropped or turned into strings."""
    trainer.log({"a": math.nan, "b": torch.tensor(math.inf)})
    trainer.push_logs()
    (row,) = read_rows(trainer.out_dir / "metrics.jsonl")
    assert math.isnan(row["a"]) and row["b"] == math.inf


# ------------------------------------------------------------------ RunLog: rows numbered by their line


class FakeWandb:
    """A W&B run that records (step, row) and, like W&B, refuses a step below its last one."""

    run_id = "fake0001"

    def __init__(self, next_step: int = 0) -> None:
        self.next_step = next_step
        self.logged: list[tuple[int, dict]] = []
        self.exit_code: int | None = None

    def log(self, metrics, step=None):
        step = self.next_step if step is None else step
        assert step >= self.next_step, f"step {step} after {self.next_step}"
        self.logged.append((step, dict(metrics)))
        self.next_step = step + 1

    def summary(self, values):
        pass

    def finish(self, exit_code=0):
        self.exit_code = exit_code


def row(i: int, bias: float = 0.0) -> dict:
    return {"trainer/step": i, "trainer/epoch": i // 4, "train/loss": 1.0 / (i + 1) + bias}


def write_journal(path, rows) -> int:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    path.write_bytes(data)
    return len(data)


def test_run_log_numbers_w_and_b_rows_by_their_line(tmp_path):
    """A fresh run: W&B gets every row, at its 0-based line in metrics.jsonl."""
    from trainkit.run.journal import JsonlSink
    from trainkit.run.log import RunLog

    wandb = FakeWandb()
    log = RunLog(JsonlSink(tmp_path / "m.jsonl", truncate_to=0), wandb)
    for i in range(5):
        log.log(row(i))
    log.finish()
    assert [step for step, _ in wandb.logged] == [0, 1, 2, 3, 4]
    assert [r for _, r in wandb.logged] == read_rows(tmp_path / "m.jsonl")
    assert wandb.exit_code == 0


def test_run_log_skips_the_rows_w_and_b_holds_and_reports_a_changed_rerun(tmp_path, capsys):
    """Resumed at line 4 with W&B holding lines 0-6: lines 4-6 stay out of W&B; changed values are reported once."""
    from trainkit.run.journal import JsonlSink
    from trainkit.run.log import RunLog
    from trainkit.run.wandb_run import WandbHistory

    path = tmp_path / "m.jsonl"
    offset = write_journal(path, [row(i) for i in range(4)])
    with path.open("ab") as journal:  # the rows a crash lost
        journal.write(b"".join(json.dumps(row(i)).encode() + b"\n" for i in range(4, 7)))
    held = WandbHistory(7, {i: row(i) for i in range(4, 7)})

    wandb = FakeWandb()
    log = RunLog(JsonlSink(path, truncate_to=offset), wandb, held)
    for i in range(4, 9):
        log.log(row(i))
    log.finish()
    assert [step for step, _ in wandb.logged] == [7, 8]
    assert "W&B already held" not in capsys.readouterr().err  # a bit-exact rerun: nothing to say

    path.write_bytes(b"")
    offset = write_journal(path, [row(i) for i in range(4)])
    wandb = FakeWandb()
    log = RunLog(JsonlSink(path, truncate_to=offset), wandb, held)
    for i in range(4, 9):
        log.log(row(i, bias=0.5 if i == 5 else 0.0))
    err = capsys.readouterr().err
    assert "W&B already held steps 4-6 of this run" in err and "1 of those 3 rows differ" in err, err
    log.finish()
    assert "W&B already held" not in capsys.readouterr().err  # said once
    assert [step for step, _ in wandb.logged] == [7, 8]


def test_run_log_sends_the_rows_w_and_b_lost_when_it_resumes(tmp_path):
    """W&B wrote lines 0-1 before a kill; the file kept 0-5: lines 2-5 are sent at once, torn lines skipped."""
    from trainkit.run.journal import JsonlSink
    from trainkit.run.log import RunLog
    from trainkit.run.wandb_run import WandbHistory

    path = tmp_path / "m.jsonl"
    rows = [row(i) for i in range(6)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    torn = data.replace(json.dumps(rows[3]).encode(), b'{"trainer/st')  # a line a crash tore
    path.write_bytes(torn)
    wandb = FakeWandb()
    log = RunLog(JsonlSink(path, truncate_to=len(torn)), wandb, WandbHistory(2, {}))
    assert [step for step, _ in wandb.logged] == [2, 4, 5]
    assert [r for _, r in wandb.logged] == [rows[2], rows[4], rows[5]]
    log.log(row(6))
    assert wandb.logged[-1] == (6, row(6))


def test_run_log_starts_after_the_steps_online_w_and_b_holds(tmp_path):
    """Online, W&B's own next step counts: rows below it are not sent (W&B would drop them)."""
    from trainkit.run.journal import JsonlSink
    from trainkit.run.log import RunLog

    path = tmp_path / "m.jsonl"
    offset = write_journal(path, [row(i) for i in range(3)])
    wandb = FakeWandb(next_step=5)
    log = RunLog(JsonlSink(path, truncate_to=offset), wandb)
    for i in range(3, 7):
        log.log(row(i))
    assert [step for step, _ in wandb.logged] == [5, 6]


def test_run_log_without_a_file_numbers_from_zero():
    """Checkpoints off (no metrics.jsonl): rows are numbered from 0 in the session."""
    from trainkit.run.log import RunLog

    wandb = FakeWandb()
    log = RunLog(None, wandb)
    for i in range(3):
        log.log(row(i))
    assert log.offset() is None
    assert [step for step, _ in wandb.logged] == [0, 1, 2]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kept=st.integers(0, 8),
    lost=st.integers(0, 8),
    wandb_wrote=st.integers(0, 20),
    new=st.integers(0, 8),
)
def test_run_log_w_and_b_gets_every_line_once_in_order(tmp_path, kept, lost, wandb_wrote, new):
    """Whatever the file kept, lost and W&B wrote before a crash: after the resume W&B holds every line once.

    The session before logged ``kept + lost`` rows; W&B wrote the first ``wandb_wrote`` of them (a kill
    takes the rest); the checkpoint recorded ``kept``. The resumed run redoes the lost rows and goes on.
    """
    from trainkit.run.journal import JsonlSink
    from trainkit.run.log import RunLog
    from trainkit.run.wandb_run import WandbHistory

    wandb_wrote = min(wandb_wrote, kept + lost)
    path = tmp_path / f"m-{kept}-{lost}-{wandb_wrote}-{new}.jsonl"
    offset = write_journal(path, [row(i) for i in range(kept)])
    with path.open("ab") as journal:
        journal.write(b"".join(json.dumps(row(i)).encode() + b"\n" for i in range(kept, kept + lost)))
    before = [(i, row(i)) for i in range(wandb_wrote)]
    held = WandbHistory(wandb_wrote, {i: r for i, r in before if i >= kept})

    wandb = FakeWandb()  # a new offline folder starts at 0; FakeWandb checks that steps only grow
    log = RunLog(JsonlSink(path, truncate_to=offset), wandb, held)
    for i in range(kept, kept + lost + new):
        log.log(row(i))
    log.finish()
    after = wandb.logged
    assert sorted(step for step, _ in before + after) == list(range(kept + lost + new))
    assert dict(before + after) == dict(enumerate(read_rows(path)))


def test_journal_sync_fsyncs_every_row_written_since_the_last_sync_and_nothing_else(tmp_path, monkeypatch):
    """sync() before a checkpoint makes every row written since the last sync durable, and skips the fsync only when
    no byte was written since: a fresh empty file, or a second sync with no row between; a file found non-empty (a
    resumed run's rows, a cut, padding, carried history) is synced by its first sync, even when nothing is new."""
    from trainkit.run import journal
    from trainkit.run.journal import JsonlSink

    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(journal.os, "fsync", counting_fsync)
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.sync()
    assert synced == []  # empty at open, nothing written: nothing to make durable
    sink.log(row(0))
    first = sink.tell()
    sink.sync()
    sink.sync()
    sink.log(row(1))
    sink.log(row(2))
    sink.sync()
    assert synced == [first, sink.tell()]
    sink.finish()
    size = (tmp_path / "m.jsonl").stat().st_size
    for reopen in ({}, {"truncate_to": size}, {"truncate_to": 5}, {"truncate_to": size + 7}, {"history": b""}):
        synced.clear()
        if reopen.get("truncate_to") == size + 7:
            with pytest.warns(RuntimeWarning, match="7 bytes shorter"):
                sink = JsonlSink(tmp_path / "m.jsonl", **reopen)
        else:
            sink = JsonlSink(tmp_path / "m.jsonl", **reopen)
        sink.sync()
        sink.sync()
        assert synced == [sink.tell()], reopen
        sink.finish()
        write_journal(tmp_path / "m.jsonl", [row(0), row(1), row(2)])
