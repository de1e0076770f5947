"""The remote tier: every published checkpoint copied to object storage in the background (interim face)."""

from __future__ import annotations

from trainkit.checkpoint.remote.manifest import folder_name, folder_step
from trainkit.checkpoint.remote.tier import (
    FETCH_PREFIX,
    FOLDER_ID_FILE,
    LAST,
    LAST_DIR,
    LEASE_LOCK,
    LEASE_LOCK_S,
    READ_DEADLINE_S,
    STAGING_DIR,
    Anchor,
    Fetched,
    RemoteTier,
    Upload,
    folder_identity,
    open_store,
    published_files,
    remove_transfer_leftovers,
    shown,
    store_errors,
)

__all__ = [
    "RemoteTier",
    "Upload",
    "Anchor",
    "Fetched",
    "open_store",
    "store_errors",
    "shown",
    "folder_identity",
    "folder_name",
    "folder_step",
    "published_files",
    "remove_transfer_leftovers",
    "FETCH_PREFIX",
    "FOLDER_ID_FILE",
    "LAST",
    "LAST_DIR",
    "LEASE_LOCK",
    "LEASE_LOCK_S",
    "READ_DEADLINE_S",
    "STAGING_DIR",
]
