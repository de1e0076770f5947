"""The configuration records: a frozen, validated tree with dotted-key overrides.

Pure: stdlib and attrs only. Build a :class:`Config` directly, from any nested mapping (a dict, a
loaded YAML file, an OmegaConf container) with :meth:`Config.from_mapping`, and apply command-line style
overrides (``"val.patience=5"``) with :meth:`Config.with_overrides`. A typo anywhere is an error that
names the closest known key; a wrong type or range names the key, the rule and the value.

Secrets: declare a field with :func:`secret_field` (or name it like one, see :func:`is_secret_name`); your
code reads it as a plain value, and :func:`public_config` leaves it out of what is saved and logged.

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
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from trainkit.bookkeeping import is_int, is_real, parse_keep
from trainkit.errors import BookkeepingError, ConfigError

__all__ = [
    "Config",
    "secret_field",
    "is_secret_name",
    "is_secret_key",
    "redact_text",
    "strip_secrets",
    "public_config",
    "render_value",
    "redact_argv",
    "all_keys",
    "apply_overrides",
    "changed_on_resume",
    "RESUME_SAFE_KEYS",
    "RETUNED_KEYS",
    "ValConfig",
    "TestConfig",
    "CkptConfig",
    "WandbConfig",
    "ProgressConfig",
    "DistConfig",
    "GuardConfig",
    "DEFAULT_NO_WEIGHT_DECAY",
]

C = TypeVar("C", bound="_Section")

DEFAULT_NO_WEIGHT_DECAY = ("bias", "norm", "_emb")
"""Name fragments that exempt a parameter from weight decay: biases, norm layers and ``*_emb`` tables."""

WANDB_MODES = ("offline", "online", "disabled")


def _rule(check: typing.Callable[[Any], bool], text: str) -> typing.Callable[[Any, attrs.Attribute, Any], None]:
    """Build a range validator; values of the wrong type are left to the type check, which names them."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if is_real(value) and not math.isfinite(value):
            raise ConfigError(attribute.name, "must be a finite number", value)
        if is_real(value) and not check(value):
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


_WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def _wandb_project(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
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


def _wandb_tags(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """W&B's own rule for tags: every tag 1 to 64 characters."""
    if not isinstance(value, tuple):
        return
    for tag in value:
        if isinstance(tag, str) and not (tag.strip() and len(tag) <= 64):
            raise ConfigError(attribute.name, "must hold tags of 1 to 64 characters each (W&B's limit)", tag)


def _optional(validator: typing.Callable[[Any, attrs.Attribute, Any], None]) -> typing.Callable[..., None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return validate


def _signal_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    import signal

    if isinstance(value, str) and not isinstance(getattr(signal, value, None), signal.Signals):
        raise ConfigError(attribute.name, "must be a signal name such as 'SIGUSR1'", value)
    if value in ("SIGKILL", "SIGSTOP"):
        raise ConfigError(attribute.name, "must be a signal a process can catch (not SIGKILL or SIGSTOP)", value)


def _patience_rule(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if is_real(value) and value < 1:
        raise ConfigError(
            attribute.name,
            "must be >= 1 or None",
            value,
            hint="use 1 to stop at the first counted miss, or null to disable early stopping",
        )


def _keep_items(value: Any) -> Any:
    """``ckpt.keep``: a comma-separated string, or a list of them, as one tuple of items."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        if not all(isinstance(item, str) for item in value):
            return tuple(value)  # the type check names it
        return tuple(part.strip() for item in value for part in item.split(",") if part.strip())
    return value


def _keep_rules(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
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
        return is_real
    if tp is int:
        return is_int
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
                secret = is_secret_key(name, self)
                raise ConfigError(name, f"must be {_type_name(tp)}", None if secret else value, show_value=not secret)

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
        if not overrides:
            return _build(cls, mapping, prefix="", root=cls)
        # overrides go into the mapping before it is validated: a required key may come from an override alone
        data = _plain_tree(mapping) if isinstance(mapping, Mapping) else mapping
        if isinstance(data, dict):
            apply_overrides(cls, data, overrides)
        return _build(cls, data, prefix="", root=cls)

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
        apply_overrides(type(self), data, overrides)
        return _build(type(self), data, prefix="", root=type(self))


def _plain_tree(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a nested mapping whose mappings are plain dicts, to apply overrides to."""
    return {key: _plain_tree(value) if isinstance(value, Mapping) else value for key, value in mapping.items()}


def apply_overrides(root: type, data: dict[str, Any], overrides: Iterable[str]) -> None:
    """Write ``"dotted.key=value"`` overrides into ``data`` (a plain tree), each value parsed for its key's type.

    Pure apart from changing ``data``.

    >>> data = {"val": {"patience": 3}}
    >>> apply_overrides(Config, data, ["val.patience=5", "epochs=2"])
    >>> data
    {'val': {'patience': 5}, 'epochs': 2}

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
                raise _unknown_key(root, ".".join(parts[: depth + 1]))
            tp = _hints(cls)[part]
            if depth == len(parts) - 1:
                try:
                    if attrs.has(tp):
                        raise ConfigError(key, "is a section; override one of its keys", text)
                    node[part] = _parse(text.strip(), tp, key)
                except ConfigError as exc:
                    raise _hide_if_secret(exc, key, root) from None
            elif attrs.has(tp):
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(".".join(parts[: depth + 1]), "must be a mapping", child)
                node = child
                cls = tp
            else:
                raise _unknown_key(root, key)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """List every leaf key of a config class, dotted, in declaration order.

    >>> all_keys(Config)[:3]
    ['epochs', 'seed', 'out_dir']

    :param cls: A config class (or section class).
    :param prefix: Put before every key.
    :returns: The dotted keys.
    """
    keys = []
    for field in attrs.fields(cls):
        name = prefix + field.name
        tp = _hints(cls).get(field.name)
        keys.extend(all_keys(tp, name + ".") if tp is not None and attrs.has(tp) else [name])
    return keys


def _sections(cls: type, prefix: str = "") -> list[str]:
    names = []
    for field in attrs.fields(cls):
        tp = _hints(cls).get(field.name)
        if tp is not None and attrs.has(tp):
            names.append(prefix + field.name)
            names.extend(_sections(tp, prefix + field.name + "."))
    return names


def _unknown_key(root: type, key: str, root_prefix: str = "") -> ConfigError:
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


def _build(cls: type[C], mapping: Any, *, prefix: str, root: type, root_prefix: str = "") -> C:
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
            raise _unknown_key(root, prefix + key, root_prefix)
        kind = plan[key]
        if kind == "section":
            try:
                value = _build(_hints(cls)[key], value, prefix=f"{prefix}{key}.", root=root, root_prefix=root_prefix)
            except ConfigError as exc:
                raise _hide_if_secret(exc, key, cls) from None
        elif kind == "tuple":
            value = _to_tuple(value)
        kwargs[key] = value
    missing = [name for name, field in fields.items() if field.default is attrs.NOTHING and name not in kwargs]
    if missing:
        raise ConfigError(prefix + missing[0], "is required", show_value=False)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise _hide_if_secret(exc, exc.key, cls).with_prefix(prefix.rstrip(".")) from None
    except (TypeError, ValueError) as exc:  # an attrs validator's message quotes the value: not for a secret
        field = next((arg for arg in exc.args if isinstance(arg, attrs.Attribute)), None)
        if field is None or not is_secret_key(field.name, cls):
            raise
        raise ConfigError(prefix + field.name, "was refused by its validator", show_value=False) from None


def _section(cls: type) -> Any:
    """A config section field: takes the section's record, or any mapping validated into one exactly as
    :meth:`Config.from_mapping` validates it (``MyConfig(epochs=20, val={"patience": 3})``)."""

    def convert(value: Any, field: attrs.Attribute) -> Any:
        if isinstance(value, Mapping):
            name = f"{field.name}."
            return _build(cls, value, prefix=name, root=cls, root_prefix=name)
        return value

    return attrs.field(factory=cls, converter=attrs.Converter(convert, takes_field=True))


# ----------------------------------------------------------------------------------------------- secrets

SECRET_MASK = "***"
"""What a secret value, or the password of a URL, is replaced by wherever trainkit shows or writes it."""

_SECRET_WORDS = frozenset(
    {
        "password", "passwd", "pwd", "passphrase", "passcode",
        "secret", "secrets",
        "credential", "credentials", "creds",
        "auth", "oauth", "authorization",
        "apikey", "accesskey", "privatekey", "secretkey",
        "cookie", "cookies", "bearer", "jwt",
    }
)  # fmt: skip
"""Words that make a name secret wherever they stand in it."""

_KEY_QUALIFIERS = frozenset(
    {"api", "access", "private", "secret", "signing", "encryption", "ssh", "master", "license", "account", "session"}
)
"""Words that make a following ``key``/``keys`` a credential (``api_key``); any other ``key`` is a data key."""

_VOCABULARY_TOKENS = frozenset(
    {
        "pad", "bos", "eos", "eot", "sos", "sot", "unk", "sep", "cls", "mask",
        "start", "end", "stop", "special", "image", "video", "audio", "vision",
        "max", "min", "num", "n",
    }
)  # fmt: skip
"""Words that make a final ``token`` a vocabulary token or a count (``pad_token``), not a credential."""

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SEPARATORS = re.compile(r"[_\-\s]+")
_URL_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?:(?P<user>[^\s:/?#@]*):(?P<password>\S*)|(?P<lone>[^\s:/?#@]+))@"
)
_PAIR = re.compile(r"(?<![^\s?&;])(?P<name>-{0,2}[A-Za-z_][\w.\-]*)=(?P<value>[^&;#\s]*)")


def _words(segment: str) -> list[str]:
    """The lowercase words of one name segment: split on ``_``, ``-``, spaces and camelCase; trailing digits dropped."""
    words = []
    for word in _SEPARATORS.split(_CAMEL.sub(" ", segment)):
        word = word.lower().rstrip("0123456789") or word.lower()
        if word:
            words.append(word)
    return words


@functools.lru_cache(maxsize=4096)  # every save and W&B config asks about the same few dozen names
def _secret_segment(segment: str) -> bool:
    words = _words(segment)
    for index, word in enumerate(words):
        if word in _SECRET_WORDS:
            return True
        if word in ("key", "keys") and index and words[index - 1] in _KEY_QUALIFIERS:
            return True
    return bool(words) and words[-1] == "token" and (len(words) == 1 or words[-2] not in _VOCABULARY_TOKENS)


def is_secret_name(name: str) -> bool:
    """Say whether a key's name alone marks its value as a secret.

    Pure. The name is cut into segments at ``.``, each segment into words at ``_``, ``-``, spaces and
    camelCase boundaries (``apiKey`` is ``api key``, ``APIKey`` too), lowercased, trailing digits dropped.
    Whole words count, never substrings, and a dotted name is secret when any segment is. A segment is secret
    when one of its words

    - is ``password``, ``passwd``, ``pwd``, ``passphrase``, ``passcode``, ``secret(s)``, ``credential(s)``,
      ``creds``, ``auth``, ``oauth``, ``authorization``, ``apikey``, ``accesskey``, ``privatekey``,
      ``secretkey``, ``cookie(s)``, ``bearer`` or ``jwt`` (anywhere: ``db_password``, ``auth_mode``);
    - is ``key``/``keys`` right after ``api``, ``access``, ``private``, ``secret``, ``signing``,
      ``encryption``, ``ssh``, ``master``, ``license``, ``account`` or ``session`` (``WANDB_API_KEY``,
      ``aws_secret_access_key``); any other key is a data key (``key_dim``, ``num_keys``, ``rng_key``);
    - is ``token`` as the last word, unless the word before it names a vocabulary token or a count
      (``pad``, ``bos``, ``eos``, ``eot``, ``sos``, ``sot``, ``unk``, ``sep``, ``cls``, ``mask``,
      ``start``, ``end``, ``stop``, ``special``, ``image``, ``video``, ``audio``, ``vision``, ``max``,
      ``min``, ``num``, ``n``): ``hf_token`` and ``auth_token`` are secret; ``pad_token``,
      ``pad_token_id``, ``max_tokens``, ``token_budget`` and ``tokenizer`` are not.

    A name the rule misses (``openai_key``) is declared with :func:`secret_field`; a field the rule catches
    by mistake (``auth_mode``) is kept public with ``attrs.field(..., metadata={"secret": False})``.

    :param name: A key, dotted or not, e.g. ``"db.password"`` or ``"apiKey"``.
    :returns: Whether values under that name are secret.

    >>> [is_secret_name(n) for n in ("api_key", "apiKey", "db.password", "hf_token", "credentials")]
    [True, True, True, True, True]
    >>> [is_secret_name(n) for n in ("max_tokens", "pad_token_id", "tokenizer", "keypoint_weight", "key_dim")]
    [False, False, False, False, False]
    """
    return any(_secret_segment(segment) for segment in str(name).split("."))


def secret_field(*, default: Any = attrs.NOTHING, metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Declare a config field whose value is a secret (an API key, a password, a token).

    Pure. The field is an ordinary ``attrs`` field: your code reads ``cfg.api_key`` as the plain value, and
    :meth:`~trainkit.Config.from_mapping`, :meth:`~trainkit.Config.with_overrides` and ``to_dict`` treat it
    like any other key. What changes: :func:`public_config` leaves it out of checkpoints and W&B, the
    command line W&B records shows ``***`` for it, its value is masked in ``repr(cfg)``, and a
    :class:`~trainkit.ConfigError` about it does not quote the value. A field whose name is already secret
    by :func:`is_secret_name` needs no declaration, but declaring it also masks its ``repr``.

    :param default: The default value; without one the key is required.
    :param metadata: Extra ``attrs`` metadata; ``"secret": True`` is added.
    :param kwargs: Passed on to :func:`attrs.field` (``validator``, ``converter``, ``factory``, ...).
    :returns: The field, for a class body.

    >>> @attrs.frozen(kw_only=True)
    ... class HubConfig(Config):
    ...     hub_login: str | None = secret_field(default=None)
    >>> cfg = HubConfig.from_mapping({"epochs": 1}, ["hub_login=hunter2"])
    >>> cfg.hub_login, "hub_login" in public_config(cfg), "hunter2" in repr(cfg)
    ('hunter2', False, False)
    """
    return attrs.field(default=default, metadata={**(metadata or {}), "secret": True}, repr=_masked_repr, **kwargs)


def _masked_repr(value: Any) -> str:
    return "None" if value is None else repr(SECRET_MASK)


def _config_class(config: Any) -> type | None:
    if config is None:
        return None
    cls = config if isinstance(config, type) else type(config)
    return cls if attrs.has(cls) else None


def _field_is_secret(field: attrs.Attribute) -> bool:
    if "secret" in field.metadata:
        return bool(field.metadata["secret"])
    return _secret_segment(field.name)


def is_secret_key(key: str, config: Any = None) -> bool:
    """Say whether a dotted key holds a secret, in a config or anywhere else.

    Pure. Along the config's fields a field's declaration decides (:func:`secret_field`, or
    ``metadata={"secret": False}`` to keep a field public whatever its name), and an undeclared field is
    judged by its name (:func:`is_secret_name`); a secret section makes every key under it secret. Beyond
    the config's fields (keys inside a dict value, keys the config does not have) the name rule decides.

    :param key: The dotted key, e.g. ``"wandb_api_key"`` or ``"db.password"``.
    :param config: A config record or its class; None judges by the name rule alone.
    :returns: Whether the key's value must be kept out of files, logs and messages.

    >>> is_secret_key("passwd"), is_secret_key("val.patience", Config), is_secret_key("headers.Authorization")
    (True, False, True)
    """
    return _walk_key(_config_class(config), str(key).split("."))[0]


@functools.cache
def _field_secrecy(cls: type) -> dict[str, tuple[bool, type | None]]:
    """Per field of a config class: whether it is secret, and the record class of its value (None: not a record)."""
    hints = _hints(cls)
    secrecy = {}
    for field in attrs.fields(cls):
        tp = hints.get(field.name)
        secrecy[field.name] = (_field_is_secret(field), tp if tp is not None and attrs.has(tp) else None)
    return secrecy


def _walk_key(cls: type | None, segments: list[str]) -> tuple[bool, type | None]:
    """:func:`is_secret_key` for a key's segments read from ``cls`` down: (secret, the record class it names).

    Where a segment is no field (or ``cls`` is None) the name rule decides for it and every segment after it.
    """
    for depth, segment in enumerate(segments):
        fields = _field_secrecy(cls) if cls is not None else {}
        field = fields.get(segment) or fields.get(segment.replace("-", "_"))
        if field is None:
            return any(_secret_segment(rest) for rest in segments[depth:]), None
        secret, cls = field
        if secret:
            return True, None
    return False, cls


def _mask_url_userinfo(match: re.Match[str]) -> str:
    if match["lone"] is not None:
        return f"{match['scheme']}{SECRET_MASK}@"
    return f"{match['scheme']}{match['user']}:{SECRET_MASK}@"


def _mask_pair(match: re.Match[str]) -> str:
    if is_secret_name(match["name"].lstrip("-")):
        return f"{match['name']}={SECRET_MASK}"
    return match[0]


def redact_text(text: str) -> str:
    """Mask the credentials inside a string: URL passwords and ``name=value`` pairs with a secret name.

    Pure. In a URL with a scheme the password becomes ``***`` (``postgres://bob:***@host/db``), and a
    user name without a password, which is often a token (``https://ghp_x@github.com``), becomes ``***``
    itself. A ``name=value`` pair at the start of the text, after a space or after ``?``, ``&`` or ``;``
    (URL queries, connection strings, command-line words) has its value masked up to the next ``&``,
    ``;``, ``#`` or space when :func:`is_secret_name` says the name is secret. Masking twice changes nothing.

    :param text: Any string.
    :returns: The string with those parts replaced by ``***``.

    >>> redact_text("postgres://bob:hunter2@db.example.com:5432/runs")
    'postgres://bob:***@db.example.com:5432/runs'
    >>> redact_text("https://api.example.com/v1?model=x&api_key=abc123&lang=en")
    'https://api.example.com/v1?model=x&api_key=***&lang=en'
    """
    if "@" in text:
        text = _URL_USERINFO.sub(_mask_url_userinfo, text)
    if "=" in text:
        text = _PAIR.sub(_mask_pair, text)
    return text


def strip_secrets(data: Any, config: Any = None) -> Any:
    """Copy plain data without its secrets: secret keys dropped, credentials in strings masked, recursively.

    Pure. A mapping entry is dropped when :func:`is_secret_key` says its dotted key (from the top of
    ``data``) is secret for ``config``; every string left is passed through :func:`redact_text`; tuples
    become lists. Use it on plain data from elsewhere (an old checkpoint's config); for a config record,
    :func:`public_config` says the same in one call.

    :param data: Nested mappings, lists and plain values, e.g. ``cfg.to_dict()``.
    :param config: The config record (or class) whose declarations apply; None judges by name alone.
    :returns: The copy.

    >>> strip_secrets({"db_url": "mysql://u:pw@h/db", "passwd": "x", "max_tokens": 512})
    {'db_url': 'mysql://u:***@h/db', 'max_tokens': 512}
    """
    return _strip(data, _config_class(config))


def _strip(data: Any, cls: type | None) -> Any:
    # each key judged from the record class of its level down, which is is_secret_key on its dotted path
    if isinstance(data, Mapping):
        out = {}
        for key, value in data.items():
            secret, below = _walk_key(cls, str(key).split("."))
            if not secret:
                out[key] = _strip(value, below)
        return out
    if isinstance(data, list | tuple):
        return [_strip(value, cls) for value in data]
    if isinstance(data, str):
        return redact_text(data)
    return data


def public_config(cfg: Config) -> dict[str, Any]:
    """Return the config as the plain dict that may be saved and logged: ``to_dict()`` without its secrets.

    Pure. Secret keys (:func:`is_secret_key`: declared with :func:`secret_field`, or named like a secret)
    are left out, not replaced by a placeholder: a placeholder would read back as a real value
    (``from_mapping`` would set the password to ``"***"``), and a secret's change cannot be reported without
    showing it either way. Every other key is kept, with URL credentials in its strings masked
    (:func:`redact_text`). The trainer writes this dict into every checkpoint and W&B's config panel.

    :param cfg: The config record.
    :returns: The nested dict of plain values.

    >>> @attrs.frozen(kw_only=True)
    ... class DbConfig(Config):
    ...     db_url: str = "postgres://bob:hunter2@host/db"
    ...     db_password: str = "hunter2"
    ...     max_tokens: int = 512
    >>> public = public_config(DbConfig(epochs=1))
    >>> public["db_url"], "db_password" in public, public["max_tokens"]
    ('postgres://bob:***@host/db', False, 512)
    """
    return strip_secrets(cfg.to_dict(), cfg)


def render_value(key: str, value: Any, config: Any = None) -> str:
    """Render a config value for a printed message, as ``repr`` does, with secrets masked.

    Pure. A secret key (:func:`is_secret_key`) renders as ``'***'`` whatever its value; any other value is
    rendered after :func:`strip_secrets`, so a URL's password or a secret-named entry inside it never shows.

    :param key: The value's dotted key.
    :param value: The value.
    :param config: The config record (or class) whose declarations apply; None judges by name alone.
    :returns: The text for the message.

    >>> render_value("passwd", "hunter2"), render_value("db_url", "redis://:pw@cache:6379"), render_value("lr", 0.1)
    ("'***'", "'redis://:***@cache:6379'", '0.1')
    """
    secret, below = _walk_key(_config_class(config), str(key).split("."))
    return repr(SECRET_MASK) if secret else repr(_strip(value, below))


def redact_argv(argv: Sequence[str], config: Any = None) -> list[str]:
    """Mask the secrets in command-line words, as a copy for a record of how a run was started.

    Pure. A ``key=value`` or ``--key=value`` word whose key is secret (:func:`is_secret_key` for
    ``config``, so declared fields count) keeps its key and shows ``***`` as the whole value; the word after
    a flag with a secret name (``--api-key VALUE``) or an empty secret override (``api_key= VALUE``) becomes
    ``***``; every other word goes through
    :func:`redact_text`, which masks URL credentials.

    :param argv: The words, e.g. ``sys.argv[1:]``.
    :param config: The config record (or class) the overrides are for; None judges by name alone.
    :returns: The masked words, one per word.

    >>> redact_argv(["conf.yaml", "epochs=3", "api_key=abc", "--token", "xyz", "db=pg://u:pw@h/d"])
    ['conf.yaml', 'epochs=3', 'api_key=***', '--token', '***', 'db=pg://u:***@h/d']
    """
    cls = _config_class(config)
    out: list[str] = []
    mask_next = False
    for word in map(str, argv):
        if mask_next and not word.startswith("-"):
            out.append(SECRET_MASK)
            mask_next = False
            continue
        mask_next = False
        name, sep, value = word.partition("=")
        bare = name.strip().lstrip("-")
        if sep and bare and is_secret_key(bare, cls):
            out.append(f"{name}={SECRET_MASK}")
            mask_next = not value  # a shell split ``api_key= VALUE`` in two
        elif sep and bare:
            out.append(f"{name}={redact_text(value)}")
        elif not sep and word.startswith("-") and bare and is_secret_key(bare, cls):
            out.append(word)
            mask_next = True
        else:
            out.append(redact_text(word))
    return out


def _hide_if_secret(exc: ConfigError, key: str, config: Any) -> ConfigError:
    """The same error without its value when ``key`` is secret, so a message never quotes a secret."""
    if not is_secret_key(key, config) or (not exc.show_value and exc.value is None):
        return exc
    return ConfigError(exc.key, exc.rule, hint=exc.hint, show_value=False)


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
    ``every_n_steps`` also writes ``last.pt`` every that many optimizer steps, at a step boundary inside the
    epoch, so a kill loses at most that many steps and a resume continues from the same batch (for a loop
    that iterates ``self.progress(loader)``); with it set, a stop signal stops at the next step boundary
    instead of the epoch's end. None (the default) keeps checkpoints at epoch ends only.
    ``format`` is ``"file"`` (``last.pt``/``best.pt``, written whole by rank 0) or ``"sharded"``
    (``last.ckpt/``/``best.ckpt/`` directories in which every rank writes its own shards through
    ``torch.distributed.checkpoint``; needed for a model wrapped by ``make_fsdp``, and resumable on another
    number of processes at an epoch boundary). See :mod:`trainkit.sharded`.
    ``keep`` also keeps checkpoints under ``checkpoints/step-<step>.pt`` (``step-<step>.ckpt/`` directories with
    ``format="sharded"``), deleting the older ones no rule keeps: rules such as
    ``"latest:3,every_steps:1000,best:2"`` (a string or a list; see :func:`~trainkit.bookkeeping.parse_keep`).
    Empty (the default) keeps only ``last``/``best`` and their ``.prev`` copies.
    """

    enable: bool = True
    resume: str = attrs.field(default="auto", validator=_non_empty)
    requeue_signal: str | None = attrs.field(default="SIGUSR1", validator=_optional(_signal_name))
    async_save: bool = False
    every_n_steps: int | None = attrs.field(default=None, validator=_optional(_at_least(1)))
    format: str = attrs.field(default="file", validator=_one_of("file", "sharded"))
    keep: tuple[str, ...] = attrs.field(default=(), converter=_keep_items, validator=_keep_rules)


@attrs.frozen(kw_only=True)
class WandbConfig(_Section):
    """``wandb.*``: the W&B run; ``mode`` is ``"offline"`` (local files), ``"online"`` or ``"disabled"``."""

    mode: str = attrs.field(default="offline", validator=_one_of(*WANDB_MODES))
    project: str | None = attrs.field(default="trainkit", validator=_optional(_wandb_project))
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_wandb_tags)


@attrs.frozen(kw_only=True)
class ProgressConfig(_Section):
    """``progress.*``: tqdm bars on rank 0."""

    enable: bool = True


@attrs.frozen(kw_only=True)
class DistConfig(_Section):
    """``dist.*``: the process group; every collective is bounded by ``timeout_s``."""

    backend: str = attrs.field(default="auto", validator=_one_of("auto", "gloo", "nccl"))
    timeout_s: float = attrs.field(default=300.0, validator=_positive)


GUARD_NONFINITE = ("off", "raise", "skip", "rollback")
"""The ``guard.nonfinite`` choices."""

_SKIP_BATCH = re.compile(r"^(0|[1-9][0-9]{0,17}):(0|[1-9][0-9]{0,17})$")


def _skip_batches(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    for item in value if isinstance(value, tuple) else ():
        if not isinstance(item, str) or not _SKIP_BATCH.match(item):
            raise ConfigError(
                attribute.name, "must be a list of 'EPOCH:BATCH' strings (0-based ints, e.g. '0:3')", item
            )


def skip_batches(cfg: GuardConfig) -> dict[int, frozenset[int]]:
    """``guard.skip_batches`` as batch positions per epoch.

    >>> skip_batches(GuardConfig(skip_batches=["0:3", "0:5", "2:0"]))
    {0: frozenset({3, 5}), 2: frozenset({0})}
    """
    skips: dict[int, frozenset[int]] = {}
    for item in cfg.skip_batches:
        epoch, batch = map(int, item.split(":"))
        skips[epoch] = skips.get(epoch, frozenset()) | {batch}
    return skips


@attrs.frozen(kw_only=True)
class GuardConfig(_Section):
    """``guard.*``: the divergence guard, acting on optimizer steps whose total grad norm is not finite.

    ``nonfinite`` is ``"off"`` (the default: nothing is installed), ``"raise"`` (stop before the optimizer step
    with an error naming the step and the batch) or ``"skip"`` (drop the step: no parameter or optimizer-state
    update; counted as ``guard/skipped_steps``). With ``max_skips`` set, ``"skip"`` raises instead once that many
    non-finite steps fall within ``window`` optimizer steps; ``"rollback"`` skips as ``"skip"`` until then, and
    then reloads the newest checkpoint before the first of them and goes on with their batches left out.
    ``skip_batches`` (``"EPOCH:BATCH"`` strings) leaves those batch positions out of the counted loop, as a
    rollback does (how a rerun skips the batches a rollback skipped). See :mod:`trainkit.guard`.
    """

    nonfinite: str = attrs.field(default="off", validator=_one_of(*GUARD_NONFINITE))
    max_skips: int | None = attrs.field(default=None, validator=_optional(_at_least(1)))
    window: int = attrs.field(default=100, validator=_at_least(1))
    skip_batches: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_skip_batches)


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
    log_throughput: bool = False
    wandb: WandbConfig = _section(WandbConfig)
    progress: ProgressConfig = _section(ProgressConfig)
    dist: DistConfig = _section(DistConfig)
    guard: GuardConfig = _section(GuardConfig)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


RESUME_SAFE_KEYS = frozenset(
    key
    for key in all_keys(Config)
    if key.split(".")[0] in ("epochs", "out_dir", "ckpt", "wandb", "progress", "dist", "test", "guard")
    or key in ("log_stats_every_n_steps", "log_weight_stats", "log_grad_stats", "log_throughput")
)
"""The engine's config keys that may change between a run and its resume without changing what it computes.

Exact keys, not prefixes: a user's ``epochs_warmup`` or ``log_temperature`` is compared like any other key.
"""

RETUNED_KEYS = frozenset({"val.patience", "val.start_patience", "val.min_delta"})
"""Keys a resume applies to the records it restores (see :func:`~trainkit.bookkeeping.reconcile`)."""


_MAY_CHANGE_ON_RESUME = RESUME_SAFE_KEYS | RETUNED_KEYS


def changed_on_resume(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Compare the config a checkpoint holds with the one a run resumes under.

    Pure. Keys in :data:`RESUME_SAFE_KEYS` and :data:`RETUNED_KEYS` are left out: they may change.

    >>> changed_on_resume({"lr": 0.1, "epochs": 3, "val": {"minimize": True}}, {"lr": 0.2, "epochs": 5, "val": {}})
    [('lr', 0.1, 0.2), ('val.minimize', True, '<absent>')]

    :param saved: The saved config (plain, without secrets).
    :param current: The current config, the same way.
    :returns: ``(dotted key, saved value, current value)`` for each changed key, sorted; ``'<absent>'`` stands
        for a missing key.
    """
    old, new = _flatten(saved), _flatten(current)
    return [
        (key, old.get(key, "<absent>"), new.get(key, "<absent>"))
        for key in sorted(set(old) | set(new))
        if old.get(key, "<absent>") != new.get(key, "<absent>") and key not in _MAY_CHANGE_ON_RESUME
    ]
