"""Every random generator of a process: seeding it, and capturing and restoring its state for a checkpoint.

Side effects: the process's Python, torch (CPU and CUDA) and numpy (when loaded) generators.
"""

from __future__ import annotations

import array
import random
import sys
from typing import Any

import torch

__all__ = [
    "seed_everything",
    "capture_rng",
    "restore_rng",
    "start_persistent_workers",
    "GeneratorItem",
    "loader_generators",
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
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng` (also its earlier tensor-valued form).

    :param state: The captured states.
    """
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

    Side effects: starts the loader's worker processes (and their first prefetch) when they are not running.
    Anything else (a loader without workers, not persistent, already started, not a DataLoader) is left alone.

    :param loader: The object ``self.progress()`` was given.
    """
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or not loader.persistent_workers or loader.num_workers == 0:
        return
    if getattr(loader, "_iterator", None) is not None:  # started before: its draw already happened
        return
    state = torch.get_rng_state()
    try:
        iter(loader)
    finally:
        torch.set_rng_state(state)


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
    from torch.utils.data import DataLoader

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
