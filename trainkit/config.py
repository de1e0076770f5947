"""The configuration records: a frozen, validated tree with dotted-key overrides.

Pure: stdlib and attrs only. Build a :class:`Config` directly, from any nested mapping (a dict, a
loaded YAML file, an OmegaConf container) with :meth:`Config.from_mapping`, and apply command-line style
overrides (``"val.patience=5"``) with :meth:`Config.with_overrides`. A typo anywhere is an error that
names the closest known key; a wrong type or range names the key, the rule and the value.

Add your own keys by subclassing::

    @attrs.frozen(kw_only=True)
    class MyConfig(Config):
        lr: float = 1e-3
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from trainkit.errors import ConfigError

__all__ = [
    "Config",
    "ValConfig",
    "TestConfig",
    "CkptConfig",
    "WandbConfig",
    "ProgressConfig",
    "DistConfig",
    "DEFAULT_NO_WEIGHT_DECAY",
]

C = TypeVar("C", bound="_Section")

DEFAULT_NO_WEIGHT_DECAY = ("bias", "norm", "_emb")
"""Name fragments that exempt a parameter from weight decay: biases, norm layers and ``*_emb`` tables."""

WANDB_MODES = ("offline", "online", "disabled")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rule(check: typing.Callable[[Any], bool], text: str) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    """Build a range validator; values of the wrong type are left to the type check, which names them."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if _is_number(value) and not math.isfinite(value):
            raise ConfigError(attribute.name, "must be a finite number", value)
        if _is_number(value) and not check(value):
            raise ConfigError(attribute.name, text, value)

    return validate


def _at_least(minimum: float) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    return _rule(lambda v: v >= minimum, f"must be >= {minimum}")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _rule(lambda v: v > 0, "must be > 0")(instance, attribute, value)


def _one_of(*choices: str) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, str) and value not in choices:
            raise ConfigError(attribute.name, f"must be one of {', '.join(map(repr, choices))}", value)

    return validate


def _non_empty(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str) and not value.strip():
        raise ConfigError(attribute.name, "must be a non-empty string", value)


def _optional(validator: typing.Callable[[Any, attrs.Attribute, Any], None]) -> typing.Callable[..., None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return validate


def _signal_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    import signal

    if isinstance(value, str) and not isinstance(getattr(signal, value, None), signal.Signals):
        raise ConfigError(attribute.name, "must be a signal name such as 'SIGUSR1'", value)


def _patience_rule(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if _is_number(value) and value < 1:
        raise ConfigError(
            attribute.name,
            "must be >= 1 or None",
            value,
            hint="use 1 to stop at the first counted miss, or null to disable early stopping",
        )


def _to_tuple(value: Any) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(value)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(tp))
    if origin is tuple:
        return "a list of " + _type_name(typing.get_args(tp)[0])
    if attrs.has(tp):
        return "a mapping"
    return {int: "an int", float: "a float", bool: "a bool", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _anything(value: Any) -> bool:
    return True


def _checker(tp: Any) -> typing.Callable[[Any], bool]:
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
        options = tuple(_checker(arg) for arg in typing.get_args(tp))
        return lambda value: any(check(value) for check in options)
    if origin is tuple:
        item = _checker(typing.get_args(tp)[0])
        return lambda value: isinstance(value, tuple) and all(item(v) for v in value)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        return lambda value: value in allowed
    if tp is float:
        return _is_number
    if tp is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return lambda value: isinstance(value, tp)
    return _anything


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, Any, typing.Callable[[Any], bool]], ...]:
    hints = _hints(cls)
    return tuple(
        (field.name, hints.get(field.name, Any), _checker(hints.get(field.name, Any))) for field in attrs.fields(cls)
    )


@functools.cache
def _build_plan(cls: type) -> dict[str, str | None]:
    """Per field of ``cls``: ``"section"`` (a nested record), ``"tuple"`` (lists become tuples) or None."""
    plan: dict[str, str | None] = {}
    hints = _hints(cls)
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


@attrs.frozen(kw_only=True)
class _Section:
    """Shared machinery of every config record: type checks, dict round trips, mapping construction."""

    def __attrs_post_init__(self) -> None:
        for name, tp, check in _field_checks(type(self)):
            value = getattr(self, name)
            if not check(value):
                raise ConfigError(name, f"must be {_type_name(tp)}", value)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a nested dict of plain values (tuples become lists).

        :returns: A dict that :meth:`from_mapping` turns back into an equal config.
        """
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, _Section):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out

    @classmethod
    def from_mapping(cls: type[C], mapping: Mapping[str, Any], overrides: Iterable[str] = ()) -> C:
        """Build and validate a config from a nested mapping, then apply dotted overrides.

        :param mapping: Nested keys and values, e.g. a dict or a loaded YAML document.
        :param overrides: ``"dotted.key=value"`` strings, applied after the mapping.
        :returns: The validated config.
        :raises ConfigError: On an unknown key (naming the closest known one), a wrong type or a value out of range.

        >>> Config.from_mapping({"epochs": 3, "val": {"patience": 2}}, ["val.patience=5"]).val.patience
        5
        >>> Config.from_mapping({"epochs": 3, "val": {"paitence": 2}})
        Traceback (most recent call last):
        ...
        trainkit.errors.ConfigError: unknown config key 'val.paitence'; did you mean 'val.patience'?
        """
        cfg = _build(cls, mapping, prefix="", root=cls)
        return cfg.with_overrides(overrides) if overrides else cfg

    def with_overrides(self: C, overrides: Iterable[str]) -> C:
        """Return a copy with ``"dotted.key=value"`` overrides applied, as a command line gives them.

        Values are parsed for the key's type: ``5``, ``0.1``, ``true``/``false``, ``null``/``none``, and
        ``[a, b]`` or ``a,b`` for lists; anything else is a string.

        :param overrides: The override strings.
        :returns: The new validated config.
        :raises ConfigError: On a malformed override, an unknown key, or a value that breaks a rule.

        >>> cfg = Config(epochs=2).with_overrides(["val.minimize=true", "out_dir=runs/x"])
        >>> cfg.val.minimize, cfg.out_dir
        (True, 'runs/x')
        """
        data = self.to_dict()
        for override in overrides:
            key, sep, text = str(override).partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError("override", "must look like 'dotted.key=value'", override, show_value=True)
            node: dict[str, Any] = data
            cls: type = type(self)
            parts = key.split(".")
            for depth, part in enumerate(parts):
                fields = attrs.fields_dict(cls)
                if part not in fields:
                    raise _unknown_key(type(self), ".".join(parts[: depth + 1]))
                tp = _hints(cls)[part]
                if depth == len(parts) - 1:
                    if attrs.has(tp):
                        raise ConfigError(key, "is a section; override one of its keys", text)
                    node[part] = _parse(text.strip(), tp, key)
                elif attrs.has(tp):
                    node = node[part]
                    cls = tp
                else:
                    raise _unknown_key(type(self), key)
        return _build(type(self), data, prefix="", root=type(self))


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for field in attrs.fields(cls):
        name = prefix + field.name
        tp = _hints(cls).get(field.name)
        keys.extend(_all_keys(tp, name + ".") if tp is not None and attrs.has(tp) else [name])
    return keys


def _sections(cls: type, prefix: str = "") -> list[str]:
    names = []
    for field in attrs.fields(cls):
        tp = _hints(cls).get(field.name)
        if tp is not None and attrs.has(tp):
            names.append(prefix + field.name)
            names.extend(_sections(tp, prefix + field.name + "."))
    return names


def _unknown_key(root: type, key: str) -> ConfigError:
    known = _all_keys(root)
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, known + _sections(root), n=1, cutoff=0.6)
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
            if _checker(arg)(value):
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


def _build(cls: type[C], mapping: Any, *, prefix: str, root: type) -> C:
    if isinstance(mapping, cls):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", "must be a mapping", mapping)
    fields = attrs.fields_dict(cls)
    plan = _build_plan(cls)
    kwargs: dict[str, Any] = {}
    for raw_key, value in mapping.items():
        key = str(raw_key)
        if key not in fields:
            raise _unknown_key(root, prefix + key)
        kind = plan[key]
        if kind == "section":
            value = _build(_hints(cls)[key], value, prefix=f"{prefix}{key}.", root=root)
        elif kind == "tuple":
            value = _to_tuple(value)
        kwargs[key] = value
    missing = [name for name, field in fields.items() if field.default is attrs.NOTHING and name not in kwargs]
    if missing:
        raise ConfigError(prefix + missing[0], "is required", show_value=False)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.with_prefix(prefix.rstrip(".")) from None


def _section(cls: type) -> Any:
    return attrs.field(factory=cls)


@attrs.frozen(kw_only=True)
class ValConfig(_Section):
    """``val.*``: the validation schedule, the selection direction and early stopping."""

    every_n_epochs: int = attrs.field(default=1, validator=_at_least(1))
    minimize: bool = False
    patience: int | None = attrs.field(default=None, validator=_optional(_patience_rule))
    start_patience: int = attrs.field(default=0, validator=_at_least(0))
    min_delta: float = attrs.field(default=0.0, validator=_at_least(0))


@attrs.frozen(kw_only=True)
class TestConfig(_Section):
    """``test.*``: whether ``train()`` ends with ``test()`` on the best weights."""

    __test__ = False  # a config record, not a pytest test class

    enable: bool = False


@attrs.frozen(kw_only=True)
class CkptConfig(_Section):
    """``ckpt.*``: checkpoint writing and resuming.

    ``resume`` is ``"auto"`` (resume from ``out_dir/last.pt`` when it exists), ``"never"`` (start fresh;
    an existing ``last.pt`` is overwritten by the first epoch), or the path of a checkpoint to resume from.
    With ``enable`` off nothing is written and nothing is read unless ``resume`` names a path.
    ``requeue_signal`` is a signal name (besides SIGTERM and SIGINT) that makes the run save at the end of
    the current epoch and exit, as a cluster scheduler sends before requeueing a job; None disables it.
    ``async_save`` copies the state into reused host buffers and writes it from a background thread, so
    the loop waits only for the copy (off by default).
    """

    enable: bool = True
    resume: str = attrs.field(default="auto", validator=_non_empty)
    requeue_signal: str | None = attrs.field(default="SIGUSR1", validator=_optional(_signal_name))
    async_save: bool = False


@attrs.frozen(kw_only=True)
class WandbConfig(_Section):
    """``wandb.*``: the W&B run; ``mode`` is ``"offline"`` (local files), ``"online"`` or ``"disabled"``."""

    mode: str = attrs.field(default="offline", validator=_one_of(*WANDB_MODES))
    project: str | None = "trainkit"
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)


@attrs.frozen(kw_only=True)
class ProgressConfig(_Section):
    """``progress.*``: tqdm bars on rank 0."""

    enable: bool = True


@attrs.frozen(kw_only=True)
class DistConfig(_Section):
    """``dist.*``: the process group; every collective is bounded by ``timeout_s``."""

    backend: str = attrs.field(default="auto", validator=_one_of("auto", "gloo", "nccl"))
    timeout_s: float = attrs.field(default=300.0, validator=_positive)


@attrs.frozen(kw_only=True)
class Config(_Section):
    """The engine's configuration. Subclass it (with ``@attrs.frozen(kw_only=True)``) to add your own keys.

    >>> cfg = Config(epochs=10)
    >>> cfg.val.every_n_epochs, cfg.ckpt.resume, cfg.wandb.mode
    (1, 'auto', 'offline')
    >>> Config.from_mapping(cfg.to_dict()) == cfg
    True
    """

    epochs: int = attrs.field(validator=_at_least(1))
    seed: int = 0
    out_dir: str = attrs.field(default="runs/default", validator=_non_empty)
    val: ValConfig = _section(ValConfig)
    test: TestConfig = _section(TestConfig)
    ckpt: CkptConfig = _section(CkptConfig)
    weight_decay: float = attrs.field(default=0.0, validator=_at_least(0))
    no_weight_decay: tuple[str, ...] = attrs.field(default=DEFAULT_NO_WEIGHT_DECAY, converter=_to_tuple)
    grad_clip: float | None = attrs.field(default=None, validator=_optional(_positive))
    log_stats_every_n_steps: int = attrs.field(default=100, validator=_at_least(1))
    log_weight_stats: bool = False
    log_grad_stats: bool = False
    wandb: WandbConfig = _section(WandbConfig)
    progress: ProgressConfig = _section(ProgressConfig)
    dist: DistConfig = _section(DistConfig)
