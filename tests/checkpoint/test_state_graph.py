"""Registered items' and loaders' states that hold a cycle or share one part many times (issue 52, defect 7).

A cycle is refused before anything is written, naming the item and the path; a list shared at every level
(``a = [a, a]`` sixty times: 61 lists, 2**60 paths) is walked once per distinct list by every walk a save makes
(the loadable check, the size, the background copy, the ranks' digest), saved as ``torch.save`` memoizes it, and
read back by the safe loader with its sharing. Each test has a hard timeout: a regression fails, it does not hang.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShuffledStream, StepTrainer, TinyTrainer
from trainkit import CheckpointUnsafeError
from trainkit.checkpoint import check_loadable, payload_nbytes
from trainkit.checkpoint.formats.async_save import StagingBuffers
from trainkit.state.digest import state_digest
from trainkit.state.graph import check_state_graph

pytestmark = pytest.mark.timeout(60)


def shared_list(levels=60):
    """``[a, a]`` nested ``levels`` deep over ``[0]``: levels + 1 lists, 2**levels paths to the 0."""
    shared = [0]
    for _ in range(levels):
        shared = [shared, shared]
    return shared


def cyclic():
    state = {"count": 3}
    state["self"] = state
    return state


class Item:
    """A registered item whose state_dict() is what ``make`` returns; load_state_dict() keeps what it is given."""

    def __init__(self, make):
        self.make, self.loaded = make, None

    def state_dict(self):
        return self.make()

    def load_state_dict(self, state):
        self.loaded = state


class ItemTrainer(TinyTrainer):
    MAKE = staticmethod(cyclic)

    def setup(self, ckpt):
        super().setup(ckpt)
        self.counter = Item(self.MAKE)
        self.add_checkpoint_items(counter=self.counter)


def train(trainer_class, out, **overrides):
    trainer = trainer_class(make_cfg(out, **overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_an_item_state_that_holds_itself_is_refused_naming_the_item_before_anything_is_written(tmp_path, fmt):
    with pytest.raises(
        CheckpointUnsafeError,
        match=r"checkpoint item 'counter' holds a cycle: counter\['self'\] is "
        r"the dict at counter, which contains it",
    ) as caught:
        train(ItemTrainer, tmp_path, epochs=1, ckpt={"format": fmt})
    assert caught.value.location == "counter['self']"
    assert not (tmp_path / "last.pt").exists() and not (tmp_path / "last.ckpt").exists()


class SharedTrainer(ItemTrainer):
    MAKE = staticmethod(lambda: {"levels": shared_list(60)})


@pytest.mark.parametrize(("fmt", "background"), [("file", False), ("file", True), ("sharded", False)])
def test_a_list_shared_many_times_is_saved_at_once_and_resumed_with_its_sharing(tmp_path, fmt, background):
    train(SharedTrainer, tmp_path, epochs=1, ckpt={"format": fmt, "async_save": background})
    resumed = train(SharedTrainer, tmp_path, epochs=2, ckpt={"format": fmt, "async_save": background})
    node, depth = resumed.counter.loaded["levels"], 0
    while node != [0]:
        assert type(node) is list and len(node) == 2 and node[0] is node[1]  # read back shared, not copied out
        node, depth = node[0], depth + 1
    assert depth == 60


def test_an_item_nested_deeper_than_a_resume_reads_is_refused_at_the_save(tmp_path):
    class DeepTrainer(ItemTrainer):
        @staticmethod
        def MAKE():  # noqa: N802 - the class attribute the base reads
            state = []
            for _ in range(300):
                state = [state]
            return {"deep": state}

    with pytest.raises(
        CheckpointUnsafeError,
        match=r"checkpoint item 'counter' nests containers deeper than 256 at "
        r"counter\['deep'\]\[0\]",
    ):
        train(DeepTrainer, tmp_path, epochs=1)
    assert not (tmp_path / "last.pt").exists()


def tensor_back_to_its_state():
    tensor = torch.ones(2)
    state = {"t": tensor}
    tensor.back = state  # a Python attribute of a tensor: torch.save pickles it with the tensor
    return state


def tensor_with_a_deep_attribute():
    tensor, deep = torch.ones(2), []
    for _ in range(100_000):
        deep = [deep]
    tensor.deep = deep
    return {"t": tensor}


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        (tensor_back_to_its_state, r"holds a cycle: counter\['t'\]\.back is the dict at counter"),
        (tensor_with_a_deep_attribute, r"nests containers deeper than 256 at counter\['t'\]\.deep\[0\]"),
    ],
    ids=["cycle", "deep"],
)
def test_a_tensors_python_attributes_are_walked_as_part_of_the_state(tmp_path, make, refusal):
    """A cycle through a tensor's attribute was saved and then refused by every resume (the run lost its
    checkpoints); an attribute nested 10**5 deep was a ``RecursionError`` traceback from torch.save. Both are
    refused before anything is written, naming the path through the attribute."""

    class AttributeTrainer(ItemTrainer):
        MAKE = staticmethod(make)

    with pytest.raises(CheckpointUnsafeError, match=r"checkpoint item 'counter' " + refusal):
        train(AttributeTrainer, tmp_path, epochs=1)
    assert not (tmp_path / "last.pt").exists()


def test_a_tensor_with_plain_attributes_is_still_saved_and_resumed(tmp_path):
    class PlainAttributeTrainer(ItemTrainer):
        @staticmethod
        def MAKE():  # noqa: N802 - the class attribute the base reads
            tensor = torch.ones(2)
            tensor.meta = {"a": [1, 2]}
            return {"t": tensor}

    train(PlainAttributeTrainer, tmp_path, epochs=1)
    resumed = train(PlainAttributeTrainer, tmp_path, epochs=2)
    assert resumed.counter.loaded["t"].meta == {"a": [1, 2]}


class CyclicStream(ShuffledStream):
    def state_dict(self):
        state = super().state_dict()
        state["self"] = state
        return state


class CyclicStreamTrainer(StepTrainer):
    def _loader_with_a_position(self, x, y, options, items):
        return CyclicStream(x, y, self.cfg.batch_size, rank=self.rank)


def test_a_loader_state_that_holds_itself_is_refused_at_the_first_step_checkpoint(tmp_path):
    with pytest.raises(
        CheckpointUnsafeError,
        match=r"the state_dict\(\) of the CyclicStream holds a cycle: "
        r"loader_state\['self'\]",
    ):
        train(CyclicStreamTrainer, tmp_path, epochs=1, loader="stream", ckpt={"every_n_steps": 1})
    assert not (tmp_path / "last.pt").exists()


def test_every_walk_of_a_save_visits_a_shared_container_once():
    """The walks a save makes over the states, on a structure with 2**60 paths: each returns at once."""
    tensor = torch.ones(4)
    shared = [tensor]
    for _ in range(60):
        shared = (shared, shared) if len(shared) % 2 else [shared, shared]
    payload = {"item": {"levels": shared}}
    check_state_graph("item", payload["item"], owner="checkpoint item 'item'", max_depth=256)
    check_loadable(payload)
    assert payload_nbytes(payload) == tensor.untyped_storage().nbytes()
    staged = StagingBuffers().stage(payload)["item"]["levels"]
    assert staged[0] is staged[1] and staged is not shared
    # the ranks' digest: by content, however the parts are shared, and a cycle ends
    assert state_digest(shared_list(60)) != state_digest(shared_list(59))
    part = [1, {"a": (2,)}]
    assert state_digest([part, part]) == state_digest([[1, {"a": (2,)}], [1, {"a": (2,)}]])
    assert len(state_digest(cyclic())) == 32


def test_the_walk_is_bounded_in_containers():
    with pytest.raises(CheckpointUnsafeError, match=r"checkpoint item 'big' holds more than 100 distinct containers"):
        check_state_graph(
            "big", [[i] for i in range(200)], owner="checkpoint item 'big'", max_depth=256, max_containers=100
        )
