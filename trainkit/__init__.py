"""trainkit: a functional training engine for PyTorch.

Immutable bookkeeping records advanced by pure functions (``trainkit.bookkeeping``), a validated
config (:class:`Config`), and a thin :class:`BaseTrainer` that wires them to torch, files, W&B and
tqdm. ``import trainkit`` loads neither torch, wandb nor tqdm: the trainer is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainkit.bookkeeping import (
    BestState,
    CkptRegistry,
    LoopState,
    PatienceState,
    apply_payload,
    collect_payload,
    end_epoch,
    register_items,
    save_if_best,
    should_validate,
    step_patience,
)
from trainkit.config import (
    CkptConfig,
    Config,
    DistConfig,
    GuardConfig,
    ProgressConfig,
    TestConfig,
    ValConfig,
    WandbConfig,
    public_config,
    secret_field,
)
from trainkit.errors import (
    BookkeepingError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnsafeError,
    ConfigError,
    DistributedError,
    DivergenceError,
    HookNotImplementedError,
    OutDirError,
    RegistryError,
    TrainingInterrupted,
    TrainkitError,
    UsageError,
)

if TYPE_CHECKING:
    from trainkit.cli.certify import certify
    from trainkit.distributed.launch import fork_server, launch, spawn
    from trainkit.loop.optim import RunningMean
    from trainkit.loop.tracked_batches import SampleIndex
    from trainkit.state.rng import sample_generator, sample_seed
    from trainkit.trainer import BaseTrainer

__version__ = "0.1.0"

_LAZY = {
    "BaseTrainer": "trainkit.trainer",
    "launch": "trainkit.distributed.launch",
    "spawn": "trainkit.distributed.launch",
    "fork_server": "trainkit.distributed.launch",
    "RunningMean": "trainkit.loop.optim",
    "sample_generator": "trainkit.state.rng",
    "sample_seed": "trainkit.state.rng",
    "SampleIndex": "trainkit.loop.tracked_batches",
    "certify": "trainkit.cli.certify",
}

__all__ = [
    "BaseTrainer",
    "launch",
    "spawn",
    "fork_server",
    "RunningMean",
    "sample_generator",
    "sample_seed",
    "SampleIndex",
    "certify",
    "Config",
    "ValConfig",
    "TestConfig",
    "CkptConfig",
    "WandbConfig",
    "ProgressConfig",
    "DistConfig",
    "GuardConfig",
    "secret_field",
    "public_config",
    "BestState",
    "save_if_best",
    "PatienceState",
    "step_patience",
    "CkptRegistry",
    "register_items",
    "collect_payload",
    "apply_payload",
    "LoopState",
    "end_epoch",
    "should_validate",
    "TrainkitError",
    "ConfigError",
    "BookkeepingError",
    "RegistryError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointUnsafeError",
    "CheckpointMismatchError",
    "DistributedError",
    "DivergenceError",
    "OutDirError",
    "UsageError",
    "HookNotImplementedError",
    "TrainingInterrupted",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainkit' has no attribute {name!r}")
