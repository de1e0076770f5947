"""The best-model snapshot: copies of a model's weights that nothing outside trainkit can see.

Side effects: allocates and copies tensors; no files, no collectives.

The rule that keeps it correct: a snapshot tensor is refilled in place only while it is private, i.e. no
code outside this object has been given it. Once the snapshot is handed out (the trainer's ``best_model``
is read or assigned), somebody may hold its tensors: a model after ``load_state_dict(best, assign=True)``,
another module, a list. The next :meth:`WeightSnapshot.take` then allocates new tensors, so it can never
write into a tensor a model or a user can see. Nothing is remembered between takes but the private dict
itself: no copy plan, no views of old weights, nothing that can go stale.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trainkit import torch_private
from trainkit.state.modules import load_module_state, restore_training_modes, training_modes

__all__ = ["WeightSnapshot", "weights_swapped_in", "modes_kept"]

_FOREACH_COPY_MAX_NUMEL = 1 << 20
"""Above this many elements a tensor is copied on its own: foreach kernels are tuned for many small
tensors and copy large ones at under half of the bandwidth a plain ``copy_`` reaches (measured on an
H200), while a launch per tensor costs nothing next to copying a million elements."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's own memory: an FSDP2 ``DTensor``'s local shard (which it shares), else the tensor itself."""
    return torch_private.dtensor_local_shard(tensor)


def _reusable(held: Any, value: torch.Tensor) -> bool:
    """Whether a private snapshot tensor can take ``value`` in place: same shape, dtype, device, strided, and
    for a ``DTensor`` (an FSDP2 shard) the same kind, placements, mesh and local shard shape."""
    if type(held) is not type(value):
        return False
    if type(value) is not torch.Tensor and hasattr(value, "placements"):
        if held.placements != value.placements or held.device_mesh != value.device_mesh:
            return False
        if _local(held).shape != _local(value).shape:
            return False
    return (
        isinstance(held, torch.Tensor)
        and held.layout == torch.strided
        and value.layout == torch.strided
        and held.shape == value.shape
        and held.dtype == value.dtype
        and held.device == value.device
    )


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy ``sources`` into ``targets``: large tensors one by one, the rest in one fused foreach copy."""
    small_targets: list[torch.Tensor] = []
    small_sources: list[torch.Tensor] = []
    for target, source in zip(targets, sources):
        if source.numel() > _FOREACH_COPY_MAX_NUMEL:
            target.copy_(source)
        else:
            small_targets.append(target)
            small_sources.append(source)
    if small_targets:
        torch_private.foreach_copy_(small_targets, small_sources)


class WeightSnapshot:
    """Holds the best weights as a state dict of tensors that no model shares.

    >>> model = torch.nn.Linear(2, 1)
    >>> snapshot = WeightSnapshot()
    >>> best = snapshot.take(model.state_dict())
    >>> torch.equal(best["weight"], model.weight), best["weight"].data_ptr() != model.weight.data_ptr()
    (True, True)
    """

    __slots__ = ("_state", "_private")

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None
        self._private = False  # True while no code outside this object has been given _state

    @property
    def state(self) -> dict[str, Any] | None:
        """The snapshot, for trainkit's own readers (``test()``, ``best.pt``); reading it hands nothing out.

        Those readers only copy from it (``load_state_dict`` without ``assign``, a file write).
        """
        return self._state

    def load_into(self, model: torch.nn.Module | None) -> bool:
        """Copy the best weights into ``model``'s own tensors (the snapshot stays apart from it).

        :param model: The unwrapped model, or None.
        :returns: Whether anything was loaded (False when there is no model or no best yet).
        """
        if model is None or self._state is None:
            return False
        load_module_state(model, self._state)
        return True

    def hand_out(self) -> dict[str, Any] | None:
        """Return the snapshot to code outside trainkit; from now on its tensors are never written again.

        :returns: The snapshot state dict, or None before the first :meth:`take`.
        """
        self._private = False
        return self._state

    def replace(self, state: dict[str, Any] | None, *, private: bool = False) -> None:
        """Make ``state`` the snapshot, e.g. weights read back from ``best.pt`` or assigned by a user.

        :param state: The new snapshot, or None to forget it.
        :param private: True only when no other code holds ``state``'s tensors and no two entries share
            memory; such tensors may be refilled in place by the next :meth:`take`.
        """
        self._state = state
        self._private = private and state is not None

    def take(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Snapshot ``state`` (a model's ``state_dict()``): afterwards the snapshot equals it exactly.

        Side effects: copies into the previous snapshot's tensors when they are private and still fit
        (same shape, dtype and device), and allocates new tensors for every other entry. Non-tensor
        entries (extra state) are deep-copied. The sources are only read.

        :param state: Name to tensor or plain value.
        :returns: The new snapshot (also :attr:`state`), private until :meth:`hand_out`.
        """
        previous = self._state if self._private else None
        snapshot: dict[str, Any] = {}
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                snapshot[key] = copy.deepcopy(value)
                continue
            source = value.detach()
            held = previous.get(key) if previous is not None else None
            if held is not None and _reusable(held, source):
                # an FSDP2 shard is copied shard to shard: each rank keeps its own part, no gather
                targets.append(_local(held))
                sources.append(_local(source))
                snapshot[key] = held
            else:
                snapshot[key] = source.clone()
        _copy_all(targets, sources)
        self._state = snapshot
        self._private = True
        return snapshot


@contextlib.contextmanager
def weights_swapped_in(model: torch.nn.Module, state: dict[str, Any] | None) -> Iterator[None]:
    """Load ``state`` into ``model`` for the ``with`` block, then put back its own weights and train/eval modes.

    Side effects: two state-dict copies into ``model`` (one in, one back) and one copy of its own weights.
    With ``state`` None the model is left as it is.

    >>> model = torch.nn.Linear(1, 1)
    >>> own = model.weight.detach().clone()
    >>> with weights_swapped_in(model, {"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}):
    ...     float(model.weight.detach())
    0.0
    >>> torch.equal(model.weight, own)
    True

    :param model: The module (unwrapped from DDP and ``torch.compile`` or not: names are matched either way).
    :param state: The weights to use inside the block (e.g. the best ones), or None.
    """
    if state is None:
        yield
        return
    own, modes = WeightSnapshot().take(model.state_dict()), training_modes(model)
    load_module_state(model, state)
    try:
        yield
    finally:
        load_module_state(model, own)
        restore_training_modes(model, modes)


@contextlib.contextmanager
def modes_kept(model: torch.nn.Module | None) -> Iterator[None]:
    """Put back ``model``'s train/eval modes after the ``with`` block (an evaluation that calls ``eval()``, say).

    >>> model = torch.nn.Linear(1, 1)
    >>> with modes_kept(model):
    ...     _ = model.eval()
    >>> model.training
    True

    :param model: The module, or None (nothing to keep).
    """
    if model is None:
        yield
        return
    modes = training_modes(model)
    try:
        yield
    finally:
        restore_training_modes(model, modes)
