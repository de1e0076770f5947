"""A config from YAML files and dotted overrides, as a command line gives them (:func:`config_from_argv`).

Side effects: reads the YAML files named.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainkit.config import Config, redact_argv
from trainkit.errors import ConfigError
from trainkit.messages import exit_refused

__all__ = [
    "load_yaml",
    "config_from_argv",
    "C",
]

C = TypeVar("C", bound=Config)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict.

    :param path: The file.
    :returns: Its top-level mapping (empty for an empty file).
    :raises ConfigError: When the file is missing or its top level is not a mapping.
    :raises ImportError: When PyYAML is not installed, saying how to get it.
    """
    try:
        import yaml
    except ImportError:
        raise ImportError(
            "PyYAML is needed to read YAML configs: pip install 'trainkit[examples]' (or pyyaml)"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file", "does not exist", str(path))
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}", "must hold a mapping at the top level", type(data).__name__)
    return data


def config_from_argv(
    config_class: type[C], argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> C:
    """Build a config from command-line words: YAML files (``*.yaml``/``*.yml``) then ``dotted.key=value`` overrides.

    Later files override earlier ones key by key; overrides apply last, in order. Without ``argv`` it reads
    the process's command line and, as ``argparse`` does, reports a bad word in one line on stderr
    (``digits.py: error: unknown config key 'val.paitence'; did you mean 'val.patience'?``) and exits with
    status 2; with ``argv`` given, it raises instead.

    :param config_class: The config record to build.
    :param argv: The words after the program name, e.g. ``["conf.yaml", "epochs=40", "val.patience=5"]``;
        None reads ``sys.argv[1:]``.
    :param defaults: Values applied before any file (a script's own defaults).
    :returns: The validated config.
    :raises ConfigError: On an unknown key, a bad value, or a word that is neither a file nor an override,
        when ``argv`` is given.
    :raises SystemExit: With status 2 for the same errors, when ``argv`` is None.
    """
    if argv is None:
        try:
            return config_from_argv(config_class, sys.argv[1:], defaults)
        except ConfigError as exc:
            exit_refused(exc)
    data: dict[str, Any] = {}
    _merge(data, defaults or {})
    overrides = []
    for index, word in enumerate(argv):
        if "=" in word:
            overrides.append(word)
        elif word.endswith((".yaml", ".yml")):
            _merge(data, load_yaml(word))
        else:
            secret = redact_argv(argv, config_class)[index] != word  # say, the value of ``api_key= VALUE``
            rule = "must be a YAML file (*.yaml) or a dotted.key=value override"
            raise ConfigError("argument", rule, None if secret else word, show_value=not secret)
    return config_class.from_mapping(data, overrides)


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
