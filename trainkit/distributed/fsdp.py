"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for trainkit: the wrap, and plain values out of DTensors.

A module wrapped here keeps its class (FSDP2 swaps in a subclass) and its parameter names; its parameters,
gradients and optimizer state become ``DTensor`` shards, one per rank of a 1-D device mesh. The helpers
turn what trainkit logs (norms, statistics) back into plain tensors, with the collective that needs,
so nothing downstream sees a DTensor.

Side effects: :func:`shard_module` shards parameters in place (collectives at every forward/backward
after it); :func:`plain` may run an all-reduce. ``torch.distributed.fsdp`` is imported only when used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from trainkit.errors import UsageError

__all__ = ["device_mesh", "shard_module", "is_sharded", "plain", "units_to_shard", "shard_like"]


def device_mesh(device: torch.device, world_size: int) -> Any:
    """A 1-D device mesh over every rank, on ``device``'s type (``cpu`` with gloo, ``cuda`` with nccl).

    :param device: This rank's device.
    :param world_size: The number of ranks.
    :returns: A ``torch.distributed.device_mesh.DeviceMesh``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def units_to_shard(module: nn.Module, shard: Iterable[nn.Module] | type | tuple[type, ...] | None) -> list[nn.Module]:
    """The submodules to shard as units of their own, innermost first, before ``module`` itself.

    :param module: The root module.
    :param shard: Submodules of ``module``; or a module class (or tuple of classes) whose instances inside
        ``module`` are each a unit (transformer blocks, say); or None for the root alone.
    :returns: The units, without ``module`` itself, children before their parents.
    :raises UsageError: When a given submodule is not inside ``module``, or ``shard`` is neither.
    """
    if shard is None:
        return []
    inside = {id(sub): name for name, sub in module.named_modules()}
    if isinstance(shard, type) or (isinstance(shard, tuple) and all(isinstance(kind, type) for kind in shard)):
        units = [sub for sub in module.modules() if sub is not module and isinstance(sub, shard)]
    else:
        try:
            units = list(shard)
        except TypeError:
            raise UsageError(
                f"make_fsdp(shard=...) takes submodules, a module class or a tuple of classes, got "
                f"{type(shard).__name__} {shard!r}"
            ) from None
        for unit in units:
            if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is module:
                raise UsageError(
                    f"make_fsdp(shard=...): every unit must be a submodule of the module being wrapped, got "
                    f"{type(unit).__name__} {unit!r:.80}"
                )
    depth = {id(sub): name.count(".") + 1 for name, sub in module.named_modules() if name}
    # children before parents: fully_shard must see a unit's submodules sharded first
    return sorted(dict.fromkeys(units), key=lambda unit: -depth[id(unit)])


def shard_on(
    module: nn.Module, device: torch.device, world_size: int, *, mesh: Any = None, **options: Any
) -> nn.Module:
    """``make_fsdp()``: ``module`` sharded over ``world_size`` ranks (:func:`shard_module`), or on one process
    returned as it is, after the same argument checks.

    :param module: The module, already on ``device``.
    :param device: This rank's device.
    :param world_size: The number of processes.
    :param mesh: The device mesh; None builds one over every rank (:func:`device_mesh`).
    :param options: ``shard``, ``mp_policy``, ``reshard_after_forward``, as :func:`shard_module` takes them.
    :returns: The sharded module, or ``module`` on one process.
    :raises UsageError: As :func:`shard_module` raises it.
    """
    if world_size == 1:
        units_to_shard(module, options.get("shard"))  # the same argument checks as on many ranks
        return module
    return shard_module(module, mesh=mesh if mesh is not None else device_mesh(device, world_size), **options)


def shard_module(
    module: nn.Module,
    *,
    mesh: Any,
    shard: Iterable[nn.Module] | type | tuple[type, ...] | None = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply ``fully_shard`` to each unit of :func:`units_to_shard`, then to ``module``.

    :param module: The module, already on this rank's device.
    :param mesh: The device mesh (:func:`device_mesh`).
    :param shard: See :func:`units_to_shard`.
    :param mp_policy: A ``torch.distributed.fsdp.MixedPrecisionPolicy``, or None for full precision.
    :param reshard_after_forward: Free the gathered parameters after each unit's forward (FSDP2's default).
    :returns: ``module`` itself, sharded.
    :raises UsageError: From :func:`units_to_shard`, when ``mp_policy`` is not a ``MixedPrecisionPolicy``, or
        when this torch has no FSDP2 (before 2.6).
    """
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:
        raise UsageError(
            f"make_fsdp() needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); this is torch "
            f"{torch.__version__}: upgrade torch, or use make_ddp()"
        ) from exc

    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise UsageError(
            f"make_fsdp(mp_policy=...) must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
            f"{type(mp_policy).__name__} {mp_policy!r}"
        )
    options = {"mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
    for unit in units_to_shard(module, shard):
        fully_shard(unit, **options)
    fully_shard(module, **options)
    return module


def is_sharded(module: nn.Module | None) -> bool:
    """Tell whether any parameter of ``module`` is a DTensor (an FSDP2-wrapped module).

    :param module: A module, or None.
    :returns: True when its state dict holds shards rather than whole tensors.
    """
    if module is None:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in module.parameters())


def plain(value: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor that may be a DTensor (a norm over shards, say), as a plain tensor.

    A replicated DTensor is read locally; a partial or sharded one is reduced or gathered over its mesh,
    a collective every rank must reach. On a GPU this stays on the device: no host sync.

    :param value: A tensor or a DTensor.
    :returns: A plain tensor with the same value on every rank.
    """
    if type(value) is torch.Tensor:
        return value
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def shard_like(whole: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards of whole tensors, laid out as ``like``'s DTensors (a collective for sharded entries).

    :param whole: Name to whole tensor (every rank holds the same), e.g. a ``best.pt``'s weights.
    :param like: Name to tensor or DTensor: a sharded module's state dict.
    :returns: Name to a new DTensor with ``like``'s mesh and placements (a plain tensor where ``like`` has one).
    :raises KeyError: When ``whole`` lacks one of ``like``'s names.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    out: dict[str, Any] = {}
    for name, template in like.items():
        value = whole[name]
        if isinstance(template, DTensor):
            out[name] = distribute_tensor(
                value.detach().to(template.device, template.dtype), template.device_mesh, template.placements
            )
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
        else:
            out[name] = value
    return out
