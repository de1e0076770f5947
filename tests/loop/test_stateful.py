"""A loader that carries its own position (state_dict/load_state_dict): what a step checkpoint saves of it, and what
a resume refuses, by name, before training a batch. The bit-for-bit resumes are in tests/test_step_resume.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import trainers
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShuffledStream, StepTrainer
from trainkit.checkpoint.payload import validate_last
from trainkit.errors import CheckpointCorruptError, CheckpointMismatchError, TrainingInterrupted, UsageError

STREAM = {"epochs": 2, "ckpt": {"every_n_steps": 1}, "loader": "stream"}
"""Two epochs of a ShuffledStream (8 batches, no length), a step checkpoint at every step."""


def stopped_run(tmp_path, config=STREAM):
    """Run until a SIGTERM after batch 2 of epoch 0 stops it at the step boundary after batch 4 (of no length for a
    stream); return last.pt."""
    trainers.SIGTERM_AT = ("batch", 0, 2)
    try:
        trainer = StepTrainer(make_cfg(tmp_path, config), 0, 1)
        with pytest.raises(TrainingInterrupted, match="stopped after step 2, batch 4 (of 8 )?of epoch 0"):
            trainer.train()
        trainer.close()
    finally:
        trainers.SIGTERM_AT = None
    return torch.load(tmp_path / "last.pt", weights_only=True)


def test_each_step_checkpoint_keeps_the_loaders_own_state_and_a_position_of_unknown_length(tmp_path):
    """The rank's share holds the stream's state_dict() at the boundary (4 batches consumed) and its generators;
    the position knows the batches done but not the epoch's length."""
    payload = stopped_run(tmp_path)
    share = payload["trainkit"]["ranks"][0]
    assert share["loader_state"]["position"] == 4 and sorted(share["loader_state"]["order"]) == list(range(30))
    assert share["generators_at_save"] == []
    position = payload["trainkit"]["position"]
    assert (position["batches"], position["batches_per_epoch"], position["dataset_length"]) == (4, None, None)
    assert position["schema_version"] == 2


class RefusingStream(ShuffledStream):
    def load_state_dict(self, state):
        raise KeyError("no such shard: 'part-7'")


class RefusingTrainer(StepTrainer):
    def setup(self, ckpt):
        super().setup(ckpt)
        self.loader = RefusingStream(self.loader.x, self.loader.y, self.cfg.batch_size, rank=self.rank)


def test_a_state_the_loader_refuses_is_a_mismatch_naming_the_loader_and_why_and_loses_nothing(tmp_path):
    stopped_run(tmp_path)
    before = (tmp_path / "last.pt").read_bytes()
    trainer = RefusingTrainer(make_cfg(tmp_path, STREAM), 0, 1)
    message = r"the RefusingStream given to progress\(\) could not load the state it saved there \(KeyError: .*part-7"
    with pytest.raises(CheckpointMismatchError, match=message):
        trainer.train()
    trainer.close()
    assert (tmp_path / "last.pt").read_bytes() == before


class ListTrainer(StepTrainer):
    """Iterates a plain list of the stream's batches: nothing to give the saved state to, nothing to skip into."""

    def train_epoch(self):
        for x, y in self.progress(list(self.loader)):
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def test_a_saved_loader_state_with_a_loader_that_cannot_take_it_is_refused_by_name(tmp_path):
    stopped_run(tmp_path)
    trainer = ListTrainer(make_cfg(tmp_path, STREAM), 0, 1)
    with pytest.raises(CheckpointMismatchError, match="now iterates a list, which has no load_state_dict"):
        trainer.train()
    trainer.close()


def test_an_index_level_position_with_a_loader_that_carries_its_own_is_refused_by_name(tmp_path):
    """Written by a DataLoader that trainkit skips into: a stream given no state would start its epoch over."""
    stopped_run(tmp_path, {**STREAM, "loader": "dataloader"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the changed config is warned about; the refusal is the point
        trainer = StepTrainer(make_cfg(tmp_path, STREAM), 0, 1)
    with pytest.raises(CheckpointMismatchError, match="now iterates a ShuffledStream, which carries its own position"):
        trainer.train()
    trainer.close()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("loader_state", [1, 2], "\\['loader_state'\\] must be a dict of str keys: the loader's own state_dict"),
        ("loader_state", {1: "a"}, "\\['loader_state'\\] must be a dict of str keys"),
        ("generators_at_save", [torch.zeros(3, dtype=torch.uint8)], "\\['generators_at_save'\\]\\[0\\] must be"),
    ],
)
def test_a_hostile_loader_state_is_refused_naming_the_key(tmp_path, key, value, message):
    payload = stopped_run(tmp_path)
    validate_last(payload, path="last.pt", world_size=1)
    payload["trainkit"]["ranks"][0][key] = value
    with pytest.raises(CheckpointCorruptError, match=message):
        validate_last(payload, path="last.pt", world_size=1)


def test_a_loader_state_nested_deeper_than_any_state_dict_is_refused(tmp_path):
    payload = stopped_run(tmp_path)
    deep: dict = {}
    for _ in range(300):
        deep = {"inner": deep}
    payload["trainkit"]["ranks"][0]["loader_state"] = deep
    with pytest.raises(CheckpointCorruptError, match="must be nested at most 256 deep"):
        validate_last(payload, path="last.pt", world_size=1)


def test_a_share_with_the_loader_state_alone_is_refused(tmp_path):
    payload = stopped_run(tmp_path)
    del payload["trainkit"]["ranks"][0]["generators_at_save"]
    with pytest.raises(CheckpointCorruptError, match="'loader_state' and 'generators_at_save'"):
        validate_last(payload, path="last.pt", world_size=1)


class ListStateStream(ShuffledStream):
    def state_dict(self):
        return [self.position]


class ListStateTrainer(StepTrainer):
    def setup(self, ckpt):
        super().setup(ckpt)
        self.loader = ListStateStream(self.loader.x, self.loader.y, self.cfg.batch_size, rank=self.rank)


def test_a_state_dict_that_is_no_dict_is_a_usage_error_at_the_first_step_checkpoint(tmp_path):
    trainer = ListStateTrainer(make_cfg(tmp_path, STREAM), 0, 1)
    with pytest.raises(UsageError, match=r"ListStateStream.state_dict\(\) must return a dict with str keys.*got list"):
        trainer.train()
    trainer.close()


ITERABLE = {**STREAM, "loader": "stateful iterable"}
"""The same run over torchdata's StatefulDataLoader over a ShuffledSamples stream (no state of its own)."""


def test_a_stream_resumed_by_reading_it_again_saves_the_batches_the_loop_consumed(tmp_path):
    """Resumed after 4 batches, torchdata counts the 4 it read again as well; stopped again after 6 batches, the
    saved state counts 6 (not 10), and the live loader's own count is left as torchdata keeps it."""
    pytest.importorskip("torchdata.stateful_dataloader")
    first = stopped_run(tmp_path, ITERABLE)
    assert first["trainkit"]["ranks"][0]["loader_state"]["_num_yielded"] == 4
    trainers.SIGTERM_AT = ("batch", 0, 4)
    try:
        trainer = StepTrainer(make_cfg(tmp_path, ITERABLE), 0, 1)
        with pytest.raises(TrainingInterrupted, match="stopped after step 3, batch 6 of epoch 0"):
            trainer.train()
        live = trainer.loader.state_dict()
        trainer.close()
    finally:
        trainers.SIGTERM_AT = None
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    state = payload["trainkit"]["ranks"][0]["loader_state"]
    assert payload["trainkit"]["position"]["batches"] == 6
    assert (state["_num_yielded"], state["_sampler_iter_yielded"]) == (6, 6)
    assert state["_sampler_iter_state"] == {"samples_yielded": 6 * 4}
    assert live["_num_yielded"] == 10


def test_a_stream_state_counting_other_batches_than_the_position_is_refused_at_resume(tmp_path):
    """A saved state whose count is not the position's (as trainkit wrote it before it wrote the loop's count) would
    skip data: refused by name before a batch is trained, last.pt untouched."""
    pytest.importorskip("torchdata.stateful_dataloader")
    payload = stopped_run(tmp_path, ITERABLE)
    payload["trainkit"]["ranks"][0]["loader_state"]["_num_yielded"] = 6
    torch.save(payload, tmp_path / "last.pt")
    before = (tmp_path / "last.pt").read_bytes()
    trainer = StepTrainer(make_cfg(tmp_path, ITERABLE), 0, 1)
    message = (
        r"after 4 batches, but the StatefulDataLoader given to progress\(\) saved a state that reads its "
        r"IterableDataset ShuffledSamples again for 6 batches .*give the IterableDataset state_dict\(\)"
    )
    with pytest.raises(CheckpointMismatchError, match=message):
        trainer.train()
    trainer.close()
    assert (tmp_path / "last.pt").read_bytes() == before


class Numbers(torch.utils.data.IterableDataset):
    """0..79, dealt round-robin to the workers; no state of its own."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter(range(80) if info is None else range(info.id, 80, info.num_workers))


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 3)], ids=["in-process", "workers", "snapshots-3"])
def test_a_corrected_stream_state_resumes_at_the_consumed_batch_however_often_resumed(workers, every):
    """Three resumes of one epoch, each state saved with the batches consumed so far: the next batch is always the
    uninterrupted pass's (with workers, whatever batch the last snapshot was taken at)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainkit.loop.stateful_batches import naive_count, with_naive_count

    def loader():
        return StatefulDataLoader(Numbers(), batch_size=2, num_workers=workers, snapshot_every_n_steps=every)

    truth = [batch.tolist() for batch in loader()]
    state, consumed = None, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for more in (5, 4, 3):
            current = loader()
            if state is not None:
                current.load_state_dict(state)
            batches = iter(current)
            assert next(batches).tolist() == truth[consumed]
            for _ in range(more - 1):
                next(batches)
            consumed += more
            live = current.state_dict()
            state = with_naive_count(current, live, consumed)
            assert naive_count(current, state) == consumed
            del batches, current
        last = loader()
        last.load_state_dict(state)
        assert next(iter(last)).tolist() == truth[consumed]
