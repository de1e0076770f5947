"""Every random generator of a process: seeding it, and capturing and restoring its state for a checkpoint.

Side effects: the process's Python, torch (CPU and CUDA) and numpy (when loaded) generators.
"""

from __future__ import annotations

import array
import hashlib
import random
import sys
import threading
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainkit import torch_private

__all__ = [
    "seed_everything",
    "capture_rng",
    "capture_torch_rng",
    "restore_rng",
    "start_persistent_workers",
    "GeneratorItem",
    "loader_generators",
    "sample_seed",
    "sample_generator",
    "sample_epoch",
    "reshard_seed",
    "LOADING",
]


def capture_rng() -> dict[str, Any]:
    """Capture the state of every random generator this process uses, as plain values.

    Python's, torch's CPU and numpy's states are kept as ``bytes``: they pickle inline, where a tensor
    would add a record (and a CRC) to the checkpoint file on every save.

    :returns: ``{"python": ..., "torch": ..., "numpy": ... (when numpy is loaded), "cuda": ... (when used)}``.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, array.array("q", internal).tobytes(), gauss],
        "torch": capture_torch_rng(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def capture_torch_rng() -> bytes:
    """Torch's CPU generator state alone, as :func:`capture_rng` keeps it under ``"torch"``.

    :returns: The state as ``bytes``.
    """
    return torch.get_rng_state().numpy().tobytes()


def restore_rng(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng` (also its earlier tensor-valued form).

    Only the generators present in ``state`` are set; torch's CPU one must be.

    :param state: The captured states.
    """
    if "python" in state:  # a loader's iterator-time states may hold torch's alone (see trainkit.loop.tracked_batches)
        version, internal, gauss = state["python"]
        if isinstance(internal, bytes):
            internal = array.array("q", internal).tolist()
        elif isinstance(internal, torch.Tensor):
            internal = internal.tolist()
        random.setstate((version, tuple(internal), gauss))
    cpu = state["torch"]
    torch.set_rng_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8) if isinstance(cpu, bytes) else cpu)
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = numpy.frombuffer(keys, dtype=numpy.uint32) if isinstance(keys, bytes) else keys.numpy()
        numpy.random.set_state((name, keys.astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's (when loaded) and torch's generators (CUDA included).

    :param seed: The seed; the trainer passes ``cfg.seed + rank``.
    """
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def start_persistent_workers(loader: Any) -> None:
    """Start the workers of a ``persistent_workers`` DataLoader without moving torch's global generator.

    Such a loader draws its workers' base seed from the global generator once, the first time it is
    iterated, and never again. A run resumed at epoch 5 iterates it for the first time at epoch 5, where the
    uninterrupted run did at epoch 0: that one draw would shift every later shuffle. Started here, with the
    generator's state put back afterwards, the draw never counts, in a fresh run and in a resumed one alike,
    so each epoch's shuffle depends only on the generator state at that epoch. What the workers themselves
    draw is not reproduced on resume: they were seeded once, and their state after several epochs is gone.

    The loader's own generators (``loader_generators``) are put back the same way.

    Side effects: starts the loader's worker processes (and their first prefetch) when they are not running.
    Anything else (a loader without workers, not persistent, already started, not a DataLoader) is left alone.

    :param loader: The object ``self.progress()`` was given.
    """
    if not isinstance(loader, DataLoader) or not loader.persistent_workers or loader.num_workers == 0:
        return
    if torch_private.persistent_iterator(loader) is not None:  # started before: its draw already happened
        return
    state = torch.get_rng_state()
    # the loader's own generators too: its base seed, and a sampler's shuffle when prefetching starts
    generators = [(generator, generator.get_state()) for generator in loader_generators(loader)]
    try:
        iter(loader)
    finally:
        torch.set_rng_state(state)
        for generator, saved in generators:
            generator.set_state(saved)


class GeneratorItem:
    """A ``torch.Generator`` as a checkpoint item: its state is saved, and restored into it in place.

    :meth:`~trainkit.BaseTrainer.add_checkpoint_items` wraps a generator in one, so a DataLoader or sampler
    that shuffles with a generator of its own resumes its shuffle exactly.

    >>> generator = torch.Generator().manual_seed(0)
    >>> item = GeneratorItem(generator)
    >>> saved = item.state_dict()
    >>> first = torch.randperm(5, generator=generator)
    >>> item.load_state_dict(saved)
    >>> torch.equal(torch.randperm(5, generator=generator), first)
    True

    :param generator: The generator.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generator's state.

        :returns: ``{"state": generator.get_state()}`` (a uint8 tensor).
        """
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a saved state back into the generator.

        :param state: What :meth:`state_dict` returned.
        :raises ValueError: When the state is not a generator state of this generator's kind.
        """
        value = state.get("state") if isinstance(state, dict) else None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise ValueError(f"a generator state is a uint8 tensor under 'state', got {type(value).__name__}")
        self.generator.set_state(value)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators a DataLoader shuffles or seeds its workers with, other than torch's global one.

    :param loader: Anything; only a ``DataLoader`` has any.
    :returns: Its own generator and its sampler's, also one a batch sampler wraps, each once.
    """
    if not isinstance(loader, DataLoader):
        return []
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [
        loader.generator,
        getattr(loader.sampler, "generator", None),
        getattr(getattr(loader.sampler, "sampler", None), "generator", None),  # a BatchSampler given as sampler
        getattr(getattr(batch_sampler, "sampler", None), "generator", None),
    ]
    found: list[torch.Generator] = []
    for candidate in candidates:
        if isinstance(candidate, torch.Generator) and all(candidate is not g for g in found):
            found.append(candidate)
    return found


LOADING = threading.local()
"""``LOADING.epoch``: the epoch of the batch this thread is loading (the ``DataLoader`` fetcher iterates the
batch's indices, calling ``__getitem__`` for each), else absent or None; :func:`sample_seed` reads it for an index
that carries no epoch. :mod:`trainkit.loop.tracked_batches` sets it as such a batch is iterated and clears it as the
batch is freed, right after its fetch. Per thread: a thread that loads no batch of the epoch never sees it."""


def sample_epoch(index: int) -> int | None:
    """The epoch a sample index belongs to, as :func:`sample_seed` finds it: the index's own (a
    :class:`~trainkit.loop.tracked_batches.SampleIndex`), else that of the batch this thread is loading
    (:data:`LOADING`).

    >>> sample_epoch(3) is None  # a plain int, no batch being loaded
    True

    :param index: What ``__getitem__`` received.
    :returns: The 0-based epoch, or None when none is known.
    """
    epoch = getattr(index, "epoch", None)
    return getattr(LOADING, "epoch", None) if epoch is None else epoch


def sample_seed(seed: int, index: int, epoch: int | None = None) -> int:
    """A seed for one sample's randomness in one epoch: a pure function of ``(seed, epoch, index)``.

    Randomness drawn from it (an augmentation's crop, a dropout mask made in ``__getitem__``) is the same in
    a resumed run as in the uninterrupted one, whichever worker loads the sample and whatever it loaded
    before, which a worker's own generator cannot promise. The epoch is known without ``epoch=`` while
    ``train_epoch()`` iterates a ``DataLoader`` through ``self.progress()``, with or without step checkpoints and
    workers: the loader's fetcher calls ``__getitem__`` while it iterates the batch's indices, and trainkit's batch
    says its epoch then (and an unbatched loader hands over a :class:`~trainkit.loop.tracked_batches.SampleIndex`, which
    carries it). Anywhere else, pass ``epoch``.

    >>> seed = sample_seed(0, 5, epoch=1)
    >>> seed == sample_seed(0, 5, epoch=1), seed == sample_seed(0, 5, epoch=2), seed == sample_seed(1, 5, epoch=1)
    (True, False, False)

    :param seed: The run's seed (``cfg.seed``), so two runs with different seeds augment differently.
    :param index: The sample's index.
    :param epoch: The 0-based epoch; None reads ``index.epoch``.
    :returns: An int in ``[0, 2**63)``.
    :raises ValueError: When ``epoch`` is None and no epoch is known (the message says what to do).
    """
    if epoch is None:
        epoch = sample_epoch(index)
        if epoch is None:
            raise ValueError(
                f"sample_seed(): index {index!r} carries no epoch: trainkit knows it only while train_epoch() "
                "iterates a DataLoader through self.progress() (for x, y in self.progress(self.loader)), with "
                "__getitem__ called as the loader's fetcher iterates each batch's indices (a __getitems__ must "
                "iterate the indices it is given); anywhere else, pass epoch= explicitly"
            )
    digest = hashlib.blake2b(f"{int(seed)}/{int(epoch)}/{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reshard_seed(seed: int, rank: int, step: int) -> int:
    """The seed of every generator of rank ``rank`` resuming at optimizer step ``step`` on another world size.

    A checkpoint holds one RNG state per saved rank; they cannot be dealt onto another number of ranks, so every
    rank of a resharded run (the ones whose number existed before too) seeds Python's, numpy's and torch's global
    generators from this pure function of ``(seed, rank, step)`` instead: a resume is repeatable, and two ranks
    never share a stream. Randomness keyed by the sample (:func:`sample_generator`) does not depend on it.

    >>> reshard_seed(0, 1, 40) == reshard_seed(0, 1, 40), reshard_seed(0, 1, 40) == reshard_seed(0, 2, 40)
    (True, False)

    :param seed: The run's seed (``cfg.seed``).
    :param rank: This rank.
    :param step: The optimizer steps the checkpoint had taken.
    :returns: An int in ``[0, 2**63)``.
    """
    digest = hashlib.blake2b(f"reshard/{int(seed)}/{int(rank)}/{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_generator(seed: int, index: int, epoch: int | None = None) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`sample_seed` for per-sample randomness in a dataset.

    Use it in ``__getitem__`` for anything random, so a resumed run (even one resumed in the middle of an
    epoch, with workers) sees the same sample the same way::

        def __getitem__(self, index):
            generator = trainkit.sample_generator(self.seed, index)
            noise = torch.randn(self.x[index].shape, generator=generator)
            return self.x[index] + 0.1 * noise, self.y[index]

    >>> a = torch.rand(2, generator=sample_generator(0, 3, epoch=1))
    >>> torch.equal(a, torch.rand(2, generator=sample_generator(0, 3, epoch=1)))
    True

    :param seed: The run's seed.
    :param index: The sample's index (its epoch is read from it when it carries one).
    :param epoch: The 0-based epoch; None reads ``index.epoch``.
    :returns: A fresh generator.
    :raises ValueError: When no epoch is known.
    """
    return torch.Generator().manual_seed(sample_seed(seed, index, epoch))
