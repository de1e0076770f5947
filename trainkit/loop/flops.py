"""``throughput.mfu``: the model FLOPs of a sample, counted once on a real training batch (or given), and the
peak FLOP/s of a device, for ``perf/mfu``.

Side effects: while the loop body of one batch runs, a ``TorchDispatchMode`` sees its ops. It runs each op as
it came (no decomposition, no copy), so the training is the same as without it; it only reads shapes and
dtypes (no host sync). Only ops outside the autograd engine's backward are counted, with the formulas of
``torch.utils.flop_counter`` (``FlopCounterMode``'s own, to which ``register_flop_formula`` adds), and the model
FLOPs are three times those: a backward is twice its forward, whatever ran in it (activation checkpointing's
recomputed forward, FlashAttention's recomputed scores are hardware FLOPs, not model FLOPs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from trainkit import torch_private
from trainkit.bookkeeping.throughput_rates import peak_flops
from trainkit.config.schema import ThroughputConfig
from trainkit.messages import warn_user

__all__ = ["ForwardFlops", "ModelFlops"]

COUNTED_BATCH = 1
"""Which batch of the counted loop (0-based, in this process) is counted: not the first, which compiles,
autotunes and initializes lazily (a ``torch.compile``'d model first called under a dispatch mode is never compiled
after), so the counted step is one that runs as every later one does."""

_TABLE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
_CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward, torch_private.legacy_convolution_op()}
_FP8 = {dtype for name, dtype in vars(torch).items() if name.startswith("float8_") and isinstance(dtype, torch.dtype)}


def _compute_dtype(packet: Any, args: tuple[Any, ...]) -> str:
    """The table column an op's FLOPs belong to: its first matrix operand's dtype (fp32 as tf32 where torch
    lets cuBLAS or cuDNN use TF32 for it)."""
    matrix = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    dtype = matrix.dtype if matrix is not None else torch.float32
    if dtype == torch.float32:
        tf32 = torch.backends.cudnn.allow_tf32 if packet in _CONVOLUTIONS else torch.backends.cuda.matmul.allow_tf32
        return "tf32" if tf32 else "fp32"
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    return "fp8" if dtype in _FP8 else names.get(dtype, str(dtype).removeprefix("torch."))


class ForwardFlops(torch_private.dispatch_mode_base()):  # type: ignore[misc]
    """Count the FLOPs of the ops dispatched outside backward, by the dtype they run in.

    Side effects: none on the ops (each runs exactly as called); the counts go into ``by_dtype``.

    :ivar by_dtype: FLOPs per table column (``"bf16"``, ``"tf32"``, ...), forward only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None and torch_private.autograd_task_id() == -1:  # -1: not inside a backward
            dtype = _compute_dtype(func.overloadpacket, args)
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + int(formula(*args, **kwargs, out_val=out))
        return out


class ModelFlops:
    """The model FLOPs per sample and one device's peak FLOP/s, for ``perf/mfu``.

    Side effects: :meth:`counting` counts one batch's loop body once, then never again; a problem (no peak for
    the device, a count that failed) is warned about once, and the rows then carry no ``perf/mfu``.

    :param cfg: The ``throughput`` config section.
    :param device: The trainer's device (a CUDA device's name picks the row of the peak table).
    """

    def __init__(self, cfg: ThroughputConfig, device: torch.device) -> None:
        self._cfg = cfg
        self._device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.flops_per_sample: float | None = cfg.flops_per_sample
        self._dtype: str | None = None if cfg.dtype == "auto" else cfg.dtype
        self._failed = False
        self._batches_seen = 0
        if cfg.peak_flops is None and self._device_name is None:
            self._failed = True  # a CPU (or an MPS device) has no table row: nothing to count, no cost

    @property
    def pending(self) -> bool:
        """Whether a batch is still to be counted (a count given, or given up on, needs none)."""
        return self.flops_per_sample is None and not self._failed

    @contextlib.contextmanager
    def counting(self, samples: int | None) -> Iterator[None]:
        """Count the FLOPs of what runs inside (one batch's loop body) if it is the batch to count:
        the second of the counted loop in this process, or the next one after a count that did not end.

        :param batch: The batch (only its place in the loop matters).
        :param samples: Its number of samples (None: unknown, and nothing can be counted per sample).
        """
        self._batches_seen += 1
        if self._batches_seen <= COUNTED_BATCH or not self.pending:
            yield
            return
        mode = ForwardFlops()
        with mode:
            yield  # a body left by an exception (or a break) is not taken: the next batch is counted instead
        self._take(mode.by_dtype, samples)

    def _take(self, by_dtype: dict[str, int], samples: int | None) -> None:
        total = sum(by_dtype.values())
        if not samples or not total:
            why = "its samples are unknown" if not samples else "no op with a FLOP formula ran (a compiled step?)"
            return self._give_up(f"the counted batch gave no FLOPs per sample: {why}")
        self.flops_per_sample = 3.0 * total / samples  # forward + a backward of twice its FLOPs
        if self._dtype is None:
            self._dtype = max(by_dtype, key=by_dtype.__getitem__)

    def _give_up(self, why: str) -> None:
        self._failed = True
        warn_user(f"perf/mfu is left out: {why}; set throughput.flops_per_sample to give the count")

    def peak(self) -> float | None:
        """One device's peak FLOP/s: ``throughput.peak_flops``, else the table's for this device and dtype.

        :returns: The peak, or None where there is none (warned about once).
        """
        if self._cfg.peak_flops is not None or self._failed:
            return self._cfg.peak_flops
        if self._dtype is None:
            self._failed = True
            warn_user(
                "perf/mfu is left out: with throughput.flops_per_sample given, set throughput.dtype (the peak "
                "table's column) or throughput.peak_flops"
            )
            return None
        peak = peak_flops(self._device_name or "", self._dtype) if self._dtype in _TABLE_DTYPES else None
        if peak is None:
            self._failed = True
            warn_user(
                f"perf/mfu is left out: no dense peak FLOP/s is known for {self._device_name!r} in "
                f"{self._dtype}; set throughput.peak_flops"
            )
        return peak
