"""Checkpoint files: atomic, durable writes; verified, code-free reads; RNG capture.

Side effects: file I/O. Payloads hold only tensors and plain Python values, so every checkpoint loads
with ``torch.load(..., weights_only=True)``; trainkit never loads with ``weights_only=False``.
"""

from __future__ import annotations

import array
import errno
import functools
import itertools
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
import zipfile
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainkit.errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "atomic_save",
    "previous_path",
    "load_checkpoint",
    "verify_checkpoint",
    "capture_rng",
    "restore_rng",
    "seed_everything",
    "remove_stale_temp_files",
    "payload_nbytes",
    "warn_if_low_on_space",
]

TEMP_SUFFIX = ".tmp"


_FILE_MODE = 0o666
"""Checkpoints get the permissions ``open()`` gives (the umask applies), not mkstemp's owner-only ones."""

_TEMP_COUNTER = itertools.count()


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Return where the previous version of a checkpoint is kept: ``last.pt`` -> ``last.prev.pt``.

    :param path: The checkpoint path.
    :returns: The sibling path for its previous version.
    """
    return Path(_save_names(os.fspath(path)).previous)


class _SaveNames(NamedTuple):
    directory: str
    temp_prefix: str  # + "<pid>.<n>.tmp": the file being written
    previous: str
    previous_temp_prefix: str  # + "<pid>.<n>.tmp": the link being made, renamed over ``previous``


@functools.lru_cache(maxsize=64)
def _save_names(path: str) -> _SaveNames:
    """The sibling names a save of ``path`` uses, worked out once per destination (string work, no pathlib)."""
    directory, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    previous_name = f"{stem}.prev{suffix}"
    return _SaveNames(
        directory=directory or os.curdir,
        temp_prefix=os.path.join(directory, f".{name}."),
        previous=os.path.join(directory, previous_name),
        previous_temp_prefix=os.path.join(directory, f".{previous_name}."),
    )


def _temp_name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}.{next(_TEMP_COUNTER)}{TEMP_SUFFIX}"


def _fsync_directory(directory: str | os.PathLike[str]) -> None:
    with suppress(OSError):  # some filesystems (and Windows) cannot open a directory for fsync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(payload: Any, path: str | os.PathLike[str], *, keep_previous: bool = False) -> float:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the new one, never a torn one.

    Side effects: serializes straight into a temp file in the same directory, flushes, fsyncs,
    ``os.replace``\\ s it over ``path`` and fsyncs the directory. On any failure the temp file is removed
    and ``path`` is left byte-identical.

    :param payload: Tensors and plain Python values.
    :param path: The destination file.
    :param keep_previous: Keep the file being replaced as :func:`previous_path` (a hard link, so no copy),
        for a fallback when the newest one turns out corrupted.
    :returns: The seconds the save took.
    :raises CheckpointError: On a full disk, naming the path, the bytes written so far and the bytes free.
    """
    target = os.fspath(path)
    names = _save_names(target)
    start = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:  # a name no other save uses; O_EXCL refuses a leftover from a process with the same pid
        tmp = _temp_name(names.temp_prefix)
        try:
            fd = os.open(tmp, flags, _FILE_MODE)
            break
        except FileExistsError:
            continue
        except FileNotFoundError:  # the first save into a folder that does not exist yet
            os.makedirs(names.directory, exist_ok=True)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if keep_previous:
            _link_previous(target, names)
        os.replace(tmp, target)
    except BaseException as exc:
        written = _size_or_zero(tmp)
        with suppress(OSError):
            os.unlink(tmp)
        full = _disk_full_error(exc)
        if full is not None:
            free = shutil.disk_usage(names.directory).free
            needed = max(payload_nbytes(payload), written)
            raise CheckpointError(
                f"cannot write checkpoint {target}: no space left after {written} bytes; about {needed} bytes "
                f"are needed and {free} bytes are free; {target} was left unchanged"
            ) from full
        raise
    _fsync_directory(names.directory)
    return time.perf_counter() - start


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _disk_full_error(exc: BaseException | None) -> OSError | None:
    """Find the ENOSPC/EDQUOT error behind ``exc``: torch's zip writer masks it with its own RuntimeError."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _link_previous(path: str, names: _SaveNames) -> None:
    """Point ``previous_path(path)`` at the current ``path`` atomically; both stay loadable throughout.

    The link is made under a temp name and renamed over the old previous file: unlinking it first would
    leave no previous file at all if the process were killed in between.
    """
    link_tmp = _temp_name(names.previous_temp_prefix)
    try:
        os.link(path, link_tmp)
    except FileNotFoundError:  # the first save: nothing to keep
        return
    except OSError:  # no hard links on this filesystem: fall back to a copy
        shutil.copyfile(path, link_tmp)
    os.replace(link_tmp, names.previous)


def payload_nbytes(payload: Any) -> int:
    """Estimate a payload's size on disk: the bytes of every tensor storage in it, counted once.

    :param payload: Nested dicts, lists and tuples of tensors and plain values.
    :returns: The total tensor bytes (pickled plain values are small next to them and not counted).
    """
    seen: set[int] = set()
    total = 0
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def warn_if_low_on_space(payload: Any, path: str | os.PathLike[str]) -> None:
    """Warn when the checkpoint's disk has less than twice the payload's size free.

    Two copies must fit during a save: the temp file being written and the file it replaces.

    :param payload: What is about to be saved.
    :param path: Where it goes.
    """
    needed = payload_nbytes(payload)
    directory = Path(path).parent
    free = shutil.disk_usage(directory if directory.exists() else Path.cwd()).free
    if free < 2 * needed:
        warnings.warn(
            f"{directory} has {free} bytes free, less than twice the checkpoint's ~{needed} bytes; "
            "saves may fail with a full disk (the previous checkpoint stays intact if they do)",
            RuntimeWarning,
            stacklevel=3,
        )


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete temp files left behind by saves that were killed mid-write.

    Side effects: removes ``.<name>.*.tmp`` files in ``directory``. Call it only where no other process
    is saving into the same directory (rank 0, before its first save).

    :param directory: The checkpoint directory.
    :returns: The files removed.
    """
    removed = []
    directory = Path(directory)
    if directory.is_dir():
        for candidate in directory.glob(f".*{TEMP_SUFFIX}"):
            with suppress(OSError):
                candidate.unlink()
                removed.append(candidate)
    return removed


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check a checkpoint's zip structure and every member's CRC-32 before anything is unpickled.

    ``torch.load`` does not check the CRCs itself, so a flipped bit in tensor data would otherwise load
    silently.

    :param path: The checkpoint file.
    :raises CheckpointCorruptError: When the file is missing, truncated, not a torch zip file, or corrupted.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            # torch's reader skips a member flagged as a directory and leaves its tensor's memory uninitialized
            folders = [info.filename for info in archive.infolist() if info.is_dir() or info.external_attr & 0x10]
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - zipfile also raises RuntimeError (a flipped "encrypted" flag), zlib.error
        raise CheckpointCorruptError(
            f"checkpoint {path} is truncated or not a torch checkpoint ({exc}); it was not loaded"
        ) from exc
    if bad is not None:
        raise CheckpointCorruptError(f"checkpoint {path} is corrupted: CRC mismatch in {bad!r}; it was not loaded")
    if folders:
        raise CheckpointCorruptError(
            f"checkpoint {path} is corrupted: {folders[0]!r} is marked as a directory; it was not loaded"
        )


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Verify and load a checkpoint with ``weights_only=True``: no code from the file ever runs.

    :param path: The checkpoint file.
    :param map_location: Where tensors go, ``"cpu"`` by default.
    :returns: The payload dict.
    :raises CheckpointCorruptError: When the file fails verification or holds objects that are not
        tensors or plain values.
    """
    verify_checkpoint(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's first line advises loading with weights_only=False; name what was refused instead
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
        lines = str(exc).strip().splitlines() or ["an empty pickle"]
        detail = f"refused global {refused.group(1)}" if refused else lines[-1]
        raise CheckpointCorruptError(
            f"checkpoint {path} was refused: it holds objects other than tensors and plain values "
            f"(trainkit only loads with weights_only=True): {detail}"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint {path} could not be read: {exc}") from exc
    if not isinstance(payload, dict):
        raise CheckpointCorruptError(f"checkpoint {path} holds a {type(payload).__name__}, not a dict")
    return payload


def capture_rng() -> dict[str, Any]:
    """Capture the state of every random generator this process uses, as plain values.

    Python's, torch's CPU and numpy's states are kept as ``bytes``: they pickle inline, where a tensor
    would add a record (and a CRC) to the checkpoint file on every save.

    :returns: ``{"python": ..., "torch": ..., "numpy": ... (when numpy is loaded), "cuda": ... (when used)}``.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, array.array("q", internal).tobytes(), gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng` (also its earlier tensor-valued form).

    :param state: The captured states.
    """
    version, internal, gauss = state["python"]
    if isinstance(internal, bytes):
        internal = array.array("q", internal).tolist()
    elif isinstance(internal, torch.Tensor):
        internal = internal.tolist()
    random.setstate((version, tuple(internal), gauss))
    cpu = state["torch"]
    torch.set_rng_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8) if isinstance(cpu, bytes) else cpu)
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = numpy.frombuffer(keys, dtype=numpy.uint32) if isinstance(keys, bytes) else keys.numpy()
        numpy.random.set_state((name, keys.astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's (when loaded) and torch's generators (CUDA included).

    :param seed: The seed; the trainer passes ``cfg.seed + rank``.
    """
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
