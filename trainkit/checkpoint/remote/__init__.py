"""The remote tier: every published checkpoint copied to object storage (any fsspec URL) in the background, and a
resume's newer checkpoint taken from there.

The package is housed by job: :mod:`~trainkit.checkpoint.remote.tier` holds the tier's policy
(:class:`~trainkit.checkpoint.remote.tier.RemoteTier`: the lease, uploads, catch-up, retention, verified downloads),
:mod:`~trainkit.checkpoint.remote.store` the object-store verbs it calls (plain functions: open, list, read bounded
in size and time, put, delete, the lease's conditional writes per kind of store),
:mod:`~trainkit.checkpoint.remote.manifest` its records (pure: the commit record, the lease, folder names), and
:mod:`~trainkit.checkpoint.remote.staging` its files in the run folder (staged uploads, downloads, the folder's
identity). The protocol is described in ``docs/remote.rst``.

This face exports what the rest of trainkit uses.
"""

from __future__ import annotations

from trainkit.checkpoint.remote.manifest import folder_name, folder_step
from trainkit.checkpoint.remote.staging import (
    FETCH_PREFIX,
    FOLDER_ID_FILE,
    LAST,
    LAST_DIR,
    STAGING_DIR,
    folder_identity,
    published_files,
    remove_transfer_leftovers,
)
from trainkit.checkpoint.remote.store import (
    LEASE_LOCK,
    LEASE_LOCK_S,
    READ_DEADLINE_S,
    open_store,
    shown,
    store_errors,
)
from trainkit.checkpoint.remote.tier import Anchor, Fetched, RemoteTier, Upload

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
