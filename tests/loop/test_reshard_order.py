"""The real DistributedSampler deals as the model behind the resharding properties says, and a loader resumed on
another world size with the decided skip draws exactly the rest of the epoch."""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.sampling import batches_per_epoch, deal
from trainkit.bookkeeping import EpochPosition, decide_resume, distributed_order


def shares(n: int, world: int, *, seed: int = 5, epoch: int = 3, drop_last: bool = False) -> list[list[int]]:
    dataset = list(range(n))
    samplers = [DistributedSampler(dataset, world, rank, seed=seed, drop_last=drop_last) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


def test_the_model_deals_what_the_real_sampler_deals():
    """Same permutation for every world size, padded (or cut) and dealt every W-th: the model is the sampler."""
    for n, world, drop_last in itertools.product((7, 20, 36), range(1, 7), (False, True)):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 3)).tolist()
        assert shares(n, world, drop_last=drop_last) == [deal(order, world, r, drop_last) for r in range(world)]


def test_real_loaders_resumed_on_three_ranks_draw_the_rest_of_a_two_rank_epoch():
    """20 samples, a global batch of 6: two ranks consume 2 batches of 3; three ranks of 2 skip the decided batches
    and draw the 8 samples left once each, plus the head sample that a 3-rank epoch pads with (21 = 20 + 1)."""
    n, order = 20, distributed_order(shuffle=True, seed=5, drop_last=False)
    saved = EpochPosition(
        epoch=3,
        batches=2,
        batches_per_epoch=batches_per_epoch(n, 2, 3),
        batch_size=3,
        dataset_length=n,
        world_size=2,
        samples=12,
        global_batch=6,
        order=order,
    )
    loaders = []
    for rank in range(3):
        sampler = DistributedSampler(list(range(n)), 3, rank, seed=5)
        sampler.set_epoch(3)
        loaders.append(DataLoader(list(range(n)), sampler=sampler, batch_size=2))
    decision = decide_resume(
        saved, world_size=3, batch_size=2, dataset_length=n, batches_per_epoch=len(loaders[0]), order=order
    )
    assert (decision.action, decision.skip_batches, decision.skip_samples) == ("reshard", 2, 4)
    consumed = [i for share in shares(n, 2) for i in share[:6]]
    rest = [
        int(i) for loader in loaders for batch in itertools.islice(loader, decision.skip_batches, None) for i in batch
    ]
    head = shares(n, 1)[0][0]
    assert Counter(consumed) + Counter(rest) == Counter(range(n)) + Counter([head])
    assert not set(consumed) & (set(rest) - {head})
