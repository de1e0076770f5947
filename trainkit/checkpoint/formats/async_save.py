"""Asynchronous checkpoint writes: copy the state into reused CPU buffers, write it in the background.

Side effects: a background thread that calls :func:`trainkit.files.durable.atomic_save`, so every write is
as atomic and durable as a synchronous one. At most one write is in flight; the next submit, and
:meth:`AsyncCheckpointWriter.wait`, wait for it and re-raise its failure with the original exception.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainkit.files.durable import atomic_save, finish_freeing

__all__ = ["AsyncCheckpointWriter", "SyncCheckpointWriter", "StagingBuffers", "write_in_order"]


class StagingBuffers:
    """Host copies of a payload's tensors, allocated once per tensor slot and reused by every save.

    The payload's structure (dict keys, list positions) names each slot; a slot whose shape or dtype
    changes gets a new buffer. On CUDA the buffers are pinned, so the device-to-host copies are DMA.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, payload: Any) -> Any:
        """Copy ``payload`` into the buffers: tensors into their slots, everything else deep-copied.

        Types survive: ``nn.Parameter``, ``OrderedDict`` (with its ``_metadata``), ``Counter`` and ``torch.Size``
        stay what they were, and so do a tensor's Python attributes (copied; a reused buffer never keeps them); numpy
        arrays are copied, so changing them after the call does not change the save.

        Side effects: one copy per tensor (waits for device copies to finish before returning).

        :param payload: Nested dicts, lists and tuples of tensors and plain values.
        :returns: A structure equal to ``payload`` that shares nothing with it; a container ``payload`` holds at
            several places is copied once and held at the same places (as ``torch.save`` writes it).
        """
        staged = self._stage(payload, (), {})
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the write thread must see finished copies
        return staged

    def _stage(self, item: Any, path: tuple[Any, ...], copies: dict[int, Any]) -> Any:
        if isinstance(item, dict | list | tuple) and type(item) is not torch.Size:
            # a shared container is copied once (linear, not one copy per path); the walk's states have no cycle
            copied = copies.get(id(item))
            if copied is None:
                copied = copies[id(item)] = self._stage_container(item, path, copies)
            return copied
        if isinstance(item, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != item.shape or buffer.dtype != item.dtype:
                buffer = torch.empty(item.shape, dtype=item.dtype, device="cpu", pin_memory=item.device.type == "cuda")
                self._buffers[path] = buffer
            buffer.copy_(item.detach(), non_blocking=item.device.type == "cuda")
            staged = buffer
            if type(item) is torch.nn.Parameter:  # saved as a Parameter by a synchronous save: keep the type
                staged = torch.nn.Parameter(buffer, requires_grad=item.requires_grad)
            attributes = getattr(item, "__dict__", None)
            if attributes:  # a synchronous save keeps a tensor's Python attributes: on an alias, the buffer stays bare
                staged = staged.view(staged.shape) if staged is buffer else staged
                staged.__dict__.update(copy.deepcopy(attributes))
            return staged
        return copy.deepcopy(item)

    def _stage_container(self, item: Any, path: tuple[Any, ...], copies: dict[int, Any]) -> Any:
        if isinstance(item, dict):
            staged = {key: self._stage(value, (*path, key), copies) for key, value in item.items()}
            if isinstance(item, OrderedDict):  # a module's state_dict: keep its type and version metadata
                staged = OrderedDict(staged)
                if hasattr(item, "_metadata"):
                    staged._metadata = copy.deepcopy(item._metadata)  # type: ignore[attr-defined]
            elif isinstance(item, Counter):
                staged = Counter(staged)
            return staged
        staged = [self._stage(value, (*path, index), copies) for index, value in enumerate(item)]
        return staged if isinstance(item, list) else tuple(staged)


def write_in_order(
    writes: list[tuple[Any, Path]],
    *,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> float:
    """Write ``writes`` in order with ``atomic_save(keep_previous=True)``: what both writers do, in their thread.

    ``before`` runs beside the first write (its ``alongside``): its ``fsync`` waits on the disk while the payload
    is serialized, instead of before it, and the first file is published only once it is done.

    :param writes: ``(payload, path)`` pairs.
    :param before: Work to finish before the first file is published (the metrics journal's ``fsync``).
    :param after: Called after the last write.
    :returns: The seconds the writes took, all files together.
    :raises BaseException: The failure of a write, of ``before`` or of ``after``.
    """
    total = 0.0
    for index, (payload, path) in enumerate(writes):
        # looked up at each call: a test can put a failing save in its place for both writers
        total += atomic_save(payload, path, keep_previous=True, alongside=before if index == 0 else None)
    if after is not None:
        after()
    return total


class SyncCheckpointWriter:
    """The writer of ``ckpt.async_save=false``: :meth:`submit` writes before it returns.

    It has :class:`AsyncCheckpointWriter`'s interface, and its ``last_seconds`` the same meaning: the
    seconds the job's writes took, all files together.
    """

    background = False
    busy = False

    def __init__(self) -> None:
        self.last_seconds: float | None = None

    def submit(
        self,
        writes: list[tuple[Any, Path]],
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Write ``writes`` in order with ``atomic_save(keep_previous=True)``.

        :param writes: ``(payload, path)`` pairs.
        :param before: Run beside the first write, done before it publishes its file (e.g. to make the metrics
            journal durable before the checkpoint that records its size).
        :param after: Called after the last write (e.g. to keep the checkpoint just published).
        :raises BaseException: A write's failure.
        """
        self.last_seconds = write_in_order(writes, before=before, after=after)

    def wait(self) -> None:
        """Nothing is in flight but the freeing of a replaced ``.prev`` file: waited for."""
        finish_freeing()


class AsyncCheckpointWriter:
    """One background writer; at most one job (a list of ``(payload, path)`` writes) in flight."""

    background = True

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_seconds: float | None = None

    def submit(
        self,
        writes: list[tuple[Any, Path]],
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Wait for the previous job, then start writing ``writes`` in order in the background.

        :param writes: ``(staged payload, path)`` pairs; each is written with ``atomic_save(keep_previous=True)``.
        :param before: Run beside the first write, done before it publishes its file (e.g. to make the metrics
            journal durable before the checkpoint that records its size); its failure fails the job.
        :param after: Called in the writer thread after the last write (to keep the checkpoint just published);
            its failure fails the job.
        :raises BaseException: The previous job's failure, unchanged.
        """
        self.wait()

        def run() -> None:
            try:
                total = write_in_order(writes, before=before, after=after)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the next wait()
                self._error = exc
                return
            self.last_seconds = total

        self._thread = threading.Thread(target=run, name="trainkit-checkpoint-writer", daemon=False)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """True while a job is being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the job in flight (if any) is on disk.

        :raises BaseException: That job's failure, with its original traceback (raised once).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        finish_freeing()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
