"""Every use trainkit makes of torch's private API, each behind a name that says what it is for.

torch can move or rename whatever is underscored in a minor release. Here, and nowhere else in the package, trainkit
touches such a thing, so a torch upgrade that moves one fails in one place: a call of the function below (and
``tests/test_torch_private.py``, which resolves them all), with a :class:`~trainkit.errors.TorchInternalsError` that
names the thing, the torch found and what to do, never an ``AttributeError`` deep in a user's run.

What each reach is for, and why no public API serves:

- **DataLoader internals** (:func:`loader_uses_batch_sampler`, :func:`makes_iterator_as_dataloader`,
  :func:`persistent_iterator`, :func:`set_index_sampler`, :func:`index_stream`, :func:`set_index_stream`): a step
  resume skips the consumed batches at the index level, before any index reaches a worker
  (:mod:`trainkit.loop.tracked_batches`). torch has no public hook to hand a DataLoader iterator another index
  sampler, nor to ask which sampler (``sampler`` or ``batch_sampler``) it draws from.
- **Fused foreach kernels** (:data:`foreach_norm`, :data:`foreach_mul_`, :data:`foreach_copy_`): gradient norms,
  clipping on torch versions without ``torch.nn.utils.get_total_norm``/``clip_grads_with_norm_``, per-parameter
  statistics and the best-model snapshot, in one kernel launch per tensor list. Hot (per step): they are the torch
  functions themselves, looked up once when this module is imported, so a call costs exactly what
  ``torch._foreach_norm(...)`` costs.
- **Dispatch and autograd** (:func:`dispatch_mode_base`, :data:`autograd_task_id`, :func:`legacy_convolution_op`):
  the FLOP counter of ``perf/mfu`` (:mod:`trainkit.loop.flops`) sees every op as a ``TorchDispatchMode`` (torch's
  public ``FlopCounterMode`` cannot tell a forward op from one run inside backward) and asks the autograd engine
  whether it runs a backward now (per op: looked up once); ``aten._convolution`` is the convolution op an older
  graph dispatches.
- **DCP internals** (:func:`dcp_storage_info_class`, :func:`tensor_layout_by_name`, :func:`dcp_set_element`,
  :func:`narrow_tensor_by_index`): the safe reader of sharded checkpoints (:mod:`trainkit.checkpoint.formats.dcp_read`)
  admits DCP's own records by class and fills a state dict as DCP's default planner does; DCP exports none of them.
- **Protocol attributes** (:func:`dtensor_local_shard`, :func:`optimizer_unscales_itself`,
  :func:`compiled_inner_module`, :data:`COMPILER_MODULE`): an FSDP2 shard's own memory (``to_local()`` is a
  differentiable view), GradScaler's flag for optimizers that take ``found_inf``, ``torch.compile``'s wrapped
  module, and the compiler package the fork server preloads.

torch versions checked: every name here resolves on torch 2.13.0 (``tests/test_torch_private.py`` resolves and calls
them all on the installed torch, so CI checks whichever torch it installs). By torch's release history each was there
by 2.1 (``_foreach_copy_`` 2.1, ``_current_graph_task_id`` 2.0, ``TorchDispatchMode`` 1.13, the DataLoader, DCP,
GradScaler and compile names 2.0 or earlier), hence in every torch pyproject admits (``>=2.4``); no torch 2.4 install
was run to confirm it.

Side effects: importing it imports ``torch``; nothing else runs until a function is called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from trainkit.errors import TorchInternalsError

__all__ = [
    "COMPILER_MODULE",
    "SUPPORTED_TORCH",
    "autograd_task_id",
    "bind",
    "compiled_inner_module",
    "dcp_set_element",
    "dcp_storage_info_class",
    "dispatch_mode_base",
    "dtensor_local_shard",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "index_stream",
    "legacy_convolution_op",
    "loader_uses_batch_sampler",
    "makes_iterator_as_dataloader",
    "missing",
    "narrow_tensor_by_index",
    "optimizer_unscales_itself",
    "persistent_iterator",
    "resolve",
    "set_index_sampler",
    "set_index_stream",
    "tensor_layout_by_name",
]

SUPPORTED_TORCH = ">=2.4"
"""The torch versions trainkit supports (pyproject's ``torch>=2.4``), named in every error raised here."""

COMPILER_MODULE = "torch._dynamo"
"""torch's compiler package, which a first optimizer imports (2-3 s of CPU per process): the fork server imports it
once for every rank it forks (:mod:`trainkit.distributed.launch`)."""


def _missing_error(thing: str) -> TorchInternalsError:
    return TorchInternalsError(
        f"trainkit uses {thing}, which torch {torch.__version__} does not have (moved or removed); "
        f"use a torch version trainkit supports ({SUPPORTED_TORCH}, tested up to the one its CI installs), "
        "or report it to trainkit with this message"
    )


def resolve(module: str, name: str) -> Any:
    """Look up ``module.name`` in torch, raising an actionable error when torch moved or removed it.

    >>> resolve("torch", "_foreach_norm") is torch._foreach_norm
    True

    :param module: The dotted module, e.g. ``"torch.serialization"``.
    :param name: The attribute, e.g. ``"_get_layout"``.
    :returns: The attribute.
    :raises TorchInternalsError: When the module or the attribute is not there.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing_error(f"{module}.{name}") from None


def bind(module: str, name: str) -> Callable[..., Any]:
    """Bind a torch-private function once, for calls that are hot: ``module.name`` itself when torch has it (a call
    costs exactly what a direct one does), else a stand-in that raises :func:`resolve`'s error when called, so that
    importing trainkit never fails over one missing kernel.

    >>> bind("torch", "_foreach_copy_") is torch._foreach_copy_
    True

    :param module: The dotted module, e.g. ``"torch"``.
    :param name: The function, e.g. ``"_foreach_norm"``.
    :returns: The function, or the stand-in.
    """
    try:
        return resolve(module, name)
    except TorchInternalsError as error:
        message = str(error)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise TorchInternalsError(message)

        unavailable.__qualname__ = unavailable.__name__ = f"missing {module}.{name}"
        return unavailable


foreach_norm: Callable[..., Any] = bind("torch", "_foreach_norm")
"""``torch._foreach_norm(tensors, ord)``: the norm of each tensor, one fused kernel per device and dtype."""

foreach_mul_: Callable[..., Any] = bind("torch", "_foreach_mul_")
"""``torch._foreach_mul_(tensors, scalar_or_tensor)``: multiply each tensor in place, fused."""

foreach_copy_: Callable[..., Any] = bind("torch", "_foreach_copy_")
"""``torch._foreach_copy_(targets, sources)``: copy each source into its target, fused."""

autograd_task_id: Callable[[], int] = bind("torch._C", "_current_graph_task_id")
"""``torch._C._current_graph_task_id()``: the id of the backward the autograd engine runs now, -1 outside one."""

_BINDINGS = {
    "foreach_norm": ("torch", "_foreach_norm"),
    "foreach_mul_": ("torch", "_foreach_mul_"),
    "foreach_copy_": ("torch", "_foreach_copy_"),
    "autograd_task_id": ("torch._C", "_current_graph_task_id"),
}


def missing() -> list[str]:
    """The torch internals of the bindings above (resolved at import) that this torch lacks.

    >>> missing()
    []

    :returns: ``module.name`` of each, empty when all are there.
    """
    return [f"{module}.{name}" for module, name in _BINDINGS.values() if not _has(module, name)]


def _has(module: str, name: str) -> bool:
    try:
        resolve(module, name)
    except TorchInternalsError:
        return False
    return True


def _loader_attribute(loader: Any, name: str) -> Any:
    try:
        return getattr(loader, name)
    except AttributeError:
        raise _missing_error(f"DataLoader.{name}") from None


def loader_uses_batch_sampler(loader: Any) -> bool:
    """Tell whether a DataLoader draws its indices from ``batch_sampler`` (else from ``sampler``, one index a
    sample: ``batch_size=None``).

    :param loader: A ``torch.utils.data.DataLoader`` (or subclass).
    :returns: ``DataLoader._auto_collation``.
    :raises TorchInternalsError: When torch's DataLoader no longer has it.
    """
    return bool(_loader_attribute(loader, "_auto_collation"))


def makes_iterator_as_dataloader(loader_class: type) -> bool:
    """Tell whether a loader class makes its iterator as ``DataLoader`` does (neither ``__iter__`` nor the
    iterator factory overridden).

    :param loader_class: A ``DataLoader`` subclass.
    :returns: Whether both are DataLoader's own.
    :raises TorchInternalsError: When torch's DataLoader no longer has ``_get_iterator``.
    """
    dataloader = torch.utils.data.DataLoader
    factory = _loader_attribute(dataloader, "_get_iterator")
    return loader_class.__iter__ is dataloader.__iter__ and getattr(loader_class, "_get_iterator", None) is factory


def persistent_iterator(loader: Any) -> Any:
    """The iterator a DataLoader with ``persistent_workers`` keeps between epochs, or None (not made yet, or
    ``loader`` is no DataLoader).

    :param loader: Any loader.
    :returns: ``DataLoader._iterator``.
    :raises TorchInternalsError: When ``loader`` is a DataLoader without it.
    """
    if isinstance(loader, torch.utils.data.DataLoader):
        return _loader_attribute(loader, "_iterator")
    return None


def _is_dataloader_iterator(iterator: Any) -> bool:
    return isinstance(iterator, resolve("torch.utils.data.dataloader", "_BaseDataLoaderIter"))


def set_index_sampler(iterator: Any, sampler: Any) -> None:
    """Make a DataLoader iterator read its indices from ``sampler`` when it next starts an epoch.

    :param iterator: What ``iter(DataLoader)`` made.
    :param sampler: The sampler (or batch sampler) to read.
    :raises TorchInternalsError: When torch's iterator no longer has ``_index_sampler``.
    """
    if not hasattr(iterator, "_index_sampler"):
        raise _missing_error("_BaseDataLoaderIter._index_sampler")
    iterator._index_sampler = sampler


def index_stream(iterator: Any) -> Any:
    """The iterator over indices that a DataLoader iterator reads the current epoch from, or None when
    ``iterator`` is none of DataLoader's.

    :param iterator: Anything ``iter(loader)`` returned.
    :returns: ``_BaseDataLoaderIter._sampler_iter``.
    :raises TorchInternalsError: When torch's iterator no longer has it.
    """
    if not _is_dataloader_iterator(iterator):
        return None
    try:
        return iterator._sampler_iter
    except AttributeError:
        raise _missing_error("_BaseDataLoaderIter._sampler_iter") from None


def set_index_stream(iterator: Any, stream: Any) -> None:
    """Make a DataLoader iterator read the rest of this epoch's indices from ``stream``.

    :param iterator: What ``iter(DataLoader)`` made (:func:`index_stream` is not None for it).
    :param stream: An iterator over indices.
    :raises TorchInternalsError: When torch's iterator no longer has ``_sampler_iter``.
    """
    if not hasattr(iterator, "_sampler_iter"):
        raise _missing_error("_BaseDataLoaderIter._sampler_iter")
    iterator._sampler_iter = stream


def dispatch_mode_base() -> type:
    """torch's base class of a mode that sees every op below autograd (``__torch_dispatch__``).

    >>> dispatch_mode_base().__name__
    'TorchDispatchMode'

    :returns: ``torch.utils._python_dispatch.TorchDispatchMode``.
    :raises TorchInternalsError: When torch moved it.
    """
    return resolve("torch.utils._python_dispatch", "TorchDispatchMode")


def legacy_convolution_op() -> Any:
    """The ``aten._convolution`` op packet (what older graphs dispatch for a convolution).

    :returns: ``torch.ops.aten._convolution``.
    :raises TorchInternalsError: When torch has no such op.
    """
    try:
        return torch.ops.aten._convolution
    except (AttributeError, RuntimeError):
        raise _missing_error("torch.ops.aten._convolution") from None


def dcp_storage_info_class() -> type:
    """DCP's record of where an entry lies in a ``.distcp`` file (a ``.metadata`` names it).

    :returns: ``torch.distributed.checkpoint.filesystem._StorageInfo``.
    :raises TorchInternalsError: When DCP moved it.
    """
    return resolve("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def tensor_layout_by_name() -> Callable[[str], Any]:
    """The function a ``.metadata`` pickle calls to turn a layout's name into ``torch.strided`` and the like.

    :returns: ``torch.serialization._get_layout``.
    :raises TorchInternalsError: When torch moved it.
    """
    return resolve("torch.serialization", "_get_layout")


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` in a nested state dict, as DCP's default load planner does for a flattened one.

    :param root: The state dict being filled.
    :param path: The path (DCP's mapping of a flattened name).
    :param value: The loaded value.
    :raises TorchInternalsError: When DCP moved ``_traverse.set_element``.
    """
    resolve("torch.distributed.checkpoint._traverse", "set_element")(root, path, value)


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The chunk of ``tensor`` at ``offsets`` of ``sizes`` (a view), as DCP's reader takes a shard's piece.

    :param tensor: The tensor.
    :param offsets: Start per dimension.
    :param sizes: Length per dimension.
    :returns: The narrowed view.
    :raises TorchInternalsError: When torch moved ``_shard._utils.narrow_tensor_by_index``.
    """
    return resolve("torch.distributed._shard._utils", "narrow_tensor_by_index")(tensor, offsets, sizes)


def dtensor_local_shard(tensor: Any) -> Any:
    """A tensor's own memory: an FSDP2 ``DTensor``'s local shard (which it shares), else the tensor itself.

    >>> plain = torch.zeros(2)
    >>> dtensor_local_shard(plain) is plain
    True

    :param tensor: A tensor or a DTensor.
    :returns: ``DTensor._local_tensor`` (``to_local()`` is a differentiable view, not the storage itself).
    :raises TorchInternalsError: When a DTensor (it has ``placements``) no longer has ``_local_tensor``.
    """
    if type(tensor) is torch.Tensor or not hasattr(tensor, "placements"):
        return tensor
    try:
        return tensor._local_tensor
    except AttributeError:
        raise _missing_error("DTensor._local_tensor") from None


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """Tell whether an optimizer's step takes GradScaler's ``found_inf`` (a fused torch optimizer).

    An optimizer without the flag does not (GradScaler's own reading), so there is no error to raise.

    :param optimizer: A ``torch.optim.Optimizer``.
    :returns: ``optimizer._step_supports_amp_scaling``, False when absent.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def compiled_inner_module(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, or None for any other module.

    :param module: A module, compiled or not.
    :returns: ``OptimizedModule._orig_mod``, or None.
    """
    return getattr(module, "_orig_mod", None)
