"""Where a run stands inside an epoch: the position a step checkpoint records, and whether it resumes here.

Pure: stdlib and attrs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trainkit.bookkeeping._records import is_int, record_from_dict, record_to_dict
from trainkit.errors import BookkeepingError

__all__ = ["EpochPosition", "position_mismatch"]


def _count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise BookkeepingError(f"EpochPosition.{attribute.name} must be an int >= 0, got {value!r}")


def _optional_count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _count(instance, attribute, value)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise BookkeepingError(f"EpochPosition.{attribute.name} must be an int >= 1, got {value!r}")


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise BookkeepingError(f"EpochPosition.{attribute.name} must be None (unknown) or an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class EpochPosition:
    """How far into an epoch a step checkpoint was written, and what the epoch's batches were made of.

    A resumed run skips ``batches`` batches of epoch ``epoch`` at the index level, or hands a loader that carries its
    own position the state it saved; the other fields are what must not have changed for the rest of the epoch to be
    the same samples. A loader without a length (a stream) leaves ``batches_per_epoch`` and ``dataset_length``
    unknown: None.

    :ivar epoch: The 0-based epoch in progress.
    :ivar batches: Batches of it already consumed (trained on), at least 1 and at most ``batches_per_epoch``.
    :ivar batches_per_epoch: ``len(loader)`` on each rank, or None when the loader has no length.
    :ivar batch_size: The loader's ``batch_size`` (None for a loader built from a ``batch_sampler``, or without one).
    :ivar dataset_length: ``len(loader.dataset)``, or None when there is none with a length.
    :ivar world_size: The number of processes.
    :ivar samples: The samples of the epoch's global order consumed, ``batches * global_batch`` (None: unknown, as in
        a checkpoint written before it was recorded, or for a loader without a ``batch_size``).
    :ivar global_batch: The samples one batch position holds across the ranks, ``batch_size * world_size``.
    :ivar order: What decides the epoch's global order when it does not depend on the world size (a
        ``DistributedSampler``'s shuffle, seed and drop_last: :func:`~trainkit.bookkeeping.distributed_order`), else
        the sampler's class name; None when unknown. Only a world-size-free order resumes on another world size.

    >>> EpochPosition(epoch=2, batches=5, batches_per_epoch=10, batch_size=16, dataset_length=320, world_size=2,
    ...               samples=160, global_batch=32, order="DistributedSampler(shuffle=True, seed=0, drop_last=False)")
    ... # doctest: +ELLIPSIS
    EpochPosition(epoch=2, batches=5, batches_per_epoch=10, batch_size=16, dataset_length=320, world_size=2, ...)
    >>> EpochPosition(epoch=0, batches=7, batches_per_epoch=None, batch_size=8, dataset_length=None, world_size=1).done
    '7 batches'
    >>> EpochPosition(epoch=0, batches=11, batches_per_epoch=10, batch_size=None, dataset_length=1, world_size=1)
    Traceback (most recent call last):
    ...
    trainkit.errors.BookkeepingError: EpochPosition.batches must be at most batches_per_epoch=10, got 11
    """

    epoch: int = attrs.field(validator=_count)
    batches: int = attrs.field(validator=_positive)
    batches_per_epoch: int | None = attrs.field(validator=_optional_positive)
    batch_size: int | None = attrs.field(validator=_optional_count)
    dataset_length: int | None = attrs.field(validator=_optional_count)
    world_size: int = attrs.field(validator=_positive)
    samples: int | None = attrs.field(default=None, validator=_optional_count)
    global_batch: int | None = attrs.field(default=None, validator=_optional_positive)
    order: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )

    def __attrs_post_init__(self) -> None:
        if self.batches_per_epoch is not None and self.batches > self.batches_per_epoch:
            raise BookkeepingError(
                f"EpochPosition.batches must be at most batches_per_epoch={self.batches_per_epoch}, got {self.batches}"
            )
        if (
            self.global_batch is not None
            and self.samples is not None
            and self.samples != self.batches * self.global_batch
        ):
            raise BookkeepingError(
                f"EpochPosition.samples must be batches * global_batch = {self.batches * self.global_batch}, "
                f"got {self.samples}"
            )

    @property
    def done(self) -> str:
        """The batches done, as messages say it: ``"5 of 10 batches"``, or ``"5 batches"`` when the length is unknown.

        >>> EpochPosition(epoch=0, batches=5, batches_per_epoch=None, batch_size=8, dataset_length=None,
        ...               world_size=1).done
        '5 batches'
        """
        of = "" if self.batches_per_epoch is None else f" of {self.batches_per_epoch}"
        return f"{self.batches}{of} batches"

    def to_dict(self) -> dict[str, Any]:
        """Return the record as plain JSON-able values with a schema version.

        Version 1 when every length is known (what a trainkit before unknown lengths reads), else 2; 3 when it
        records its place in the global order (``samples``, ``global_batch``, ``order``).

        >>> p = EpochPosition(epoch=0, batches=1, batches_per_epoch=2, batch_size=8, dataset_length=16, world_size=1)
        >>> EpochPosition.from_dict(p.to_dict()) == p, p.to_dict()["schema_version"]
        (True, 1)
        >>> stream = attrs.evolve(p, batches_per_epoch=None, dataset_length=None)
        >>> EpochPosition.from_dict(stream.to_dict()) == stream, stream.to_dict()["schema_version"]
        (True, 2)
        """
        if (self.samples, self.global_batch, self.order) != (None, None, None):
            return record_to_dict(self, version=3)
        unknown = self.batches_per_epoch is None or self.dataset_length is None
        data = record_to_dict(self, version=2 if unknown else 1)
        for name in ("samples", "global_batch", "order"):  # absent, as an older trainkit wrote it and reads it
            del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochPosition:
        """Rebuild a record written by :meth:`to_dict`.

        :param data: The dict.
        :returns: The record.
        :raises BookkeepingError: On a foreign kind, a newer schema or an invalid field.
        """
        return record_from_dict(cls, data)


def position_mismatch(
    saved: EpochPosition, *, world_size: int, loader: tuple[int | None, int, int] | None = None
) -> str | None:
    """Say why a mid-epoch position cannot be resumed here, or None when it can.

    Pure. Skipping ``saved.batches`` batches lands on the samples the interrupted run had not seen only when
    the world size, the batch size, the dataset's length and the epoch's length are unchanged. The world size
    is known at construction, the loader only once it is seen: without ``loader`` only the world size is
    compared.

    :param saved: The checkpoint's position.
    :param world_size: This run's number of processes.
    :param loader: This run's loader's ``(batch_size, len(dataset), len(loader))``, None where it has none.
    :returns: ``"<what>: <saved> then, <now> now"`` for each difference, joined by ``"; "``; None when none.

    >>> p = EpochPosition(epoch=1, batches=3, batches_per_epoch=10, batch_size=32, dataset_length=320, world_size=2)
    >>> position_mismatch(p, world_size=2, loader=(32, 320, 10)) is None
    True
    >>> position_mismatch(p, world_size=4, loader=(16, 320, 20))
    'world size: 2 then, 4 now; batch size: 32 then, 16 now; batches per epoch: 10 then, 20 now'
    """
    checks = [("world size", saved.world_size, world_size)]
    if loader is not None:
        batch_size, dataset_length, batches_per_epoch = loader
        checks += [
            ("batch size", saved.batch_size, batch_size),
            ("dataset length", saved.dataset_length, dataset_length),
            ("batches per epoch", saved.batches_per_epoch, batches_per_epoch),
        ]
    parts = [f"{what}: {then} then, {now} now" for what, then, now in checks if then != now]
    return "; ".join(parts) or None
