"""A pure-Python model of how torch's DistributedSampler deals an epoch over the ranks.

It follows torch/utils/data/distributed.py: one permutation of the N indices for (seed, epoch) whatever the world
size; without drop_last it is padded to a multiple of W with its own head, with drop_last cut to one; rank r takes
every W-th index from r. A loader then cuts each rank's share into batches of b (the last one short).
"""

from __future__ import annotations

import math

RTOL, ATOL = 1e-5, 1e-6
"""The tolerance docs/checkpoints.rst states for float32 weights after a world-size change: measured, the largest
difference on the elastic tests' small model was 1.2e-7 absolute (one unit in the last place at the weights' scale
of ~1), from the float summation order."""


def deal(order: list[int], world: int, rank: int, drop_last: bool = False) -> list[int]:
    """Rank ``rank``'s share of the epoch's ``order``, as DistributedSampler deals it."""
    n = len(order)
    if drop_last and n % world:
        total = (n // world) * world
        padded = order[:total]
    else:
        total = math.ceil(n / world) * world
        padded = order + (order * math.ceil((total - n) / n))[: total - n]
    return padded[rank:total:world]


def batches_per_epoch(n: int, world: int, batch: int, drop_last: bool = False) -> int:
    return math.ceil(len(deal(list(range(n)), world, 0, drop_last)) / batch)
