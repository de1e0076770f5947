"""Dotted-key overrides (``"val.patience=5"``): parsed for the key's type and applied to a nested mapping.

Pure: stdlib and attrs only. An unknown key names the closest known one.
"""

from __future__ import annotations

import ast
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from trainkit.config.rules import type_check
from trainkit.config.secrets import field_types, hide_if_secret
from trainkit.errors import ConfigError

__all__ = [
    "apply_overrides",
    "all_keys",
]


def plain_tree(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a nested mapping whose mappings are plain dicts, to apply overrides to."""
    return {key: plain_tree(value) if isinstance(value, Mapping) else value for key, value in mapping.items()}


def apply_overrides(root: type, data: dict[str, Any], overrides: Iterable[str]) -> None:
    """Write ``"dotted.key=value"`` overrides into ``data`` (a plain tree), each value parsed for its key's type; a
    key past a mapping field (``ckpt.remote_options.endpoint_url=...``) sets that entry of the mapping.

    Pure apart from changing ``data``.

    >>> from trainkit.config import Config
    >>> data = {"val": {"patience": 3}}
    >>> apply_overrides(Config, data, ["val.patience=5", "epochs=2"])
    >>> data
    {'val': {'patience': 5}, 'epochs': 2}
    >>> apply_overrides(Config, data, ["ckpt.remote_options.client_kwargs.region_name=eu-west-1"])
    >>> data["ckpt"]
    {'remote_options': {'client_kwargs': {'region_name': 'eu-west-1'}}}

    :param root: The config class the keys belong to.
    :param data: The plain tree to change.
    :param overrides: ``"dotted.key=value"`` strings.
    :raises ConfigError: On a malformed override, an unknown key, a section overridden as a whole, or a value
        that does not parse.
    """
    for override in overrides:
        key, sep, text = str(override).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("override", "must look like 'dotted.key=value'", override, show_value=True)
        node: dict[str, Any] = data
        cls: type = root
        parts = key.split(".")
        for depth, part in enumerate(parts):
            fields = attrs.fields_dict(cls)
            if part not in fields:
                raise unknown_key(root, ".".join(parts[: depth + 1]))
            tp = field_types(cls)[part]
            if depth == len(parts) - 1:
                try:
                    if attrs.has(tp):
                        raise ConfigError(key, "is a section; override one of its keys", text)
                    node[part] = _parse(text.strip(), tp, key)
                except ConfigError as exc:
                    raise hide_if_secret(exc, key, root) from None
            elif attrs.has(tp):
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(".".join(parts[: depth + 1]), "must be a mapping", child)
                node = child
                cls = tp
            elif _is_mapping_field(fields[part]):  # ckpt.remote_options.endpoint_url=...: one entry of the mapping
                _set_entry(node, parts[: depth + 1], parts[depth + 1 :], text.strip())
                break
            else:
                raise unknown_key(root, key)


def _is_mapping_field(field: attrs.Attribute) -> bool:
    """Whether a field holds a free mapping of its own (its default a ``dict``), whose entries an override may set."""
    default = field.default
    return isinstance(default, dict) or (isinstance(default, attrs.Factory) and default.factory is dict)


def _set_entry(node: dict[str, Any], field: list[str], entry: list[str], text: str) -> None:
    """Set one (possibly nested) entry of a mapping field from ``field.entry=text``; the value parsed as a literal."""
    mapping = node.setdefault(field[-1], {})
    for depth, name in enumerate(entry):
        if not isinstance(mapping, dict):
            raise ConfigError(".".join(field + entry[:depth]), "must be a mapping", mapping)
        if depth == len(entry) - 1:
            mapping[name] = None if text.lower() in ("null", "none", "~") else _literal(text)
        else:
            mapping = mapping.setdefault(name, {})


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """List every leaf key of a config class, dotted, in declaration order.

    >>> from trainkit.config import Config
    >>> all_keys(Config)[:3]
    ['epochs', 'seed', 'out_dir']

    :param cls: A config class (or section class).
    :param prefix: Put before every key.
    :returns: The dotted keys.
    """
    keys = []
    for field in attrs.fields(cls):
        name = prefix + field.name
        tp = field_types(cls).get(field.name)
        keys.extend(all_keys(tp, name + ".") if tp is not None and attrs.has(tp) else [name])
    return keys


def _sections(cls: type, prefix: str = "") -> list[str]:
    names = []
    for field in attrs.fields(cls):
        tp = field_types(cls).get(field.name)
        if tp is not None and attrs.has(tp):
            names.append(prefix + field.name)
            names.extend(_sections(tp, prefix + field.name + "."))
    return names


def unknown_key(root: type, key: str, root_prefix: str = "") -> ConfigError:
    known = all_keys(root, root_prefix)
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, known + _sections(root, root_prefix), n=1, cutoff=0.6)
    if not close:
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(key, "is unknown", show_value=False, hint=hint, message=f"unknown config key {key!r}")


def _parse(text: str, tp: Any, key: str) -> Any:
    """Parse an override's text for the field type ``tp``."""
    lowered = text.lower()
    if lowered in ("null", "none", "~"):
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None):
                continue
            try:
                value = _parse(text, arg, key)
            except ConfigError:
                continue
            if type_check(arg)(value):
                return value
        return _literal(text)
    if origin is tuple:
        if text.startswith(("[", "(")):
            items = _literal(text)
            if isinstance(items, list | tuple):
                return tuple(items)
            if text.endswith(("]", ")")):  # unquoted items, as a shell passes them: [a, b]
                text = text[1:-1]
        return tuple(_unquote(part.strip()) for part in text.split(",") if part.strip())
    if tp is bool:
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(key, "must be a bool (true or false)", text)
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            return _literal(text)
    if tp is str:
        return _unquote(text)
    return _literal(text)


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
