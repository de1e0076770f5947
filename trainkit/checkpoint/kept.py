"""Kept checkpoints on disk: ``out_dir/checkpoints/step-<step>.pt`` (or ``step-<step>.ckpt/`` directories with
``ckpt.format="sharded"``), their index, and deleting what is not kept.

Side effects: files in ``out_dir/checkpoints/`` (rank 0 only) and a background deletion thread. The decision
of what to keep is the pure :func:`trainkit.bookkeeping.retain`; this part describes what is on disk, asks it,
and deletes the rest.

The rules this part keeps:

- A kept checkpoint is a hard link to the ``last.pt`` just published (made under a temp name and renamed into
  place; a durable copy where the filesystem has no hard links), so it is as whole and as checked as
  ``last.pt`` was, and ``last.pt`` being replaced later (``os.replace``) leaves it as it was.
- A kept sharded checkpoint is a directory of hard links to the files of the ``last.ckpt/`` just published
  (its shards, ``trainkit.pt`` and the manifest; copies where links fail), built under a temp name, fsynced
  and published by one rename, so a resume checks it by its manifest exactly as it checks ``last.ckpt/``.
  It is deleted by a rename to a trash name first (``.step-<int>.ckpt.<pid>.<n>.trash``), then removed: a
  kill during the removal never leaves a half directory under a kept name, and the leftover is cleaned later.
- Only names trainkit writes are ever touched: ``step-<int>.pt`` (a regular file) and ``step-<int>.ckpt`` (a
  directory) exactly, and ``.step-<int>.pt.<pid>.<n>.tmp`` (``.ckpt``, ``.trash``) leftovers of a killed link
  or deletion whose process is gone. A symbolic link or any other file kind under such a name is never
  followed, replaced nor deleted (it is warned about and left out of retention).
- Deletion removes whole files, one ``unlink`` each, in a background thread that the next save and the end of
  the run join: a kill during it leaves every remaining checkpoint whole and loadable.
- ``checkpoints/index.json`` (written atomically) records each kept checkpoint's epoch, wall time and scores,
  which the file name does not hold; it is read as hostile input, entry by entry, and a checkpoint it does not
  describe (or describes badly) is judged by its step alone: its epoch counts as unknown (0, inside an epoch),
  its time is the file's modification time, it has no scores.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import attrs

from trainkit import bookkeeping
from trainkit.errors import BookkeepingError
from trainkit.files.bounded_read import UnreadableFile, load_json, read_regular
from trainkit.files.durable import current_umask, fsync_directory, link_or_copy, process_gone
from trainkit.messages import warn_user

__all__ = [
    "KEPT_DIR",
    "INDEX_FILE",
    "KeptCheckpoints",
    "kept_name",
    "kept_step",
    "kept_path",
    "run_folder_of",
    "read_kept",
    "KeptFolder",
    "remove_kept",
    "directory_problem",
    "folder_problem",
]

KEPT_DIR = "checkpoints"
INDEX_FILE = "index.json"
INDEX_FORMAT = 1
MAX_INDEX_BYTES = 16 << 20
"""The most bytes ``index.json`` may hold (a million checkpoints' entries fit in far less)."""

# matched whole (fullmatch): "$" would also admit a name ending in a newline, which no kept path spells
_KEPT_NAME = re.compile(r"step-(0|[1-9][0-9]{0,17})\.(pt|ckpt)")
_TEMP_NAME = re.compile(r"\.(?:step-(?:0|[1-9][0-9]{0,17})\.(?:pt|ckpt)|index\.json)\.(?P<pid>\d+)\.\d+\.(?:tmp|trash)")
SUFFIXES = (".pt", ".ckpt")
"""A kept checkpoint's name ends in ``.pt`` (a file, ``ckpt.format="file"``) or ``.ckpt`` (a directory)."""
_COUNTER = itertools.count()


def kept_name(step: int, suffix: str = ".pt") -> str:
    """The name of the kept checkpoint of ``step``: a file (``.pt``) or a sharded directory (``.ckpt``).

    >>> kept_name(1200), kept_name(1200, ".ckpt")
    ('step-1200.pt', 'step-1200.ckpt')
    """
    return f"step-{step}{suffix}"


def kept_step(name: str) -> int | None:
    """The step a kept checkpoint's name holds, or None for a name trainkit does not write.

    >>> kept_step("step-1200.pt"), kept_step("step-7.ckpt"), kept_step("step-01.pt"), kept_step("step-5.pt\\n")
    (1200, 7, None, None)
    """
    found = _KEPT_NAME.fullmatch(name)
    return int(found[1]) if found else None


def _right_kind(name: str, mode: int) -> bool:
    """Whether ``mode`` is the kind trainkit writes under ``name``: a regular ``.pt`` file, a ``.ckpt`` directory."""
    return stat.S_ISDIR(mode) if name.endswith(".ckpt") else stat.S_ISREG(mode)


def kept_path(directory: Path, step: int) -> Path:
    """The kept checkpoint of ``step`` in ``directory``: ``step-<step>.pt`` if a regular file is there, else
    ``step-<step>.ckpt`` if a directory is (no link is followed), else the ``.pt`` name.

    :param directory: ``out_dir/checkpoints``.
    :param step: The step.
    :returns: Its path.
    """
    for suffix in SUFFIXES:
        path = directory / kept_name(step, suffix)
        try:
            if _right_kind(path.name, os.lstat(path).st_mode):
                return path
        except OSError:
            continue
    return directory / kept_name(step)


def run_folder_of(path: Path) -> Path:
    """The run folder a checkpoint belongs to: its folder, or for a kept one (``checkpoints/step-N.pt`` or
    ``checkpoints/step-N.ckpt``) the folder above (where its best checkpoint and ``metrics.jsonl`` are).

    :param path: A checkpoint's path.
    :returns: Its run folder.
    """
    if path.parent.name == KEPT_DIR and kept_step(path.name) is not None:
        return path.parent.parent
    return path.parent


def remove_kept(path: Path) -> bool:
    """Delete one kept checkpoint: a regular ``.pt`` file or a ``.ckpt`` directory only, never what a link points to.

    A directory is renamed to a trash name first and removed from there (without following a link inside),
    so a kill during its removal leaves no half directory under a kept name.

    :param path: ``checkpoints/step-<step>.pt`` or ``checkpoints/step-<step>.ckpt``.
    :returns: Whether it was deleted (False: gone already, or not of the kind trainkit writes, which is warned about).
    :raises NotADirectoryError: When the folder holding it is a symbolic link or not a directory (nothing is deleted).
    """
    problem = directory_problem(path.parent)
    if problem is not None:
        raise NotADirectoryError(f"{problem}; nothing is deleted through it")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not _right_kind(path.name, info.st_mode):
        warn_user(f"{path} is not a checkpoint that trainkit wrote ({_kind(info.st_mode)}); it is left alone")
        return False
    if stat.S_ISDIR(info.st_mode):
        return _remove_directory(path)
    os.unlink(path)  # unlink removes a name, never a link's target, even if the name was swapped meanwhile
    return True


def _remove_directory(path: Path) -> bool:
    """Rename a kept directory to a trash name, make that durable, then remove it (``rmtree`` refuses a link and
    never follows one inside)."""
    trash = path.with_name(f".{path.name}.{os.getpid()}.{next(_COUNTER)}.trash")
    os.rename(path, trash)  # renames the name itself: a link swapped in meanwhile is moved, not followed
    fsync_directory(path.parent)
    if not stat.S_ISDIR(os.lstat(trash).st_mode):  # swapped for something else since the check: put it back
        os.rename(trash, path)
        warn_user(f"{path} changed into something trainkit did not write while it was deleted; it is left alone")
        return False
    shutil.rmtree(trash)
    return True


def _kind(mode: int) -> str:
    from trainkit.files.bounded_read import file_kind

    return file_kind(mode)


def _describe(entry: Any, step: int) -> bookkeeping.Checkpoint | None:
    if not isinstance(entry, Mapping):
        return None
    scores = entry.get("scores", {})
    if not isinstance(scores, Mapping) or not all(isinstance(v, int | float) for v in scores.values()):
        return None
    try:
        return bookkeeping.Checkpoint(
            step=step,
            epoch=entry.get("epoch", 0),
            epoch_end=entry.get("epoch_end", False),
            time=entry.get("time", 0.0),
            scores=scores,
        )
    except (BookkeepingError, TypeError):
        return None


def directory_problem(directory: Path) -> str | None:
    """Say why ``directory`` (``out_dir/checkpoints``) cannot be read or written through, or None when it can.

    A symbolic link (even to a directory) or anything but a directory in its place is refused: whatever trainkit
    writes or deletes stays inside the run folder, so a link out of it is never followed.

    :param directory: ``out_dir/checkpoints``.
    :returns: The reason (naming the path and what is there), or None for a directory or no entry at all.
    """
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{directory} cannot be examined ({exc})"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is {_kind(info.st_mode)}, not a directory trainkit made"
    return None


def folder_problem(directory: Path) -> str | None:
    """Say why checkpoints cannot be kept (nor deleted by rules) in ``directory``, or None when they can.

    :func:`directory_problem`'s reasons, and anything but a regular file at ``index.json`` (a directory, a link, a
    FIFO): the index could not be written, and a kept checkpoint without its description would be judged by its
    name alone.

    :param directory: ``out_dir/checkpoints``.
    :returns: The reason (naming the path and what is there), or None.
    """
    problem = directory_problem(directory)
    if problem is not None:
        return problem
    try:
        index = os.lstat(directory / INDEX_FILE)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"{directory / INDEX_FILE} cannot be examined ({exc})"
    if not stat.S_ISREG(index.st_mode):
        return f"{directory / INDEX_FILE} is {_kind(index.st_mode)}, not the index trainkit writes"
    return None


def read_index(
    directory: Path,
) -> tuple[dict[int, bookkeeping.Checkpoint], bool | None, tuple[str, ...] | None, int | None]:
    """Read ``checkpoints/index.json`` as hostile input: the entries that check out, the run's direction and rules,
    and the step of the newest checkpoint the run kept.

    :param directory: ``out_dir/checkpoints``.
    :returns: ``({step: description}, minimize, keep, newest)``; ``({}, None, None, None)`` when there is no
        usable index (warned unless it is missing); ``keep`` is None when the recorded rules do not parse,
        ``newest`` when the index records none (or not a step).
    """
    path = directory / INDEX_FILE
    try:
        data = load_json(read_regular(path, MAX_INDEX_BYTES))
    except UnreadableFile as exc:
        if exc.reason != "missing":
            warn_user(f"{exc}; the kept checkpoints are judged by their steps alone")
        return {}, None, None, None
    except ValueError as exc:
        warn_user(f"{path} is not JSON ({exc}); the kept checkpoints are judged by their steps alone")
        return {}, None, None, None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT or not isinstance(data.get("kept"), dict):
        warn_user(f"{path} is not a trainkit index of kept checkpoints; they are judged by their steps alone")
        return {}, None, None, None
    found: dict[int, bookkeeping.Checkpoint] = {}
    bad = 0
    for key, entry in data["kept"].items():
        step = kept_step(f"step-{key}.pt")
        described = _describe(entry, step) if step is not None else None
        if described is None:
            bad += 1
            continue
        found[described.step] = described
    if bad:
        warn_user(f"{path}: {bad} entries do not check out and are ignored")
    minimize = data.get("minimize")
    keep = data.get("keep")
    try:
        rules = tuple(keep) if isinstance(keep, list) and bookkeeping.parse_keep(keep) is not None else None
    except BookkeepingError:
        rules = None
    newest = data.get("newest")
    if not (type(newest) is int and 0 <= newest < 10**18):
        newest = None  # absent (an older index) or not a step: the largest step on disk is the newest
    return found, minimize if isinstance(minimize, bool) else None, rules, newest


@attrs.frozen(kw_only=True)
class KeptFolder:
    """What a run folder's ``checkpoints/`` holds, as :func:`read_kept` found it.

    :ivar described: The kept checkpoints, in step order (from the index, else from the name and the file's time).
    :ivar refused: The entries under a kept name that trainkit did not write (links, other kinds), with their kind.
    :ivar minimize: The run's direction, as the index recorded it (None: not recorded).
    :ivar keep: The run's ``ckpt.keep``, as the index recorded it (None: not recorded, or not rules).
    :ivar newest: The step of the newest checkpoint the run kept (None: not recorded; the largest step is).
    """

    described: tuple[bookkeeping.Checkpoint, ...] = attrs.field(converter=tuple)
    refused: tuple[str, ...] = attrs.field(converter=tuple)
    minimize: bool | None
    keep: tuple[str, ...] | None
    newest: int | None


def read_kept(directory: Path) -> KeptFolder:
    """Describe the kept checkpoints in ``directory``: regular files named ``step-<int>.pt`` and directories named
    ``step-<int>.ckpt`` only, never through a link.

    :param directory: ``out_dir/checkpoints``.
    :returns: What is there, and what the index recorded of the run.
    """
    index, minimize, keep, newest = read_index(directory)
    described, refused = on_disk(directory, index)
    return KeptFolder(described=described, refused=refused, minimize=minimize, keep=keep, newest=newest)


def on_disk(
    directory: Path, known: Mapping[int, bookkeeping.Checkpoint]
) -> tuple[list[bookkeeping.Checkpoint], list[str]]:
    """The kept checkpoints in ``directory`` (regular files named ``step-<int>.pt``, directories named
    ``step-<int>.ckpt``), described by ``known`` or, for one it lacks, by its name and modification time; and the
    entries refused under a kept name. A step kept under both names counts once.

    :param directory: ``out_dir/checkpoints``.
    :param known: Descriptions by step (the index's, or the ones this run recorded).
    :returns: The descriptions in step order, and the refused entries' names with their kinds.
    """
    described: list[bookkeeping.Checkpoint] = []
    refused: list[str] = []
    seen: set[int] = set()
    if directory_problem(directory) is not None:  # a link out of the run folder is never followed, even to read
        return [], []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return [], []
    for entry in entries:
        step = kept_step(entry.name)
        if step is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not _right_kind(entry.name, info.st_mode):
            refused.append(f"{entry.name} ({_kind(info.st_mode)})")
            continue
        if step in seen:
            continue
        seen.add(step)
        found = known.get(step)
        mtime = info.st_mtime if math.isfinite(info.st_mtime) else 0.0
        described.append(found if found is not None else bookkeeping.Checkpoint(step=step, epoch_end=False, time=mtime))
    described.sort(key=lambda c: c.step)
    return described, refused


def _index_entry(c: bookkeeping.Checkpoint) -> dict[str, Any]:
    return {
        "epoch": c.epoch,
        "epoch_end": c.epoch_end,
        "time": c.time,
        "scores": {name: value for name, value in c.scores.items() if math.isfinite(value)},
    }


def write_index(
    directory: Path,
    kept: Iterable[bookkeeping.Checkpoint],
    minimize: bool | None,
    keep: tuple[str, ...] | None,
    *,
    newest: int | None = None,
) -> None:
    """Write ``checkpoints/index.json`` atomically and durably (a temp file of its own, renamed into place).

    :param directory: ``out_dir/checkpoints``.
    :param kept: The descriptions to record.
    :param minimize: The run's direction (for ``best`` rules without one, read by ``trainkit retain``).
    :param keep: The run's ``ckpt.keep`` (what ``trainkit inspect`` explains the kept ones by).
    :param newest: The step of the newest checkpoint the run wrote (a kept one with a larger step is not the
        run's, see :func:`~trainkit.bookkeeping.keep_reasons`); None: the largest step is.
    :raises NotADirectoryError: When ``directory`` is a symbolic link or not a directory (nothing is written).
    :raises OSError: When the file cannot be written; the index before it is left as it was.
    """
    problem = folder_problem(directory)
    if problem is not None:
        raise NotADirectoryError(f"{problem}; {INDEX_FILE} is not written there")
    data = {
        "format": INDEX_FORMAT,
        "minimize": minimize,
        "keep": list(keep) if keep is not None else None,
        "newest": newest,
        "kept": {str(c.step): _index_entry(c) for c in sorted(kept, key=lambda c: c.step)},
    }
    text = json.dumps(data, indent=1, allow_nan=False).encode()
    tmp = directory / f".{INDEX_FILE}.{os.getpid()}.{next(_COUNTER)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / INDEX_FILE)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


class KeptCheckpoints:
    """Rank 0's kept checkpoints of one run folder: publish each new one, delete what the policy lets go.

    A save describes its checkpoint in ``index.json`` (:meth:`announce`) before the checkpoint is written, and
    keeps it (:meth:`publish`) once it is published: a kill at any moment between leaves the description on disk,
    where the link, or the resume that makes it (:meth:`keep_resumed`), finds it.

    :param out_dir: The run folder.
    :param keep: ``ckpt.keep``: the rules (see :func:`~trainkit.bookkeeping.parse_keep`).
    :param writes: Whether this process writes checkpoints (rank 0 of a run with ``ckpt.enable``).
    :param sharded: Keep ``last.ckpt/`` directories as ``step-<step>.ckpt/`` (``ckpt.format="sharded"``) rather
        than ``last.pt`` files as ``step-<step>.pt``.
    """

    def __init__(self, out_dir: Path, keep: tuple[str, ...], *, writes: bool, sharded: bool = False) -> None:
        self.directory = out_dir / KEPT_DIR
        self._keep = keep
        self._suffix = ".ckpt" if sharded else ".pt"
        self.active = writes and bool(keep)
        self._known: dict[int, bookkeeping.Checkpoint] | None = None  # read from disk at the first use
        self._recorded: dict[int, bookkeeping.Checkpoint] = {}  # what index.json described then, files or not
        self._announced: bookkeeping.Checkpoint | None = None  # in index.json already, its checkpoint not kept yet
        self._deleter: threading.Thread | None = None
        self._disabled = False
        self._unranked: set[str] = set()  # the best rules warned about as ranking nothing
        self.resumed_from: int | None = None
        """The step of the kept checkpoint of this folder the run resumed from (``ckpt.resume`` named it): never
        deleted while the run goes on, so the same command run again finds it."""

    def policy(self, minimize: bool) -> bookkeeping.KeepAny:
        """The rules as a policy, ``best`` rules without a direction taking ``minimize``."""
        return bookkeeping.parse_keep(self._keep, minimize=minimize)

    def _ready(self) -> bool:
        """Make ``checkpoints/`` and read what it keeps (at the first use); False when this run keeps nothing there
        (a link in its place: warned once)."""
        if self._disabled:
            return False
        problem = folder_problem(self.directory)
        if problem is not None:
            self._disabled = True
            warn_user(f"{problem}; no checkpoints are kept there in this run (move it away to keep them)")
            return False
        self.directory.mkdir(exist_ok=True)
        if self._known is None:
            self._remove_stale_temp_files()
            self._recorded = read_index(self.directory)[0]
            self._known = {c.step: c for c in on_disk(self.directory, self._recorded)[0]}
        return True

    def _on_disk(self) -> dict[int, bookkeeping.Checkpoint]:
        """The kept checkpoints on disk now, by step (a file removed or added by hand meanwhile counts as it is)."""
        return {c.step: c for c in on_disk(self.directory, self._known or {})[0]}

    def announce(self, description: bookkeeping.Checkpoint, *, minimize: bool) -> None:
        """Describe a checkpoint in ``index.json`` before it is written, so that no kill can lose its description:
        one after ``last`` is published and before it is kept leaves it for the resume that keeps it.

        Runs beside the save's first write (in a thread of its own) and is done before that write publishes its
        file. A failure does not stop the save: :meth:`publish` writes the index again (and warns when it cannot).

        :param description: What retention needs to know of the checkpoint about to be written.
        :param minimize: The run's direction.
        """
        if not self.active:
            return
        self.join()
        try:
            if not self._ready():
                return
            entries = {**self._on_disk(), description.step: description}
            write_index(self.directory, entries.values(), minimize, self._keep, newest=description.step)
        except OSError:
            return  # publish() writes the index again, and warns if that fails too: one warning per failed keep
        self._announced = description

    def publish(self, source: Path, description: bookkeeping.Checkpoint, *, minimize: bool) -> bool:
        """Keep ``source`` (the ``last.pt`` just published) as ``checkpoints/step-<step>.pt`` (``last.ckpt/`` as
        ``checkpoints/step-<step>.ckpt/``), then start deleting in the background what the policy does not keep.

        Runs where the save's writes run (the writer thread of ``ckpt.async_save``; rank 0 after every rank's
        shards are published, for a sharded one), after them. ``index.json`` describes it before the link is made
        (by :meth:`announce`, else here). A failure to keep it (a read-only or full ``checkpoints/``) is warned
        about, in both formats alike, and the run goes on: ``source`` is whole, and raising on rank 0 would leave
        the other ranks waiting.

        :param source: The published checkpoint file (or directory).
        :param description: What retention needs to know of it.
        :param minimize: The run's direction.
        :returns: Whether it was kept.
        """
        self.join()
        announced, self._announced = self._announced, None
        try:
            return self._publish(source, description, announced, minimize=minimize)
        except OSError as exc:
            name = kept_name(description.step, self._suffix)
            warn_user(
                f"keeping {source} as {self.directory / name} failed ({exc}); {source} itself is whole, and step "
                f"{description.step} is not kept"
            )
            return False

    def _publish(
        self,
        source: Path,
        description: bookkeeping.Checkpoint,
        announced: bookkeeping.Checkpoint | None,
        *,
        minimize: bool,
    ) -> bool:
        if not self._ready():
            return False
        target = self.directory / kept_name(description.step, self._suffix)
        try:
            info = os.lstat(target)
        except FileNotFoundError:
            info = None
        if info is not None and not _right_kind(target.name, info.st_mode):
            warn_user(
                f"{target} is {_kind(info.st_mode)}, not a checkpoint trainkit wrote; it is left alone, step "
                f"{description.step} is not kept"
            )
            return False
        known = {**self._on_disk(), description.step: description}
        if announced != description:  # the description goes to disk before the link is visible
            write_index(self.directory, known.values(), minimize, self._keep, newest=description.step)
        if self._suffix == ".ckpt":
            self._link_directory(source, target, replace=info is not None)
        else:
            self._link(source, target)
        self._known = known
        # the newest is the one just kept: a larger step on disk is not this run's (planted, or abandoned by a
        # resume from an older checkpoint), so it neither displaces this run's checkpoints nor is deleted
        self._apply(minimize, newest=description.step)
        return True

    def _apply(self, minimize: bool, *, newest: int) -> None:
        """Start deleting in the background what the policy does not keep of ``self._known``."""
        policy = self.policy(minimize)
        keep = bookkeeping.retain(policy, (self._known or {}).values(), newest=newest, resumed_from=self.resumed_from)
        self._warn_unranked(policy, newest)
        doomed = sorted(step for step in self._known or {} if step not in keep)
        if doomed:
            self._deleter = threading.Thread(
                target=self._delete, args=(doomed, minimize, newest), name="trainkit-retention", daemon=False
            )
            self._deleter.start()

    def _warn_unranked(self, policy: bookkeeping.KeepAny, newest: int) -> None:
        """Warn once about a ``best`` rule that ranks nothing although validation scores were recorded (a misspelt
        metric keeps nothing, silently otherwise)."""
        mine = [c for c in (self._known or {}).values() if c.step <= newest]
        names = sorted({name for c in mine for name in c.scores})
        idle = [rule.spec for rule in bookkeeping.unranked(policy, mine) if rule.spec not in self._unranked]
        if not names or not idle:
            return
        self._unranked.update(idle)
        warn_user(
            f"ckpt.keep rule {', '.join(idle)} ranks no kept checkpoint: none has a finite score of that name (the "
            f"scores recorded are {', '.join(names)}); it keeps nothing until one does (check the metric's name)"
        )

    def keep_resumed(self, source: Path, description: bookkeeping.Checkpoint, *, minimize: bool) -> bool:
        """Finish what a kill left undone for the ``last`` a run resumes from: keep it when no checkpoint of its
        step is kept (a kill between publishing it and keeping it, a few milliseconds, or a background save's whole
        write), and delete what the policy does not keep (a kill during the deletion after its save, the last
        save of a finished run included), leftovers of a killed deletion removed first.

        It is described as its save described it in ``index.json`` (scores included), when that entry is there and
        agrees with ``description`` on the epoch; else by ``description``. The deletion runs in the background,
        as after a save, with this checkpoint as the newest.

        A link that cannot be made is warned about; the run goes on.

        :param source: The resumed checkpoint (``last.pt`` or ``last.prev.pt``; a sharded directory), of the
            kind this run keeps.
        :param description: What the checkpoint itself says of it (the score only of an epoch that improved).
        :param minimize: The run's direction.
        :returns: Whether it was kept now.
        """
        if not self.active or self._disabled:
            return False
        try:
            if not self._ready():
                return False
            if any(os.path.lexists(self.directory / kept_name(description.step, suffix)) for suffix in SUFFIXES):
                self._known = self._on_disk()
                self._apply(minimize, newest=description.step)
                return False
        except OSError as exc:
            warn_user(f"keeping {source} as step {description.step} failed ({exc}); it is not kept")
            return False
        recorded = self._recorded.get(description.step)
        if recorded is not None and (recorded.epoch, recorded.epoch_end) == (description.epoch, description.epoch_end):
            description = recorded  # what the save announced before it wrote the checkpoint
        return self.publish(source, description, minimize=minimize)

    def history(self) -> list[tuple[bookkeeping.Checkpoint, Path]]:
        """The kept checkpoints on disk now (none when this run keeps none), each with its path, in step order:
        described as their saves recorded them in ``index.json`` (else by name and modification time).

        :returns: ``(description, path)`` pairs.
        """
        if not self.active or not self._ready():
            return []
        return [(c, kept_path(self.directory, c.step)) for c in on_disk(self.directory, self._known or {})[0]]

    def _link(self, source: Path, target: Path) -> None:
        tmp = str(self.directory / f".{target.name}.{os.getpid()}.{next(_COUNTER)}.tmp")
        link_or_copy(source, tmp)
        try:
            os.replace(tmp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_directory(self.directory)

    def _link_directory(self, source: Path, target: Path, *, replace: bool) -> None:
        """Make ``target`` a directory of hard links to ``source``'s files (copies where links fail): built under a
        temp name of its own, fsynced, and published by one rename."""
        if not stat.S_ISDIR(os.lstat(source).st_mode):  # swapped for a link since it was published: not followed
            raise OSError(f"{source} is not the directory trainkit published")
        tmp = self.directory / f".{target.name}.{os.getpid()}.{next(_COUNTER)}.tmp"
        os.mkdir(tmp, 0o700)  # nobody else can add to it while it is built
        try:
            for entry in os.scandir(source):
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(f"{entry.path} is {_kind(info.st_mode)}, not a file trainkit wrote")
                link_or_copy(entry.path, tmp / entry.name)
            fsync_directory(tmp)
            os.chmod(tmp, 0o777 & ~current_umask())
            if replace:  # the same step kept before (a resumed run saving it again): the old one goes first
                remove_kept(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_directory(self.directory)

    def _delete(self, steps: list[int], minimize: bool, newest: int) -> None:
        known = self._known if self._known is not None else {}
        try:
            for step in steps:
                remove_kept(kept_path(self.directory, step))
                known.pop(step, None)
            fsync_directory(self.directory)
            write_index(self.directory, known.values(), minimize, self._keep, newest=newest)
        except Exception as exc:  # noqa: BLE001 - a checkpoint not deleted is no reason to stop training
            warn_user(f"deleting kept checkpoints in {self.directory} failed: {exc!r}; they are left in place")

    def _remove_stale_temp_files(self) -> None:
        with suppress(OSError):
            for entry in os.scandir(self.directory):
                found = _TEMP_NAME.fullmatch(entry.name)
                if not found or not process_gone(int(found["pid"])):
                    continue
                if entry.is_dir(follow_symlinks=False) and ".ckpt." in entry.name:
                    shutil.rmtree(entry.path, ignore_errors=True)  # a killed build or deletion of a kept directory
                elif entry.is_file(follow_symlinks=False):
                    with suppress(OSError):
                        os.unlink(entry.path)

    def join(self) -> None:
        """Wait for a background deletion to end (the next save and the end of the run call this)."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None


def describe_save(
    *,
    step: int,
    epoch: int,
    epoch_end: bool,
    validated: bool,
    score: tuple[int, float] | None,
    latest_metrics: Mapping[str, float],
    saved_at: float | None = None,
) -> bookkeeping.Checkpoint:
    """What retention knows of a checkpoint being saved now (or, with ``saved_at``, saved then).

    Scores are recorded only for a checkpoint whose weights were validated: an epoch-end checkpoint whose epoch
    ended with a validation, or one written at the step of a validation (``val.every_n_steps``). ``"score"`` is the
    selection score given to ``save_if_best`` at that step, and every ``val/*`` metric last pushed is recorded
    under its name. Any other checkpoint holds weights no validation has seen: it has no scores.

    :param step: The optimizer step.
    :param epoch: The epochs completed (``LoopState.epoch``).
    :param epoch_end: Written at an epoch's end.
    :param validated: Its weights were validated (its epoch ended with a validation, or a validation ran at its step).
    :param score: ``(step, score)`` of the last ``save_if_best`` call, if any.
    :param latest_metrics: The last pushed value of every metric.
    :param saved_at: When it was saved (seconds since the epoch); None: now.
    :returns: The description.
    """
    scores: dict[str, float] = {}
    if validated:
        scores = {name: value for name, value in latest_metrics.items() if name.startswith("val/")}
        if score is not None and score[0] == step:
            scores["score"] = score[1]
    when = time.time() if saved_at is None else saved_at
    return bookkeeping.Checkpoint(step=step, epoch=epoch, epoch_end=epoch_end, time=when, scores=scores)
