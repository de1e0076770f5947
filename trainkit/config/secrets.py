"""Which config keys are secret, and text and values with them masked.

Pure: stdlib and attrs only. A field is secret when declared with :func:`secret_field` or named like one
(:func:`is_secret_name`); :func:`strip_secrets` leaves such keys out of what is saved and logged, and
:func:`redact_text` / :func:`redact_argv` mask them (and URL userinfo) in free text and command lines.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trainkit.errors import ConfigError

__all__ = [
    "is_secret_name",
    "secret_field",
    "is_secret_key",
    "redact_text",
    "has_url_userinfo",
    "strip_secrets",
    "render_value",
    "redact_argv",
    "SECRET_MASK",
]


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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


_URL_USERINFO = re.compile(  # ``:/{2,}``: ``s3:///KEY:SECRET@bucket`` is still userinfo to s3fs
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*:/{2,})(?:(?P<user>[^\s:/?#@]*):(?P<password>\S*)|(?P<lone>[^\s:/?#@]+))@"
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
    like any other key. What changes: :func:`~trainkit.config.public_config` leaves it out of checkpoints and W&B, the
    command line W&B records shows ``***`` for it, its value is masked in ``repr(cfg)``, and a
    :class:`~trainkit.ConfigError` about it does not quote the value. A field whose name is already secret
    by :func:`is_secret_name` needs no declaration, but declaring it also masks its ``repr``.

    :param default: The default value; without one the key is required.
    :param metadata: Extra ``attrs`` metadata; ``"secret": True`` is added.
    :param kwargs: Passed on to :func:`attrs.field` (``validator``, ``converter``, ``factory``, ...).
    :returns: The field, for a class body.

    >>> from trainkit.config import Config, public_config
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

    >>> from trainkit.config import Config
    >>> is_secret_key("passwd"), is_secret_key("val.patience", Config), is_secret_key("headers.Authorization")
    (True, False, True)
    """
    return _walk_key(_config_class(config), str(key).split("."))[0]


@functools.cache
def _field_secrecy(cls: type) -> dict[str, tuple[bool, type | None]]:
    """Per field of a config class: whether it is secret, and the record class of its value (None: not a record)."""
    hints = field_types(cls)
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


_QUERY_SIGNATURES = frozenset({"sig", "signature", "credential"})
"""Words that make a URL query's parameter a credential (``?sig=`` of an Azure SAS, ``X-Amz-Signature``,
``X-Amz-Credential``, ``X-Goog-Signature``), though not a config key's name (``signature_dim``)."""


def _mask_pair(match: re.Match[str]) -> str:
    name = match["name"].lstrip("-")
    in_query = match.start() > 0 and match.string[match.start() - 1] in "?&"
    if is_secret_name(name) or (in_query and _QUERY_SIGNATURES.intersection(_words(name.replace(".", "_")))):
        return f"{match['name']}={SECRET_MASK}"
    return match[0]


def redact_text(text: str) -> str:
    """Mask the credentials inside a string: URL passwords and ``name=value`` pairs with a secret name.

    Pure. In a URL with a scheme the password becomes ``***`` (``postgres://bob:***@host/db``), and a
    user name without a password, which is often a token (``https://ghp_x@github.com``), becomes ``***``
    itself. A ``name=value`` pair at the start of the text, after a space or after ``?``, ``&`` or ``;``
    (URL queries, connection strings, command-line words) has its value masked up to the next ``&``,
    ``;``, ``#`` or space when :func:`is_secret_name` says the name is secret, and so has a URL query's
    signature (``sig``, ``signature`` or ``credential`` among its words). Masking twice changes nothing.

    :param text: Any string.
    :returns: The string with those parts replaced by ``***``.

    >>> redact_text("postgres://bob:hunter2@db.example.com:5432/runs")
    'postgres://bob:***@db.example.com:5432/runs'
    >>> redact_text("https://api.example.com/v1?model=x&api_key=abc123&lang=en")
    'https://api.example.com/v1?model=x&api_key=***&lang=en'
    >>> redact_text("az://c/p?sv=2022&sig=c2VjcmV0&se=2026"), redact_text("s3://b/k?X-Amz-Signature=f00d")
    ('az://c/p?sv=2022&sig=***&se=2026', 's3://b/k?X-Amz-Signature=***')
    """
    if "@" in text:
        text = _URL_USERINFO.sub(_mask_url_userinfo, text)
    if "=" in text:
        text = _PAIR.sub(_mask_pair, text)
    return text


def has_url_userinfo(url: str) -> bool:
    """Say whether a URL carries credentials before its host (``scheme://user:password@host``, ``scheme://token@``).

    Pure. The same rule :func:`redact_text` masks by, anywhere in the URL: whatever :func:`redact_text` would
    mask, this calls userinfo (a password may hold ``/``, as secret keys do; a chained URL such as
    ``simplecache::s3://KEY:SECRET@bucket`` or a third slash, ``s3:///KEY:SECRET@bucket``, hides nothing: fsspec
    hands either to s3fs, which takes ``KEY:SECRET@bucket`` for the bucket and repeats it in its errors).

    :param url: A URL.
    :returns: Whether it has userinfo.

    >>> has_url_userinfo("s3://KEY:SECRET@bucket/runs"), has_url_userinfo("s3://bucket/runs/a@b")
    (True, False)
    >>> has_url_userinfo("s3://KEY:se/cret@bucket/runs"), has_url_userinfo("file:///home/me@site/runs")
    (True, False)
    >>> has_url_userinfo("simplecache::s3://KEY:SECRET@bucket/runs"), has_url_userinfo("s3:///KEY:SECRET@bucket")
    (True, True)
    """
    return _URL_USERINFO.search(url) is not None


def strip_secrets(data: Any, config: Any = None) -> Any:
    """Copy plain data without its secrets: secret keys dropped, credentials in strings masked, recursively.

    Pure. A mapping entry is dropped when :func:`is_secret_key` says its dotted key (from the top of
    ``data``) is secret for ``config``; every string left is passed through :func:`redact_text`; tuples
    become lists. Use it on plain data from elsewhere (an old checkpoint's config); for a config record,
    :func:`~trainkit.config.public_config` says the same in one call.

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


def hide_if_secret(exc: ConfigError, key: str, config: Any) -> ConfigError:
    """The same error without its value when ``key`` is secret, so a message never quotes a secret."""
    if not is_secret_key(key, config) or (not exc.show_value and exc.value is None):
        return exc
    return ConfigError(exc.key, exc.rule, hint=exc.hint, show_value=False)
