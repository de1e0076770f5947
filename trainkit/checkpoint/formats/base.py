"""The one storage interface of a run's checkpoints, which each format answers, and what a save hands it.

:class:`~trainkit.checkpoint.checkpointer.Checkpointer` picks a format at construction (``ckpt.format``:
:class:`~trainkit.checkpoint.formats.pt.PtStorage` for ``"file"``, :class:`~trainkit.checkpoint.formats.dcp.DcpStorage`
for ``"sharded"``) and never asks which it has: both take the same :class:`SaveRequest`, answer the same
:class:`Storage` calls with the same signatures, and do the format's own work (which rank writes, the best's
agreement across ranks, the DCP state dicts, conversions between wraps) inside.

Side effects: none here (the formats have them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs
from torch import nn

from trainkit import bookkeeping
from trainkit.state.modules import module_state

__all__ = ["SaveRequest", "BestWeights", "Storage", "item_state"]


def item_state(obj: Any) -> Any:
    """A registered object's state: modules under names free of ``torch.compile``'s ``_orig_mod.``.

    :param obj: A registered object with ``state_dict()``.
    :returns: Its state.
    """
    return module_state(obj) if isinstance(obj, nn.Module) else obj.state_dict()


@attrs.frozen(kw_only=True)
class SaveRequest:
    """What one save writes: the registered items, the engine's payload, and the best weights when they changed.

    :ivar registry: The checkpoint registry (its objects' states are read by the storage).
    :ivar engine: Builds the ``last`` payload from the items' states (called on rank 0 only).
    :ivar best_weights: The best weights (each rank's own shards under FSDP2), when the best changed since the
        last save; None otherwise.
    :ivar best: The best record, with ``best_weights``.
    :ivar config: The config as saved (``public_config``), for ``best``'s payload.
    :ivar epoch: The epoch being saved (names a sharded save's temporary directory).
    :ivar step: The optimizer step (the same).
    :ivar before: Done before the first file is published: makes ``metrics.jsonl`` durable before ``last`` records
        its size (the file format runs it beside its first write, the sharded one before its writes); None when
        nothing needs it.
    :ivar after: Called once ``last`` is published, where the writes run (keeps it under ``checkpoints/``;
        for a sharded one on rank 0 once every rank's shards are published); None for nothing.
    """

    registry: bookkeeping.CkptRegistry
    engine: Callable[[dict[str, Any]], dict[str, Any]]
    best_weights: dict[str, Any] | None
    best: bookkeeping.BestState | None
    config: dict[str, Any]
    epoch: int
    step: int
    before: Callable[[], None] | None
    after: Callable[[], None] | None = None


@attrs.frozen(kw_only=True)
class BestWeights:
    """Best weights read back at a resume.

    :ivar weights: The state dict, in this run's layout (each rank's shards under FSDP2).
    :ivar private: No other code holds its tensors (the snapshot may refill them in place).
    :ivar rewrite: This run's folder lacks them in its format: the next save writes them.
    """

    weights: dict[str, Any]
    private: bool
    rewrite: bool


class Storage(Protocol):
    """What the :class:`~trainkit.checkpoint.checkpointer.Checkpointer` asks of a checkpoint format (each one does it:
    :class:`~trainkit.checkpoint.formats.pt.PtStorage`, :class:`~trainkit.checkpoint.formats.dcp.DcpStorage`)."""

    last_path: Path
    """Where ``last`` is written."""
    best_path: Path
    """Where ``best`` is written."""

    @property
    def last_seconds(self) -> float | None: ...

    def published(self) -> list[Path]: ...

    def load_resume(self, resume: str) -> tuple[dict[str, Any] | None, Path | None]: ...

    def best_weights(
        self, directory: Path, best: bookkeeping.BestState, model: nn.Module | None
    ) -> BestWeights | None: ...

    def save_checkpoint(self, request: SaveRequest) -> float | None: ...

    def lost_best(self, tracked: bool) -> bool: ...

    def wait(self) -> None: ...

    def wait_local(self) -> None: ...

    def abandon(self) -> None: ...

    def release(self) -> None: ...
