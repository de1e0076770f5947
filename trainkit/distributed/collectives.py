"""Process-group setup and the few collectives the trainer issues.

Side effects: creates the ``torch.distributed`` process group and runs collectives. Every collective
is bounded by the group's timeout (``dist.timeout_s``), so a dead rank makes the others fail rather
than hang.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainkit import torch_private
from trainkit.errors import DistributedError, UsageError
from trainkit.messages import warn_user

__all__ = [
    "init_process_group",
    "is_distributed",
    "reduce_mean",
    "broadcast_object",
    "all_gather_objects",
    "any_all",
    "DelayedVote",
    "raise_if_any_rank_failed",
    "barrier",
    "teardown",
    "unwrap",
    "free_port",
]


def is_distributed() -> bool:
    """Tell whether a process group is initialized in this process.

    :returns: True inside a multi-process run set up by :func:`init_process_group` or by the user.
    """
    return dist.is_available() and dist.is_initialized()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now.

    Side effects: binds and closes a socket.

    :returns: The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(rank: int, world_size: int, *, backend: str, timeout_s: float, device: torch.device) -> bool:
    """Join the default process group unless one exists already.

    Side effects: reads ``MASTER_ADDR``/``MASTER_PORT`` (defaults ``127.0.0.1``/``29500``) and creates
    the group. ``backend="auto"`` picks nccl on CUDA and gloo on CPU.

    :param rank: This process's rank.
    :param world_size: The number of processes.
    :param backend: ``"auto"``, ``"gloo"`` or ``"nccl"``.
    :param timeout_s: The bound on every collective, in seconds.
    :param device: The device this rank computes on; nccl binds to it.
    :returns: True when this call created the group (and so the caller owns its teardown).
    :raises DistributedError: When an existing group disagrees with ``rank``/``world_size``, when nccl
        would have to put two of this node's processes on one GPU, or when the ranks of a job of several torchrun
        agents do not meet in the agents' shared store (naming ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
    """
    if is_distributed():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise DistributedError(
                f"a process group already exists with rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the trainer was given rank {rank} of {world_size}"
            )
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        check_one_gpu_per_process(world_size)
        kwargs["device_id"] = device
    store = _elastic_attempt_store(world_size, datetime.timedelta(seconds=timeout_s))
    if store is not None:
        kwargs["store"] = store
    try:
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    except dist.DistStoreError as exc:
        if store is None or int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
            raise
        raise DistributedError(
            f"the ranks did not meet within dist.timeout_s={timeout_s} in torchrun's shared agent store; with "
            "several agents (nodes) each counts its own restarts (TORCHELASTIC_RESTART_COUNT="
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} here), which part the ranks of one attempt when "
            "an agent joined or was replaced; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every agent, so that "
            "each attempt's process group gets a store of its own (docs: 'torchrun elastic')"
        ) from exc
    return True


def check_one_gpu_per_process(world_size: int) -> None:
    """Refuse, before NCCL does so cryptically ("Duplicate GPU detected"), more processes than GPUs on a node.

    :param world_size: The number of processes (``LOCAL_WORLD_SIZE``, as torchrun sets it, wins: one node's).
    :raises DistributedError: Naming the counts and the fix.
    """
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun sets it; spawn is one node
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise DistributedError(
            f"dist.backend=nccl needs one GPU per process, but {local_world_size} processes share this node's "
            f"{gpus} visible CUDA device(s); start at most {gpus} per node (torchrun --nproc_per_node={gpus}), "
            "or set dist.backend=gloo"
        )


def _elastic_attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Return torchrun's agent store scoped to this restart attempt, or None when not under its shared store.

    torchrun's agent hosts one TCPStore for every restart attempt (``TORCHELASTIC_USE_AGENT_STORE``), and
    the process group's keys carry no attempt in their names: a restarted rank would read the dead
    attempt's peer addresses and fail to connect. A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps the
    attempts apart (the count is the same on every rank of a single-node job). With several agents each counts its
    own: one that joined later, or replaced a lost one, counts fewer, and a restart for a node that joins counts
    none. Elastic jobs therefore set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: no shared store, and rank 0 of each
    attempt hosts a new one (:func:`init_process_group` names it when the ranks do not meet in the shared one).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"trainkit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Tensors handed to trainkit's collectives, until the backend lets go of them. A gloo worker thread (an
# nccl watchdog too) holds each collective's tensors a little past the moment the caller sees it done,
# and frees them under the GIL; if the process is finalizing by then, that thread is killed inside a
# noexcept destructor and the process aborts ("terminate called without an active exception").
# teardown() waits for these to be gone before it returns.
_held_by_backend: list[weakref.ref[torch.Tensor]] = []

_RELEASE_WAIT_CAP_S = 10.0
"""The longest teardown waits for the backend to free them: it takes milliseconds when all is well."""


def held_by_backend() -> list[weakref.ref[torch.Tensor]]:
    """The weak references to the tensors trainkit handed to its collectives (the list itself, pruned as they go).

    :returns: The list.
    """
    return _held_by_backend


def handed_to_backend(*tensors: torch.Tensor) -> None:
    """Note tensors given to a collective, which the backend may hold a little past the call (see ``teardown``).

    :param tensors: The tensors.
    """
    _held_by_backend[:] = [ref for ref in _held_by_backend if ref() is not None]
    _held_by_backend.extend(weakref.ref(tensor) for tensor in tensors)


def wait_until_backend_lets_go(timeout_s: float) -> bool:
    """Sleep (the GIL released) until every tensor of trainkit's collectives is freed.

    :param timeout_s: The longest wait.
    :returns: True when they are all freed; False on timeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        _held_by_backend[:] = [ref for ref in _held_by_backend if ref() is not None]
        if not _held_by_backend:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)


def _pickled(value: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    # a copy torch owns: a tensor over the bytes object would free it from the backend's thread as well
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone().to(device)


def _unpickled(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301 - peers of one job, as in torch's own


def reduce_mean(total: Any, count: Any) -> float:
    """Pool a sum and a count over every rank and return their quotient.

    Side effects: one all-reduce when distributed (sums in float64). Every rank must call it the same
    number of times, in the same order.

    :param total: This rank's summed quantity (a float or a scalar tensor).
    :param count: This rank's number of terms in that sum.
    :returns: The pooled mean, identical on every rank; NaN when no rank contributed a term.
    :raises UsageError: When ``total`` or ``count`` is a DTensor that is whole on every rank (not a partial sum).
    """
    total, count = _own_share(total, "total"), _own_share(count, "count")
    if is_distributed():
        device = _collective_device()
        pair = torch.stack(
            [
                torch.as_tensor(total, dtype=torch.float64).to(device).reshape(()),
                torch.as_tensor(count, dtype=torch.float64).to(device).reshape(()),
            ]
        )
        dist.all_reduce(pair, op=dist.ReduceOp.SUM)
        handed_to_backend(pair)
        total_sum, count_sum = pair.tolist()
    else:
        total_sum, count_sum = float(total), float(count)
    return total_sum / count_sum if count_sum > 0 else math.nan


def _own_share(value: Any, name: str) -> Any:
    """This rank's share of a value that may be a DTensor: a partial sum is its local part; anything else that
    is already whole on every rank would be counted once per rank, so it is refused."""
    if type(value) is torch.Tensor or not isinstance(value, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    if value.placements and all(placement.is_partial() for placement in value.placements):
        return value.to_local()
    raise UsageError(
        f"reduce_mean(): {name} is a DTensor with placements {tuple(value.placements)}, which holds the whole "
        "value on every rank, so pooling it would count it once per rank; pass this rank's own share as a "
        "plain tensor"
    )


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Give every rank ``src``'s value of a small picklable object.

    Side effects: one broadcast when distributed; returns ``value`` itself otherwise.

    :param value: The value on ``src``; ignored elsewhere.
    :param src: The rank whose value wins.
    :returns: ``src``'s value, on every rank.
    """
    if not is_distributed():
        return value
    device = _collective_device()
    is_src = dist.get_rank() == src
    payload = _pickled(value, device) if is_src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    handed_to_backend(size, payload)
    return value if is_src else _unpickled(payload)


def all_gather_objects(value: Any) -> list[Any]:
    """Collect one small picklable object from every rank, in rank order.

    :param value: This rank's object.
    :returns: Every rank's object, on every rank; ``[value]`` when not distributed.
    """
    if not is_distributed():
        return [value]
    device = _collective_device()
    payload = _pickled(value, device)
    world_size = dist.get_world_size()
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    lengths = torch.cat(sizes).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    handed_to_backend(size, *sizes, padded, *gathered)
    out = [_unpickled(data[:length]) for data, length in zip(gathered, lengths)]
    return out


def any_all(flags: list[bool]) -> tuple[list[bool], list[bool]]:
    """Reduce boolean flags over every rank in one all-reduce.

    :param flags: This rank's flags; every rank passes the same number.
    :returns: For each flag, whether any rank set it, and whether every rank set it.
    """
    if not is_distributed():
        return list(flags), list(flags)
    device = _collective_device()
    values = torch.tensor([int(f) for f in flags] + [int(not f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    handed_to_backend(values)
    got = values.tolist()
    n = len(flags)
    return [bool(v) for v in got[:n]], [not bool(v) for v in got[n:]]


class DelayedVote:
    """Whether any rank raised a flag, learned one call late so that no call waits for the other ranks.

    Each :meth:`cast` starts a non-blocking all-reduce (MAX) of this rank's flag and returns the result of
    the one the previous call started, which has long finished by then when the calls are a training step
    apart. The all-reduce runs on a process group of its own, gloo on CPU tensors whatever the main backend:
    on the default group it would queue the step's gradient all-reduce behind it (measured on 2 gloo ranks:
    +45 % on a 3 ms step), and under nccl reading its result would wait for the GPU. Every rank must call it
    at the same points; the first call makes the group, collectively. Without a process group it returns the
    flag at once.

    >>> vote = DelayedVote(timeout_s=5.0)
    >>> vote.cast(False), vote.cast(True), vote.finish()
    (False, True, False)

    :param timeout_s: How long a wait for the previous all-reduce may take (``dist.timeout_s``).
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._group: Any = None
        self._work: Any = None
        self._value: torch.Tensor | None = None

    def cast(self, flag: bool) -> bool:
        """Send this rank's flag; return whether any rank's flag was set at the previous call.

        :param flag: This rank's flag now.
        :returns: Any rank's flag at the previous call (False at the first); ``flag`` itself when not distributed.
        """
        if not is_distributed():
            return bool(flag)
        previous = self.finish()
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        value = torch.tensor([int(bool(flag))], dtype=torch.int32)
        self._work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._value = value
        handed_to_backend(value)
        return previous

    def finish(self) -> bool:
        """Wait for the all-reduce in flight, if any, and return its result (False when none is in flight).

        :returns: Whether any rank's flag was set at the last :meth:`cast`.
        :raises RuntimeError: From torch.distributed, when a rank does not join within the timeout.
        """
        work, value = self._work, self._value
        self._work = self._value = None
        if work is None or value is None:
            return False
        work.wait(self._timeout)
        return bool(value.item())


def raise_if_any_rank_failed(
    error: BaseException | None, failed_elsewhere: Callable[[], BaseException], *, world_size: int
) -> None:
    """Let every rank learn, in one all-reduce, whether a step failed on some rank, and raise if it did.

    A rank whose own step failed raises its ``error``; the others raise ``failed_elsewhere()``, so no rank
    walks on into a collective that the failed one will never join.

    :param error: This rank's failure, or None.
    :param failed_elsewhere: Builds the error the ranks that did not fail raise.
    :param world_size: The run's number of processes; with 1 there is no collective.
    :raises BaseException: ``error`` or ``failed_elsewhere()``, when any rank failed.
    """
    failed = error is not None
    if world_size > 1:
        (failed,), _ = any_all([failed])
    if error is not None:
        raise error
    if failed:
        raise failed_elsewhere()


def barrier(timeout_s: float) -> None:
    """Wait until every rank has reached this call.

    Side effects: one barrier when distributed. On gloo it is ``monitored_barrier``: its messages go
    out and come in on the calling thread, with the GIL released, and a rank that does not arrive is
    named in the error. ``dist.barrier()`` on gloo runs on a worker thread and keeps every collective
    still in flight alive until that thread frees the barrier, after the caller has moved on.

    :param timeout_s: The bound on the wait, in seconds.
    :raises RuntimeError: From torch.distributed, when a rank does not arrive within ``timeout_s``.
    """
    if not is_distributed():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.barrier()


def teardown(timeout_s: float, *, meet: bool = True) -> None:
    """Leave the default process group: optionally meet the other ranks, then destroy it.

    Side effects: a :func:`barrier` when ``meet`` (so that no rank tears down what a slower one still
    uses: the store lives in rank 0); then, met or not, waits (the GIL released, up to 10 s) until the
    backend has freed the tensors of trainkit's collectives; then ``destroy_process_group``. Without that
    wait, a backend thread that frees them while the interpreter is finalizing aborts the process
    (SIGABRT, "terminate called without an active exception"), and one that frees them while the group's
    destructor joins it deadlocks the process; both typically on a loaded machine.

    :param timeout_s: The bound on the barrier, in seconds (and on the wait, up to 10 s).
    :param meet: Meet the other ranks first; pass False after a failure (the others may be gone).
    :raises RuntimeError: From torch.distributed, when a rank does not reach the barrier in time.
    """
    if not is_distributed():
        return
    if meet:
        barrier(timeout_s)
    # after a failure too: the wait needs no other rank, and a backend thread that frees a tensor while this
    # thread holds the GIL in the group's destructor (which joins that thread) deadlocks the process
    wait_s = min(timeout_s, _RELEASE_WAIT_CAP_S)
    if not wait_until_backend_lets_go(wait_s):
        warn_user(
            f"torch.distributed still held the tensors of a finished collective after {wait_s} s; "
            "the process may abort at exit"
        )
    dist.destroy_process_group()


def wrap_ddp(module: nn.Module, world_size: int, find_unused_parameters: bool = False) -> nn.Module:
    """``make_ddp()``: ``module`` in ``DistributedDataParallel`` over ``world_size`` ranks, or itself on one process.

    :param module: The module, already on this rank's device (a CUDA module is given its device id).
    :param world_size: The number of processes.
    :param find_unused_parameters: Passed to DDP.
    :returns: The DDP-wrapped module, or ``module`` on one process.
    """
    if world_size == 1:
        return module
    device = next(iter(module.parameters()), torch.empty(0)).device
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, find_unused_parameters=find_unused_parameters
    )


def unwrap(module: nn.Module | None) -> nn.Module | None:
    """Return the module inside a DistributedDataParallel (or ``torch.compile``) wrapper.

    :param module: A module, possibly wrapped, or None.
    :returns: The innermost module.
    """
    while module is not None:
        inner = getattr(module, "module", None) if isinstance(module, nn.parallel.DistributedDataParallel) else None
        inner = inner if inner is not None else torch_private.compiled_inner_module(module)
        if inner is None:
            return module
        module = inner
    return module
