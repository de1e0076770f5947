"""The parts of step checkpoints: the pure position record, the index-level skip, the saved state, bad input."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import trainkit
from tests.faults.harness import ROOT, child_env
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, StepTrainer
from trainkit.bookkeeping import EpochPosition, next_step_checkpoint, position_mismatch, step_checkpoint_due
from trainkit.checkpoint.payload import validate_last
from trainkit.errors import BookkeepingError, CheckpointCorruptError, CheckpointMismatchError, TrainingInterrupted
from trainkit.loop.optim import RunningMean
from trainkit.loop.tracked_batches import SampleIndex, draws_only_from_torch, iterator_rng
from trainkit.loop.trainer_metrics import LogBuffer
from trainkit.run.lock import RunLock
from trainkit.state.rng import sample_epoch

# --- the pure core ----------------------------------------------------------------------------------------------


@given(st.integers(1, 7), st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_a_step_checkpoint_is_due_once_per_multiple_crossed(every, increments):
    """Whatever the step counter does between boundaries (several optimizer steps, none), a save is due exactly
    at the boundaries where it reached a multiple of every_n_steps it had not reached, and no multiple is missed."""
    saved, step = 0, 0
    for increment in increments:
        before, step = step, step + increment
        due = step_checkpoint_due(saved, step, every)
        assert due == (step // every > before // every)
        if due:
            saved = step
        assert saved // every == step // every


@given(st.integers(0, 500), st.integers(0, 500), st.one_of(st.none(), st.integers(1, 40)))
def test_the_next_due_step_is_where_a_checkpoint_first_comes_due(saved, step, every):
    """The threshold the loop compares against agrees with step_checkpoint_due for every step after a save."""
    due_at = next_step_checkpoint(saved, every)
    assert step_checkpoint_due(saved, step, every) == (due_at is not None and step >= due_at)
    if due_at is not None:
        assert due_at > saved and due_at % every == 0 and due_at - saved <= every


def test_only_torch_samplers_let_the_iterator_states_hold_torch_alone():
    """Python's and numpy's states are left out only where the iterator cannot reach them."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

    from tests.helpers.trainers import PythonShuffleSampler

    data = torch.utils.data.TensorDataset(torch.arange(10.0))

    class OwnRandomSampler(RandomSampler):
        def __iter__(self):
            import random

            random.random()
            return super().__iter__()

    class OwnLoader(DataLoader):
        def __iter__(self):
            return super().__iter__()

    torch_only = [
        DataLoader(data, shuffle=True, batch_size=3),
        DataLoader(data, batch_size=3),
        DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0), batch_size=2),
        DataLoader(data, sampler=BatchSampler(RandomSampler(data), 4, False), batch_size=None),
    ]
    reaching = [
        DataLoader(data, sampler=PythonShuffleSampler(10), batch_size=3),
        DataLoader(data, sampler=OwnRandomSampler(data), batch_size=3),
        DataLoader(data, sampler=BatchSampler(OwnRandomSampler(data), 4, False), batch_size=None),
        DataLoader(data, batch_sampler=BatchSampler(PythonShuffleSampler(10), 4, False)),
        OwnLoader(data, shuffle=True, batch_size=3),
    ]
    assert [draws_only_from_torch(loader) for loader in torch_only] == [True] * len(torch_only)
    assert [draws_only_from_torch(loader) for loader in reaching] == [False] * len(reaching)
    assert set(iterator_rng(torch_only[0])) == {"torch"}
    assert {"python", "torch"} <= set(iterator_rng(reaching[0]))


@given(st.integers(0, 5), st.integers(1, 9), st.integers(1, 9), st.sampled_from([None, 4, 8]), st.integers(0, 99))
def test_a_position_survives_its_dict_and_any_change_is_named(epoch, batches, extra, batch_size, length):
    position = EpochPosition(epoch=epoch, batches=batches, batches_per_epoch=batches + extra - 1,
                             batch_size=batch_size, dataset_length=length, world_size=2)
    assert EpochPosition.from_dict(position.to_dict()) == position
    same = (batch_size, length, batches + extra - 1)
    assert position_mismatch(position, world_size=2, loader=same) is None
    changed = position_mismatch(position, world_size=2, loader=(batch_size, length + 1, batches + extra - 1))
    assert changed == f"dataset length: {length} then, {length + 1} now"


@pytest.mark.parametrize("fields", [{"batches": 0}, {"batches": 5, "batches_per_epoch": 4}, {"epoch": -1},
                                    {"world_size": 0}, {"batch_size": True}])
def test_an_impossible_position_is_refused(fields):
    values = {"epoch": 0, "batches": 1, "batches_per_epoch": 4, "batch_size": 2, "dataset_length": 8,
              "world_size": 1, **fields}
    with pytest.raises(BookkeepingError, match=f"EpochPosition.{next(iter(fields))}"):
        EpochPosition(**values)


# --- the helpers a dataset and a trainer use ----------------------------------------------------------------------


def test_a_sample_index_is_an_int_that_knows_its_epoch():
    index = SampleIndex(3, epoch=4)
    assert index == 3 and hash(index) == hash(3) and type(index + 0) is int
    assert torch.arange(10)[index].item() == 3
    assert pickle.loads(pickle.dumps(index)).epoch == 4
    assert trainkit.sample_seed(0, index) == trainkit.sample_seed(0, 3, epoch=4)
    with pytest.raises(ValueError, match="carries no epoch"):
        trainkit.sample_seed(0, 3)


def test_the_log_buffer_and_running_mean_come_back_as_they_were():
    buffer = LogBuffer()
    buffer.add({"a": torch.tensor(1.5), "b": 2})
    buffer.add_vector(["c", "d"], torch.tensor([0.25, 0.5]))
    state = buffer.state_dict()
    restored = LogBuffer()
    restored.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert list(restored.drain().items()) == list(buffer.drain().items()) == [("a", 1.5), ("b", 2.0), ("c", 0.25),
                                                                              ("d", 0.5)]
    mean = RunningMean()
    mean.add(torch.tensor(1.0))
    copy = RunningMean()
    copy.load_state_dict(mean.state_dict())
    for m in (mean, copy):
        m.add(torch.tensor(4.0))
    assert float(copy.take()) == float(mean.take()) == 2.5


# --- the trainer ----------------------------------------------------------------------------------------------


class CountingTrainer(StepTrainer):
    """Counts the samples its dataset loads; sends itself SIGTERM after batch ``term_at`` of epoch 0."""

    term_at: int | None = None

    def setup(self, ckpt):
        super().setup(ckpt)
        self.loaded = []
        dataset = self.train_set
        original = type(dataset).__getitem__

        class Counting(type(dataset)):
            def __getitem__(inner, index):  # noqa: N805 - the dataset's self; the trainer's is outer
                self.loaded.append(int(index))
                return original(inner, index)

        dataset.__class__ = Counting

    def train_epoch(self):
        self.batches_seen = 0
        original = self.push_logs

        def after_batch():
            self.batches_seen += 1
            if self.epoch == 0 and self.first_batch + self.batches_seen - 1 == self.term_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return original()

        self.push_logs = after_batch
        try:
            super().train_epoch()
        finally:
            del self.push_logs


STEPS = {"epochs": 1, "ckpt": {"every_n_steps": 1}, "push_every": 1, "val": {"minimize": False}}
"""What the step-checkpoint runs here put over make_cfg's defaults: 1 epoch, a checkpoint and a push at every step,
and the engine's default direction (the validation loss maximized)."""


def test_a_resume_skips_the_consumed_batches_without_loading_them(tmp_path):
    """Stopped after batch 4 (a step boundary): the resumed epoch loads only the samples of batches 4..7."""
    CountingTrainer.term_at = 3
    first = CountingTrainer(make_cfg(tmp_path, STEPS), 0, 1)
    with pytest.raises(TrainingInterrupted, match="after step 2, batch 4 of 8 of epoch 0") as stopped:
        first.train()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    consumed = first.loaded[:16]
    first.close()
    CountingTrainer.term_at = None
    second = CountingTrainer(make_cfg(tmp_path, STEPS), 0, 1)
    assert second.first_batch == 4
    second.train()
    second.close()
    assert len(second.loaded) == 30 - 16 and not set(second.loaded) & set(consumed)
    assert sorted(consumed + second.loaded) == list(range(30))  # one epoch: every sample exactly once


def test_a_resume_inside_an_epoch_with_another_batch_size_is_refused_and_loses_nothing(tmp_path):
    CountingTrainer.term_at = 3
    first = CountingTrainer(make_cfg(tmp_path, STEPS), 0, 1)
    with pytest.raises(TrainingInterrupted):
        first.train()
    first.close()
    CountingTrainer.term_at = None
    last = (tmp_path / "last.pt").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the changed config is warned about; the refusal is the point
        second = CountingTrainer(make_cfg(tmp_path, STEPS, batch_size=5), 0, 1)
    with pytest.raises(CheckpointMismatchError, match=r"batch size: 4 then, 5 now; .*batches per epoch: 8 then, 6 now"):
        second.train()
    second.close()
    assert (tmp_path / "last.pt").read_bytes() == last


class ListTrainer(StepTrainer):
    def train_epoch(self):
        data = self.train_set
        for x, _y in self.progress([(data.x[i : i + 4], data.y[i : i + 4]) for i in range(0, len(data), 4)]):
            self.model(x).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def test_a_loop_over_something_trainkit_cannot_skip_into_warns_and_keeps_epoch_checkpoints(tmp_path):
    trainer = ListTrainer(make_cfg(tmp_path, STEPS, epochs=2), 0, 1)
    with pytest.warns(RuntimeWarning, match="needs progress\\(\\) to be given a DataLoader.*got a list") as caught:
        trainer.train()
    trainer.close()
    assert len([w for w in caught if "DataLoader over a map-style" in str(w.message)]) == 1
    assert torch.load(tmp_path / "last.pt", weights_only=True)["trainkit"] is None


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("trainkit",), 3, "trainkit must be None or a dict with 'position'"),
        (("trainkit", "ranks"), [], "trainkit\\['ranks'\\] must be a non-empty list"),
        (("trainkit", "position", "batches"), 99, "trainkit\\['position'\\] must be a EpochPosition dict"),
        (("trainkit", "ranks", 0, "logs", "scalars"), [["a", "1"]], "logs'\\]\\['scalars'\\] must be a list of"),
        (("trainkit", "ranks", 0, "grad_norm"), {"sum": 1.0, "count": 1}, "grad_norm'\\]\\['sum'\\] must be None"),
        (("trainkit", "position", "epoch"), 1, "trainkit\\['position'\\]\\['epoch'\\] must be the epoch in progress"),
    ],
)
def test_a_hostile_step_checkpoint_is_refused_naming_the_key(tmp_path, path, value, message):
    CountingTrainer.term_at = 3
    trainer = CountingTrainer(make_cfg(tmp_path, STEPS, epochs=2), 0, 1)
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    trainer.close()
    CountingTrainer.term_at = None
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    validate_last(payload, path="last.pt", world_size=1)
    target = payload
    for key in path[:-1]:
        target = target[key]
    if path == ("trainkit",):
        payload["trainkit"] = value
    else:
        target[path[-1]] = value
    with pytest.raises(CheckpointCorruptError, match=message):
        validate_last(payload, path="last.pt", world_size=1)


def test_workers_of_a_killed_run_do_not_keep_its_folder_locked(tmp_path):
    """A process holding the lock forks a child (as a DataLoader does) and dies by SIGKILL: the folder is free."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from trainkit.run.lock import RunLock
        lock = RunLock({str(tmp_path)!r}); lock.acquire()
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        print("forked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"forked"
        proc.wait(timeout=30)
        time.sleep(0.1)
        lock = RunLock(tmp_path)
        lock.acquire()  # the forked child still lives, and holds no copy of the lock
        lock.release()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_inspect_says_where_inside_the_epoch_a_checkpoint_stands(tmp_path):
    CountingTrainer.term_at = 3
    trainer = CountingTrainer(make_cfg(tmp_path, STEPS, epochs=2), 0, 1)
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    trainer.close()
    CountingTrainer.term_at = None
    proc = subprocess.run([sys.executable, "-m", "trainkit", "inspect", str(tmp_path / "last.pt")], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "position:     inside epoch 0: 4 of 8 batches done (batch size 4, 30 samples)" in proc.stdout


class TwoPasses(StepTrainer):
    def train_epoch(self):
        batches = self.progress(self.loader)
        for _ in range(2):
            for x, y in batches:
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()


def test_a_second_pass_over_the_same_batches_is_not_counted(tmp_path):
    """The second pass warns, writes no step checkpoint; the epoch's end checkpoint is written as usual."""
    trainer = TwoPasses(make_cfg(tmp_path, STEPS, ckpt={"every_n_steps": 100}), 0, 1)
    with pytest.warns(RuntimeWarning, match="iterated a second time"):
        trainer.train()
    trainer.close()
    assert trainer.step == 16
    assert torch.load(tmp_path / "last.pt", weights_only=True)["trainkit"] is None


# --- which loaders are counted, and what reaches their datasets -------------------------------------------------


class EchoIndices(torch.utils.data.Dataset):
    """Gives back each index it is asked for and the epoch that index carries (-1: none)."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        if isinstance(index, list):  # a whole batch at once: batch_size=None over a BatchSampler
            return torch.tensor(index), torch.tensor([_epoch_of(i) for i in index])
        return torch.tensor(int(index)), torch.tensor(_epoch_of(index))


def _epoch_of(index: int) -> int:
    epoch = sample_epoch(index)
    return -1 if epoch is None else epoch


class ShuffleWithoutLength(torch.utils.data.Sampler):
    """A sampler with no __len__: its DataLoader, and so its epoch, have no length."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class LazyLoader(DataLoader):
    """A DataLoader that makes its iterator only when the first batch is asked for: its __iter__ is a generator."""

    def __iter__(self):
        yield from super().__iter__()


def echo_loader(kind: str) -> DataLoader:
    data = EchoIndices()
    return {
        "batched": lambda: DataLoader(data, batch_size=3, shuffle=True),
        "batched, persistent workers": lambda: DataLoader(
            data, batch_size=3, shuffle=True, num_workers=2, persistent_workers=True
        ),
        "one index at a time": lambda: DataLoader(data, batch_size=None, shuffle=True),
        "one index at a time, workers": lambda: DataLoader(data, batch_size=None, shuffle=True, num_workers=2),
        "a list per batch": lambda: DataLoader(
            data, batch_size=None, sampler=BatchSampler(RandomSampler(data), 3, False)
        ),
        "made lazily": lambda: LazyLoader(data, batch_size=3, shuffle=True),
        "sampler without a length": lambda: DataLoader(data, batch_size=3, sampler=ShuffleWithoutLength(20)),
    }[kind]()


class EchoTrainer(trainkit.BaseTrainer):
    """Records, per epoch, the indices its dataset was given and their epochs; may crash at (epoch, batch)."""

    kind = "batched"
    crash_at: tuple[int, int] | None = None

    def setup(self, ckpt):
        self.model = nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.loader = echo_loader(self.kind)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.seen = []

    def train_epoch(self):
        indices, epochs = [], []
        for batch, (index, epoch) in enumerate(self.progress(self.loader), start=self.first_batch):
            if (self.epoch, batch) == self.crash_at:
                raise Crash
            loss = self.model(index.float().reshape(-1, 1) / 20).square().mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            indices += index.reshape(-1).tolist()
            epochs += epoch.reshape(-1).tolist()
        self.seen.append((indices, epochs))

    def val_epoch(self):
        return False


def echo_run(out_dir, kind, ckpt, crash_at=None):
    EchoTrainer.kind, EchoTrainer.crash_at = kind, crash_at
    # 3 epochs and the engine's default direction (the validation loss maximized)
    trainer = EchoTrainer(make_cfg(out_dir, {"epochs": 3, "val": {"minimize": False}}, ckpt=ckpt), 0, 1)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind",
    [
        "batched",
        "batched, persistent workers",
        "one index at a time",
        "one index at a time, workers",
        "a list per batch",
    ],
)
def test_every_index_carries_its_epoch_and_counting_keeps_the_order(tmp_path, kind):
    """Epoch after epoch (a persistent worker's too), every int index reaching the dataset is known to belong to its
    epoch (sample_epoch), counted loop (step checkpoints) or not, and the order is the one the loader gives
    uncounted; a sampler that yields lists is left alone."""
    plain = echo_run(tmp_path / "plain", kind, {"enable": False}).seen
    counted = echo_run(tmp_path / "counted", kind, {"every_n_steps": 1000}).seen
    tagged = kind != "a list per batch"
    assert len(plain) == len(counted) == 3
    for epoch, ((plain_order, plain_tags), (order, tags)) in enumerate(zip(plain, counted, strict=True)):
        assert order == plain_order and sorted(order) == list(range(20))
        assert plain_tags == tags == [epoch if tagged else -1] * 20


def test_a_loader_that_makes_its_iterator_lazily_is_not_counted_and_resumes_at_the_epoch_start(tmp_path):
    """Such a loader makes its DataLoader iterator after trainkit's index sampler was put back, so no batch could be
    skipped: it warns once (at the loop), writes no step checkpoint, and a crash inside an epoch resumes exactly from
    that epoch's first batch (before, its step checkpoints resumed by training the consumed batches again)."""
    whole = echo_run(tmp_path / "whole", "made lazily", {"enable": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Crash):
            echo_run(tmp_path / "run", "made lazily", {"every_n_steps": 1}, crash_at=(1, 4))
    lazy = [w for w in caught if "makes its DataLoader iterator only when its first batch" in str(w.message)]
    assert len(lazy) == 1 and lazy[0].filename == __file__, [str(w.message) for w in caught]
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["trainkit"] is None  # epoch 1's start
    with pytest.warns(RuntimeWarning, match="cannot skip into it"):
        resumed = echo_run(tmp_path / "run", "made lazily", {"every_n_steps": 1})
    assert resumed.seen == whole.seen[1:]
    weights = zip(resumed.model.state_dict().values(), whole.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)


def test_a_loader_whose_epoch_has_no_length_is_not_counted_and_trains_to_the_end(tmp_path):
    """Its position inside the epoch could not be recorded (batches out of len(loader)): it warns once at the loop and
    keeps epoch checkpoints, where the first due step checkpoint used to stop the run with a bare TypeError."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = echo_run(tmp_path, "sampler without a length", {"every_n_steps": 1})
    said = [w for w in caught if "whose sampler has no length" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    assert [sorted(order) for order, _ in trainer.seen] == [list(range(20))] * 3
    assert torch.load(tmp_path / "last.pt", weights_only=True)["trainkit"] is None
