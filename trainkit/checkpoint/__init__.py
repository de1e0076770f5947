"""The checkpoint layer: payloads, the checkpointer, its storage formats, kept checkpoints; and this face for files.

The layer owns the engine's payloads (:mod:`~trainkit.checkpoint.payload`), the
:class:`~trainkit.checkpoint.checkpointer.Checkpointer` part and the one storage interface under it
(:mod:`~trainkit.checkpoint.storage`), the ``.pt`` format (:mod:`~trainkit.checkpoint.pt_files`, with background writes
in :mod:`~trainkit.checkpoint.async_save`), the sharded DCP format (:mod:`~trainkit.checkpoint.dcp`, read as hostile
input by :mod:`~trainkit.checkpoint.dcp_read`, laid out in the run folder by :mod:`~trainkit.checkpoint.dcp_files`)
and the checkpoints kept by ``ckpt.keep`` (:mod:`~trainkit.checkpoint.kept`).

This face is the one place to import a checkpoint file's writes and reads from: atomic, durable writes; verified,
code-free reads.

Side effects: file I/O. Payloads hold only tensors and plain Python values, so every checkpoint loads
with ``torch.load(..., weights_only=True)``; trainkit never loads with ``weights_only=False``. Numpy numeric
values, slices and ``b""`` also load, through :func:`load_checkpoint`'s own checked allowlist (a bare
``torch.load`` refuses them); :func:`check_loadable` refuses anything else before a save.

Each job lives in a module of its own: :mod:`trainkit.files.durable` (writing durably),
:mod:`trainkit.files.zip_check` (verifying a file's structure), :mod:`trainkit.files.allowlist` (what a checkpoint
may hold) and :mod:`trainkit.files.weights_only_load` (loading it safely).
"""

from __future__ import annotations

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
]
