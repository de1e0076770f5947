"""The checkpoint layer: payloads, the checkpointer, its storage formats, kept checkpoints, exports; and its API.

Housed by job, as orbax and torchtitan house theirs:

- :mod:`~trainkit.checkpoint.payload`: the engine's payloads (pure);
- :mod:`~trainkit.checkpoint.checkpointer`: the :class:`~trainkit.checkpoint.checkpointer.Checkpointer` part;
- :mod:`trainkit.checkpoint.formats`: the one storage interface and one class per format behind it (``.pt`` files,
  DCP directories), with the DCP directory machinery and its hostile-input reader;
- :mod:`~trainkit.checkpoint.kept`: the checkpoints kept by ``ckpt.keep``;
- :mod:`trainkit.checkpoint.export`: weights written for other programs (``python -m trainkit export``);
- :mod:`trainkit.checkpoint.remote`: the remote tier (the store's verbs, the tier's policy, its records);
- :mod:`~trainkit.checkpoint.compare`: two checkpoints compared.

This face exports the checkpoint API, each name imported on first use (so that importing one module of the layer
does not import them all) and documented where it is defined: the checkpointer and its records
(:class:`~trainkit.checkpoint.checkpointer.Checkpointer`, ``Resume``, ``SaveRecord``, ``load_item``), the storage
formats (:class:`~trainkit.checkpoint.formats.base.Storage`, ``SaveRequest``, ``BestWeights``,
:class:`~trainkit.checkpoint.formats.pt.PtStorage`, :class:`~trainkit.checkpoint.formats.dcp.DcpStorage`, the
sharded directory check :func:`~trainkit.checkpoint.formats.dcp_read.verify_directory`), the kept checkpoints
(:class:`~trainkit.checkpoint.kept.KeptCheckpoints`) and the payloads' schema (``SCHEMA_VERSION``,
``last_payload``, ``best_payload``, ``validate_last``, ``validate_best``, ``resume_refusal`` of
:mod:`~trainkit.checkpoint.payload`). Beside them, as it always has, it exports a checkpoint file's writes and reads
from :mod:`trainkit.files` (atomic, durable writes; verified, code-free reads), documented below; modules of
trainkit import those from :mod:`trainkit.files` itself.

Side effects: file I/O. Payloads hold only tensors and plain Python values, so every checkpoint loads
with ``torch.load(..., weights_only=True)``; trainkit never loads with ``weights_only=False``. Numpy numeric
values, slices and ``b""`` also load, through :func:`load_checkpoint`'s own checked allowlist (a bare
``torch.load`` refuses them); :func:`check_loadable` refuses anything else before a save.
"""

from __future__ import annotations

import importlib
from typing import Any

from trainkit.files.allowlist import check_loadable
from trainkit.files.durable import (
    TEMP_SUFFIX,
    atomic_save,
    atomic_write_bytes,
    current_umask,
    fsync_directory,
    payload_nbytes,
    previous_path,
    remove_stale_temp_files,
    warn_if_low_on_space,
)
from trainkit.files.weights_only_load import load_archive, load_checkpoint
from trainkit.files.zip_check import verify_checkpoint

_API = {
    "Checkpointer": "trainkit.checkpoint.checkpointer",
    "Resume": "trainkit.checkpoint.checkpointer",
    "SaveRecord": "trainkit.checkpoint.checkpointer",
    "load_item": "trainkit.checkpoint.checkpointer",
    "Storage": "trainkit.checkpoint.formats.base",
    "SaveRequest": "trainkit.checkpoint.formats.base",
    "BestWeights": "trainkit.checkpoint.formats.base",
    "PtStorage": "trainkit.checkpoint.formats.pt",
    "DcpStorage": "trainkit.checkpoint.formats.dcp",
    "verify_directory": "trainkit.checkpoint.formats.dcp_read",
    "KeptCheckpoints": "trainkit.checkpoint.kept",
    "SCHEMA_VERSION": "trainkit.checkpoint.payload",
    "last_payload": "trainkit.checkpoint.payload",
    "best_payload": "trainkit.checkpoint.payload",
    "validate_last": "trainkit.checkpoint.payload",
    "validate_best": "trainkit.checkpoint.payload",
    "resume_refusal": "trainkit.checkpoint.payload",
}
"""The checkpoint API's names, each with the module that defines it (imported on first use)."""

__all__ = [
    "atomic_save",
    "atomic_write_bytes",
    "previous_path",
    "load_checkpoint",
    "load_archive",
    "verify_checkpoint",
    "check_loadable",
    "remove_stale_temp_files",
    "payload_nbytes",
    "warn_if_low_on_space",
    "fsync_directory",
    "current_umask",
    "TEMP_SUFFIX",
    *_API,
]


def __getattr__(name: str) -> Any:
    """The checkpoint API's names, imported on first use (the checkpointer imports most of the layer).

    :param name: A name of the API.
    :returns: What it names.
    :raises AttributeError: For any other name.
    """
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Every name of the face, the lazily imported ones included.

    :returns: The names.
    """
    return sorted({*globals(), *_API})
