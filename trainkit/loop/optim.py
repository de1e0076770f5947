"""Optimizer helpers: weight-decay parameter groups, fused gradient norms, per-parameter statistics.

Side effects: only what each function's docstring states; nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from trainkit import torch_private
from trainkit.distributed.collectives import unwrap

__all__ = [
    "RunningMean",
    "named_trainable_parameters",
    "trainable_parameters",
    "make_param_groups",
    "learning_rates",
    "total_grad_norm",
    "clip_grads_",
    "param_stats",
]


def _named_trainable(modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter, tuple[str, ...]]]:
    """Each trainable parameter once: its first name, itself, and every name it goes by (tied weights)."""
    order: dict[int, tuple[str, nn.Parameter]] = {}
    aliases: dict[int, list[str]] = {}
    for index, module in enumerate(modules):
        module = unwrap(module)
        prefix = f"{index}." if len(modules) > 1 else ""
        for name, param in module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            order.setdefault(id(param), (prefix + name, param))
            aliases.setdefault(id(param), []).append(prefix + name)
    return [(name, param, tuple(aliases[key])) for key, (name, param) in order.items()]


def named_trainable_parameters(modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """List the trainable parameters of ``modules`` once each, with readable names, in a fixed order.

    Wrappers (DDP, ``torch.compile``) are looked through. A parameter shared by two modules, or tied
    inside one, is listed once under its first name. With more than one module, names are prefixed by
    the module's position (``"1.proj.weight"``) so they stay unique.

    :param modules: The modules, in order.
    :returns: ``(name, parameter)`` pairs.
    """
    return [(name, param) for name, param, _ in _named_trainable(modules)]


def trainable_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of :func:`named_trainable_parameters`, in the same order, without building names.

    The per-step helpers (clipping, the grad norm) need no names, and skipping them halves the walk.

    :param modules: The modules, in order.
    :returns: Each trainable parameter once.

    >>> shared = nn.Linear(2, 2)
    >>> frozen = nn.Linear(2, 2).requires_grad_(False)
    >>> [tuple(p.shape) for p in trainable_parameters([nn.Sequential(shared, frozen), shared])]
    [(2, 2), (2,)]
    """
    if len(modules) == 1:  # parameters() already lists a tied parameter once
        return [param for param in unwrap(modules[0]).parameters() if param.requires_grad]
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module in modules:
        for param in unwrap(module).parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def learning_rates(items: Mapping[str, Any], or_else: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The learning rate of every parameter group of the optimizers among ``items``, as ``lr/<optimizer>/<group>``.

    :param items: Name to object (the registered checkpoint items, say); the optimizers among them are read.
    :param or_else: Where to look for optimizers when ``items`` holds none (a trainer's attributes, say).
    :returns: Key to learning rate; a group's part of the key is its ``name`` entry, or its index.

    >>> net = torch.nn.Linear(1, 1)
    >>> opt = torch.optim.SGD([{"params": [net.weight], "name": "w"}, {"params": [net.bias]}], lr=0.1)
    >>> learning_rates({"opt": opt})
    {'lr/opt/w': 0.1, 'lr/opt/1': 0.1}
    """
    optimizers = {name: obj for name, obj in items.items() if isinstance(obj, torch.optim.Optimizer)}
    if not optimizers and or_else is not None:
        optimizers = {name: obj for name, obj in or_else.items() if isinstance(obj, torch.optim.Optimizer)}
    return {
        f"lr/{name}/{group.get('name', index)}": group["lr"]
        for name, optimizer in optimizers.items()
        for index, group in enumerate(optimizer.param_groups)
    }


def make_param_groups(
    modules: Sequence[nn.Module], *, weight_decay: float, no_weight_decay: Iterable[str]
) -> list[dict]:
    """Split parameters into a weight-decayed group and an undecayed one.

    A parameter is undecayed when it is 1-D or any of its names (a tied weight has several) contains one
    of ``no_weight_decay``, so an embedding tied to an output head is undecayed whichever is declared first.

    :param modules: The modules to take trainable parameters from.
    :param weight_decay: The decay of the first group.
    :param no_weight_decay: Name fragments that exempt a parameter.
    :returns: ``[{"name": "decay", ...}, {"name": "no_decay", ...}]``, each with ``params`` and
        ``weight_decay``; an empty group is left out. No ``param_names`` entry: torch requires every group
        of an optimizer to have one or none, so a group added later with ``add_param_group({"params": ...})``
        would be refused.
    """
    fragments = tuple(no_weight_decay)
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, param, names in _named_trainable(modules):
        exempt = param.ndim <= 1 or any(fragment in alias for alias in names for fragment in fragments)
        (no_decay if exempt else decay).append((name, param))
    groups = []
    for group_name, members, wd in (("decay", decay, float(weight_decay)), ("no_decay", no_decay, 0.0)):
        if members:
            groups.append(
                {
                    "name": group_name,
                    "params": [p for _, p in members],
                    "weight_decay": wd,
                }
            )
    return groups


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def total_grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Compute the L2 norm of all gradients with fused foreach kernels, without a host sync.

    :param params: The parameters whose ``.grad`` count; those without a gradient are skipped.
    :returns: A 0-d float32 tensor on the parameters' device (0 when no gradient exists).
    """
    grads = _grads(params)
    if not grads:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros((), device=device)
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    norms = torch_private.foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)


def clip_grads_(params: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so their total norm is at most ``max_norm``, without a host sync.

    :param params: The parameters whose gradients are scaled.
    :param max_norm: The bound.
    :param total_norm: Their current total norm, from :func:`total_grad_norm`.
    """
    grads = _grads(params)
    if not grads:
        return
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch_private.foreach_mul_(grads, coef.to(grads[0].device))


def param_stats(
    named_params: Sequence[tuple[str, torch.Tensor]], *, weights: bool, grads: bool
) -> tuple[list[str], torch.Tensor]:
    """Compute per-parameter weight norms, grad norms and grad-to-weight ratios in a few fused ops.

    The ratio of a parameter whose weights are all zero (a zero-initialised bias or LoRA factor) is
    undefined; it is reported as 0, so that every series stays finite and a chart can draw it, instead
    of ``inf`` (or NaN for a zero gradient too).

    :param named_params: ``(name, parameter)`` pairs.
    :param weights: Include ``params/<name>/weight_norm``.
    :param grads: Include ``params/<name>/grad_norm`` and ``params/<name>/grad_to_weight``.
    :returns: The keys, and one 1-D float32 tensor of the values in the same order, still on the device.
    """
    keys: list[str] = []
    pieces: list[torch.Tensor] = []
    if not named_params or not (weights or grads):
        return keys, torch.zeros(0)
    tensors = [p.detach() for _, p in named_params]
    weight_norms = torch.stack([n.float() for n in torch_private.foreach_norm(tensors, 2.0)])
    if weights:
        keys += [f"params/{name}/weight_norm" for name, _ in named_params]
        pieces.append(weight_norms)
    if grads:
        with_grad = [(name, p) for name, p in named_params if p.grad is not None]
        if with_grad:
            grad_norms = torch.stack(
                [n.float() for n in torch_private.foreach_norm([p.grad for _, p in with_grad], 2.0)]
            )
            if len(with_grad) == len(named_params):
                own_weight_norms = weight_norms
            else:  # a second fused norm rather than an index tensor built on the host (an H2D copy)
                own_weight_norms = torch.stack(
                    [n.float() for n in torch_private.foreach_norm([p.detach() for _, p in with_grad], 2.0)]
                )
            # torch.where keeps it on the device: no host sync to test for zero weights
            ratios = torch.where(own_weight_norms > 0, grad_norms / own_weight_norms, torch.zeros_like(grad_norms))
            keys += [f"params/{name}/grad_norm" for name, _ in with_grad]
            keys += [f"params/{name}/grad_to_weight" for name, _ in with_grad]
            pieces += [grad_norms, ratios]
    if not pieces:  # grads only, and no parameter has a gradient yet
        return keys, torch.zeros(0, device=weight_norms.device)
    return keys, torch.cat(pieces)


class RunningMean:
    """The mean of 0-d tensors added one by one, kept on their device (no host sync).

    An epoch's mean loss, say: ``add()`` once per batch, ``take()`` at the epoch's end. Register it with
    :meth:`~trainkit.BaseTrainer.add_checkpoint_items` when step checkpoints are on, so the mean of an epoch
    resumed in its middle counts the batches trained before the checkpoint too.

    >>> mean = RunningMean()
    >>> mean.add(torch.tensor(1.0)); mean.add(torch.tensor(3.0))
    >>> float(mean.take()), mean.take()
    (2.0, None)
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, value: torch.Tensor) -> None:
        """Add one value (copied on the first add, so the caller's tensor is never changed).

        :param value: A 0-d tensor.
        """
        total = self._sum
        if total is None:
            self._sum = value.clone()
        else:
            if total.device != value.device:  # restored from a checkpoint on the CPU
                total = self._sum = total.to(value.device)
            total.add_(value)
        self._count += 1

    def state_dict(self) -> dict[str, Any]:
        """The running sum and count; register the object with ``add_checkpoint_items`` and an epoch's mean
        survives a resume from a step checkpoint inside the epoch.

        :returns: ``{"sum": a 0-d CPU tensor or None, "count": int}``.
        """
        return {"sum": None if self._sum is None else self._sum.detach().cpu().clone(), "count": self._count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (the sum moves to the values' device at the next add).

        :param state: The saved sum and count.
        """
        total = state["sum"]
        self._sum = None if total is None else total.detach().clone()
        self._count = int(state["count"])

    def take(self) -> torch.Tensor | None:
        """Return the mean of the values added since the last take, and start over.

        :returns: A 0-d tensor on the values' device, or None when nothing was added.
        """
        if self._sum is None or self._count == 0:
            return None
        mean = self._sum / self._count
        self._sum, self._count = None, 0
        return mean
