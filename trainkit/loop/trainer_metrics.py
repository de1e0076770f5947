"""Metrics between pushes: the log buffer, and the trainer's metrics (the buffer, the last pushed values, the
epoch's grad-norm mean, and the guard and throughput parts that add to a row). With the divergence guard on, the
grad-norm mean is a :class:`FiniteMean`: a skipped step's NaN or inf norm stays out of it.

Side effects: none but on tensors; one device-to-host transfer per push.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainkit.bookkeeping import is_real
from trainkit.loop.divergence_guard import SKIPPED_KEY
from trainkit.loop.optim import RunningMean

if TYPE_CHECKING:
    from trainkit.loop.divergence_guard import DivergenceGuard
    from trainkit.loop.throughput import Throughput

__all__ = [
    "FiniteMean",
    "LogBuffer",
    "TrainerMetrics",
]


class LogBuffer:
    """Metrics waiting for the next push, kept on their device until then.

    ``add`` keeps a device-side copy of each accelerator tensor (no host sync) and reads a CPU tensor at once
    (it is on the host: nothing to wait for); ``drain`` moves every tensor to the host in one transfer per
    device. A key logged twice before a push keeps its last value; later in-place changes to a logged tensor
    stay out of it.
    """

    read_cpu_at_log: bool = True
    """Read a CPU tensor at ``add`` (the default); False keeps it on the CPU until the push, as an accelerator's
    tensor is kept (the tests set it to run the accelerator path on a machine without one)."""

    def __init__(self) -> None:
        self._scalars: dict[str, Any] = {}
        self._vectors: dict[tuple[str, ...], torch.Tensor] = {}
        # one float64 scalar per tensor-valued key, reused from push to push: logging once per step
        # copies into it instead of allocating a tensor per step (drain reads slots, they never escape)
        self._slots: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._scalars) + sum(len(keys) for keys in self._vectors)

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Buffer scalar metrics: floats, ints, or 1-element tensors (an accelerator's kept on it).

        :param metrics: Name to value.
        :raises TypeError: When a value is not a number or a 1-element tensor.
        """
        slots = self._slots
        for key, value in metrics.items():
            key = str(key)
            if isinstance(value, torch.Tensor) and value.is_cpu and self.read_cpu_at_log:
                # a CPU tensor is on the host already: reading it now waits for nothing, is the snapshot, and is the
                # one tensor call a logged row needs (a device-side copy costs a few times more on a cold cache)
                try:
                    value = float(value.item())
                except (RuntimeError, TypeError, ValueError):
                    if value.numel() != 1:
                        raise TypeError(
                            f"logged metric {key!r} must be a 1-element tensor, got shape {tuple(value.shape)}"
                        ) from None
                    raise TypeError(
                        f"logged metric {key!r} must be a real-valued 1-element tensor, got dtype {value.dtype}"
                    ) from None
            elif isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise TypeError(f"logged metric {key!r} must be a 1-element tensor, got shape {tuple(value.shape)}")
                value = value.detach()
                if value.dim():
                    value = value.reshape(())
                slot = slots.get(key)
                if slot is None or slot.device != value.device:
                    slot = slots[key] = torch.empty((), dtype=torch.float64, device=value.device)
                # one device-side copy is the snapshot (later in-place changes stay out) and the cast for drain
                value = slot.copy_(value)
            elif isinstance(value, str | bytes):
                raise TypeError(f"logged metric {key!r} must be a number or a tensor, got {value!r}")
            elif not is_real(value):
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise TypeError(f"logged metric {key!r} must be a number or a tensor, got {value!r}") from None
            self._scalars[key] = value

    def add_vector(self, keys: list[str], values: torch.Tensor) -> None:
        """Buffer many metrics held in one 1-D tensor, e.g. per-parameter statistics.

        :param keys: One name per element.
        :param values: The values, on any device.
        """
        if len(keys) != values.numel():
            raise ValueError(f"add_vector got {len(keys)} keys for {values.numel()} values")
        if keys:
            # the same keys logged again before a push replace the older values, so memory stays bounded
            self._vectors.pop(tuple(keys), None)
            self._vectors[tuple(keys)] = values.detach().reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        """The buffered metrics as host values, without draining them (what a step checkpoint keeps).

        Side effects: one device-to-host transfer per buffered tensor.

        :returns: ``{"scalars": [[key, float], ...], "vectors": [[[key, ...], [float, ...]], ...]}``, in logging order.
        """
        return {
            "scalars": [
                [key, float(value.item()) if isinstance(value, torch.Tensor) else float(value)]
                for key, value in self._scalars.items()
            ],
            "vectors": [[list(keys), values.to(torch.float64).tolist()] for keys, values in self._vectors.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned, replacing the buffer's content.

        :param state: The saved buffer.
        """
        self._scalars = {str(key): float(value) for key, value in state["scalars"]}
        self._vectors = {tuple(keys): torch.tensor(values, dtype=torch.float64) for keys, values in state["vectors"]}

    def drain(self) -> dict[str, float]:
        """Return every buffered metric as a Python float and empty the buffer.

        Side effects: one device-to-host transfer per device that holds buffered tensors.

        :returns: Name to float, in logging order.
        """
        if len(self._scalars) == 1 and not self._vectors:  # a push per step of one metric: the short way
            ((key, value),) = self._scalars.items()
            self._scalars.clear()
            return {key: value.item() if isinstance(value, torch.Tensor) else float(value)}
        scalars: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        vectors: dict[torch.device, list[tuple[tuple[str, ...], torch.Tensor]]] = {}
        result: dict[str, float] = {}
        for key, value in self._scalars.items():
            if isinstance(value, torch.Tensor):
                scalars.setdefault(value.device, []).append((key, value))
                result[key] = math.nan  # placeholder keeps logging order
            else:
                result[key] = float(value)
        for keys, values in self._vectors.items():
            vectors.setdefault(values.device, []).append((keys, values))
        for device in {**scalars, **vectors}:
            names: list[str] = []
            parts: list[torch.Tensor] = []
            if scalars.get(device):
                entries = scalars[device]
                names += [key for key, _ in entries]
                parts.append(entries[0][1].reshape(1) if len(entries) == 1 else torch.stack([v for _, v in entries]))
            for keys, values in vectors.get(device, []):
                names += keys
                parts.append(values.to(torch.float64))
            flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the one transfer per device
            result.update(zip(names, flat))
        self._scalars.clear()
        self._vectors.clear()
        return result


class FiniteMean:
    """The mean of the finite values among 0-d tensors added one by one: the epoch's grad-norm mean under the
    divergence guard, whose skipped steps (a NaN or inf norm) did not train.

    Side effects: none but tensor ops on the values' device. A value the caller has read on the host already (the
    log buffer reads a CPU norm when it is logged) is added as that float, with no tensor op; a tensor (an
    accelerator's norm) is added on its device with no host sync, in three small ops into a ``[sum, count]``
    pair (float32: the count is exact up to 2**24 values per mean). The state is :class:`~trainkit.RunningMean`'s
    (``count``: the finite values), so a step checkpoint keeps it in the same place and a resumed mean is exact.

    >>> mean = FiniteMean()
    >>> for value in (1.0, float("nan"), 3.0):
    ...     mean.add(torch.tensor(value), value)
    >>> mean.take(), mean.take()
    (2.0, None)
    >>> for value in (2.0, float("inf"), 4.0):
    ...     mean.add(torch.tensor(value))  # on the value's device
    >>> float(mean.take())
    3.0
    >>> mean.add(torch.tensor(float("nan"))); float(mean.take())  # every value non-finite: NaN, as a 0/0
    nan
    """

    def __init__(self) -> None:
        self._sum: float | torch.Tensor | None = None  # None: nothing added since the last take
        self._count = 0
        self._pair: torch.Tensor | None = None  # the device path's [sum, count]
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [0, 1], [1, 0], a scratch pair

    def add(self, value: torch.Tensor, read: float | None = None) -> None:
        """Add one value; a non-finite one is left out of the mean (it only counts as added).

        :param value: A 0-d tensor (not changed).
        :param read: The same value read on the host already, or None (then added on the value's device).
        """
        if read is not None:
            if self._pair is not None or self._sum is None or self._sum.__class__ is not float:
                self._to_host()
            if math.isfinite(read):
                self._sum += read
                self._count += 1
            return
        pair = self._pair
        if pair is None or pair.device != value.device:
            pair = self._to_device(value.device)
        zero_one, one_zero, scratch = self._step  # type: ignore[misc]
        # [value, 1] when finite; [inf, nan] or [nan, nan] otherwise, which nan_to_num_ makes [0, 0]
        torch.addcmul(zero_one, value, one_zero, out=scratch)
        pair.add_(scratch.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))

    def _to_host(self) -> None:
        """Hold the sum and count as Python numbers (a checkpoint's, or the device pair's: one read, once)."""
        state = self.state_dict()
        self._pair, self._count = None, state["count"]
        self._sum = 0.0 if state["sum"] is None else float(state["sum"])

    def _to_device(self, device: torch.device) -> torch.Tensor:
        """Hold the sum and count as a ``[sum, count]`` pair on ``device`` (nothing yet, or a checkpoint's)."""
        state = self.state_dict()
        total = 0.0 if state["sum"] is None else float(state["sum"])
        self._sum = 0.0  # something was added: take() returns a mean, NaN when nothing finite
        self._pair = torch.tensor([total, state["count"]], dtype=torch.float32, device=device)
        ones = torch.tensor([[0.0, 1.0], [1.0, 0.0]], device=device)
        self._step = (ones[0], ones[1], torch.empty(2, device=device))
        return self._pair

    def take(self) -> float | torch.Tensor | None:
        """Return the mean of the finite values added since the last take, and start over.

        :returns: A float (values read on the host) or a 0-d tensor on the values' device (no host sync); NaN when
            every value was non-finite; None when nothing was added.
        """
        total, count, pair = self._sum, self._count, self._pair
        self._sum, self._count, self._pair = None, 0, None
        if pair is not None:
            return pair[0] / pair[1]
        if total is None:
            return None
        if isinstance(total, torch.Tensor):  # a checkpoint's sum, nothing added since: divided in its own dtype
            return total / count
        return total / count if count else math.nan

    def state_dict(self) -> dict[str, Any]:
        """The finite values' sum and count, as :meth:`trainkit.RunningMean.state_dict` gives them.

        Side effects: one device-to-host read of the device path's pair (at a checkpoint, never per step).

        :returns: ``{"sum": a 0-d CPU tensor or None, "count": int}``.
        """
        if self._pair is not None:
            pair = self._pair.cpu()
            return {"sum": pair[0].clone(), "count": int(pair[1])}
        total = self._sum
        if total is None:
            return {"sum": None, "count": 0}
        if isinstance(total, torch.Tensor):
            return {"sum": total.detach().cpu().clone(), "count": self._count}
        return {"sum": torch.tensor(total, dtype=torch.float64), "count": self._count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (it moves to the values' device, or the host, at the next add).

        :param state: The saved sum and count.
        """
        total = state["sum"]
        self._sum = None if total is None else total.detach().cpu().clone()
        self._count, self._pair = int(state["count"]), None


class TrainerMetrics:
    """The trainer's metrics between pushes: what waits for the next push, what was pushed last, and the
    epoch's grad-norm mean.

    :ivar buffer: The :class:`LogBuffer` of metrics logged since the last push.
    :ivar latest: The last pushed value of every key (the final metrics ``train()`` returns).
    :ivar grad_norm: The running mean of the epoch's grad norms (``log_epoch_grad_norm``): a
        :class:`~trainkit.loop.optim.RunningMean`, or with the guard a :class:`FiniteMean` (a skipped step's
        non-finite norm left out: it costs the guard's runs a tensor op or two per step, and the others nothing).
    :ivar guard: The divergence guard (:class:`~trainkit.loop.divergence_guard.DivergenceGuard`), None when
        ``guard.nonfinite`` is off.
    :ivar throughput: The ``perf/*`` counters (a :class:`trainkit.loop.throughput.Throughput`) with
        ``log_throughput``, else None.
    :ivar drain: What ``push_logs`` drains by: :meth:`LogBuffer.drain` itself when neither the guard nor the
        throughput counters are on (nothing in between on the per-row path), else :meth:`drain_with_parts`.
    """

    __slots__ = ("buffer", "latest", "grad_norm", "guard", "throughput", "drain")

    def __init__(self, *, guard: DivergenceGuard | None = None, throughput: Throughput | None = None) -> None:
        self.buffer = LogBuffer()
        self.latest: dict[str, float] = {}
        self.grad_norm: RunningMean | FiniteMean = RunningMean() if guard is None else FiniteMean()
        self.guard = guard
        self.throughput = throughput
        parts = guard is not None or throughput is not None
        self.drain: Callable[[], dict[str, float]] = self.drain_with_parts if parts else self.buffer.drain

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """Take a step's pre-clip grad norm: into the epoch mean, the buffer, and the guard when there is one.

        :param norm: The 0-d norm on the device.
        """
        self.buffer.add({"train/grad_norm": norm})
        if self.guard is None:
            self.grad_norm.add(norm)
            return
        read = self.buffer._scalars["train/grad_norm"]  # a float when the buffer read the norm (a CPU one)
        read = read if read.__class__ is float else None
        self.grad_norm.add(norm, read)  # a FiniteMean: a skipped step's NaN or inf stays out of the epoch's mean
        self.guard.observe(norm, read)

    def log_grad_norm_mean(self) -> None:
        """Buffer ``train/grad_norm_epoch``, the mean of the norms taken since the last call (nothing if none)."""
        mean = self.grad_norm.take()
        if mean is not None:
            self.buffer.add({"train/grad_norm_epoch": mean})

    def last_value(self, key: str) -> Any:
        """The value of ``key`` waiting in the buffer, else the last one pushed, else None.

        :param key: The metric's name.
        """
        value = self.buffer._scalars.get(key)
        if isinstance(value, torch.Tensor):
            return value.item()
        return value if value is not None else self.latest.get(key)

    def drain_with_parts(self) -> dict[str, float]:
        """:meth:`LogBuffer.drain`, with the divergence guard's skip count added to a non-empty buffer first and
        the throughput counters' ``perf/*`` rates after.

        :returns: Name to float, in logging order.
        """
        if self.guard is not None and len(self.buffer):
            self.buffer.add(self.guard.count())
        if self.throughput is not None:
            return self.throughput.drain(self.buffer)
        return self.buffer.drain()

    def outside_training(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Stop the throughput counters' training clock inside (a no-op without them): see
        :meth:`~trainkit.loop.throughput.Throughput.outside_training`.

        :param kind: What is done: ``"val"``, ``"ckpt"``, ``"test"``.
        :returns: The context manager.
        """
        if self.throughput is None:
            return contextlib.nullcontext()
        return self.throughput.outside_training(kind)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a step checkpoint keeps of this rank's metrics: the unpushed buffer (with the guard's skip count,
        when there is a guard) and the grad-norm mean.

        :returns: ``(buffer state, grad-norm state)``.
        """
        if self.guard is not None:
            self.buffer.add(self.guard.count())
        return self.buffer.state_dict(), self.grad_norm.state_dict()

    def resume(self, latest: Mapping[str, float] | None, rank_state: Mapping[str, Any] | None) -> None:
        """Put back what a checkpoint holds of the metrics; the guard's window starts again from its skip count.

        :param latest: The checkpoint's last pushed value of every metric.
        :param rank_state: This rank's share of a step checkpoint (``logs``, ``grad_norm``), or None.
        """
        self.latest = dict(latest or {})
        if rank_state is not None:
            self.load_state_dict(rank_state["logs"], rank_state["grad_norm"])
        if self.guard is not None:
            self.guard.reset(self.last_value(SKIPPED_KEY))

    def clear(self) -> None:
        """Drop what waits for the next push and the epoch's grad-norm mean (a rollback's lost steps)."""
        self.load_state_dict(LogBuffer().state_dict(), RunningMean().state_dict())

    def load_state_dict(self, logs: Mapping[str, Any], grad_norm: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned.

        :param logs: The buffer's state.
        :param grad_norm: The grad-norm mean's state.
        """
        self.buffer.load_state_dict(logs)
        self.grad_norm.load_state_dict(grad_norm)
