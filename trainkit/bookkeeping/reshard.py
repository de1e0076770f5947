"""Whether a mid-epoch position resumes on another number of processes, and where the new ranks start.

Pure: stdlib and attrs only.

A ``DistributedSampler(shuffle=True, seed=s)`` draws the same permutation ``P`` of the ``N`` indices for
``(s, epoch)`` whatever the world size ``W``; it pads ``P`` to a multiple of ``W`` with ``P``'s head and rank ``r``
takes ``P[r::W]``. With a per-rank batch ``b = G / W`` batch position ``j`` of every rank together holds
``P[j*G:(j+1)*G]`` for every ``W`` that divides ``G``, up to the padding in the epoch's last batch. So after ``c``
batch positions, the ``W'`` ranks of a resumed run that each skip their first ``c * G / W'`` samples draw ``P[c*G:]``,
the rest of the epoch, each sample once: the skip is the same number of batches, of the new per-rank batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from trainkit.bookkeeping._records import is_int
from trainkit.bookkeeping.position import EpochPosition, position_mismatch
from trainkit.errors import BookkeepingError

__all__ = [
    "DISTRIBUTED",
    "ResumeDecision",
    "distributed_order",
    "decide_resume",
    "world_change_refusal",
    "resumable_world_sizes",
    "pooled_mean_share",
    "differing_items",
    "differing_items_refusal",
]

DISTRIBUTED = "DistributedSampler"
"""The prefix of an ``EpochPosition.order`` that does not depend on the world size."""

_WHAT_WORKS = (
    "what resumes on another world size is DistributedSampler(dataset, shuffle=..., seed=...) on every world size, "
    "1 included, with a per-rank batch_size of global_batch // world_size"
)


def distributed_order(*, shuffle: bool, seed: int, drop_last: bool) -> str:
    """The order a ``DistributedSampler`` deals, as a position records it: the same on every world size.

    :param shuffle: The sampler's ``shuffle``.
    :param seed: Its ``seed``.
    :param drop_last: Its ``drop_last``.
    :returns: ``"DistributedSampler(shuffle=..., seed=..., drop_last=...)"``.

    >>> distributed_order(shuffle=True, seed=3, drop_last=False)
    'DistributedSampler(shuffle=True, seed=3, drop_last=False)'
    """
    return f"{DISTRIBUTED}(shuffle={bool(shuffle)}, seed={int(seed)}, drop_last={bool(drop_last)})"


@attrs.frozen(kw_only=True)
class ResumeDecision:
    """How a mid-epoch position resumes on this run's ranks.

    :ivar action: ``"same"`` (the same world size: as the checkpoint says, bit for bit), ``"reshard"`` (another world
        size: each rank skips ``skip_samples`` of its share of the epoch's global order) or ``"refuse"``.
    :ivar skip_batches: Batches of this run's loader each rank skips (the saved count, whatever the world size): what
        the epoch tracker's counted loop skips (:class:`~trainkit.loop.epoch_tracker.EpochTracker`).
    :ivar skip_samples: What that skip is in samples of each rank's share, ``skip_batches`` of this run's per-rank
        batch (None when the batch size is unknown): the samples the loop's index-level skip draws past.
    :ivar reason: For ``"refuse"``, what changed and what would work; else None.
    """

    action: str = attrs.field(validator=attrs.validators.in_(("same", "reshard", "refuse")))
    skip_batches: int = 0
    skip_samples: int | None = None
    reason: str | None = None


def _refuse(reason: str) -> ResumeDecision:
    return ResumeDecision(action="refuse", reason=reason)


def world_change_refusal(saved: EpochPosition, world_size: int) -> str | None:
    """Say why ``saved`` cannot resume on ``world_size`` processes, from what a checkpoint alone tells (the loader
    is checked later, by :func:`decide_resume`); None when it may.

    :param saved: The checkpoint's position.
    :param world_size: This run's number of processes.
    :returns: What stands in the way and what would work, or None (the same world size always may).
    :raises BookkeepingError: When ``world_size`` is not an int >= 1.

    >>> p = EpochPosition(epoch=0, batches=2, batches_per_epoch=4, batch_size=3, dataset_length=24, world_size=2,
    ...                   samples=12, global_batch=6, order=distributed_order(shuffle=True, seed=0, drop_last=False))
    >>> world_change_refusal(p, 3) is None, world_change_refusal(p, 2) is None
    (True, True)
    >>> world_change_refusal(p, 4).split("; ")[1]
    'it resumes on 1, 2, 3 or 6 ranks (a per-rank batch of 6, 3, 2 or 1)'
    >>> world_change_refusal(attrs.evolve(p, order="DistributedSamplerWrapper"), 3) is None  # another class's order
    False
    """
    if not is_int(world_size) or world_size < 1:
        raise BookkeepingError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == saved.world_size:
        return None
    if saved.global_batch is None or saved.order is None:
        return (
            f"it was written on {saved.world_size} ranks without its place in the epoch's global order (by a trainkit "
            "before it was recorded, from a loader without a batch_size, or from one that carries its own per-rank "
            "position), so it resumes only on "
            f"{saved.world_size} ranks; resume it there, or from a checkpoint written at an epoch's end"
        )
    if not saved.order.startswith(f"{DISTRIBUTED}("):
        return (
            f"its epoch was ordered by a {saved.order}, whose order depends on the world size (a plain shuffle on one "
            f"process is not what a DistributedSampler deals on several), so it resumes only on {saved.world_size} "
            f"ranks; {_WHAT_WORKS}"
        )
    if saved.global_batch % world_size:
        sizes = resumable_world_sizes(saved)
        return (
            f"the global batch of {saved.global_batch} samples ({saved.batch_size} per rank on {saved.world_size} "
            f"ranks) cannot be split over {world_size} ranks; it resumes on {_either([w for w, _ in sizes])} ranks "
            f"(a per-rank batch of {_either([b for _, b in sizes])})"
        )
    return None


def _either(values: Sequence[int]) -> str:
    words = [str(value) for value in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def decide_resume(
    saved: EpochPosition,
    *,
    world_size: int,
    batch_size: int | None,
    dataset_length: int | None,
    batches_per_epoch: int | None,
    order: str | None,
) -> ResumeDecision:
    """Decide how ``saved`` resumes on this run's ranks and loader: as saved, resharded, or refused.

    Pure. On the same world size nothing changes (:func:`position_mismatch` decides, as before). On another one the
    rest of the epoch is exact only when the global batch, the dataset, the epoch's length and its world-size-free
    order are unchanged: then every rank skips the saved number of batches of its new per-rank batch.

    :param saved: The checkpoint's position.
    :param world_size: This run's number of processes.
    :param batch_size: This run's loader's per-rank ``batch_size``.
    :param dataset_length: ``len(loader.dataset)``.
    :param batches_per_epoch: ``len(loader)``.
    :param order: This run's loader's order, as ``EpochPosition.order`` records it.
    :returns: The decision.

    >>> order = distributed_order(shuffle=True, seed=0, drop_last=False)
    >>> p = EpochPosition(epoch=0, batches=2, batches_per_epoch=4, batch_size=3, dataset_length=24, world_size=2,
    ...                   samples=12, global_batch=6, order=order)
    >>> decide_resume(p, world_size=3, batch_size=2, dataset_length=24, batches_per_epoch=4, order=order)
    ResumeDecision(action='reshard', skip_batches=2, skip_samples=4, reason=None)
    >>> decide_resume(p, world_size=2, batch_size=3, dataset_length=24, batches_per_epoch=4, order=order).action
    'same'
    >>> refused = decide_resume(p, world_size=3, batch_size=3, dataset_length=24, batches_per_epoch=3, order=order)
    >>> refused.action, refused.reason.split(': ')[-1]
    ('refuse', 'set batch_size=2 (global_batch // world_size) to resume it on 3 ranks')
    """
    if world_size == saved.world_size:
        mismatch = position_mismatch(
            saved,
            world_size=world_size,
            loader=(batch_size, dataset_length, batches_per_epoch),  # type: ignore[arg-type]
        )
        if mismatch is not None:
            return _refuse(mismatch)
        samples = None if batch_size is None else saved.batches * batch_size
        return ResumeDecision(action="same", skip_batches=saved.batches, skip_samples=samples)
    refusal = world_change_refusal(saved, world_size)
    if refusal is not None:
        return _refuse(refusal)
    global_batch = saved.global_batch
    assert global_batch is not None  # world_change_refusal refuses a position without one
    needed = global_batch // world_size
    if batch_size != needed:
        now = "none" if batch_size is None else f"{batch_size} on {world_size} ranks, a global batch of "
        now += "" if batch_size is None else str(batch_size * world_size)
        return _refuse(
            f"the per-rank batch_size is {now}; the checkpoint's is {global_batch} ({saved.batch_size} per rank on "
            f"{saved.world_size} ranks): set batch_size={needed} (global_batch // world_size) to resume it on "
            f"{world_size} ranks"
        )
    if order != saved.order:
        return _refuse(
            f"the epoch's order: {saved.order} then, {order or 'unknown'} now; {_WHAT_WORKS}, and the same seed"
        )
    changed = [
        f"{what}: {then} then, {now} now"
        for what, then, now in (
            ("dataset length", saved.dataset_length, dataset_length),
            ("batches per epoch", saved.batches_per_epoch, batches_per_epoch),
        )
        if then != now
    ]
    if changed:
        return _refuse(
            "; ".join(changed) + "; the rest of the epoch continues exactly only with the same data and as many "
            "batches per epoch (a loader's drop_last=True can change them with the world size)"
        )
    return ResumeDecision(action="reshard", skip_batches=saved.batches, skip_samples=saved.batches * needed)


def resumable_world_sizes(saved: EpochPosition) -> list[tuple[int, int]]:
    """The world sizes ``saved`` resumes on, each with the per-rank batch it needs: the divisors of its global batch
    (only its own when its order depends on the world size or is unknown).

    :param saved: The checkpoint's position.
    :returns: ``[(world size, per-rank batch), ...]``, smallest world first.

    >>> order = distributed_order(shuffle=True, seed=0, drop_last=False)
    >>> p = EpochPosition(epoch=0, batches=1, batches_per_epoch=4, batch_size=2, dataset_length=24, world_size=3,
    ...                   samples=6, global_batch=6, order=order)
    >>> resumable_world_sizes(p)
    [(1, 6), (2, 3), (3, 2), (6, 1)]
    >>> resumable_world_sizes(attrs.evolve(p, order="RandomSampler"))
    [(3, 2)]
    """
    global_batch = saved.global_batch
    if global_batch is None or saved.order is None or not saved.order.startswith(f"{DISTRIBUTED}("):
        return [(saved.world_size, saved.batch_size)] if saved.batch_size is not None else []
    return [(world, global_batch // world) for world in range(1, global_batch + 1) if global_batch % world == 0]


def pooled_mean_share(shares: Sequence[tuple[float, int]], *, name: str) -> tuple[float, int]:
    """What each rank of a run on another world size takes of the saved ranks' running means (sum, count): the
    pooled mean, over the count each saved rank held (so a value added later weighs as much as a saved one).

    Identical shares (a mean every rank computed from all-reduced values, a grad norm) come back as they are.

    :param shares: Each saved rank's ``(sum, count)``.
    :param name: The item, for the error.
    :returns: ``(sum, count)`` for every new rank.
    :raises BookkeepingError: When the saved ranks' counts differ (no per-rank share is then exact), naming ``name``.

    >>> pooled_mean_share([(2.0, 2), (6.0, 2)], name="loss_mean")
    (4.0, 2)
    >>> pooled_mean_share([(1.5, 3), (1.5, 3)], name="grad_norm")
    (1.5, 3)
    """
    if not shares:
        raise BookkeepingError(f"{name}: no saved rank's state to pool")
    if all(share == shares[0] for share in shares):
        return shares[0]
    counts = {count for _, count in shares}
    if len(counts) != 1:
        raise BookkeepingError(
            f"{name} differs between the saved ranks with different counts ({sorted(counts)}), so it cannot be "
            "pooled into per-rank shares on another world size; resume on the world size that wrote it"
        )
    (count,) = counts
    return sum(total for total, _ in shares) / len(shares), count


def differing_items(digests: Sequence[Mapping[str, str]]) -> list[str]:
    """The items whose state differs between ranks, from each rank's digests of them (by rank).

    :param digests: Per rank, item name to the digest of its state (every rank names the same items).
    :returns: The names whose digests are not all equal, in rank 0's order.

    >>> differing_items([{"loss_mean": "a", "steps": "b"}, {"loss_mean": "c", "steps": "b"}])
    ['loss_mean']
    >>> differing_items([{"steps": "b"}])
    []
    """
    if not digests:
        return []
    return [name for name, digest in digests[0].items() if any(other.get(name) != digest for other in digests[1:])]


def differing_items_refusal(names: Sequence[str], *, saved_world_size: int, world_size: int) -> str | None:
    """Say why registered items whose state differed between the saved ranks cannot resume on ``world_size`` ranks;
    None when they may (none differed, or the same world size: each rank continues as it did before).

    :param names: The items whose state differed (running means excepted: those pool).
    :param saved_world_size: The world size that wrote the checkpoint.
    :param world_size: This run's.
    :returns: The reason, naming the items and what would work, or None.

    >>> differing_items_refusal(["tally"], saved_world_size=2, world_size=2) is None
    True
    >>> differing_items_refusal(["tally"], saved_world_size=2, world_size=1).split(", which")[0]
    "checkpoint item 'tally' held a different state on each of the 2 ranks that wrote it"
    """
    if not names or world_size == saved_world_size:
        return None
    which = ", ".join(repr(name) for name in names)
    plural = "s" if len(names) > 1 else ""
    onto = f"{world_size} rank{'s' * (world_size > 1)}"
    return (
        f"checkpoint item{plural} {which} held a different state on each of the {saved_world_size} ranks that wrote "
        f"it, which does not map onto {onto} (only a trainkit.RunningMean pools); resume on {saved_world_size} "
        "ranks, or make the item's state the same on every rank (all-reduce a value before adding it, say)"
    )
