"""Sharded checkpoints (``ckpt.format="sharded"``): one directory per checkpoint, every rank writing its shards.

Layout of ``out_dir/last.ckpt/`` (and ``best.ckpt/``)::

    .metadata, __<rank>_<n>.distcp   torch.distributed.checkpoint (DCP): registered modules and optimizers,
                                     each rank writing its own shards (FSDP2 DTensors; a replicated tensor once)
    trainkit.pt                      rank 0: the engine's payload (records, every rank's RNG states, the config,
                                     the other registered items), the same schema as a last.pt / best.pt
    manifest.json                    every file's size and CRC-32, written last: what makes the checkpoint whole

A save writes into a temporary sibling (``.last.ckpt.tmp-<epoch>-<step>-<n>-<random>``, made by rank 0 with
mode 0700 under a name nobody can guess, so nothing can be planted in it while the ranks write); once every
rank has finished its files (each checked to be a regular file it wrote, not a link), rank 0 writes
``trainkit.pt`` and the manifest, moves the published directory to ``last.prev.ckpt`` and renames the
temporary one into place, then fsyncs ``out_dir``. A run killed at any point leaves either the old
``last.ckpt`` or the new one (and ``last.prev.ckpt``), never a half-written one under a published name; the
temporary directory is removed by the next save or run. A resume checks the manifest (every rank a share of
the files) and reads every file as hostile input (:mod:`trainkit.checkpoint.formats.dcp_read`) before it trusts a
directory, and falls back to ``last.prev.ckpt``.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``,
``get_optimizer_state_dict`` over a ``ModuleDict`` of the registered modules), so a checkpoint written by N
ranks loads on M ranks (resharded by DCP) and into a plain module on one process.

Side effects: files in ``out_dir``; collectives (every rank must call :func:`save_directory`,
:func:`load_items` and :func:`~trainkit.checkpoint.formats.dcp_read.verify_directory` together).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.checkpoint.formats.dcp_read import (
    ENGINE_FILE,
    MANIFEST_FILE,
    entries_of,
    load_into,
    read_metadata,
    verify_directory,
)
from trainkit.distributed.collectives import all_gather_objects, raise_if_any_rank_failed, unwrap
from trainkit.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from trainkit.files.checksum import file_checksum
from trainkit.files.durable import atomic_save, current_umask, fsync_directory
from trainkit.files.weights_only_load import load_checkpoint

__all__ = [
    "LAST_DIR",
    "BEST_DIR",
    "ENGINE_FILE",
    "MANIFEST_FILE",
    "SHARDED",
    "previous_directory",
    "dcp_items",
    "state_for_save",
    "save_directory",
    "BackgroundSave",
    "load_items",
    "load_items_into",
    "read_whole",
    "apply_items",
    "apply_whole_items",
    "read_engine",
    "remove_temporary",
    "wait_discarded",
]

LAST_DIR = "last.ckpt"
BEST_DIR = "best.ckpt"
SHARDED = "trainkit:sharded"
"""What ``trainkit.pt`` holds in place of an item whose state is in the DCP files."""


def previous_directory(path: Path) -> Path:
    """``last.ckpt`` -> ``last.prev.ckpt``: where the checkpoint a save replaces is kept.

    :param path: A checkpoint directory.
    :returns: Its ``.prev`` sibling.
    """
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def dcp_items(items: Mapping[str, Any]) -> dict[str, Any]:
    """The registered items a save puts in the DCP files: modules, and optimizers that have a state.

    An optimizer that has not stepped yet has no state, and ``get_optimizer_state_dict`` would make one by
    stepping it with zero gradients (moving its step count, and the trainer's); such an optimizer's plain
    ``state_dict()`` goes into ``trainkit.pt`` instead.

    :param items: The registry's name -> object mapping.
    :returns: The subset, in registration order.
    """
    return {
        name: obj
        for name, obj in items.items()
        if isinstance(obj, nn.Module) or (isinstance(obj, torch.optim.Optimizer) and obj.state)
    }


def _modules(items: Mapping[str, Any]) -> nn.ModuleDict:
    # one container for every registered module: an optimizer's parameters are named through it, whichever
    # module holds them (unwrapped from DDP: the same names with either wrap)
    return nn.ModuleDict({name: unwrap(obj) for name, obj in items.items() if isinstance(obj, nn.Module)})


def _states(items: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The DCP state dicts of the named modules and optimizers (sharded tensors stay sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    container = _modules(items)
    state: dict[str, Any] = {}
    for name in names:
        obj = items[name]
        if isinstance(obj, nn.Module):
            state[name] = get_model_state_dict(unwrap(obj))
        else:
            state[name] = get_optimizer_state_dict(container, obj)
    return state


def state_for_save(items: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of the items :func:`dcp_items` selects (sharded tensors stay sharded).

    :param items: The registry's items.
    :returns: ``{name: state}``.
    """
    return _states(items, dcp_items(items))


def load_items(items: Mapping[str, Any], directory: Path, names: Iterable[str]) -> dict[str, Any]:
    """Read the named modules' and optimizers' states from a checkpoint directory, resharded to this run's ranks.

    :param items: The registry's items (their current states shape the templates DCP fills).
    :param directory: The checkpoint directory.
    :param names: The items its ``trainkit.pt`` marks as stored in the DCP files.
    :returns: ``{name: state}``, ready for :func:`apply_items`.
    :raises CheckpointCorruptError: When DCP cannot read an entry (a missing key, a shape that changed).
    """
    return load_items_into(_states(items, names), directory)


def load_items_into(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> dict[str, Any]:
    """Fill ``state`` (tensors and DTensors of this run's shapes and shards) from a checkpoint directory.

    Read through :func:`trainkit.checkpoint.formats.dcp_read.load_into`: nothing in the directory reaches an unpickler
    that could run it.

    :param state: The template, filled in place.
    :param directory: The checkpoint directory.
    :param no_dist: Read in this process alone, even inside a process group.
    :returns: ``state``.
    :raises CheckpointCorruptError: When DCP cannot read an entry (a missing key, a shape that changed).
    :raises CheckpointUnsafeError: When an entry holds what trainkit does not load, naming the file and entry.
    """
    return load_into(state, directory, no_dist=no_dist)


def apply_items(items: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """Load states read by :func:`load_items` into the registered modules and optimizers.

    :param items: The registry's items.
    :param states: ``{name: state}``.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    container = _modules(items)
    for name, state in states.items():
        obj = items[name]
        if isinstance(obj, nn.Module):
            set_model_state_dict(unwrap(obj), state)
        else:
            set_optimizer_state_dict(container, obj, state)


def read_whole(directory: Path, key: str) -> dict[str, Any]:
    """Read one entry of a checkpoint directory (``"model"``, say) whole, in this process alone.

    The template is built from the checkpoint's own metadata (every tensor's global shape and dtype), so
    nothing of the run that wrote it is needed: no model class, no process group.

    :param directory: The checkpoint directory.
    :param key: The top-level entry.
    :returns: ``{name: tensor}`` with whole (unsharded) CPU tensors.
    :raises CheckpointCorruptError: When the entry is missing or cannot be read.
    :raises CheckpointUnsafeError: When the directory holds what trainkit does not load.
    """
    metadata = read_metadata(directory)
    template = {
        name: torch.zeros(entry.size, dtype=entry.properties.dtype) for name, entry in entries_of(metadata, key)
    }
    if not template:
        raise CheckpointCorruptError(f"{directory} holds no tensors under {key!r}")
    return load_items_into({key: template}, directory, no_dist=True)[key]


def apply_whole_items(items: Mapping[str, Any], payload: Mapping[str, Any]) -> list[str]:
    """Load a file checkpoint's whole module and optimizer states into (possibly FSDP2-sharded) registered items.

    A module's state may carry DDP's ``module.`` prefix; an optimizer's is torch's own (states keyed by the
    position of each parameter in its param groups), which is mapped to parameter names through this run's
    optimizer, built the same way. Each rank keeps its own shards of the whole states.

    :param items: The registry's items.
    :param payload: The file checkpoint (a ``last.pt``), each item's state under its name.
    :returns: The names of the items loaded.
    :raises CheckpointMismatchError: When an optimizer's parameter count differs from the checkpoint's.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    container = _modules(items)
    names_of = {id(param): name for name, param in container.named_parameters()}
    loaded = []
    for name, obj in items.items():
        state = payload.get(name)
        if not isinstance(obj, nn.Module | torch.optim.Optimizer) or not isinstance(state, dict):
            continue
        if isinstance(obj, nn.Module):
            if state and all(key.startswith("module.") for key in state):
                state = {key.removeprefix("module."): value for key, value in state.items()}
            set_model_state_dict(unwrap(obj), state, options=whole)
        elif not state.get("state"):  # saved before its first step: nothing to shard, nothing to name
            obj.load_state_dict(state)
        else:
            params = [param for group in obj.param_groups for param in group["params"]]
            saved = [index for group in state["param_groups"] for index in group["params"]]
            if len(saved) != len(params):
                raise CheckpointMismatchError(
                    f"checkpoint item {name!r} is an optimizer over {len(saved)} parameters and this run's has "
                    f"{len(params)}; build the optimizer over the same parameters, in the same order"
                )
            fqn = {index: names_of[id(param)] for index, param in zip(saved, params, strict=True)}
            converted = {
                "state": {fqn[index]: value for index, value in state["state"].items()},
                "param_groups": [
                    {**group, "params": [fqn[index] for index in group["params"]]} for group in state["param_groups"]
                ],
            }
            set_optimizer_state_dict(container, obj, converted, options=whole)
        loaded.append(name)
    return loaded


def read_engine(
    directory: Path, *, rank: int, world_size: int, validate: Callable[..., None]
) -> tuple[dict[str, Any] | None, str | None]:
    """Check a checkpoint directory against its manifest (a collective), then load and validate its ``trainkit.pt``.

    :param directory: The checkpoint directory.
    :param rank: This rank.
    :param world_size: The number of ranks.
    :param validate: ``validate_last`` or ``validate_best`` (called with the payload and ``path=``).
    :returns: ``(payload, None)``, or ``(None, what is wrong)`` when the directory is damaged, incomplete or not a
        trainkit checkpoint.
    """
    problem = verify_directory(directory, rank=rank, world_size=world_size)
    if problem is not None:
        return None, problem
    path = directory / ENGINE_FILE
    try:
        engine = load_checkpoint(path)
        validate(engine, path=path)
    except CheckpointCorruptError as exc:
        return None, str(exc)
    return engine, None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def _own_files(directory: Path, rank: int) -> list[Path]:
    """The DCP files ``rank`` wrote (``__<rank>_<n>.distcp``), and ``.metadata`` for rank 0."""
    own = sorted(directory.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (directory / ".metadata").exists():
        own.append(directory / ".metadata")
    return own


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own_checksums(temporary: Path, rank: int) -> dict[str, list[int]]:
    """fsync the files this rank wrote and return each one's ``[size, CRC-32]``, by name.

    DCP writes them without fsync (:func:`_writer`): the fsyncs run in a thread, waiting on the disk, while
    this thread computes the CRCs from the page cache, so the checksums cost next to nothing on top of the
    flush every durable save waits for anyway. Both finish before this returns; an fsync's error raises here,
    and so does a file that is not a regular file (a link planted in the temporary directory).
    """
    files = _own_files(temporary, rank)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainkit-fsync") as flusher:
        flushed = [flusher.submit(_fsync_file, path) for path in files]
        checksums = {path.name: list(file_checksum(path)) for path in files}  # a link in its place: refused here
        for done in flushed:
            done.result()
    return checksums


def _writer(temporary: Path) -> Any:
    """DCP's file writer for ``temporary``, without its fsync per file: :func:`_own_checksums` fsyncs every
    file before the checkpoint can be published (overlapped with the checksums)."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemWriter(str(temporary), sync_files=False)


def _prepare(final: Path, *, rank: int, world_size: int, tag: str) -> Path:
    """Rank 0 clears torn temporary directories of ``final`` and makes this save's; every rank learns its name.

    The name ends in a random token and the directory is created exclusively with mode 0700 (``mkdtemp``), so
    nothing planted under a predictable name can stop a save, and nobody else can plant a link in it while the
    ranks write.
    """
    made: str | None = None
    failed = False
    if rank == 0:
        try:
            wait_discarded()  # one deletion in flight: done before this save writes (the loop was busy meanwhile)
            remove_temporary(final.parent, final.name)
            made = tempfile.mkdtemp(prefix=f".{final.name}.tmp-{tag}-", dir=final.parent)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            failed = True
            error: BaseException = exc
    answers = all_gather_objects((made, failed)) if world_size > 1 else [(made, failed)]
    if failed:
        raise error
    if any(answer[1] for answer in answers):
        raise RuntimeError(f"rank 0 could not prepare a temporary directory for {final}")
    return Path(answers[0][0])


def _complete(
    temporary: Path,
    final: Path,
    engine: dict[str, Any] | None,
    error: BaseException | None,
    *,
    rank: int,
    world_size: int,
    checksums: dict[str, list[int]] | None = None,
) -> None:
    """After this rank's shards are written (or failed with ``error``): checksum them (unless ``checksums`` holds
    them already), gather, and on rank 0 write ``trainkit.pt`` and the manifest and publish; every rank raises
    when any rank failed (a collective)."""
    if error is None and checksums is None:
        try:
            checksums = _own_checksums(temporary, rank)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            error = _write_failed(final, rank, exc)  # a link planted among the files: a failed write
    checksums = checksums if error is None and checksums is not None else {}
    gathered = all_gather_objects((checksums, error is not None))
    if error is None and any(failed for _, failed in gathered):
        error = RuntimeError("another rank failed to write its shards")
    if rank == 0 and error is None:
        try:
            manifest: dict[str, list[int]] = {}
            for files, _ in gathered:
                manifest.update(files)
            for path in sorted(temporary.iterdir()):  # a file no rank claimed (another DCP naming): rank 0 sums it
                if path.name not in manifest:
                    manifest[path.name] = list(file_checksum(path))  # anything but a regular file fails the save
            atomic_save(engine, temporary / ENGINE_FILE)
            manifest[ENGINE_FILE] = list(file_checksum(temporary / ENGINE_FILE))
            with open(temporary / MANIFEST_FILE, "w") as handle:
                json.dump({"version": 1, "files": manifest}, handle, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_directory(temporary)
            os.chmod(temporary, 0o777 & ~current_umask())  # mkdtemp's 0700 kept others out while it was written
            _publish(temporary, final)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            error = exc
    raise_if_any_rank_failed(
        error, lambda: RuntimeError(f"a rank failed to write {final}; see its traceback"), world_size=world_size
    )


def save_directory(
    final: Path, state: dict[str, Any], engine: dict[str, Any] | None, *, rank: int, world_size: int, tag: str
) -> None:
    """Write a checkpoint directory and publish it as ``final`` (a collective: every rank calls it).

    Rank 0 clears a stale temporary directory of the same name; every rank writes its shards with
    ``dcp.save`` and checksums its own files; rank 0 writes ``engine`` as ``trainkit.pt``, the manifest,
    then keeps the published directory as ``.prev`` and renames the new one into place.

    :param final: ``out_dir/last.ckpt`` or ``out_dir/best.ckpt``.
    :param state: This rank's DCP state (:func:`state_for_save`, or the best weights).
    :param engine: The engine's payload (rank 0; ignored elsewhere).
    :param rank: This rank.
    :param world_size: The number of ranks.
    :param tag: What makes the temporary directory's name unique to this save (epoch, step, a count).
    :raises BaseException: Whatever a rank's write raised, on every rank (see ``raise_if_any_rank_failed``).
    """
    import torch.distributed.checkpoint as dcp

    temporary = _prepare(final, rank=rank, world_size=world_size, tag=tag)
    error: BaseException | None = None
    try:
        dcp.save(state, storage_writer=_writer(temporary))
    except BaseException as exc:
        if not _is_write_error(exc):
            raise
        error = _write_failed(final, rank, exc)
    _complete(temporary, final, engine, error, rank=rank, world_size=world_size)


def _dcp_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _is_write_error(exc: BaseException) -> bool:
    """A DCP write's failure: an ordinary exception, or DCP's ``CheckpointException``, which derives from
    ``BaseException`` (so a plain ``except Exception`` lets it through, and ``spawn`` reports only an exit code);
    never a ``KeyboardInterrupt`` or ``SystemExit``."""
    return isinstance(exc, Exception | _dcp_exception())


def _write_failed(final: Path, rank: int, exc: BaseException) -> CheckpointError:
    """A DCP write failure as a trainkit error (an ``Exception``, picklable, with DCP's reason in its message)."""
    error = CheckpointError(f"writing the shards of {final} failed on rank {rank}: {_why(exc)}")
    error.__cause__ = exc
    return error


def _after_write(write: Any, temporary: Path, rank: int) -> dict[str, list[int]]:
    """Wait for a background DCP write, then checksum what this rank wrote (in the checksum thread)."""
    write.result()
    return _own_checksums(temporary, rank)


class BackgroundSave:
    """One sharded save in flight: ``dcp.async_save`` writes the shards from a thread, on a gloo group of its own;
    :meth:`finish` (on the main thread, every rank together) waits for it, then checksums and publishes.

    The state is staged (copied to host memory) before :meth:`start` returns, so training may change the
    weights at once. Only one save is in flight: the trainer finishes the previous one before it starts the
    next, at the end of the run and before a signal's exit; a failed write raises there, on every rank.

    The host copy is kept between saves and copied into again (DCP's ``DefaultStager``, its buffers pinned
    when CUDA is there): a save after the first allocates nothing, and its staging is one copy at memory
    speed. That is safe because the write that reads a copy always ends (:meth:`finish` or :meth:`abandon`)
    before the next save copies into it. :meth:`release` frees the copy (the trainer calls it at the run's end).

    :param timeout_s: The bound on the save group's collectives (``dist.timeout_s``).
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._group: Any = None
        self._pending: tuple[Any, Path, Path, dict[str, Any] | None] | None = None
        self._checksummer: concurrent.futures.ThreadPoolExecutor | None = None
        self._stager: Any = None

    @property
    def pending(self) -> bool:
        """Whether a save was started and not finished."""
        return self._pending is not None

    def start(
        self, final: Path, state: dict[str, Any], engine: dict[str, Any] | None, *, rank: int, world_size: int, tag: str
    ) -> None:
        """Stage ``state`` and start writing it into a temporary directory of ``final`` (a collective).

        :param final: ``out_dir/last.ckpt``.
        :param state: This rank's DCP state.
        :param engine: The engine's payload (rank 0), written at :meth:`finish`.
        :param rank: This rank.
        :param world_size: The number of ranks.
        :param tag: Unique to this save.
        :raises RuntimeError: When a save is still in flight (finish it first).
        """
        import datetime

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:
            raise RuntimeError("a sharded save is still in flight; finish() it before starting another")
        temporary = _prepare(final, rank=rank, world_size=world_size, tag=tag)
        if world_size > 1 and self._group is None:
            # the writer thread's collectives on their own group: nothing the training loop does can queue
            # behind them or interleave with them (a shared group deadlocks on the loop's next barrier)
            timeout = datetime.timedelta(seconds=self._timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        if self._stager is None:
            self._stager = _stager()
        future = dcp.async_save(
            state, storage_writer=_writer(temporary), process_group=self._group, async_stager=self._stager
        )
        future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse wraps the one to wait on
        if self._checksummer is None:
            self._checksummer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainkit-checksum")
        # this rank's fsyncs and CRCs (a second read of everything it wrote) in the background too, after the
        # write: rank-local, no collective, so finish() only gathers and publishes
        summed = self._checksummer.submit(_after_write, future, temporary, rank)
        self._pending = (summed, temporary, final, engine)

    def finish(self, *, rank: int, world_size: int) -> None:
        """Wait for the save in flight, then checksum and publish it (a collective; nothing to do when none is).

        :param rank: This rank.
        :param world_size: The number of ranks.
        :raises BaseException: The write's failure on this rank, or another rank's, on every rank.
        """
        if self._pending is None:
            return
        future, temporary, final, engine = self._pending
        self._pending = None
        error: BaseException | None = None
        checksums = None
        try:
            checksums = future.result(timeout=self._timeout_s)
        except BaseException as exc:
            if not _is_write_error(exc):
                raise
            error = _write_failed(final, rank, exc)
        _complete(temporary, final, engine, error, rank=rank, world_size=world_size, checksums=checksums)

    def release(self) -> None:
        """Free the host copy kept for the next save (finish or abandon the save in flight first).

        :raises RuntimeError: When a save is still in flight (its write may be reading the copy).
        """
        if self._pending is not None:
            raise RuntimeError("a sharded save is still in flight; finish() or abandon() it before release()")
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def abandon(self) -> None:
        """Let a save in flight end without publishing it (this rank is failing; the others may be gone).

        Its temporary directory stays unpublished, and the next run's first save removes it.
        """
        if self._pending is None:
            return
        future = self._pending[0]
        self._pending = None
        # the run is failing already: this write is never published, and its own failure adds nothing
        try:
            future.result(timeout=self._timeout_s)
        except BaseException as exc:
            if not _is_write_error(exc):
                raise


def _stager() -> Any:
    """DCP's stager for background saves: host buffers kept and reused from save to save, pinned (and filled by
    non-blocking copies, synchronized before it returns) when CUDA is there; staging finishes before
    ``async_save`` returns (no staging thread: training may change the weights right after)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # a torch without DefaultStager: DCP's own staging, a fresh host copy each save
        return None
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
        )
    )


def _publish(temporary: Path, final: Path) -> None:
    """Keep the published checkpoint as ``.prev``, rename the new one into place, make both renames durable.

    The ``.prev`` it replaces is renamed out of the way (``<temporary>-old``) and deleted in the background:
    unlinking a large checkpoint's files takes as long as a good part of writing them, and nothing needs to
    wait for it but the next save and the end of the run (:func:`wait_discarded`). A kill before it is gone
    leaves a temporary directory, which the next save removes.
    """
    previous = previous_directory(final)
    if final.exists():
        if previous.exists():
            old = temporary.with_name(f"{temporary.name}-old")
            os.replace(previous, old)  # a kill here leaves `final` published: nothing is lost
            _discard(old)
        os.replace(final, previous)  # a kill here leaves `previous` published: a resume falls back to it
    os.replace(temporary, final)
    fsync_directory(final.parent)


_discarder: concurrent.futures.ThreadPoolExecutor | None = None
_discarding: list[concurrent.futures.Future[None]] = []


def _discard(directory: Path) -> None:
    """Delete ``directory`` (renamed out of every published name already) in a background thread."""
    global _discarder
    if _discarder is None:
        _discarder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainkit-discard")
    _discarding.append(_discarder.submit(shutil.rmtree, directory, ignore_errors=True))


def wait_discarded() -> None:
    """Wait until the old checkpoint directories that publishing moved aside are deleted: before the next
    save starts (a deletion never competes with a write for the disk) and at the end of the run."""
    while _discarding:
        _discarding.pop().result()


def remove_temporary(out_dir: Path, name: str) -> list[Path]:
    """Remove the temporary directories that killed saves of checkpoint ``name`` left in ``out_dir``.

    A symbolic link under such a name (planted: trainkit makes none) is removed itself, never followed; a
    directory is removed without following the links inside it.

    :param out_dir: The run folder.
    :param name: ``last.ckpt`` or ``best.ckpt``.
    :returns: The removed paths.
    """
    removed = []
    for path in out_dir.glob(f".{name}.tmp-*"):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
