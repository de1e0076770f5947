"""The config every test run starts from: quiet (no W&B, no bars) and written into the test's own folder."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

QUIET: dict[str, Any] = {"wandb": {"mode": "disabled"}, "progress": {"enable": False}}
"""The sections that keep a test run quiet: W&B disabled, no progress bars."""

DEFAULTS: dict[str, Any] = {"epochs": 4, **QUIET, "val": {"minimize": True}}
"""What :func:`make_cfg` starts from: 4 epochs, quiet, the validation loss minimized."""


def make_cfg(out_dir: str | PathLike[str], *layers: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """A quiet config mapping in ``out_dir``: :data:`DEFAULTS`, then each of ``layers``, then ``overrides``.

    Each layer (a module's own defaults) and then the keyword overrides go on top of what came before: a section
    given as a mapping (``val={"patience": 2}``) is merged into that section, any other value replaces its key.

    >>> make_cfg("runs/t", val={"patience": 2})["val"]
    {'minimize': True, 'patience': 2}
    >>> make_cfg("runs/t", {"epochs": 2, "val": {"minimize": False}}, epochs=3)["epochs"]
    3
    """
    cfg: dict[str, Any] = {"epochs": DEFAULTS["epochs"], "out_dir": str(out_dir)}
    for layer in (DEFAULTS, *layers, overrides):
        for key, value in layer.items():
            if isinstance(value, dict):
                cfg[key] = {**cfg.get(key, {}), **value}
            else:
                cfg[key] = value
    return cfg
