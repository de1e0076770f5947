"""The rules a config value is checked against: field validators and the type checks built from annotations.

Pure: stdlib and attrs only. A rule's message names the key, the rule and the value (:class:`~trainkit.ConfigError`).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trainkit.bookkeeping import is_finite_real, is_int, is_real, parse_keep
from trainkit.config.secrets import field_types, has_url_userinfo, is_secret_name, redact_text
from trainkit.errors import BookkeepingError, ConfigError

__all__ = []


def range_rule(check: typing.Callable[[Any], bool], text: str) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    """Build a range validator; values of the wrong type are left to the type check, which names them."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if is_real(value) and not is_finite_real(value):  # an int of 400 digits fits no float: refused, not raised
            shown = value if isinstance(value, float) else f"an int of {value.bit_length()} bits"
            raise ConfigError(attribute.name, "must be a finite number", shown)
        if is_real(value) and not check(value):
            raise ConfigError(attribute.name, text, value)

    return validate


def at_least(minimum: float) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    return range_rule(lambda v: v >= minimum, f"must be >= {minimum}")


def within(low: float, high: float) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    return range_rule(lambda v: low <= v <= high, f"must be in [{low:g}, {high:g}]")


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    range_rule(lambda v: v > 0, "must be > 0")(instance, attribute, value)


def one_of(*choices: str) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, str) and value not in choices:
            raise ConfigError(attribute.name, f"must be one of {', '.join(map(repr, choices))}", value)

    return validate


def non_empty(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str) and not value.strip():
        raise ConfigError(attribute.name, "must be a non-empty string", value)


_WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def wandb_project(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """W&B's own rule for a project name, checked here so a bad name fails at construction, not at W&B start."""
    if not isinstance(value, str):
        return  # the type check names it
    if not value.strip() or len(value) > 128:
        raise ConfigError(attribute.name, "must be 1 to 128 characters (W&B's limit)", value)
    found = sorted({char for char in value if char in _WANDB_PROJECT_FORBIDDEN})
    if found:
        raise ConfigError(
            attribute.name,
            f"must not contain any of {' '.join(_WANDB_PROJECT_FORBIDDEN)} (W&B refuses them)",
            value,
            hint=f"found {' '.join(found)}",
        )


def wandb_tags(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """W&B's own rule for tags: every tag 1 to 64 characters."""
    if not isinstance(value, tuple):
        return
    for tag in value:
        if isinstance(tag, str) and not (tag.strip() and len(tag) <= 64):
            raise ConfigError(attribute.name, "must hold tags of 1 to 64 characters each (W&B's limit)", tag)


def optional_rule(validator: typing.Callable[[Any, attrs.Attribute, Any], None]) -> typing.Callable[..., None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return validate


def signal_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    import signal

    if isinstance(value, str) and not isinstance(getattr(signal, value, None), signal.Signals):
        raise ConfigError(attribute.name, "must be a signal name such as 'SIGUSR1'", value)
    if value in ("SIGKILL", "SIGSTOP"):
        raise ConfigError(attribute.name, "must be a signal a process can catch (not SIGKILL or SIGSTOP)", value)


def patience_rule(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if is_real(value) and value < 1:
        raise ConfigError(
            attribute.name,
            "must be >= 1 or None",
            value,
            hint="use 1 to stop at the first counted miss, or null to disable early stopping",
        )


def keep_items(value: Any) -> Any:
    """``ckpt.keep``: a comma-separated string, or a list of them, as one tuple of items."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        if not all(isinstance(item, str) for item in value):
            return tuple(value)  # the type check names it
        return tuple(part.strip() for item in value for part in item.split(",") if part.strip())
    return value


def keep_rules(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(item, str) for item in value):
        return  # the type check names it
    try:
        parse_keep(value)
    except BookkeepingError as exc:
        raise ConfigError(
            attribute.name,
            "must be comma-separated retention rules",
            ",".join(value),
            hint=str(exc),
        ) from None


_URL_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)


REMOTE_USERINFO_RULE = (
    "must not hold credentials before the host (user:password@ or token@); they would be saved in every "
    "checkpoint and shown in messages: give them the store's own way (its environment variables, its config files, "
    "an instance role), as its own tools read them"
)
"""Why a ``ckpt.remote`` URL with userinfo is refused (the URL is not repeated: it holds the secret)."""


def remote_url(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str) and has_url_userinfo(value):
        raise ConfigError(attribute.name, REMOTE_USERINFO_RULE, show_value=False)
    if isinstance(value, str) and (not _URL_SCHEME.match(value) or not value.split("://", 1)[1].strip("/")):
        shown = redact_text(value)
        raise ConfigError(
            attribute.name,
            "must be a URL with a scheme and a prefix (s3://bucket/prefix, file:///path)",
            shown,
            show_value="@" not in shown or "***" in shown,  # user:pw@host without a scheme: not masked, not shown
        )


_OPTIONS_DEPTH = 16
"""How deep ``ckpt.remote_options`` may nest (``client_kwargs``, ``config_kwargs``... are two or three deep)."""


def _credential_in(value: Any, path: str, depth: int = 0) -> str | None:
    """Where a credential sits in a store option: a key named like one at any depth (``client_kwargs.
    aws_secret_access_key``, ``headers.Authorization``), or a string that carries one (``AccountKey=...`` in a
    connection string, a URL's password); None when there is none."""
    if depth > _OPTIONS_DEPTH:
        return f"{path} (nested more than {_OPTIONS_DEPTH} deep)"
    if isinstance(value, str):
        return f"{path} (its text)" if redact_text(value) != value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and is_secret_name(key):
                return where
            found = _credential_in(item, where, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _credential_in(item, f"{path}[{index}]", depth + 1)
            if found is not None:
                return found
    return None


def remote_options(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ConfigError(attribute.name, "must be a mapping of option names to values", value)
    secret = _credential_in(value, "")
    if secret is not None:  # the config file is saved in every checkpoint: credentials come from the environment
        raise ConfigError(
            attribute.name,
            f"must not hold credentials (at {secret!r}): set them in the environment, as the store's own tools read "
            "them",
            show_value=False,
        )


def to_tuple(value: Any) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(value)
    return value


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in typing.get_args(tp))
    if origin is tuple:
        return "a list of " + type_name(typing.get_args(tp)[0])
    if attrs.has(tp):
        return "a mapping"
    return {int: "an int", float: "a float", bool: "a bool", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _anything(value: Any) -> bool:
    return True


def type_check(tp: Any) -> typing.Callable[[Any], bool]:
    """The type test for annotation ``tp``, worked out once per annotation (a config is built per run)."""
    try:
        return _cached_checker(tp)
    except TypeError:  # an unhashable annotation (say, a Literal of lists): work it out every time
        return _make_checker(tp)


@functools.cache
def _cached_checker(tp: Any) -> typing.Callable[[Any], bool]:
    return _make_checker(tp)


def _make_checker(tp: Any) -> typing.Callable[[Any], bool]:
    if tp is Any:
        return _anything
    if tp is type(None):
        return lambda value: value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = tuple(type_check(arg) for arg in typing.get_args(tp))
        return lambda value: any(check(value) for check in options)
    if origin is tuple:
        item = type_check(typing.get_args(tp)[0])
        return lambda value: isinstance(value, tuple) and all(item(v) for v in value)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        return lambda value: value in allowed
    if tp is float:
        return is_real
    if tp is int:
        return is_int
    if isinstance(tp, type):
        return lambda value: isinstance(value, tp)
    return _anything


@functools.cache
def field_checks(cls: type) -> tuple[tuple[str, Any, typing.Callable[[Any], bool]], ...]:
    hints = field_types(cls)
    return tuple(
        (field.name, hints.get(field.name, Any), type_check(hints.get(field.name, Any))) for field in attrs.fields(cls)
    )


@functools.cache
def build_plan(cls: type) -> dict[str, str | None]:
    """Per field of ``cls``: ``"section"`` (a nested record), ``"tuple"`` (lists become tuples) or None."""
    plan: dict[str, str | None] = {}
    hints = field_types(cls)
    for name in attrs.fields_dict(cls):
        tp = hints.get(name, Any)
        args = typing.get_args(tp)
        if attrs.has(tp):
            plan[name] = "section"
        elif typing.get_origin(tp) is tuple or tuple in args or any(typing.get_origin(arg) is tuple for arg in args):
            plan[name] = "tuple"
        else:
            plan[name] = None
    return plan
