"""The remote tier's files in the run folder: the folder's identity, the staged files an upload reads, the download
folder a fetched checkpoint is verified in and published from, and what killed runs left of them.

Side effects: creates, links, copies, moves and removes files under ``out_dir`` (``.trainkit-folder-id``,
``.remote-staging/``, ``.remote-fetch-*``); warnings.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from trainkit.checkpoint.remote.manifest import folder_id
from trainkit.errors import TrainkitError
from trainkit.files.bounded_read import read_regular
from trainkit.files.checksum import CHUNK
from trainkit.files.durable import atomic_write_bytes, fsync_directory, link_or_copy
from trainkit.messages import warn_user

__all__ = [
    "FOLDER_ID_FILE",
    "STAGING_DIR",
    "FETCH_PREFIX",
    "LAST",
    "LAST_DIR",
    "PUBLISHED_NAMES",
    "folder_identity",
    "remove_transfer_leftovers",
    "stage_files",
    "published_files",
    "publish_fetched",
]

FOLDER_ID_FILE = ".trainkit-folder-id"
"""The file in ``out_dir`` that holds the run folder's identity (:func:`folder_identity`), named in its leases."""
STAGING_DIR = ".remote-staging"
"""The folder under ``out_dir`` where handed-over files wait (hard links) for their upload, in a folder per rank."""
FETCH_PREFIX = ".remote-fetch-"
"""The prefix of the folder under ``out_dir`` where a remote checkpoint is downloaded and verified."""
LAST = "last.pt"
"""The object that makes a remote folder a file checkpoint to resume (published into ``out_dir`` last)."""
LAST_DIR = "last.ckpt"
"""The directory that makes a remote folder a sharded checkpoint to resume (its files under ``last.ckpt/``)."""
PUBLISHED_NAMES = frozenset({"best.pt", LAST, "best.ckpt", LAST_DIR, "metrics.jsonl"})
"""The only top-level names a remote checkpoint may hold: what the uploader writes, and all a fetch may publish."""

_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def folder_identity(out_dir: Path) -> str | None:
    """The run folder's identity, named in the leases its runs take: read from :data:`FOLDER_ID_FILE` (a regular
    file of 32 lowercase hex digits; anything else is replaced), or drawn and written there first. Call it holding
    the folder's lock (rank 0, :class:`~trainkit.run.lock.RunLock`): a lease naming it is then one that a run of
    this folder left, and none runs here any more.

    Side effects: creates or replaces ``out_dir/.trainkit-folder-id``.

    :param out_dir: The run folder (it exists).
    :returns: The identity, or None (warned) when it cannot be written: this run's lease is then never taken over
        early.
    """
    path = out_dir / FOLDER_ID_FILE
    try:
        known = folder_id(read_regular(path, 64).decode("ascii").strip())
    except (OSError, UnicodeDecodeError):  # missing, a link, a folder, too large: replaced (atomically, not through)
        known = None
    if known is not None:
        return known
    fresh = secrets.token_hex(16)
    try:
        atomic_write_bytes(fresh.encode() + b"\n", path)
    except (OSError, TrainkitError) as exc:
        warn_user(f"{path} cannot be written ({exc}); a rerun of this run waits for its lease to expire")
        return None
    return fresh


def remove_transfer_leftovers(out_dir: Path) -> list[Path]:
    """Remove what killed runs left in ``out_dir``: staged files (``.remote-staging/``, hard links of dead
    checkpoints) and downloads (``.remote-fetch-*``). Links are removed, never followed.

    Call it only while holding ``out_dir``'s lock, before any rank stages (rank 0, when the run claims the folder):
    a live run's files are never touched.

    :param out_dir: The run folder.
    :returns: What was removed.
    """
    removed = []
    for path in [out_dir / STAGING_DIR, *out_dir.glob(f"{FETCH_PREFIX}*")]:
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def stage_files(staged: Path, files: list[tuple[Path, str, int | None]]) -> tuple[tuple[str, int], ...]:
    """Stage just-published files for an upload in the new folder ``staged``: each a hard link, so the next publish
    cannot change it (a durable copy where the file system has none, :func:`~trainkit.files.durable.link_or_copy`),
    or a copy of its first ``size`` bytes (``metrics.jsonl`` grows while the upload runs: its prefix, frozen on disk).

    :param staged: The staging folder (created; removed again when staging fails).
    :param files: ``(path, name, size)`` of each file: ``name`` is its name in the folder (it may hold ``/``); only
        the first ``size`` bytes are staged (None: the whole file). A missing file is left out.
    :returns: ``(name, size)`` of each file staged.
    :raises OSError: When a file cannot be staged.
    """
    listed = []
    try:
        for path, name, size in files:
            target = staged / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                if size is not None:
                    _copy_prefix(path, target, size)
                else:
                    link_or_copy(path, target)
            except FileNotFoundError:
                continue
            listed.append((name, os.stat(target).st_size))
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return tuple(listed)


def _copy_prefix(source: Path, target: Path, size: int) -> None:
    """Copy the first ``size`` bytes of ``source`` (fewer if it is shorter) to the new file ``target``, in chunks."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        remaining = size
        while remaining and (chunk := src.read(min(CHUNK, remaining))):
            dst.write(chunk)
            remaining -= len(chunk)


def published_files(
    checkpoints: list[Path], metrics: Path, metrics_size: int | None, *, rank: int
) -> list[tuple[Path, str, int | None]]:
    """What this rank uploads of a just-published save: a file checkpoint whole (rank 0), or this rank's own files
    of a sharded directory (``__<rank>_<n>.distcp``; rank 0 also the rest: ``.metadata``, ``trainkit.pt``, the
    manifest); ``metrics.jsonl`` up to ``metrics_size`` bytes (rank 0). ``last`` comes last.

    :param checkpoints: ``best`` then ``last`` (files, or directories).
    :param metrics: ``metrics.jsonl``.
    :param metrics_size: Its size the checkpoint records (None: not uploaded).
    :param rank: This rank.
    :returns: ``(path, remote name, size or None for the whole file)`` triples.
    """
    files: list[tuple[Path, str, int | None]] = []
    if metrics_size:
        files.append((metrics, metrics.name, metrics_size))
    for path in checkpoints:
        if path.is_dir() and not path.is_symlink():
            for entry in sorted(path.iterdir()):
                shard = _SHARD.fullmatch(entry.name)
                if (int(shard[1]) == rank if shard else rank == 0) and entry.is_file() and not entry.is_symlink():
                    files.append((entry, f"{path.name}/{entry.name}", None))
        elif rank == 0:
            files.append((path, path.name, None))
    return files


def publish_fetched(folder: Path, out_dir: Path, names: list[str]) -> None:
    """Move verified files and directories into ``out_dir`` (each an atomic rename; ``last.pt`` or ``last.ckpt/``,
    which makes it a checkpoint, last). A directory in the way (an older local ``last.ckpt/``) is moved aside first
    and deleted.

    :param folder: The download folder (under ``out_dir``).
    :param out_dir: The run folder.
    :param names: The top-level names, in the order to publish them.
    """
    for name in names:
        target = out_dir / name
        if target.is_dir() and not target.is_symlink():
            aside = out_dir / f"{FETCH_PREFIX}old-{secrets.token_hex(8)}"
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder / name, target)
    fsync_directory(out_dir)
    shutil.rmtree(folder, ignore_errors=True)
