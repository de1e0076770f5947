"""decide_resume on another world size, against a pure-Python model of DistributedSampler's dealing
(tests/helpers/sampling.py; tests/loop/test_reshard_order.py holds it to the real sampler)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.helpers.sampling import batches_per_epoch, deal
from trainkit.bookkeeping import (
    EpochPosition,
    decide_resume,
    distributed_order,
    pooled_mean_share,
    resumable_world_sizes,
)
from trainkit.errors import BookkeepingError

ORDER = distributed_order(shuffle=True, seed=0, drop_last=False)


def batch_position(order: list[int], world: int, batch: int, position: int) -> list[int]:
    """Batch ``position`` of every rank together, sorted."""
    return sorted(i for r in range(world) for i in deal(order, world, r)[position * batch : (position + 1) * batch])


@st.composite
def resumes(draw):
    """A global batch, two world sizes that divide it, a shuffled epoch, and a position inside it."""
    global_batch = draw(st.integers(1, 24))
    divisors = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
    world, new_world = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors))
    order = draw(st.permutations(range(draw(st.integers(1, 120)))))
    per_epoch = batches_per_epoch(len(order), world, global_batch // world)
    assume(per_epoch >= 2)
    consumed = draw(st.integers(1, per_epoch - 1))
    return list(order), global_batch, world, new_world, consumed


def saved_position(n: int, global_batch: int, world: int, consumed: int, order: str = ORDER) -> EpochPosition:
    batch = global_batch // world
    return EpochPosition(
        epoch=0,
        batches=consumed,
        batches_per_epoch=batches_per_epoch(n, world, batch),
        batch_size=batch,
        dataset_length=n,
        world_size=world,
        samples=consumed * global_batch,
        global_batch=global_batch,
        order=order,
    )


@given(resumes())
def test_the_decided_skip_deals_every_unconsumed_sample_once_and_no_consumed_one(case):
    """For any N, global batch G, W and W' dividing G and position c: W' ranks that skip the decided samples draw the
    rest of the epoch's order exactly once, plus only the head repeats W''s own padding adds (as any epoch on W'
    does); every later batch position but the epoch's last holds the samples the uninterrupted run's does."""
    order, global_batch, world, new_world, consumed = case
    n, new_batch = len(order), global_batch // new_world
    saved = saved_position(n, global_batch, world, consumed)
    per_epoch = batches_per_epoch(n, new_world, new_batch)
    assert per_epoch == saved.batches_per_epoch  # ceil(N / G) batch positions on every W that divides G
    decision = decide_resume(
        saved, world_size=new_world, batch_size=new_batch, dataset_length=n, batches_per_epoch=per_epoch, order=ORDER
    )
    assert decision.action == ("same" if new_world == world else "reshard")
    assert decision.skip_batches == consumed and decision.skip_samples == consumed * new_batch
    before = [i for r in range(world) for i in deal(order, world, r)[: consumed * (global_batch // world)]]
    after = [i for r in range(new_world) for i in deal(order, new_world, r)[decision.skip_samples :]]
    assert sorted(before) == sorted(order[: consumed * global_batch])
    padding = math.ceil(n / new_world) * new_world - n
    assert Counter(after) == Counter(order[consumed * global_batch :]) + Counter((order * (padding // n + 1))[:padding])
    for position in range(consumed, per_epoch - 1):
        expected = batch_position(order, world, global_batch // world, position)
        assert batch_position(order, new_world, new_batch, position) == expected


@given(resumes(), st.integers(1, 30))
def test_a_world_size_that_does_not_divide_the_global_batch_or_another_per_rank_batch_is_refused(case, other):
    """W' not dividing G is refused naming the world sizes that work; a per-rank batch other than G // W' is refused
    naming the one to set; the order of a plain sampler is refused on any other world size."""
    order, global_batch, world, _, consumed = case
    n = len(order)
    saved = saved_position(n, global_batch, world, consumed)
    facts = {"dataset_length": n, "batches_per_epoch": saved.batches_per_epoch, "order": ORDER}
    if global_batch % other:
        decision = decide_resume(saved, world_size=other, batch_size=1, **facts)
        assert decision.action == "refuse" and f"cannot be split over {other} ranks" in decision.reason
        sizes = [w for w, _ in resumable_world_sizes(saved)]
        assert sizes == [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        return
    wrong = global_batch // other + 1
    decision = decide_resume(saved, world_size=other, batch_size=wrong, **facts)
    assert decision.action == "refuse"
    assert f"set batch_size={global_batch // other}" in decision.reason or other == world
    if other != world:
        plain = saved_position(n, global_batch, world, consumed, order="RandomSampler")
        refused = decide_resume(plain, world_size=other, batch_size=global_batch // other, **facts)
        assert refused.action == "refuse" and "depends on the world size" in refused.reason


@given(resumes())
def test_with_drop_last_a_resharded_epoch_never_repeats_a_sample(case):
    """A DistributedSampler with drop_last cuts a tail that depends on W: when the epoch keeps its length, the rest
    is still drawn at most once, and no consumed sample again; when it does not, the resume is refused."""
    order, global_batch, world, new_world, consumed = case
    n = len(order)
    drop = distributed_order(shuffle=True, seed=0, drop_last=True)
    batch, new_batch = global_batch // world, global_batch // new_world
    per_epoch = batches_per_epoch(n, world, batch, drop_last=True)
    assume(per_epoch > consumed)
    saved = EpochPosition(
        epoch=0,
        batches=consumed,
        batches_per_epoch=per_epoch,
        batch_size=batch,
        dataset_length=n,
        world_size=world,
        samples=consumed * global_batch,
        global_batch=global_batch,
        order=drop,
    )
    new_per_epoch = batches_per_epoch(n, new_world, new_batch, drop_last=True)
    decision = decide_resume(
        saved,
        world_size=new_world,
        batch_size=new_batch,
        dataset_length=n,
        batches_per_epoch=new_per_epoch,
        order=drop,
    )
    if new_per_epoch != per_epoch:
        assert decision.action == "refuse" and "batches per epoch" in decision.reason
        return
    before = {i for r in range(world) for i in deal(order, world, r, True)[: consumed * batch]}
    after = [i for r in range(new_world) for i in deal(order, new_world, r, True)[decision.skip_samples :]]
    assert len(after) == len(set(after)) and not before & set(after)


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=6), st.integers(1, 50), st.integers(0, 3))
def test_running_means_pool_into_shares_that_weigh_every_value_alike(sums, count, extra):
    """Saved ranks' (sum, count) with one count pool into the mean of all their values over that count (a value added
    later weighs as much as a saved one); identical shares stay as they are; unequal counts are refused by name."""
    shares = [(float(total), count) for total in sums]
    pooled, pooled_count = pooled_mean_share(shares, name="loss_mean")
    assert pooled_count == count and pooled / pooled_count == pytest.approx(sum(sums) / (count * len(sums)))
    assert pooled_mean_share([shares[0]] * len(shares), name="loss_mean") == shares[0]
    if extra:
        uneven = [*shares, (float(sums[0]) + 1.0, count + extra)]
        with pytest.raises(BookkeepingError, match="loss_mean differs between the saved ranks with different counts"):
            pooled_mean_share(uneven, name="loss_mean")


def test_a_position_written_before_the_global_order_was_recorded_resumes_only_on_its_own_world_size():
    """A version-1 position (no samples, global batch or order) loads as before: the same world size resumes it as
    it did; another is refused, saying why and what works; inspect's list of world sizes holds its own only."""
    old = {
        "kind": "EpochPosition",
        "schema_version": 1,
        "epoch": 0,
        "batches": 2,
        "batches_per_epoch": 6,
        "batch_size": 3,
        "dataset_length": 36,
        "world_size": 2,
    }
    position = EpochPosition.from_dict(old)
    assert (position.samples, position.global_batch, position.order) == (None, None, None)
    assert position.to_dict() == old  # written back as an older trainkit reads it
    facts = {"dataset_length": 36, "batches_per_epoch": 6, "order": ORDER}
    assert decide_resume(position, world_size=2, batch_size=3, **facts).action == "same"
    refused = decide_resume(position, world_size=1, batch_size=6, **facts)
    assert refused.action == "refuse"
    assert "without its place in the epoch's global order" in refused.reason
    assert "resumes only on 2 ranks; resume it there, or from a checkpoint written at an epoch's end" in refused.reason
    assert resumable_world_sizes(position) == [(2, 3)]
