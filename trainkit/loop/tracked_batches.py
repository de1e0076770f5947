"""The epoch's batches as ``self.progress(loader)`` hands them out: counted, and skippable at the index level.

A step checkpoint records how many batches of the epoch were consumed. A resumed run recreates the
loader's iterator exactly as the interrupted run did (same global and loader RNG states at creation, so the
same permutation and worker base seed), advances the loader's *index sampler* past the consumed batches
(indices only: no sample is loaded or collated) before any index reaches a worker, and only then puts back
the RNG states of the save point. The cost of skipping is drawing the epoch's indices, not reading its data.

Every batch of indices handed to a loader's fetcher says its epoch while the fetcher loads it
(:data:`trainkit.state.rng.LOADING`, a per-thread value :func:`trainkit.sample_generator` reads, set as the
batch is iterated and cleared as it is freed; no per-index object): the counted loop's batches do, and so do
those of a loop that is not counted (:func:`epoch_tagged`), so per-sample randomness is the same with step
checkpoints on or off, with or without workers.

Side effects: swaps a ``DataLoader``'s index sampler for the moment its iterator is created, sets the
process's RNG states when resuming, and sets the loading epoch of the thread that iterates a batch's indices.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from trainkit import torch_private
from trainkit.errors import CheckpointMismatchError
from trainkit.messages import warn_user
from trainkit.state.rng import LOADING, capture_rng, loader_generators, restore_rng

__all__ = [
    "SampleIndex",
    "TrackedBatches",
    "WatchedBatches",
    "epoch_tagged",
    "unskippable_reason",
    "RankPosition",
    "draws_only_from_torch",
    "iterator_rng",
    "rng_for_checkpoint",
]

_END = object()


class SampleIndex(int):
    """A sample index that also says which epoch asked for it: ``index.epoch``.

    An unbatched ``DataLoader`` (``batch_size=None``) iterated through ``self.progress()`` in ``train_epoch()``
    hands its dataset these instead of plain ints (a batched one hands plain ints, its batch saying the epoch while
    they are loaded). They are ints in every other respect (arithmetic gives plain ints), so datasets index with
    them as before; :func:`trainkit.sample_generator` reads the epoch from them, which is how a dataset in a worker
    process, even a persistent one, knows the epoch.

    >>> index = SampleIndex(7, epoch=2)
    >>> index + 1, index.epoch, [10, 20, 30, 40, 50, 60, 70, 80][index], isinstance(index, SampleIndex)
    (8, 2, 80, True)
    >>> import pickle; pickle.loads(pickle.dumps(index)).epoch
    2

    :param value: The index.
    :param epoch: The 0-based epoch.
    """

    __slots__ = ()
    epoch: int

    def __new__(cls, value: int, epoch: int) -> SampleIndex:
        return int.__new__(_index_type(epoch), value)

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return SampleIndex, (int(self), self.epoch)


_INDEX_TYPES: dict[int, type[SampleIndex]] = {}


def _index_type(epoch: int) -> type[SampleIndex]:
    """The subclass of :class:`SampleIndex` whose instances belong to ``epoch`` (made once per epoch).

    The epoch is a class attribute, so making an index costs what making an int does (no ``__dict__``, no
    Python-level ``__new__``), about 0.3-0.5 us; a batched loader's indices are not made into these at all (see
    :class:`_EpochBatch`).
    """
    made = _INDEX_TYPES.get(epoch)
    if made is None:
        namespace = {"__slots__": (), "epoch": epoch, "__new__": int.__new__, "__module__": __name__}
        made = _INDEX_TYPES[epoch] = type("SampleIndex", (SampleIndex,), namespace)
        made.__qualname__ = "SampleIndex"
    return made


class _EpochBatch(list):
    """A batch of indices that says its epoch (:data:`~trainkit.state.rng.LOADING`) from the moment it is iterated,
    as the fetcher iterates it to call ``__getitem__`` once per index, to the moment it is freed, right after the
    fetch; it yields its indices as they are.

    It costs two Python calls per batch where the batch is read (in the worker process, with workers), nothing per
    index. Tagging every index instead (a :class:`SampleIndex` each) cost ~2 us per index, half of it making the
    index and half in ``tensor[index]`` with an int subclass; clearing the epoch where the iteration ends (an
    ``itertools.chain`` behind the list) ~20 ns per index. The batch pickles as its plain ints and the epoch.
    """

    __slots__ = ()
    epoch: int

    def __iter__(self) -> Iterator[Any]:
        LOADING.epoch = self.epoch
        return list.__iter__(self)

    def __del__(self, loading: Any = LOADING) -> None:
        # cleared once the fetch dropped the batch (CPython frees it then): a loader iterated later outside
        # progress() (by a persistent worker, say) is not taken for this epoch (a default argument: at interpreter
        # exit the module's globals may be gone)
        loading.epoch = None

    def __reduce__(self) -> tuple[Any, tuple[list[int], int]]:
        return _epoch_batch, (list.__getitem__(self, slice(None)), self.epoch)


_BATCH_TYPES: dict[int, type[_EpochBatch]] = {}


def _batch_type(epoch: int) -> type[_EpochBatch]:
    """The subclass of :class:`_EpochBatch` whose instances belong to ``epoch`` (made once per epoch): making a
    batch is then a call of a type, all in C."""
    made = _BATCH_TYPES.get(epoch)
    if made is None:
        made = _BATCH_TYPES[epoch] = type("_EpochBatch", (_EpochBatch,), {"__slots__": (), "epoch": epoch})
    return made


def _epoch_batch(indices: list[int], epoch: int) -> _EpochBatch:
    return _batch_type(epoch)(indices)


_TORCH_ONLY_SAMPLERS = (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
"""Torch's own samplers: they draw from torch's global generator or their own, never from ``random`` or numpy."""


def draws_only_from_torch(loader: Any) -> bool:
    """Tell whether creating ``loader``'s iterator and drawing its indices can only use torch's generators.

    True when every sampler in its chain is exactly one of torch's own (``RandomSampler``, ``BatchSampler``,
    ``DistributedSampler``, ...) and the loader makes its iterator as ``DataLoader`` does: those samplers
    shuffle with torch's global generator or their own, and the loader seeds its workers from torch's. A
    subclass, or a sampler of the user's own, may call ``random`` or numpy.

    :param loader: A loader :func:`unskippable_reason` accepts.
    :returns: Whether Python's and numpy's generators are out of the iterator's reach.
    """
    kind = type(loader)
    if not torch_private.makes_iterator_as_dataloader(kind):
        return False  # a loader class that makes its own iterator may draw from anything
    known = _TORCH_ONLY_SAMPLERS
    sampler = loader.batch_sampler if torch_private.loader_uses_batch_sampler(loader) else loader.sampler
    while sampler is not None:
        if type(sampler) not in known:
            return False
        sampler = getattr(sampler, "sampler", None)  # what a BatchSampler wraps
    return True


def iterator_rng(loader: Any) -> dict[str, Any]:
    """The RNG states a resume must put back before recreating ``loader``'s iterator.

    :func:`~trainkit.state.rng.capture_rng` costs 50-170 us (numpy's state alone is ~40 us), once per epoch; when the
    iterator can only draw from torch (:func:`draws_only_from_torch`), torch's state is all it needs, and the
    other generators are set to their save-point states right after the iterator is made anyway. Torch's state
    is then the tensor ``torch.get_rng_state()`` returns (a copy): turning it into the ``bytes`` a checkpoint
    keeps costs more than taking it, inside a training loop, and is left to :func:`rng_for_checkpoint`.

    :param loader: A loader :func:`unskippable_reason` accepts.
    :returns: ``{"torch": ...}``, or everything :func:`~trainkit.state.rng.capture_rng` takes.
    """
    if draws_only_from_torch(loader):
        return {"torch": torch.get_rng_state()}
    return capture_rng()


def rng_for_checkpoint(states: dict[str, Any]) -> dict[str, Any]:
    """RNG states from :func:`iterator_rng` in the form :func:`~trainkit.state.rng.capture_rng` gives them.

    :param states: What :func:`iterator_rng` returned.
    :returns: The same states, torch's as ``bytes``.
    """
    cpu = states["torch"]
    if isinstance(cpu, torch.Tensor):
        return {**states, "torch": cpu.numpy().tobytes()}
    return states


class RankPosition:
    """What one rank must put back to resume inside an epoch (saved per rank in a step checkpoint).

    :param rng_at_iter: The RNG states (:func:`iterator_rng`) when the loader's iterator was created.
    :param generators_at_iter: The states of the loader's own generators then, in ``loader_generators`` order; None
        on another world size (no saved rank's states map onto this one: the generators keep this run's states).
    :param rng_at_save: The RNG states at the save point.
    :param loader_state: What a loader that carries its own position returned from ``state_dict()`` at the save
        point (read back from the checkpoint, unchecked but for its nesting); None for an index-level position.
    :param generators_at_save: The states of such a loader's own generators at the save point.
    """

    def __init__(
        self,
        rng_at_iter: dict[str, Any],
        generators_at_iter: list[torch.Tensor] | None,
        rng_at_save: dict[str, Any],
        loader_state: dict[str, Any] | None = None,
        generators_at_save: list[torch.Tensor] | None = None,
    ) -> None:
        self.rng_at_iter = rng_at_iter
        self.generators_at_iter = generators_at_iter
        self.rng_at_save = rng_at_save
        self.loader_state = loader_state
        self.generators_at_save = generators_at_save or []


def unskippable_reason(loader: Any) -> str | None:
    """Say why trainkit cannot resume inside an epoch of ``loader``, or None when it can.

    It can for a ``DataLoader`` over a map-style dataset whose epoch has a length: a position inside the epoch
    is a number of batches out of ``len(loader)``, and the skip draws the sampler's indices.

    >>> unskippable_reason([1, 2, 3])
    'a list, not a DataLoader'

    :param loader: What ``self.progress()`` was given.
    :returns: None, or what the loader is, as in "got <reason>".
    """
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return f"a {type(loader).__name__} over an IterableDataset"
    try:
        len(loader.dataset)
    except TypeError:
        return f"a {type(loader).__name__} whose dataset has no length"
    try:
        len(loader)
    except TypeError:
        return f"a {type(loader).__name__} whose sampler has no length, so its epoch has none"
    return None


class _SkippingIndices:
    """A loader's index sampler, iterated from batch ``skip`` on, every int index tagged with ``epoch``, the
    batch positions in ``drop`` left out (their indices drawn, never loaded)."""

    def __init__(
        self,
        inner: Any,
        *,
        skip: int,
        epoch: int,
        batched: bool,
        drop: frozenset[int] = frozenset(),
        on_drop: Callable[[int, Any], None] | None = None,
    ) -> None:
        self.inner = inner
        self.skip = skip
        self.epoch = epoch
        self.batched = batched
        self.drop = drop
        self.on_drop = on_drop
        self.stream: _IndexStream | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> _IndexStream:
        self.stream = _IndexStream(
            iter(self.inner),
            skip=self.skip,
            epoch=self.epoch,
            batched=self.batched,
            drop=self.drop,
            on_drop=self.on_drop,
        )
        return self.stream


def _dropping(
    inner: Iterator[Any], start: int, drop: frozenset[int], on_drop: Callable[[int, Any], None]
) -> Iterator[Any]:
    """``inner`` from batch position ``start`` on without the positions in ``drop``; each one left out is handed
    to ``on_drop(position, indices)`` (a Python frame per batch, only when something is dropped)."""
    for position, item in enumerate(inner, start):
        if position in drop:
            on_drop(position, item)
        else:
            yield item


def _tag_batch(batch_type: type[_EpochBatch], indices: Any) -> Any:
    # a batch sampler's list (ints, or a dict-like dataset's keys); anything else (a tuple, an array) is handed over
    # as it is, so the dataset's __getitems__ gets the type it expects
    return batch_type(indices) if type(indices) is list else indices


def _tag_index(index_type: type[SampleIndex], index: Any) -> Any:
    return index_type(index) if type(index) is int else index


class _IndexStream:
    """The index iterator the loader's iterator reads while it is made; :meth:`prime` does the skip (and the
    first draw) now, and :meth:`rest` hands the loader's iterator what is left."""

    def __init__(
        self,
        inner: Iterator[Any],
        *,
        skip: int,
        epoch: int,
        batched: bool,
        drop: frozenset[int] = frozenset(),
        on_drop: Callable[[int, Any], None] | None = None,
    ) -> None:
        self._inner = inner
        self._skip = skip
        self._drop = drop
        self._on_drop = on_drop or (lambda position, indices: None)
        self._epoch = epoch
        self._batched = batched
        self._ahead: list[Any] | None = None
        self._tags_none = False  # whether the sampler's first draw said it yields no int to tag (see rest())
        self._tag = _tagger(epoch, batched)

    def __iter__(self) -> _IndexStream:
        return self

    def prime(self) -> None:
        """Skip the consumed batches and draw the first one to come, if not done yet.

        A single-process loader reads its first indices at its first ``next()``, a multi-process one while
        its iterator is created; priming right after creation makes both draw their sampler's randomness at
        the same moment in a fresh run and in a resumed one.
        """
        if self._ahead is not None:
            return
        inner = self._inner
        for _ in range(self._skip):
            if next(inner, _END) is _END:
                break
        if self._drop:
            inner = self._inner = _dropping(inner, self._skip, self._drop, self._on_drop)
        first = next(inner, _END)
        self._ahead = [] if first is _END else [first]
        self._tags_none = not self._batched and type(first) is not int

    def __next__(self) -> Any:
        if self._ahead is None:
            self.prime()
        ahead = self._ahead
        return self._tag(ahead.pop() if ahead else next(self._inner))

    def rest(self) -> Iterator[Any]:
        """What the stream has still to give, tagged as :meth:`__next__` tags it, as an iterator made of C parts.

        The loader's iterator reads this instead of the stream for the rest of the epoch: no Python frame per
        batch where nothing is tagged. A sampler whose first draw is not an int, unbatched (a list, as a
        ``BatchSampler`` given as ``sampler`` yields; a key), is taken to draw no ints, and none is tagged.

        :returns: The iterator; the stream itself must not be read after this.
        """
        self.prime()
        ahead, self._ahead = self._ahead, []
        items = itertools.chain(ahead, self._inner)
        # decided at the first draw: with workers the loader has read it (and more) by now
        return items if self._tags_none else map(self._tag, items)


def _tagger(epoch: int, batched: bool) -> Callable[[Any], Any]:
    """What tags each item of a loader's index sampler with ``epoch``: a batch, or one index."""
    if batched:
        return functools.partial(_tag_batch, _batch_type(epoch))
    return functools.partial(_tag_index, _index_type(epoch))


class _EpochIndices:
    """A loader's index sampler, each batch (or unbatched index) tagged with ``epoch``, nothing else changed."""

    def __init__(self, inner: Any, *, epoch: int, batched: bool) -> None:
        self.inner = inner
        self.tag = _tagger(epoch, batched)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return map(self.tag, iter(self.inner))


class _EpochTagged:
    """A ``DataLoader`` whose every iterator reads its index sampler through :class:`_EpochIndices`."""

    def __init__(self, loader: DataLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)  # the loader's dataset, batch_size, ... as progress() used to hand it out

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        batched = torch_private.loader_uses_batch_sampler(loader)
        inner = loader.batch_sampler if batched else loader.sampler
        return _iterator_reading(loader, _EpochIndices(inner, epoch=self.epoch, batched=batched))


def epoch_tagged(loader: Any, epoch: int) -> Any:
    """``loader`` with every batch it loads saying ``epoch`` to :func:`trainkit.sample_generator`, for a loop that
    is not counted (no step checkpoints): the same samples as the counted loop's, at two Python calls per batch.

    Side effects: none until it is iterated; then as :class:`TrackedBatches` does, without the skip.

    :param loader: What ``progress()`` was given in ``train_epoch()``.
    :param epoch: The 0-based epoch.
    :returns: An iterable over the same batches, with ``len()``; ``loader`` itself when it is no ``DataLoader`` over
        a map-style dataset (nothing to tag).

    >>> epoch_tagged([1, 2], epoch=3)
    [1, 2]
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if not torch_private.loader_uses_batch_sampler(loader) and isinstance(loader.sampler, BatchSampler):
        return loader  # its dataset is handed whole lists of indices: no int to tag, no per-batch cost
    return _EpochTagged(loader, epoch)


def _iterator_reading(loader: Any, indices: Any) -> Iterator[Any]:
    """``iter(loader)`` with ``indices`` as its index sampler while the iterator is made.

    ``loader`` (and its persistent iterator, which keeps its own reference) reads ``indices`` only while the
    iterator is made: later epochs of a persistent iterator read the real sampler again. A loader that makes its
    DataLoader iterator lazily (a subclass whose ``__iter__`` is a generator, say), at its first ``next()``, after
    the swap, reads the real sampler, untagged.
    """
    attribute = "batch_sampler" if torch_private.loader_uses_batch_sampler(loader) else "sampler"
    real = getattr(loader, attribute)
    persistent = torch_private.persistent_iterator(loader)
    # DataLoader refuses to set these after construction; the swap lasts only while the iterator is made
    object.__setattr__(loader, attribute, indices)
    if persistent is not None:
        torch_private.set_index_sampler(persistent, indices)
    try:
        iterator = iter(loader)
    finally:
        object.__setattr__(loader, attribute, real)
        made = torch_private.persistent_iterator(loader)
        for each in (persistent, made):
            if each is not None:
                torch_private.set_index_sampler(each, real)
    return iterator


def _made_iterator(loader: Any, indices: _SkippingIndices) -> tuple[Iterator[Any], bool]:
    """``iter(loader)`` with ``indices`` as its index sampler while the iterator is made, primed (the skip done).

    :returns: The iterator, and whether it read ``indices`` (see :func:`_iterator_reading`): False when the loader
        makes its DataLoader iterator lazily; that iterator reads the real sampler, from the epoch's first batch.
    """
    iterator = _iterator_reading(loader, indices)
    stream = indices.stream
    if stream is None:
        return iterator, False
    stream.prime()
    if torch_private.index_stream(iterator) is stream:
        torch_private.set_index_stream(iterator, stream.rest())  # where DataLoader's iterators read their indices
    return iterator, True


class TrackedBatches:
    """The batches of one training epoch, with the number consumed so far known to the trainer.

    Iterating it yields the loader's batches, from batch ``skip`` on. Each time the step counter has moved
    since the previous batch (an optimizer step ended; never inside a gradient-accumulation window), it calls
    ``at_step_boundary(self)`` before fetching the next batch: that is where a step checkpoint is written, a
    stop signal acted on and a step validation run, with :attr:`consumed` batches fully trained on; when it returns
    True the iteration ends there (``max_steps``, an early stop), as if the epoch had no more batches.

    :param loader: A ``DataLoader`` :func:`unskippable_reason` accepts.
    :param epoch: The 0-based epoch.
    :param skip: Batches to skip (a resumed epoch's consumed batches), 0 otherwise.
    :param resume: What this rank puts back when resuming (with ``skip``), else None.
    :param step: Reads the trainer's optimizer step counter.
    :param at_step_boundary: Called at each step boundary, before the next batch is fetched; True ends the loop.
    :param on_close: Called once when iteration ends, however it ends.
    :param on_untracked: Called with the reason when the loader turns out not to be skippable (it makes its
        iterator lazily); the loop then runs from its first batch, its boundaries still watched.
    :param drop: Batch positions of the epoch (0-based) left out at the index level: their indices are drawn
        from the sampler, as a full epoch draws them, but never loaded nor yielded; :attr:`consumed` still counts
        positions in the whole epoch, the dropped ones included (the divergence guard's rollback).
    :param on_drop: Called ``(epoch, position, indices)`` as each one is left out.
    :raises CheckpointMismatchError: When iterated to resume (``resume``) a loader that cannot be skipped into,
        or to drop batches from one.
    """

    def __init__(
        self,
        loader: Any,
        *,
        epoch: int,
        skip: int,
        resume: RankPosition | None,
        step: Callable[[], int],
        at_step_boundary: Callable[[TrackedBatches], bool] | None,
        on_close: Callable[[], None],
        on_untracked: Callable[[str], None],
        drop: frozenset[int] = frozenset(),
        on_drop: Callable[[int, int, Any], None] | None = None,
    ) -> None:
        self.loader = loader
        self.drop = drop
        self.dropped: list[tuple[int, Any]] = []
        """The positions of ``drop`` left out so far, each with the sampler's indices drawn for it (a list of
        ints for a batched loader, one index otherwise), in the epoch's order."""
        self._on_drop = on_drop
        self.epoch = epoch
        self.skip = skip
        self.consumed = skip
        """Batch positions of this epoch passed so far (counting the skipped and the dropped ones)."""
        self._rng_at_iter: dict[str, Any] | None = None
        self.generators_at_iter: list[torch.Tensor] = []
        """The loader's own generators' states then."""
        self._resume = resume
        self._step = step
        self._at_step_boundary = at_step_boundary
        self._on_close = on_close
        self._on_untracked = on_untracked
        self._started = False
        self.ended = False
        """Whether the counted pass is over (its last batch passed, or the loop left early): an optimizer step from
        then on trained on none of its batches."""

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def per_epoch(self) -> int | None:
        """The epoch's batches, ``len(loader)``; None for a loader without a length (see
        :class:`~trainkit.loop.stateful_batches.StatefulBatches`)."""
        return len(self.loader)

    @property
    def where(self) -> tuple[int, int | None]:
        """Where the epoch stands, for messages: ``(consumed, per epoch)`` batches (:attr:`per_epoch`)."""
        return self.consumed, self.per_epoch

    @property
    def rng_at_iter(self) -> dict[str, Any] | None:
        """The RNG states when the loader's iterator was created (what a resume puts back before creating it),
        as a checkpoint keeps them; None before it was."""
        states = self._rng_at_iter
        if states is None:
            return None
        self._rng_at_iter = states = rng_for_checkpoint(states)
        return states

    def _before_iterator(self) -> None:
        """Right before the loader's iterator is made: put back the states a resume recorded then, and record them.

        The iterator draws from them as it is made (a shuffle's seed, the workers' base seed): a resumed epoch's
        iterator draws what the interrupted one drew.
        """
        loader = self.loader
        generators = loader_generators(loader)
        resume = self._resume
        if resume is not None:
            restore_rng(resume.rng_at_iter)
            saved = resume.generators_at_iter  # None on another world size: they keep this run's states
            if saved is not None:
                for generator, state in zip(generators, saved, strict=True):
                    generator.set_state(state)
        self._rng_at_iter = iterator_rng(loader)
        self.generators_at_iter = [generator.get_state() for generator in generators]

    def _start(self) -> Iterator[Any]:
        self._before_iterator()
        resume = self._resume
        iterator, skippable = self._iterate(self.skip, self.drop)
        if not skippable:
            if resume is not None:
                raise CheckpointMismatchError(
                    f"the checkpoint was written inside epoch {self.epoch}, after {self.skip} batches, but "
                    f"{self._lazy_loader()}, so trainkit cannot skip into it; resume from an epoch-boundary "
                    "checkpoint, or start fresh (ckpt.resume=never)"
                )
            if self.drop:
                raise CheckpointMismatchError(
                    f"batches {sorted(self.drop)} of epoch {self.epoch} are to be left out, but "
                    f"{self._lazy_loader()}, so trainkit cannot leave batches out of it"
                )
            if self._at_step_boundary is not None:  # still watched (the step budget, step validation), not resumable
                self._on_untracked(
                    f"{self._lazy_loader()}, so trainkit cannot skip into it: this loop writes no step "
                    "checkpoints and resumes at epoch boundaries; let its __iter__ call super().__iter__() before "
                    "it returns (return a generator over the iterator that gives), or do the per-batch work in "
                    "the loop"
                )
            return iterator
        if resume is not None:
            restore_rng(resume.rng_at_save)
            self._resume = None
        return iterator

    def _lazy_loader(self) -> str:
        return (
            f"the {type(self.loader).__name__} given to progress() makes its DataLoader iterator only when its first "
            "batch is asked for (its __iter__ is a generator, say)"
        )

    def _iterate(self, skip: int, drop: frozenset[int] = frozenset()) -> tuple[Iterator[Any], bool]:
        """The loader's iterator from batch ``skip`` on, its indices tagged with the epoch, the skip done now, the
        positions in ``drop`` left out; and whether it could be made so (see :func:`_made_iterator`)."""
        loader = self.loader
        batched = torch_private.loader_uses_batch_sampler(loader)
        inner = loader.batch_sampler if batched else loader.sampler
        indices = _SkippingIndices(
            inner, skip=skip, epoch=self.epoch, batched=batched, drop=drop, on_drop=self._drop_one
        )
        return _made_iterator(loader, indices)

    def _drop_one(self, position: int, indices: Any) -> None:
        self.dropped.append((position, indices))
        if self._on_drop is not None:
            self._on_drop(self.epoch, position, indices)

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            # a second pass over the same object: its batches are not the epoch's position any more
            warn_user(
                "the batches progress() returned were iterated a second time: this pass is not counted, so no "
                "step checkpoint is written while it runs; call progress() once per pass"
            )
            yield from self._iterate(skip=0)[0]
            return
        self._started = True
        try:
            iterator = self._start()
            boundary = self._at_step_boundary
            counted: Iterator[tuple[int, Any]] = enumerate(iterator, self.skip + 1)
            if self.drop:  # the position after each batch yielded, the dropped ones passed over
                drop = self.drop
                after = (position + 1 for position in itertools.count(self.skip) if position not in drop)
                counted = zip(after, iterator)
            if boundary is None:
                for self.consumed, batch in counted:
                    yield batch
                self._ran_out()
                return
            step = self._step
            last_step = step()
            for self.consumed, batch in counted:
                yield batch
                # the caller asked for the next batch: if an optimizer step ended since, this is a boundary
                now = step()
                if now != last_step:
                    last_step = now
                    if boundary(self):
                        return
            self._ran_out()
        finally:
            self.ended = True
            self._on_close()

    def _ran_out(self) -> None:
        """The loader's iterator ran out (not the loop leaving early): nothing more to check here."""


class WatchedBatches:
    """The batches of a training loop that cannot be skipped into (an iterable dataset, a generator, a list):
    counted, and its step boundaries watched for the step budget, step validation and rows; no step checkpoint
    resumes it.

    :param batches: What ``progress()`` was given.
    :param step: Reads the trainer's optimizer step counter.
    :param at_step_boundary: Called at each step boundary, before the next batch is fetched; True ends the loop.
    """

    skip = 0
    """Batches skipped at the start: none (nothing resumes into it)."""

    def __init__(
        self, batches: Any, *, step: Callable[[], int], at_step_boundary: Callable[[WatchedBatches], bool]
    ) -> None:
        self.loader = batches
        self.consumed = 0
        """Batches passed so far."""
        self.ended = False
        """Whether the pass is over (its last batch passed, or the loop left early)."""
        self._step = step
        self._at_step_boundary = at_step_boundary

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        step, boundary = self._step, self._at_step_boundary
        last_step = step()
        counted = enumerate(self.loader, 1)
        try:
            for self.consumed, batch in counted:
                yield batch
                now = step()
                if now != last_step:
                    last_step = now
                    if boundary(self):
                        return
        finally:
            self.ended = True
