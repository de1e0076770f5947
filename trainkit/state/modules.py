"""How a module's state goes into a checkpoint and back: names free of ``torch.compile``, training flags.

Side effects: :func:`load_module_state` and :func:`restore_training_modes` change the module they get.

``torch.compile`` wraps a module in an ``OptimizedModule`` whose state dict prefixes every name with
``_orig_mod.``; a checkpoint written with compile on would not load with it off, and the other way round.
trainkit saves names without that segment and maps them onto whichever form the module has on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = [
    "canonical_name",
    "module_state",
    "load_module_state",
    "training_modes",
    "restore_training_modes",
]

_COMPILE_SEGMENT = "_orig_mod"
_DDP_PREFIX = "module."


def canonical_name(name: str) -> str:
    """Drop every ``_orig_mod`` segment that ``torch.compile`` adds to a state-dict or module name.

    :param name: A dotted name, e.g. ``"_orig_mod.0.weight"`` or ``"module._orig_mod.fc"``.
    :returns: The same name without those segments, e.g. ``"0.weight"``, ``"module.fc"``.

    >>> canonical_name("_orig_mod.0.weight"), canonical_name("module._orig_mod"), canonical_name("fc.bias")
    ('0.weight', 'module', 'fc.bias')
    """
    if _COMPILE_SEGMENT not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILE_SEGMENT)


def module_state(module: nn.Module) -> dict[str, Any]:
    """Return ``module.state_dict()`` under compile-free names, so it loads with compile on or off.

    :param module: A module, compiled or not (also inside DDP).
    :returns: The state dict, its keys passed through :func:`canonical_name`.
    """
    state = module.state_dict()
    if not any(_COMPILE_SEGMENT in key for key in state):
        return state
    return {canonical_name(key): value for key, value in state.items()}


def load_module_state(module: nn.Module, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a state dict saved with or without ``_orig_mod.`` names into a module compiled or not, and one saved
    through a ``DistributedDataParallel`` wrapper (``module.`` names) into a bare module, or back.

    Side effects: ``module.load_state_dict`` with the saved names mapped onto the module's own.

    :param module: The module to load into.
    :param state: The saved state dict (either form).
    :param strict: Passed to ``load_state_dict``.
    :raises RuntimeError: From ``load_state_dict``, when names or shapes do not match.
    """
    own = {canonical_name(key): key for key in module.state_dict()}
    saved = {canonical_name(key): key for key in state}
    if set(saved) != set(own) and set(map(_unwrapped_name, saved)) == set(map(_unwrapped_name, own)):
        # saved by a DDP-wrapped module and loaded into a bare one, or back (a resume on another world size)
        own = {_unwrapped_name(name): key for name, key in own.items()}
        saved = {_unwrapped_name(name): key for name, key in saved.items()}
    mapped = {own.get(name, key): state[key] for name, key in saved.items()}
    module.load_state_dict(mapped, strict=strict)


def _unwrapped_name(name: str) -> str:
    """``name`` without DDP's leading ``module.`` segment.

    >>> _unwrapped_name("module.0.weight"), _unwrapped_name("0.weight")
    ('0.weight', '0.weight')
    """
    return name.removeprefix(_DDP_PREFIX)


def training_modes(module: nn.Module) -> dict[str, bool]:
    """Return the ``training`` flag of the module and each submodule, by compile-free name.

    :param module: The module.
    :returns: Submodule name (``""`` for the module itself) to its flag.
    """
    modes: dict[str, bool] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        modes.setdefault(canonical_name(name), sub.training)
    return modes


def restore_training_modes(module: nn.Module, modes: Mapping[str, bool]) -> None:
    """Set each submodule's ``training`` flag as :func:`training_modes` recorded it.

    Side effects: sets flags one by one (not ``train()``, which would set the children too); a
    submodule the record does not name keeps its flag.

    :param module: The module.
    :param modes: What :func:`training_modes` returned.
    """
    for name, sub in module.named_modules(remove_duplicate=False):
        flag = modes.get(canonical_name(name))
        if isinstance(flag, bool):
            sub.training = flag
