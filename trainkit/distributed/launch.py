"""Entry points that run a trainer in one or many processes, on torch.distributed's own launchers.

``launch`` is for a process started by ``torchrun``; ``spawn`` starts local processes itself with
``torch.multiprocessing`` (a fork server that has imported torch once). Both return rank 0's result and tear
the process group down.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed
import torch.multiprocessing as mp

from trainkit import errors, torch_private
from trainkit.config import Config
from trainkit.distributed.collectives import broadcast_object, free_port
from trainkit.errors import TrainingInterrupted, TrainkitError
from trainkit.messages import exit_refused, refusal_line

__all__ = ["launch", "spawn", "fork_server"]


def _run(
    trainer_class: type, cfg: Config | Mapping[str, Any], rank: int, world_size: int, failures: str | None = None
) -> Any:
    try:
        trainer = trainer_class(cfg, rank, world_size)
    except BaseException:
        _record_failure(failures, rank)
        raise
    try:
        result = trainer.train()
        return broadcast_object(result, src=0) if world_size > 1 else result
    except BaseException as exc:
        _record_failure(failures, rank)  # before close() tears the process group down: before any rank it fails
        _drop_locals(exc)
        raise
    finally:
        trainer.close()


def _drop_locals(exc: BaseException) -> None:
    """Clear the local variables of the finished frames of ``exc``'s tracebacks (and of the errors it chains).

    A collective that failed (a peer died) leaves its tensors in those frames, where the process-group teardown
    waits for the backend to let go of them: it never would, and each failure cost the full wait (10 s) before the
    process exited and torchrun's agent could restart it. The traceback's text is kept; only the values go.

    :param exc: The error the rank fails with.
    """
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending.extend(chained for chained in (error.__cause__, error.__context__) if chained is not None)


def _record_failure(folder: str | None, rank: int) -> None:
    """Write when and how this rank failed into ``folder`` (``spawn``'s), for the parent to find the first."""
    if folder is None:
        return
    record = {"at": time.time(), "rank": rank, "pid": os.getpid(), "traceback": traceback.format_exc()}
    error = sys.exc_info()[1]
    if isinstance(error, TrainkitError) and not isinstance(error, TrainingInterrupted):
        plain = str | int | float | bool | None  # anything else is shown in the message, and comes back as None
        own = {key: value if isinstance(value, plain) else None for key, value in vars(error).items()}
        record["refusal"] = {"class": type(error).__name__, "message": str(error), "attributes": own}
    path = Path(folder, f"rank{rank}.json")
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)  # whole or absent, whatever kills this process next


def _refusal(record: dict[str, Any]) -> TrainkitError | None:
    """The refusal a rank recorded (:func:`_record_failure`), rebuilt as the same :class:`~trainkit.TrainkitError`
    subclass with the same message and plain attributes (a :class:`~trainkit.ConfigError`'s ``key``, ``rule``...);
    None when the rank failed otherwise. Only trainkit's own error classes are rebuilt, and nothing is unpickled."""
    refusal = record.get("refusal")
    if not isinstance(refusal, dict):
        return None
    cls = getattr(errors, str(refusal.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, TrainkitError)) or issubclass(cls, TrainingInterrupted):
        return None
    error = cls.__new__(cls)
    Exception.__init__(error, str(refusal.get("message", "")))
    attributes = refusal.get("attributes")
    for key, value in attributes.items() if isinstance(attributes, dict) else ():
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, key, value)
    return error


def _recorded_failures(folder: str) -> dict[int, dict[str, Any]]:
    """The failures the ranks recorded in ``folder``, by rank."""
    records = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        records[record["rank"]] = record
    return records


def launch(trainer_class: type, cfg: Config | Mapping[str, Any]) -> Any:
    """Run this process's rank of a job started by ``torchrun`` (or as a plain single process).

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``) from the
    environment torchrun sets; without them it runs a single process. A refusal (any
    :class:`~trainkit.TrainkitError`: a bad config, a checkpoint this run cannot resume, an ``out_dir`` in use)
    ends the process with one line on stderr, ``PROGRAM: error: ...``, and exit status 2, as a config error on the
    command line does (:func:`trainkit.messages.exit_refused`); when every rank of a torchrun job refuses alike, the
    line is printed once. Any other exception on this rank propagates with its traceback (a bug; torchrun then stops
    the other ranks and exits non-zero). A run stopped by a signal (:class:`~trainkit.TrainingInterrupted`) exits the
    process with ``128 + signal number`` after saving, e.g. 143 for SIGTERM and 130 for Ctrl-C. Under torchrun those
    are each worker's status: torchrun's own is 1 (docs: "Stopping on a signal", for what a requeue script checks).

    :param trainer_class: A :class:`~trainkit.BaseTrainer` subclass.
    :param cfg: Its config, or a mapping validated into one.
    :returns: Rank 0's ``train()`` result, on every rank.
    :raises SystemExit: With ``128 + signal number`` when a signal stopped training, with 2 on a refusal.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return _run(trainer_class, cfg, rank, world_size)
    except TrainingInterrupted as exc:
        raise SystemExit(exc.exit_code) from exc
    except TrainkitError as exc:
        _refuse(exc, world_size)


_REFUSAL_STORE_TIMEOUT_S = 2.0
"""How long a torchrun worker waits for its agent's store to say whether another rank printed its refusal."""


def _refuse(error: TrainkitError, world_size: int) -> NoReturn:
    """End this rank on a refusal: its one line, unless another rank of the job printed the same one.

    No torchrun error file is written: torchrun's failure report would then repeat the line for every rank, with a
    line of its own about the file, under its traceback; without one it names the ranks' exit status 2.
    """
    line = refusal_line(error)
    exit_refused(error, show=world_size <= 1 or _first_to_say(line))


def _first_to_say(line: str) -> bool:
    """Whether this rank is the first of its job to refuse with ``line``: the ranks count it in the job's store
    (torchrun's agent serves one at ``MASTER_ADDR:MASTER_PORT``), so a refusal every rank meets is printed once.

    Bounded by :data:`_REFUSAL_STORE_TIMEOUT_S`; without a store to ask (the rank that hosted it is gone, a plain
    process), every rank prints its own.
    """
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return True
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"trainkit/refused/{attempt}/{hashlib.sha256(line.encode()).hexdigest()}"
    try:
        timeout = datetime.timedelta(seconds=_REFUSAL_STORE_TIMEOUT_S)
        store = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timeout)
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - any failure to ask only means printing the line, which is always safe
        return True


_PRELOAD = ["torch", torch_private.COMPILER_MODULE, "torch.distributed", "torch.nn.parallel", "trainkit.trainer"]
"""What the fork server imports once for every rank it forks: torch, and what a first optimizer imports
(torch's compiler, 2-3 s of CPU per process otherwise). No user module: the ranks import those anew."""


def _server() -> Any:
    return multiprocessing.forkserver._forkserver


def _server_running() -> bool:
    return getattr(_server(), "_forkserver_pid", None) is not None


def _stop_server() -> None:
    stop = getattr(_server(), "_stop", None)  # multiprocessing's own way to stop it (what its tests use)
    if stop is not None:
        stop()


@contextlib.contextmanager
def fork_server(preload: Sequence[str] = ()) -> Iterator[None]:
    """Keep one fork server for every :func:`spawn` inside the block, and stop it at the end.

    Each :func:`spawn` otherwise starts a fork server and stops it when it returns, so torch is imported
    once per call (about 3-5 s of CPU) instead of once per rank. Inside this block the server, and its
    imports, are shared by every call: a sweep of many short runs starts each one's ranks in a fraction of
    a second. The ranks still start clean, with the caller's environment, working directory, ``sys.path``
    and standard output and error at the time of each call. A server the program already runs is used
    as it is and left running.

    >>> import trainkit
    >>> with trainkit.fork_server():
    ...     pass  # trainkit.spawn(MyTrainer, cfg, world_size=2) for every run of the sweep

    :param preload: More modules for the server to import once, besides torch and trainkit's trainer (e.g.
        ``"torch.distributed.checkpoint"`` for sharded checkpoints, or the module of the trainer class).
    :returns: A context manager.
    :raises TypeError: When ``preload`` holds something other than module names.
    """
    ours = not _server_running()
    if ours:
        if isinstance(preload, str) or not all(isinstance(name, str) for name in preload):
            raise TypeError(f"fork_server(preload=...) takes module names, got {preload!r}")
        multiprocessing.get_context("forkserver").set_forkserver_preload([*_PRELOAD, *preload])
        multiprocessing.forkserver.ensure_running()  # now: a spawn inside the block finds it running, and keeps it
    try:
        yield
    finally:
        if ours:
            _stop_server()


def _caller_fd(fd: int) -> _CallerFd | None:
    """The caller's descriptor ``fd`` to hand to a rank, or None when this process has it closed."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return _CallerFd(fd)


class _CallerFd:
    """One of the caller's file descriptors, handed to a rank as it is when the rank starts.

    A rank forked by the server inherits the server's descriptors: its standard output and error would be the
    ones the server started with, not the caller's now (a test's captured output, a redirected log).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        # pickled while the rank is being started: DupFd hands the descriptor itself to the new process
        return _CallerFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(handed: Any) -> int:
        return handed.detach()


_PR_SET_PDEATHSIG = 1
"""``prctl(2)``'s option that asks the kernel for a signal when the parent process dies (Linux)."""


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this rank when ``parent`` (the fork server) dies, and let the server exit when
    :func:`spawn`'s caller does: a caller killed with SIGKILL leaves no rank training on (torchrun's workers, each
    in a session of its own and without such a signal, outlive an agent killed so). The signal is Linux's (a no-op
    elsewhere).

    torch's own wrapper asks for SIGINT, which trainkit takes as "stop after this epoch": a rank whose caller is
    gone would train to its epoch's end, however long, with nobody to return to.

    :param parent: The fork server's pid, the rank's parent.
    """
    # the server exits when no process holds its liveness pipe any more; each rank got a copy (for a fork server of
    # its own it never uses: it would start a new one): let go of it, or the server would outlive the caller
    alive = getattr(_server(), "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        _server()._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if done == 0 and os.getppid() != parent:  # the parent died before the request: no signal would come now
        os.kill(os.getpid(), signal.SIGKILL)


def _worker(
    rank: int,
    trainer_class: type,
    cfg: Any,
    world_size: int,
    results: Any,
    failures: str,
    environ: dict[str, str],
    stdio: tuple[int | None, int | None],
    parent: int | None = None,
) -> None:
    if parent is not None:
        _die_with_parent(parent)
    # the fork server's environment and output are the ones it started with: each rank gets the caller's now
    os.environ.clear()
    os.environ.update(environ)
    for stream, fd, target in ((sys.stdout, stdio[0], 1), (sys.stderr, stdio[1], 2)):
        if fd is None or fd == target:
            continue
        stream.flush()
        os.dup2(fd, target)
        os.close(fd)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    result = _run(trainer_class, cfg, rank, world_size, failures)
    if rank == 0:
        results.put(result)


def spawn(trainer_class: type, cfg: Config | Mapping[str, Any], world_size: int) -> Any:
    """Run a trainer in ``world_size`` local processes, without torchrun.

    The processes are forked from a fork server (``multiprocessing``'s forkserver context) that imports torch
    once and is stopped when the call returns (inside :func:`fork_server`, one server serves every call);
    like spawned ones, they start clean (no thread, no state of this process) with this process's
    environment, working directory, ``sys.path``, standard output and error, and import the trainer's
    module anew. Picks a free port on 127.0.0.1 for the rendezvous. When any rank raises, the others are
    terminated and the original traceback is raised here; no process is left behind. On Linux the ranks die with
    this process: killed with SIGKILL, it takes its fork server and, through a parent-death signal
    (``PR_SET_PDEATHSIG``), every rank with it. When several ranks
    fail, the one that failed first is reported (the others' failures are usually its consequences, such as
    a connection the failed rank closed), whichever process happened to exit first; a rank that died without
    an exception (killed by a signal) is reported as torch reports it. A rank that timed out in DDP's
    backward all-reduce can stay until the rank it waited for exits (then it is terminated): in torch 2.13
    freeing a gloo process group at exit can deadlock with the backend thread still freeing that all-reduce,
    which holds autograd's Python context.

    :param trainer_class: A :class:`~trainkit.BaseTrainer` subclass, importable by module path (the
        children import it anew).
    :param cfg: Its config, or a mapping validated into one.
    :param world_size: The number of processes (>= 1).
    :returns: Rank 0's ``train()`` result.
    :raises TrainkitError: When the first rank to fail refused to run (a bad config, a checkpoint this run cannot
        resume, an ``out_dir`` in use): the same :class:`~trainkit.TrainkitError` subclass, with its one-line
        message and without the rank's internal traceback, as :func:`launch` prints it.
    :raises torch.multiprocessing.ProcessRaisedException: With the failing rank's traceback, for any other error.
    :raises torch.multiprocessing.ProcessExitedException: When a rank died without an exception.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(cfg, Config):
        cfg_arg: Any = cfg
    else:
        cfg_arg = dict(cfg)
    previous = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    failures = tempfile.mkdtemp(prefix="trainkit-spawn-")
    try:
        with fork_server():
            results = mp.get_context("forkserver").SimpleQueue()
            stdio = (_caller_fd(1), _caller_fd(2))
            server = getattr(_server(), "_forkserver_pid", None)  # every rank's parent
            mp.start_processes(
                _worker,
                args=(trainer_class, cfg_arg, world_size, results, failures, dict(os.environ), stdio, server),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
            return results.get() if not results.empty() else None
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        records = _recorded_failures(failures)
        # a rank that died without an exception (a signal, os._exit) recorded nothing: when it failed is
        # unknown, and its death is the likelier cause of the others' errors, so torch's report stands
        if exc.error_index not in records:
            raise
        first = min(records.values(), key=lambda record: record["at"])
        refusal = _refusal(first)
        if refusal is not None:  # a refusal the user caused: its one line, not the rank's internal traceback
            raise refusal from None
        if first["rank"] == exc.error_index:
            raise
        later = str(exc).strip().splitlines()
        raise mp.ProcessRaisedException(
            f"\n\n-- Process {first['rank']:d} terminated with the following error:\n{first['traceback']}\n"
            f"(rank {exc.error_index} failed after it: {later[-1] if later else type(exc).__name__})",
            first["rank"],
            first["pid"],
        ) from exc
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
