"""The epoch's batches from a loader that carries its own position: saved with its ``state_dict()``, put back with its
``load_state_dict()``.

torchdata's ``StatefulDataLoader`` is one (over a map-style dataset or an ``IterableDataset``, with worker processes
or without), and so is any iterable of batches with both methods. A step checkpoint keeps each rank's
``state_dict()`` in that rank's share; a resumed epoch hands the loader its rank's state before iterating it, and the
loader goes on from there. Nothing is skipped at the index level: the loader's own state is the position, so an
epoch need have no length. Nothing here imports torchdata: a loader is known by its two methods.

Side effects: calls the loader's ``state_dict()`` at each step checkpoint and ``load_state_dict()`` once when an epoch
resumes inside, and sets the process's RNG states when resuming.
"""

from __future__ import annotations

import copy
import itertools
import reprlib
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset

from trainkit import bookkeeping
from trainkit.checkpoint.payload import MAX_ITEM_DEPTH
from trainkit.errors import CheckpointMismatchError, ConfigError, UsageError
from trainkit.loop.tracked_batches import TrackedBatches, unskippable_reason
from trainkit.state.graph import check_state_graph
from trainkit.state.rng import capture_rng, loader_generators, restore_rng

_ENDED = object()
"""What ``next()`` gives for an iterator that has run out."""

__all__ = [
    "carries_own_position",
    "check_empty_pass",
    "check_rollback_loader",
    "loader_facts",
    "loader_order",
    "naive_count",
    "StatefulBatches",
    "with_naive_count",
]


def carries_own_position(loader: Any) -> bool:
    """Tell whether ``loader`` keeps its own position: it has callable ``state_dict`` and ``load_state_dict``.

    Such a loader resumes inside an epoch from its own state, whatever it iterates; torchdata's
    ``StatefulDataLoader`` is one, torch's ``DataLoader`` is not.

    >>> class Stream:
    ...     def __iter__(self): return iter([])
    ...     def state_dict(self): return {}
    ...     def load_state_dict(self, state): pass
    >>> carries_own_position(Stream()), carries_own_position([1, 2])
    (True, False)

    :param loader: What ``self.progress()`` was given.
    :returns: Whether both methods are there.
    """
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def check_rollback_loader(loader: Any) -> None:
    """Refuse, before the first step, a training loop that ``guard.nonfinite="rollback"`` could not leave a bad
    step's batches out of: a rollback skips them at the index level, which only a ``DataLoader`` over a map-style
    dataset with a length allows. A loader that carries its own position (torchdata's ``StatefulDataLoader``) only
    knows how to go on from its state, and a stream has no index to skip; without this check the run would train
    until its first non-finite step, roll back, and only then stop.

    >>> check_rollback_loader([[1.0]])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainkit.errors.ConfigError: guard.nonfinite=rollback cannot leave batches out of ... a list, not a DataLoader: ...

    :param loader: What ``self.progress()`` was given inside ``train_epoch()``.
    :raises ConfigError: Naming ``guard.nonfinite``, the loader, the rule and what to do instead.
    """
    if carries_own_position(loader):
        what = (
            f"a {type(loader).__name__}, which carries its own position (state_dict() and load_state_dict()) and "
            "can only go on from it"
        )
    else:
        reason = unskippable_reason(loader)
        if reason is None:
            return
        what = reason
    raise ConfigError(
        "guard.nonfinite",
        "needs a loop it can leave batches out of",
        "rollback",
        message=(
            f"guard.nonfinite=rollback cannot leave batches out of train_epoch()'s loop over {what}: a rollback "
            "skips a bad step's batches at the index level, which needs a torch DataLoader over a map-style dataset "
            "with a length; iterate one through self.progress(), or set guard.nonfinite=skip (or raise)"
        ),
    )


def check_empty_pass(batches: Any) -> None:
    """Refuse an epoch whose counted pass over a loader that carries its own position started at the epoch's first
    batch, ran out and yielded no batch: the epoch trained nothing, and the run would go on as if it had.

    A loader handed a saved state at the end of a pass (a resume at an epoch's last step boundary, or from an
    epoch-end checkpoint) may resume that ended pass at its next ``__iter__`` and yield nothing: the pass after that
    one is then the epoch's (:class:`StatefulBatches`). A loader that yields nothing in that one too never starts a
    new pass from the state it was given.

    >>> check_empty_pass(None)

    :param batches: The epoch's counted loop, its loader's iterator run out (:class:`StatefulBatches` or another),
        or None.
    :raises UsageError: Naming the epoch, the loader and what it must do.
    """
    if not isinstance(batches, StatefulBatches) or batches.skip or batches.consumed:
        return
    name = type(batches.loader).__name__
    raise UsageError(
        f"epoch {batches.epoch}'s pass over the {name} given to progress() yielded no batch: the epoch would train "
        "nothing. A loader that carries its own position (or its dataset) must start a new pass when the state its "
        "load_state_dict() was given is at the end of one, at the latest at the __iter__ after the one that resumes "
        "it (docs: Step checkpoints, loaders that carry their own position)"
    )


def _length(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:  # no __len__, or an IterableDataset's DataLoader refusing one
        return None


def loader_facts(loader: Any) -> tuple[int | None, int | None, int | None]:
    """The facts a mid-epoch position records of a loader: ``(batch_size, len(dataset), len(loader))``.

    Each is None where the loader has none: no ``batch_size``, no ``dataset`` with a length, no length of its own.

    >>> loader_facts([[1, 2], [3, 4]])
    (None, None, 2)

    :param loader: What ``self.progress()`` was given.
    :returns: The three facts.
    """
    dataset = getattr(loader, "dataset", None)
    return getattr(loader, "batch_size", None), None if dataset is None else _length(dataset), _length(loader)


def loader_order(loader: Any) -> str | None:
    """What orders ``loader``'s epoch, as a step position records it
    (``EpochPosition.order``).

    A ``DataLoader`` whose sampler is exactly torch's ``DistributedSampler`` deals an order that does not depend on
    the world size (:func:`~trainkit.bookkeeping.distributed_order`); any other sampler, and a loader that carries
    its own position (its state is per rank), is named by its class: it resumes only on the world size that wrote it
    (a step position records no order for the latter at all).

    >>> loader_order([[1, 2]]) is None
    True

    :param loader: What ``self.progress()`` was given.
    :returns: The order's description, or None for a loader without a sampler.
    """
    if carries_own_position(loader):
        return type(loader).__name__
    sampler = getattr(loader, "sampler", None)
    if sampler is None:
        return None
    if type(sampler) is DistributedSampler:
        return bookkeeping.distributed_order(shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
    return type(sampler).__name__


def _is_int(value: Any) -> bool:
    return type(value) is int


def _naive_layout(loader: Any, state: dict[str, Any]) -> str | None:
    """How ``state`` holds the count torchdata's naive fast-forward reads, when ``loader`` is in that mode: a loader
    over an ``IterableDataset`` without ``state_dict``/``load_state_dict`` (so its iterator's state is None too),
    whose state has torchdata 0.11's keys with ints. ``"in-process"`` (``num_workers=0``), ``"workers"``, or None
    (another loader, a stream with a state of its own, or a state laid out otherwise: left as it is)."""
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset) or carries_own_position(dataset):
        return None
    fetcher = state.get("fetcher_state")
    if _is_int(state.get("_num_yielded")) and _is_int(state.get("_sampler_iter_yielded")) and isinstance(fetcher, dict):
        if fetcher.get("dataset_iter_state", 0) is None and "dataset_state" in state and state["dataset_state"] is None:
            return "in-process"
        return None
    snapshot = state.get("_snapshot")
    if not isinstance(snapshot, dict) or not _is_int(state.get("_steps_since_snapshot")):
        return None
    main, workers = snapshot.get("_main_snapshot"), snapshot.get("_worker_snapshots")
    if not _is_int(snapshot.get("_snapshot_step")) or not isinstance(main, dict) or not isinstance(workers, dict):
        return None
    if not _is_int(main.get("_sampler_iter_yielded")):
        return None
    for worker in workers.values():  # torchdata decides on the first worker state there is
        if worker is None:
            continue
        fetcher = worker.get("fetcher_state") if isinstance(worker, dict) else None
        if not isinstance(fetcher, dict) or "dataset_state" not in worker:
            return None
        return "workers" if worker["dataset_state"] is None and fetcher.get("dataset_iter_state", 0) is None else None
    return None


def naive_count(loader: Any, state: dict[str, Any]) -> int | None:
    """The batches torchdata's ``StatefulDataLoader`` would read again to resume from ``state`` when it resumes an
    ``IterableDataset`` without a state of its own by reading it again ("naively fast-forwarding"); None for any
    other loader or state.

    >>> naive_count([[1.0]], {"_num_yielded": 3}) is None
    True

    :param loader: What ``self.progress()`` was given.
    :param state: What its ``state_dict()`` returned.
    :returns: ``_num_yielded`` in one process, ``_snapshot_step + _steps_since_snapshot`` with workers; or None.
    """
    layout = _naive_layout(loader, state)
    if layout == "in-process":
        return state["_num_yielded"]
    if layout == "workers":
        return state["_snapshot"]["_snapshot_step"] + state["_steps_since_snapshot"]
    return None


def _less_yielded(main: dict[str, Any], excess: int) -> None:
    """Take ``excess`` batches off a main state's sampler counts (``_sampler_iter_yielded``, and the batch
    sampler iterator's ``samples_yielded`` where it is a whole number of samples per batch)."""
    yielded = main["_sampler_iter_yielded"]
    sampler = main.get("_sampler_iter_state")
    if isinstance(sampler, dict) and _is_int(sampler.get("samples_yielded")) and yielded > 0:
        per_batch, rest = divmod(sampler["samples_yielded"], yielded)
        if rest == 0:
            sampler["samples_yielded"] = max(0, sampler["samples_yielded"] - excess * per_batch)
    main["_sampler_iter_yielded"] = max(0, yielded - excess)


def with_naive_count(loader: Any, state: dict[str, Any], consumed: int) -> dict[str, Any]:
    """``state`` (a copy of it, where it changes) counting ``consumed`` batches, when ``loader`` is torchdata's
    ``StatefulDataLoader`` resuming a stateless ``IterableDataset`` by reading it again.

    Such a loader reads the stream again for as many batches as its state counts, and counts that reading again: once
    resumed, its own count is the batches it consumed plus those it re-read, and a second resume inside the same epoch
    would skip as many batches of data. The batches the training loop consumed this epoch are the position; they are
    written into the copy (``_num_yielded`` and ``_sampler_iter_yielded`` in one process; ``_snapshot_step`` and the
    main snapshot's ``_sampler_iter_yielded`` with workers, where the resume reads ``_snapshot_step`` batches again
    and then ``_steps_since_snapshot`` more: the first becomes ``consumed`` less the second). Any other loader or
    state, or another layout (another torchdata version), is returned as it is;
    ``StatefulBatches._resumed_iterator`` refuses a count that still differs.

    >>> with_naive_count([[1.0]], {"_num_yielded": 10}, 6)
    {'_num_yielded': 10}

    :param loader: What ``self.progress()`` was given.
    :param state: What its ``state_dict()`` returned (not changed).
    :param consumed: The batches of this epoch the training loop consumed.
    :returns: ``state``, or a corrected deep copy.
    """
    layout = _naive_layout(loader, state)
    count = naive_count(loader, state)
    if count is None or count <= consumed:
        return state
    excess = count - consumed
    state = copy.deepcopy(state)
    if layout == "in-process":
        state["_num_yielded"] = consumed
        _less_yielded(state, excess)
    elif consumed >= state["_steps_since_snapshot"]:
        snapshot = state["_snapshot"]
        snapshot["_snapshot_step"] = consumed - state["_steps_since_snapshot"]
        _less_yielded(snapshot["_main_snapshot"], excess)
    return state


class StatefulBatches(TrackedBatches):
    """The batches of one training epoch from a loader that carries its own position, counted as
    :class:`~trainkit.loop.tracked_batches.TrackedBatches` counts them.

    To resume, the loader is given the state it returned from ``state_dict()`` at the save point
    (``resume.loader_state``) before its iterator is made; the RNG states are put back around that as for a tracked
    ``DataLoader``: the iterator-time states (and the loader's own generators') before it is made, so it draws what the
    interrupted one drew, and the save point's states after (the loader's own generators' too). Nothing is skipped:
    ``skip`` only says how many batches the saved state had consumed, so ``consumed`` counts the whole epoch.

    :param loader: An iterable that :func:`carries_own_position`.
    :param epoch: The 0-based epoch.
    :param skip: Batches the saved state had consumed (a resumed epoch), 0 otherwise.
    :param resume: What this rank puts back when resuming (with its ``loader_state``), else None.
    :param kwargs: The rest of :class:`~trainkit.loop.tracked_batches.TrackedBatches`'s keywords; ``drop`` must be empty
        (batches cannot be left out of a loader that only knows its own position).
    :raises CheckpointMismatchError: When iterated to resume and the loader refuses the saved state, naming the
        loader's class and its error.
    """

    def __len__(self) -> int:
        length = self.per_epoch
        if length is None:  # what len() says of an object without a length; a progress bar then shows no total
            raise TypeError(f"the {type(self.loader).__name__} given to progress() has no length")
        return length

    @property
    def per_epoch(self) -> int | None:
        """The epoch's batches, ``len(loader)``, or None for a loader without a length (a stream)."""
        return _length(self.loader)

    start_state: dict[str, Any] | None = None
    """The state an epoch-end checkpoint saved of the loader, which this pass (from the epoch's first batch) hands it
    before iterating; None otherwise."""
    after_resume = False
    """Whether the loader was handed a saved state before this pass (from the epoch's first batch), which it may still
    hold for its next pass: a resume at the previous epoch's last step boundary."""

    def loader_state(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` now, checked and copied, as :meth:`saved_share` takes it (an epoch-end
        checkpoint keeps it).

        :returns: The state.
        :raises UsageError: As :meth:`saved_share` does.
        :raises CheckpointUnsafeError: As :meth:`saved_share` does.
        """
        return self.saved_share()["loader_state"]

    def saved_share(self) -> dict[str, Any]:
        """What this rank's share of a step checkpoint adds for this loader: ``loader_state``, its ``state_dict()``
        now (copied: a background save writes it later), and ``generators_at_save``, its own generators' states now.

        The generators are kept because making the resumed iterator draws from them differently than the interrupted
        run did (``StatefulDataLoader`` shuffles again, then reloads its sampler's state): they are put back after it,
        as torch's global generator is.

        :returns: The two entries.
        :raises UsageError: When ``state_dict()`` returns something else than a dict with str keys.
        :raises CheckpointUnsafeError: When it holds a cycle, nests too deep or holds too many containers
            (:func:`~trainkit.state.graph.check_state_graph`).
        """
        state = self.loader.state_dict()
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise UsageError(
                f"{type(self.loader).__name__}.state_dict() must return a dict with str keys to be saved in a step "
                f"checkpoint, got {type(state).__name__} {reprlib.repr(state)}"
            )
        check_state_graph(
            "loader_state",
            state,
            owner=f"the state_dict() of the {type(self.loader).__name__}",
            max_depth=MAX_ITEM_DEPTH,
        )
        generators = [generator.get_state() for generator in loader_generators(self.loader)]
        corrected = with_naive_count(self.loader, state, self.consumed)
        return {
            "loader_state": copy.deepcopy(state) if corrected is state else corrected,
            "generators_at_save": generators,
        }

    def _start(self) -> Iterator[Any]:
        self._before_iterator()
        resume = self._resume
        if resume is None:
            if self.start_state is None and not self.after_resume:
                return iter(self.loader)
            return self._first_pass_after_a_state()
        iterator = self._resumed_iterator(resume.loader_state)
        restore_rng(resume.rng_at_save)
        for generator, state in zip(loader_generators(self.loader), resume.generators_at_save, strict=True):
            generator.set_state(state)
        self._resume = None
        return iterator

    def _first_pass_after_a_state(self) -> Iterator[Any]:
        """The epoch's pass over a loader handed a saved state before it: an epoch-end checkpoint's
        (:attr:`start_state`), or a step checkpoint's at the previous epoch's last step boundary
        (:attr:`after_resume`); the uninterrupted run's loader had only ended its previous pass there.

        The epoch-end state goes to the loader's ``load_state_dict()``, then to an iterator made from it and dropped
        (torchdata's ``StatefulDataLoader`` hands it to its dataset's ``load_state_dict()`` only then, and an ended
        iterator's state gives way to a fresh one). The pass's first batch is then drawn: a loader (or its dataset)
        that keeps the loaded state for its next pass resumes the ended pass there and yields nothing, and the
        epoch's pass is the one after it. The RNG states and the loader's own generators' are put back before each
        iterator is made: the dropped ones drew from them, which the uninterrupted run did not.

        :raises CheckpointMismatchError: When the loader refuses the epoch-end state, naming it and why.
        """
        loader = self.loader
        rng = capture_rng()
        generators = loader_generators(loader)
        states = [generator.get_state() for generator in generators]

        def put_back() -> None:
            restore_rng(rng)
            for generator, saved in zip(generators, states, strict=True):
                generator.set_state(saved)

        if self.start_state is not None:
            try:
                loader.load_state_dict(self.start_state)
                iter(loader)
            except Exception as exc:  # noqa: BLE001 - a loader's own checks raise anything (KeyError, ...)
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                raise CheckpointMismatchError(
                    f"the checkpoint was written at the end of epoch {self.epoch - 1}, but the "
                    f"{type(loader).__name__} given to progress() could not load the state it saved there ({cause}); "
                    "resume with the loader that wrote it, or start fresh (ckpt.resume=never)"
                ) from exc
            self.start_state = None
            put_back()
        iterator = iter(loader)
        first = next(iterator, _ENDED)
        if first is not _ENDED:
            return itertools.chain((first,), iterator)
        put_back()  # the ended pass, resumed: the epoch's pass is the next one
        return iter(loader)

    def _resumed_iterator(self, state: dict[str, Any]) -> Iterator[Any]:
        """The loader's iterator from the saved position; a state it refuses (in ``load_state_dict()``, or when the
        iterator is made from it, as ``StatefulDataLoader`` reads it) is a mismatch naming the loader and why."""
        loader = self.loader
        count = naive_count(loader, state)
        if count is not None and count != self.skip:
            raise CheckpointMismatchError(
                f"the checkpoint was written inside epoch {self.epoch}, after {self.skip} batches, but the "
                f"{type(loader).__name__} given to progress() saved a state that reads its IterableDataset "
                f"{type(loader.dataset).__name__} again for {count} batches (it has no state_dict()/load_state_dict() "
                "and torchdata counted its previous resume's re-reading), which would skip or repeat data; give the "
                "IterableDataset state_dict() and load_state_dict(), or resume from an epoch-boundary checkpoint"
            )
        try:
            loader.load_state_dict(state)
            return iter(loader)
        except Exception as exc:  # noqa: BLE001 - a loader's own checks raise anything (KeyError, AssertionError...)
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CheckpointMismatchError(
                f"the checkpoint was written inside epoch {self.epoch}, after {self.skip} batches, but the "
                f"{type(loader).__name__} given to progress() could not load the state it saved there ({cause}); "
                "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
            ) from exc

    def _ran_out(self) -> None:
        """The loader's iterator ran out: refuse a pass from the epoch's first batch that yielded none
        (:func:`check_empty_pass`), before the code after the loop takes the epoch as trained."""
        check_empty_pass(self)

    def _iterate(self, skip: int, drop: frozenset[int] = frozenset()) -> tuple[Iterator[Any], bool]:
        """A second pass over the loader (uncounted): its own iterator, from wherever it stands."""
        return iter(self.loader), True
