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

import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import attrs

from trainkit.config.overrides import all_keys, apply_overrides, plain_tree, unknown_key
from trainkit.config.rules import (
    at_least,
    build_plan,
    field_checks,
    keep_items,
    keep_rules,
    non_empty,
    one_of,
    optional_rule,
    patience_rule,
    positive,
    remote_options,
    remote_url,
    signal_name,
    to_tuple,
    type_name,
    wandb_project,
    wandb_tags,
    within,
)
from trainkit.config.secrets import field_types, hide_if_secret, is_secret_key, strip_secrets
from trainkit.errors import ConfigError

__all__ = [
    "Config",
    "public_config",
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
    "ThroughputConfig",
    "DEFAULT_NO_WEIGHT_DECAY",
]

C = TypeVar("C", bound="Section")

DEFAULT_NO_WEIGHT_DECAY = ("bias", "norm", "_emb")
"""Name fragments that exempt a parameter from weight decay: biases, norm layers and ``*_emb`` tables."""

WANDB_MODES = ("offline", "online", "disabled")


@attrs.frozen(kw_only=True)
class Section:
    """Shared machinery of every config record: type checks, dict round trips, mapping construction."""

    def __attrs_post_init__(self) -> None:
        for name, tp, check in field_checks(type(self)):
            value = getattr(self, name)
            if not check(value):
                secret = is_secret_key(name, self)
                raise ConfigError(name, f"must be {type_name(tp)}", None if secret else value, show_value=not secret)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a nested dict of plain values (tuples become lists).

        :returns: A dict that :meth:`from_mapping` turns back into an equal config.
        """
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, Section):
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
        data = plain_tree(mapping) if isinstance(mapping, Mapping) else mapping
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


def _build(cls: type[C], mapping: Any, *, prefix: str, root: type, root_prefix: str = "") -> C:
    if isinstance(mapping, cls):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", "must be a mapping", mapping)
    fields = attrs.fields_dict(cls)
    plan = build_plan(cls)
    kwargs: dict[str, Any] = {}
    for raw_key, value in mapping.items():
        key = str(raw_key)
        if key not in fields:
            raise unknown_key(root, prefix + key, root_prefix)
        kind = plan[key]
        if kind == "section":
            try:
                section = field_types(cls)[key]
                value = _build(section, value, prefix=f"{prefix}{key}.", root=root, root_prefix=root_prefix)
            except ConfigError as exc:
                raise hide_if_secret(exc, key, cls) from None
        elif kind == "tuple":
            value = to_tuple(value)
        kwargs[key] = value
    missing = [name for name, field in fields.items() if field.default is attrs.NOTHING and name not in kwargs]
    if missing:
        raise ConfigError(prefix + missing[0], "is required", show_value=False)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise hide_if_secret(exc, exc.key, cls).with_prefix(prefix.rstrip(".")) from None
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


@attrs.frozen(kw_only=True)
class ValConfig(Section):
    """``val.*``: the validation schedule, the selection direction and early stopping."""

    every_n_epochs: int = attrs.field(default=1, validator=at_least(1))
    every_n_steps: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    minimize: bool = False
    patience: int | None = attrs.field(default=None, validator=optional_rule(patience_rule))
    start_patience: int = attrs.field(default=0, validator=at_least(0))
    min_delta: float = attrs.field(default=0.0, validator=at_least(0))


@attrs.frozen(kw_only=True)
class TestConfig(Section):
    """``test.*``: whether ``train()`` ends with ``test()`` on the best weights."""

    __test__ = False  # a config record, not a pytest test class

    enable: bool = False


MAX_REMOTE_WAIT_S = 86_400.0
"""``ckpt.remote_wait_s`` at most: a day (a longer wait is a hung run; the clock and ``Condition.wait`` take it)."""
MIN_REMOTE_LEASE_S = 0.1
"""``ckpt.remote_lease_s`` at least: renewed every third of it, a shorter lease is a request storm on the store."""
MAX_REMOTE_LEASE_S = 86_400.0
"""``ckpt.remote_lease_s`` at most: a day (a killed run's lease blocks its prefix this long)."""


@attrs.frozen(kw_only=True)
class CkptConfig(Section):
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
    number of processes at an epoch boundary). See :mod:`trainkit.checkpoint.formats.dcp_directory`.
    ``keep`` also keeps checkpoints under ``checkpoints/step-<step>.pt`` (``step-<step>.ckpt/`` directories with
    ``format="sharded"``), deleting the older ones no rule keeps: rules such as
    ``"latest:3,every_steps:1000,best:2"`` (a string or a list; see :func:`~trainkit.bookkeeping.parse_keep`).
    Empty (the default) keeps only ``last``/``best`` and their ``.prev`` copies.
    ``remote`` is an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///...``) every published checkpoint
    is copied to in the background, and that ``resume="auto"`` also looks in; ``remote_options`` are extra
    options for its filesystem (never credentials, nor credentials in the URL), ``remote_wait_s`` (at most a day)
    bounds the wait for the last upload at the run's end, ``remote_lease_s`` (0.1 s to a day) is how long the run's
    claim on the prefix lasts unless renewed.
    See :mod:`trainkit.checkpoint.remote`.
    """

    enable: bool = True
    resume: str = attrs.field(default="auto", validator=non_empty)
    requeue_signal: str | None = attrs.field(default="SIGUSR1", validator=optional_rule(signal_name))
    async_save: bool = False
    every_n_steps: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    format: str = attrs.field(default="file", validator=one_of("file", "sharded"))
    keep: tuple[str, ...] = attrs.field(default=(), converter=keep_items, validator=keep_rules)
    remote: str | None = attrs.field(default=None, validator=optional_rule(remote_url))
    remote_options: Any = attrs.field(factory=dict, validator=remote_options)
    remote_wait_s: float = attrs.field(default=300.0, validator=within(0, MAX_REMOTE_WAIT_S))
    remote_lease_s: float = attrs.field(default=60.0, validator=within(MIN_REMOTE_LEASE_S, MAX_REMOTE_LEASE_S))


@attrs.frozen(kw_only=True)
class WandbConfig(Section):
    """``wandb.*``: the W&B run; ``mode`` is ``"offline"`` (local files), ``"online"`` or ``"disabled"``."""

    mode: str = attrs.field(default="offline", validator=one_of(*WANDB_MODES))
    project: str | None = attrs.field(default="trainkit", validator=optional_rule(wandb_project))
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = attrs.field(default=(), converter=to_tuple, validator=wandb_tags)


@attrs.frozen(kw_only=True)
class ProgressConfig(Section):
    """``progress.*``: tqdm bars on rank 0.

    ``plain_interval_s``: when stderr is not a terminal (a job's log file), a run with ``max_steps`` prints a plain
    ``trainkit: step N/max_steps ...`` line at most every this many seconds (and one at the end) instead of a bar.
    """

    enable: bool = True
    plain_interval_s: float = attrs.field(default=30.0, validator=positive)


@attrs.frozen(kw_only=True)
class DistConfig(Section):
    """``dist.*``: the process group; every collective is bounded by ``timeout_s``."""

    backend: str = attrs.field(default="auto", validator=one_of("auto", "gloo", "nccl"))
    timeout_s: float = attrs.field(default=300.0, validator=positive)


GUARD_NONFINITE = ("off", "raise", "skip", "rollback")
"""The ``guard.nonfinite`` choices."""

_SKIP_BATCH = re.compile(r"(0|[1-9][0-9]{0,17}):(0|[1-9][0-9]{0,17})")  # fullmatch: "$" admits "0:1\n"


def _skip_batches(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    for item in value if isinstance(value, tuple) else ():
        if not isinstance(item, str) or not _SKIP_BATCH.fullmatch(item):
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
class GuardConfig(Section):
    """``guard.*``: the divergence guard, acting on optimizer steps whose total grad norm is not finite.

    ``nonfinite`` is ``"off"`` (the default: nothing is installed), ``"raise"`` (stop before the optimizer step
    with an error naming the step and the batch) or ``"skip"`` (drop the step: no parameter or optimizer-state
    update; counted as ``guard/skipped_steps``). With ``max_skips`` set, ``"skip"`` raises instead once that many
    non-finite steps fall within ``window`` optimizer steps; ``"rollback"`` skips as ``"skip"`` until then, and
    then reloads the newest checkpoint before the first of them and goes on with their batches left out, at most
    ``max_rollbacks`` times in a row to the same checkpoint (then it stops with a
    :class:`~trainkit.DivergenceError`). ``skip_batches`` (``"EPOCH:BATCH"`` strings) leaves those
    batch positions out of the counted loop, as a rollback does (how a rerun skips the batches a rollback
    skipped). See :mod:`trainkit.loop.divergence_guard`.
    """

    nonfinite: str = attrs.field(default="off", validator=one_of(*GUARD_NONFINITE))
    max_skips: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    window: int = attrs.field(default=100, validator=at_least(1))
    max_rollbacks: int = attrs.field(default=5, validator=at_least(1))
    skip_batches: tuple[str, ...] = attrs.field(default=(), converter=to_tuple, validator=_skip_batches)


@attrs.frozen(kw_only=True)
class ThroughputConfig(Section):
    """``throughput.*``: the model FLOPs utilization, ``perf/mfu``, in the rows with ``perf/*`` rates.

    ``mfu`` turns it on (and the rates with it, as ``log_throughput`` does). The model FLOPs of a sample are
    ``flops_per_sample`` (forward and backward, without recomputation), or, when None, counted once on the
    second batch of the training loop (three times its forward FLOPs; see :mod:`trainkit.loop.flops`). One
    device's peak FLOP/s is ``peak_flops``, or, when None, a CUDA device's dense peak from
    :data:`~trainkit.bookkeeping.PEAK_FLOPS` in ``dtype`` (``"auto"``: the dtype the counted batch's matrix
    multiplies ran in; fp32 counts as tf32 where torch lets them use TF32); a CPU has none.
    """

    mfu: bool = False
    flops_per_sample: float | None = attrs.field(default=None, validator=optional_rule(positive))
    peak_flops: float | None = attrs.field(default=None, validator=optional_rule(positive))
    dtype: str = attrs.field(default="auto", validator=one_of("auto", "fp32", "tf32", "bf16", "fp16", "fp8"))


@attrs.frozen(kw_only=True)
class Config(Section):
    """The engine's configuration. Subclass it (with ``@attrs.frozen(kw_only=True)``) to add your own keys.

    >>> cfg = Config(epochs=10)
    >>> cfg.val.every_n_epochs, cfg.ckpt.resume, cfg.wandb.mode
    (1, 'auto', 'offline')
    >>> Config.from_mapping(cfg.to_dict()) == cfg
    True
    """

    epochs: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    seed: int = 0
    out_dir: str = attrs.field(default="runs/default", validator=non_empty)
    val: ValConfig = _section(ValConfig)
    test: TestConfig = _section(TestConfig)
    ckpt: CkptConfig = _section(CkptConfig)
    max_steps: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    no_weight_decay: tuple[str, ...] = attrs.field(default=DEFAULT_NO_WEIGHT_DECAY, converter=to_tuple)
    grad_clip: float | None = attrs.field(default=None, validator=optional_rule(positive))
    log_stats_every_n_steps: int = attrs.field(default=100, validator=at_least(1))
    log_every_n_steps: int | None = attrs.field(default=None, validator=optional_rule(at_least(1)))
    log_weight_stats: bool = False
    log_grad_stats: bool = False
    log_throughput: bool = False
    wandb: WandbConfig = _section(WandbConfig)
    progress: ProgressConfig = _section(ProgressConfig)
    dist: DistConfig = _section(DistConfig)
    guard: GuardConfig = _section(GuardConfig)
    throughput: ThroughputConfig = _section(ThroughputConfig)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.epochs is None and self.max_steps is None:
            hint = "or max_steps: the run's length is epochs, max_steps, or both"
            raise ConfigError("epochs", "is required", show_value=False, hint=hint)


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
    if key.split(".")[0]
    in ("epochs", "max_steps", "out_dir", "ckpt", "wandb", "progress", "dist", "test", "guard", "throughput")
    or key in ("log_stats_every_n_steps", "log_every_n_steps", "log_weight_stats", "log_grad_stats", "log_throughput")
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
