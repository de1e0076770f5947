"""Checkpoint files: atomic, durable writes; verified, code-free reads; RNG capture.

Side effects: file I/O. Payloads hold only tensors and plain Python values, so every checkpoint loads
with ``torch.load(..., weights_only=True)``; trainkit never loads with ``weights_only=False``. Numpy numeric
values, slices and ``b""`` also load, through :func:`load_checkpoint`'s own checked allowlist (a bare
``torch.load`` refuses them); :func:`check_loadable` refuses anything else before a save.

This module is the one place to import these from; each job lives in a module of its own:
:mod:`trainkit.durable` (writing durably), :mod:`trainkit.zip_check` (verifying a file's structure),
:mod:`trainkit.loadable` (what a checkpoint may hold) and :mod:`trainkit.safe_load` (loading it safely).
"""

from __future__ import annotations

from trainkit.durable import (
    TEMP_SUFFIX,
    atomic_save,
    current_umask,
    fsync_directory,
    payload_nbytes,
    previous_path,
    remove_stale_temp_files,
    warn_if_low_on_space,
)
from trainkit.loadable import check_loadable

# they lived here before trainkit.rng gathered every generator's seeding, capture and restore
from trainkit.rng import capture_rng, restore_rng, seed_everything
from trainkit.safe_load import load_archive, load_checkpoint
from trainkit.zip_check import verify_checkpoint

__all__ = [
    "atomic_save",
    "previous_path",
    "load_checkpoint",
    "load_archive",
    "verify_checkpoint",
    "check_loadable",
    "capture_rng",
    "restore_rng",
    "seed_everything",
    "remove_stale_temp_files",
    "payload_nbytes",
    "warn_if_low_on_space",
    "fsync_directory",
    "current_umask",
    "TEMP_SUFFIX",
]
