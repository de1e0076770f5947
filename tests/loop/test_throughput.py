"""log_throughput: perf/* rates in the pushed rows, counted from the batches of progress() at no host sync."""

from __future__ import annotations

import json
import statistics
from collections import Counter

import pytest
import torch

from tests.helpers.configs import make_cfg
from tests.helpers.host_syncs import count_host_syncs
from tests.helpers.trainers import TinyTrainer
from trainkit.loop.throughput import CountedBatches, Throughput
from trainkit.loop.trainer_metrics import LogBuffer

RUNS = {"epochs": 2, "val": {"minimize": False}}
"""What this module's runs put over make_cfg's defaults: 2 epochs and the engine's default direction (the validation
loss maximized)."""


def rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


class TokenTrainer(TinyTrainer):
    """TinyTrainer counting 8 tokens a sample (a tensor on the batch's device) and checking progress() stays a
    sized iterable with the tracked loop's attributes."""

    def train_epoch(self):
        batches = self.progress(self.loader)
        assert len(batches) == len(self.loader)
        self.model.train()
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.count_tokens(torch.full_like(x, 1.0).sum())  # 8 features a sample: 8 "tokens"
            self.count_tokens(0)
        self.consumed = getattr(batches, "consumed", None)
        self.log({"train/loss": loss.detach()})


def test_every_row_after_training_carries_the_rates(tmp_path):
    """Each epoch's row has samples/s, steps/s and tokens/s whose ratios are the data's: 32 samples a step, 8
    tokens a sample; the metrics the run returns are the trainer's as without it."""
    trainer = TokenTrainer(make_cfg(tmp_path, RUNS, log_throughput=True, ckpt={"every_n_steps": 4}))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert trainer.consumed == 6  # the tracked loop's own attribute, through the counting wrapper
    written = rows(tmp_path)
    assert len(written) == 2
    for row in written:
        assert row["perf/samples_per_s"] / row["perf/steps_per_s"] == pytest.approx(32.0, rel=1e-9)
        assert row["perf/tokens_per_s"] / row["perf/samples_per_s"] == pytest.approx(8.0, rel=1e-9)
        assert row["perf/steps_per_s"] > 0
    assert {"train/loss", "val/loss"} <= result.keys()


def test_off_by_default_and_count_tokens_is_then_a_no_op(tmp_path):
    """Without log_throughput a trainer that counts tokens trains as with it on, and no row has a perf/ key."""
    trainer = TokenTrainer(make_cfg(tmp_path, RUNS))
    try:
        trainer.train()
    finally:
        trainer.close()
    written = rows(tmp_path)
    assert len(written) == 2
    assert not [key for row in written for key in row if key.startswith("perf/")]


@pytest.mark.parametrize("value, error", [("12", TypeError), (float("nan"), ValueError), (-1, ValueError)])
def test_count_tokens_checks_its_argument_with_log_throughput_off_too(tmp_path, value, error):
    """A bad count is refused at the call whether or not log_throughput is on: it is a bug either way."""
    trainer = TinyTrainer(make_cfg(tmp_path, RUNS))
    try:
        with pytest.raises(error, match="count_tokens"):
            trainer.count_tokens(value)
        with pytest.raises(TypeError, match="count_tokens"):
            trainer.count_tokens(torch.ones(2, dtype=torch.complex64))
        trainer.count_tokens(torch.ones(2))  # a tensor's values are not read: no host sync
    finally:
        trainer.close()


def test_rates_follow_the_clock_and_a_validation_push_carries_none():
    """On a fake clock: the first interval starts at the first counted batch, a push without a step since the
    last rates has none (but the validation's seconds), and the next one covers the training time since those
    rates (not the validation's, not since the empty push)."""
    now, step = [100.0], [0]
    counter = Throughput(lambda: step[0], world_size=2, clock=lambda: now[0])
    buffer = LogBuffer()
    now[0] = 110.0  # setup() took 10 s: not part of the first interval
    batches = CountedBatches([(torch.zeros(4, 3), torch.zeros(4))] * 3, counter)
    for _ in batches:
        step[0] += 1
        now[0] += 0.5
    buffer.add({"train/loss": 1.0})
    assert counter.drain(buffer) == {
        "train/loss": 1.0, "perf/samples_per_s": 12 * 2 / 1.5, "perf/steps_per_s": 3 / 1.5, "perf/train_s": 1.5,
        "perf/data_wait_s": 0.0,
    }
    with counter.outside_training("val"):
        now[0] += 7.0
    buffer.add({"val/loss": 2.0})
    assert counter.drain(buffer) == {"val/loss": 2.0, "perf/val_s": 7.0}  # no step since the last rates
    step[0] += 1
    counter.count_tokens(torch.tensor([3, 4]))
    counter.count_tokens(1.5)
    now[0] += 1.0
    buffer.add({"train/loss": 0.5})
    assert counter.drain(buffer) == {
        "train/loss": 0.5, "perf/samples_per_s": 0.0, "perf/steps_per_s": 1.0, "perf/tokens_per_s": 8.5 * 2,
        "perf/train_s": 1.0, "perf/data_wait_s": 0.0,
    }
    assert counter.drain(buffer) == {}  # nothing logged: no row, whatever was counted


def test_an_unknown_batch_size_reports_steps_only():
    """A batch with no tensor to measure (a list of strings, say) turns samples/s off from then on."""
    now, step = [0.0], [0]
    counter = Throughput(lambda: step[0], world_size=1, clock=lambda: now[0])
    for _ in CountedBatches([(torch.zeros(2, 1),), (["a", "b"],)], counter):
        step[0] += 1
        now[0] += 1.0
    buffer = LogBuffer()
    buffer.add({"x": 1.0})
    assert counter.drain(buffer) == {"x": 1.0, "perf/steps_per_s": 1.0, "perf/train_s": 2.0, "perf/data_wait_s": 0.0}


def test_counting_tokens_on_the_device_waits_for_nothing(monkeypatch):
    """Tensors given to count_tokens stay on their device until the push, which moves them with the logged
    metrics in one transfer (the accelerator path, which LogBuffer.read_cpu_at_log off runs on the CPU)."""
    monkeypatch.setattr(LogBuffer, "read_cpu_at_log", False)
    counter = Throughput(lambda: 1, world_size=1)
    buffer = LogBuffer()
    with count_host_syncs() as counts:
        for n in range(5):
            counter.count_tokens(torch.tensor(float(n)))
            buffer.add({"train/loss": torch.tensor(0.5)})
    assert counts == Counter()
    with count_host_syncs() as counts:
        pushed = counter.drain(buffer)
    assert counts == Counter({"tolist": 1})
    assert "perf/_tokens" not in pushed and pushed["train/loss"] == 0.5


@pytest.mark.parametrize("value", ["12", None, True, [3]])
def test_count_tokens_refuses_what_is_not_a_count(tmp_path, value):
    """count_tokens takes a number or a tensor; anything else is a TypeError that shows it."""
    trainer = TinyTrainer(make_cfg(tmp_path, RUNS, log_throughput=True))
    try:
        with pytest.raises(TypeError, match="count_tokens"):
            trainer.count_tokens(value)
    finally:
        trainer.close()


def test_a_mapping_batch_is_measured_by_its_first_tensor():
    """A batch that is a mapping but not a dict (a tokenizer's batch, say) counts its first tensor's rows."""
    from collections import UserDict

    from trainkit.loop.throughput import samples_in

    assert samples_in(UserDict({"input_ids": torch.zeros(6, 10), "labels": torch.zeros(6)})) == 6
    assert samples_in([[[[torch.zeros(3)]]]]) is None  # deeper than three containers: not looked for


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, -0.5, 10**400])
def test_count_tokens_refuses_a_number_that_is_no_count_at_the_call(tmp_path, value):
    """A NaN, infinite, negative or float-overflowing number is a ValueError naming count_tokens and the rule, at
    the call (not an OverflowError, not a NaN rate for the rest of the run)."""
    trainer = TinyTrainer(make_cfg(tmp_path, RUNS, log_throughput=True))
    try:
        with pytest.raises(ValueError, match=r"count_tokens\(n\) takes a finite count >= 0"):
            trainer.count_tokens(value)
        with pytest.raises(TypeError, match="count_tokens takes a real-valued tensor .*torch.complex64"):
            trainer.count_tokens(torch.ones(3, dtype=torch.complex64))
    finally:
        trainer.close()


@pytest.mark.parametrize("read_cpu_at_log", [True, False])
def test_a_poisoned_token_tensor_loses_one_rate_not_the_rest_of_the_run(monkeypatch, read_cpu_at_log):
    """A NaN, an overflowed float16 or a negative tensor count (checked on the device, read in the push's one
    transfer) leaves perf/tokens_per_s out of the next row with rates, with a warning naming count_tokens, and the
    rows after it count right; 70000 float16 ones are summed in float32, not to inf."""
    monkeypatch.setattr(LogBuffer, "read_cpu_at_log", read_cpu_at_log)
    now, step = [0.0], [0]
    counter = Throughput(lambda: step[0], world_size=1, clock=lambda: now[0])
    buffer = LogBuffer()

    def push(*counts):
        for n in counts:
            counter.count_tokens(n)
        step[0] += 1
        now[0] += 1.0
        buffer.add({"train/loss": 1.0})
        return counter.drain(buffer)

    assert push(torch.tensor(5.0))["perf/tokens_per_s"] == 5.0
    overflowed = torch.tensor(70000.0).half()  # a float16 sum that overflowed to inf
    for poison in (torch.tensor(float("nan")), overflowed, torch.tensor([3, -4])):
        with pytest.warns(RuntimeWarning, match="count_tokens got a tensor whose count is"):
            row = push(torch.tensor(7.0), poison)
        assert "perf/tokens_per_s" not in row and "perf/_tokens" not in row and row["perf/steps_per_s"] == 1.0
        assert push(torch.tensor(2.0), 1)["perf/tokens_per_s"] == 3.0
    assert push(torch.ones(70000, dtype=torch.float16))["perf/tokens_per_s"] == 70000.0
    assert push(torch.ones(4, dtype=torch.bool))["perf/tokens_per_s"] == 4.0


def test_time_outside_training_is_its_own_figure_and_nested_time_is_counted_once():
    """On a fake clock: a checkpoint save inside a validation is the save's time, not the validation's too; a row
    pushed inside carries the training clock as it stood when training stopped; each figure is reported once."""
    now, step = [0.0], [0]
    counter = Throughput(lambda: step[0], world_size=1, clock=lambda: now[0])
    buffer = LogBuffer()
    for _ in CountedBatches([(torch.zeros(2, 1),)] * 2, counter):
        step[0] += 1
        now[0] += 1.0
    with counter.outside_training("val"):
        now[0] += 3.0
        assert not counter.training
        with counter.outside_training("ckpt"):
            now[0] += 5.0
        buffer.add({"val/loss": 1.0})
        inside = counter.drain(buffer)
        now[0] += 4.0
    assert inside["perf/train_s"] == 2.0 and inside["perf/ckpt_s"] == 5.0 and "perf/val_s" not in inside
    buffer.add({"val/loss": 1.0})
    assert counter.drain(buffer) == {"val/loss": 1.0, "perf/val_s": 7.0}
    assert counter.training and counter.outside_s == 12.0


def test_a_loop_iterated_outside_training_is_not_counted_and_waiting_for_data_is_timed():
    """The batches of a loop iterated inside outside_training() (a validation's) are no training samples; the
    seconds next() takes are perf/data_wait_s, less a checkpoint saved inside next() (at a step boundary)."""
    now, step = [0.0], [0]
    counter = Throughput(lambda: step[0], world_size=1, clock=lambda: now[0])

    def slow_loader():
        for _ in range(3):
            now[0] += 0.25  # the loader's own wait
            with counter.outside_training("ckpt"):  # a step checkpoint written between two batches
                now[0] += 10.0
            yield (torch.zeros(4, 1),)

    for _ in CountedBatches(slow_loader(), counter):
        step[0] += 1
        now[0] += 1.0
        with counter.outside_training("val"):
            assert sum(len(x) for (x,) in CountedBatches([(torch.zeros(100, 1),)] * 2, counter)) == 200
    buffer = LogBuffer()
    buffer.add({"train/loss": 1.0})
    row = counter.drain(buffer)
    assert row["perf/samples_per_s"] == 12 / row["perf/train_s"]  # the validation's 200 samples are not there
    assert row["perf/data_wait_s"] == pytest.approx(0.75) and row["perf/ckpt_s"] == 30.0
    assert row["perf/train_s"] == pytest.approx(3.0 + 0.75)  # waiting for data is training time


class PlantedClock:
    """time.perf_counter, plus seconds planted by the code under test: a slow validation without the wait."""

    def __init__(self, real):
        self.real, self.planted = real, 0.0

    def __call__(self):
        return self.real() + self.planted


class SlowValTrainer(TinyTrainer):
    """TinyTrainer whose validation takes 1000 s more on the planted clock, and iterates batches of 7 samples
    through progress() (which must not count as training samples)."""

    clock: PlantedClock | None = None

    def val_epoch(self):
        for _ in self.progress(torch.utils.data.DataLoader(self.train_set, batch_size=7)):
            pass
        if self.clock is not None:
            self.clock.planted += 1000.0
        return super().val_epoch()


def test_a_slow_validation_does_not_move_the_rates_and_is_reported_as_its_own_figure(tmp_path, monkeypatch):
    """1000 s of validation on a planted clock: each row's perf/val_s shows them, perf/train_s and the rates do not
    (the run without them has rates of the same order, where a wall-clock rate would be ~1000x lower); the val
    loop's batches of 7 are not training samples (32 a step); the checkpoint saves show as perf/ckpt_s."""
    import time

    clock = PlantedClock(time.perf_counter)
    monkeypatch.setattr(time, "perf_counter", clock)
    runs = {}
    for planted in (False, True):
        SlowValTrainer.clock = clock if planted else None
        out = tmp_path / str(planted)
        trainer = SlowValTrainer(make_cfg(out, RUNS, log_throughput=True))
        try:
            trainer.train()
        finally:
            trainer.close()
        runs[planted] = rows(out)
    for row in runs[True]:
        assert row["perf/val_s"] >= 1000.0 and row["perf/train_s"] < 1000.0
        assert row["perf/samples_per_s"] / row["perf/steps_per_s"] == pytest.approx(32.0, rel=1e-9)
    assert "perf/ckpt_s" in runs[True][1]  # epoch 0's save, after its row
    slow, fast = (statistics.median(r["perf/samples_per_s"] for r in runs[p]) for p in (True, False))
    assert 0.1 < slow / fast < 10  # a rate over wall time would be about 1000 s / training seconds lower
