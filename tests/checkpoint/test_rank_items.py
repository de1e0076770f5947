"""What a checkpoint keeps of registered items whose state differed between ranks, and what each rank resumes with."""

from __future__ import annotations

import pytest
import torch

from trainkit.checkpoint.payload import item_states_for_rank, rank_items_state, resume_refusal
from trainkit.state.digest import state_digest


def mean(total: float | None, count: int) -> dict:
    return {"sum": None if total is None else torch.tensor(total), "count": count}


def saved(means: dict, differ: list[str], world_size: int = 2) -> dict:
    return {"world_size": world_size, "trainkit": None, "rank_items": {"means": means, "differ": differ}}


def test_a_running_mean_comes_back_as_each_ranks_own_on_its_world_and_pooled_on_another():
    """The same world size: rank r gets rank r's (sum, count), exactly; another: every rank gets the mean of the sums
    over the shared count, in the saved dtype, so the ranks' means average to the saved ranks' average."""
    ckpt = saved({"loss_mean": [mean(1.0, 2), mean(4.0, 2)]}, [])
    for rank, total in enumerate((1.0, 4.0)):
        state = item_states_for_rank(ckpt, rank=rank, world_size=2)["loss_mean"]
        assert state["count"] == 2 and torch.equal(state["sum"], torch.tensor(total))
    assert resume_refusal(ckpt, 3) is None
    for rank in range(3):
        state = item_states_for_rank(ckpt, rank=rank, world_size=3)["loss_mean"]
        assert state["count"] == 2 and state["sum"].dtype == torch.float32 and state["sum"].item() == 2.5
    assert item_states_for_rank(saved({}, []), rank=0, world_size=1) == {}


def test_what_cannot_be_pooled_is_refused_on_another_world_size_naming_the_item():
    """Running means with different counts, or another item that differed: refused by name on a world change, and
    resumed on the world size that wrote them."""
    uneven = saved({"loss_mean": [mean(1.0, 1), mean(4.0, 2)]}, [])
    assert "checkpoint item 'loss_mean' differs between the saved ranks with different counts ([1, 2])" in (
        resume_refusal(uneven, 1) or ""
    )
    tally = saved({}, ["tally"])
    assert "checkpoint item 'tally' held a different state on each of the 2 ranks" in (resume_refusal(tally, 1) or "")
    assert resume_refusal(uneven, 2) is None and resume_refusal(tally, 2) is None


def test_only_what_differed_is_kept_per_rank():
    """Nothing differed: no entry; a running mean that differed: every rank's state; anything else: its name."""
    assert rank_items_state([{"m": mean(None, 0)}] * 2, []) is None
    kept = rank_items_state([{"m": mean(1.0, 1)}, {"m": mean(2.0, 1)}], ["m", "tally"])
    assert kept is not None and kept["differ"] == ["tally"] and list(kept["means"]) == ["m"]
    assert [(state["sum"].item(), state["count"]) for state in kept["means"]["m"]] == [(1.0, 1), (2.0, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_digest_tells_states_apart_by_value_not_by_object(dtype):
    """Equal states digest alike wherever their tensors live; a changed value, dtype or shape digests otherwise."""
    value = torch.arange(6, dtype=dtype)
    assert state_digest({"v": value, "n": [1, "a"]}) == state_digest({"n": [1, "a"], "v": value.clone()})
    assert state_digest({"v": value}) != state_digest({"v": value.reshape(2, 3)})
    assert state_digest({"v": value}) != state_digest({"v": value.double()})
    changed = value.clone()
    changed[0] = 1
    assert state_digest({"v": value}) != state_digest({"v": changed})


_DIGEST_IN_A_FRESH_PROCESS = """
import threading
from trainkit.state.digest import state_digest
print(state_digest({"seen": {"alpha", "beta", "gamma", "delta", "epsilon"}, "lock": threading.Lock()}))
"""


def test_equal_states_digest_alike_in_processes_that_hash_strings_differently():
    """Ranks are separate processes: a set of strings (whose pickle follows the process's string hashing) and an
    unpicklable object (whose repr names its address) must not make equal states look different."""
    import os
    import subprocess
    import sys

    digests = {
        subprocess.run(
            [sys.executable, "-c", _DIGEST_IN_A_FRESH_PROCESS],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
        for seed in (1, 2, 3)
    }
    assert len(digests) == 1, digests
