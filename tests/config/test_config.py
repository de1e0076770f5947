"""Tests of the configuration records: every error path, dotted overrides, round trips and subclassing."""

from __future__ import annotations

import attrs
import pytest

from trainkit.config import Config, public_config
from trainkit.errors import ConfigError, TrainkitError


@attrs.frozen(kw_only=True)
class MyConfig(Config):
    """A user config: the engine's keys plus the experiment's own."""

    lr: float = 1e-3
    layers: tuple[int, ...] = (64, 64)


def build(**data):
    """Build a Config from a mapping that has the required epochs unless the test overrides it."""
    return Config.from_mapping({"epochs": 1, **data})


def config_error(data, cls=Config) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cls.from_mapping(data)
    return info.value


def override_error(*overrides, cfg=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        (cfg or Config(epochs=1)).with_overrides(overrides)
    return info.value


# ----- unknown keys -------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_closest():
    """A top-level typo is an error naming the key and the closest known key."""
    error = config_error({"epoch": 3})
    assert str(error) == "unknown config key 'epoch'; did you mean 'epochs'?"
    assert (error.key, error.rule) == ("epoch", "is unknown")


def test_unknown_nested_key_suggests_the_closest():
    """A typo inside a section is named by its dotted key, with the closest dotted key suggested."""
    error = config_error({"epochs": 3, "val": {"paitence": 2}})
    assert str(error) == "unknown config key 'val.paitence'; did you mean 'val.patience'?"


def test_unknown_key_in_the_wrong_section_suggests_the_right_one():
    """A known leaf placed in the wrong section points to where it lives."""
    error = config_error({"epochs": 3, "val": {"timeout_s": 2}})
    assert "did you mean 'dist.timeout_s'?" in str(error)


def test_unknown_key_with_no_close_match_lists_the_known_keys():
    """With nothing close, the error lists every known dotted key."""
    error = config_error({"epochs": 3, "zzzzzz": 1})
    assert "known keys: epochs, seed, out_dir, val.every_n_epochs" in str(error)


# ----- types --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"epochs": "3"}, "epochs must be an int or None, got '3'"),
        ({"epochs": True}, "epochs must be an int or None, got True"),
        ({"epochs": 2.0}, "epochs must be an int or None, got 2.0"),
        ({"epochs": 1, "log_weight_stats": 1}, "log_weight_stats must be a bool, got 1"),
        ({"epochs": 1, "val": {"patience": "5"}}, "val.patience must be an int or None, got '5'"),
        ({"epochs": 1, "val": {"min_delta": True}}, "val.min_delta must be a float, got True"),
        ({"epochs": 1, "out_dir": 3}, "out_dir must be a string, got 3"),
        ({"epochs": 1, "no_weight_decay": "bias"}, "no_weight_decay must be a list of a string, got 'bias'"),
        ({"epochs": 1, "wandb": {"tags": [1]}}, "wandb.tags must be a list of a string, got (1,)"),
    ],
    ids=[
        "str-for-int",
        "bool-for-int",
        "float-for-int",
        "int-for-bool",
        "str-for-optional-int",
        "bool-for-float",
        "int-for-str",
        "str-for-list",
        "int-in-list",
    ],
)
def test_wrong_type_names_key_rule_and_value(data, message):
    """A value of the wrong type is an error naming the dotted key, the expected type and the value."""
    assert str(config_error(data)) == message


def test_int_is_accepted_for_float():
    """An int where a float is expected is fine (YAML writes 0 for 0.0)."""
    assert build(weight_decay=0).weight_decay == 0


# ----- ranges -------------------------------------------------------------------------------------

REMOTE_RULE = "ckpt.remote must be a URL with a scheme and a prefix (s3://bucket/prefix, file:///path)"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"epochs": 0}, "epochs must be >= 1, got 0"),
        ({"epochs": 1, "val": {"every_n_epochs": 0}}, "val.every_n_epochs must be >= 1, got 0"),
        ({"epochs": 1, "val": {"start_patience": -1}}, "val.start_patience must be >= 0, got -1"),
        ({"epochs": 1, "val": {"min_delta": -0.1}}, "val.min_delta must be >= 0, got -0.1"),
        ({"epochs": 1, "weight_decay": -0.01}, "weight_decay must be >= 0, got -0.01"),
        ({"epochs": 1, "grad_clip": 0}, "grad_clip must be > 0, got 0"),
        ({"epochs": 1, "grad_clip": -1.0}, "grad_clip must be > 0, got -1.0"),
        ({"epochs": 1, "log_stats_every_n_steps": 0}, "log_stats_every_n_steps must be >= 1, got 0"),
        ({"epochs": 1, "dist": {"timeout_s": 0}}, "dist.timeout_s must be > 0, got 0"),
        ({"epochs": 1, "out_dir": ""}, "out_dir must be a non-empty string, got ''"),
        ({"epochs": 1, "out_dir": "  "}, "out_dir must be a non-empty string, got '  '"),
        ({"epochs": 1, "ckpt": {"resume": ""}}, "ckpt.resume must be a non-empty string, got ''"),
        ({"epochs": 1, "ckpt": {"remote": "bucket/x"}}, f"{REMOTE_RULE}, got 'bucket/x'"),
        ({"epochs": 1, "ckpt": {"remote": "s3://"}}, f"{REMOTE_RULE}, got 's3://'"),
        (
            {"epochs": 1, "ckpt": {"remote_options": [1]}},
            "ckpt.remote_options must be a mapping of option names to values, got [1]",
        ),
        ({"epochs": 1, "ckpt": {"remote_wait_s": -1}}, "ckpt.remote_wait_s must be in [0, 86400], got -1"),
        ({"epochs": 1, "ckpt": {"remote_wait_s": 1e10}}, "ckpt.remote_wait_s must be in [0, 86400], got 10000000000.0"),
        ({"epochs": 1, "ckpt": {"remote_lease_s": 0}}, "ckpt.remote_lease_s must be in [0.1, 86400], got 0"),
        (
            {"epochs": 1, "ckpt": {"remote_lease_s": 1e11}},
            "ckpt.remote_lease_s must be in [0.1, 86400], got 100000000000.0",
        ),
    ],
    ids=[
        "epochs",
        "every_n_epochs",
        "start_patience",
        "min_delta",
        "weight_decay",
        "grad_clip-zero",
        "grad_clip-negative",
        "log_stats_every_n_steps",
        "timeout_s",
        "out_dir-empty",
        "out_dir-blank",
        "resume-empty",
        "remote-no-scheme",
        "remote-no-prefix",
        "remote_options-list",
        "remote_wait_s",
        "remote_wait_s-huge",
        "remote_lease_s",
        "remote_lease_s-huge",
    ],
)
def test_range_rule_names_key_rule_and_value(data, message):
    """A value out of its key's range is an error naming the dotted key, the rule and the value."""
    assert str(config_error(data)) == message


@pytest.mark.parametrize("patience", [0, -1])
def test_patience_below_one_hints_at_one_or_null(patience):
    """val.patience < 1 is refused with a hint to use 1 or null instead."""
    error = config_error({"epochs": 1, "val": {"patience": patience}})
    assert str(error).startswith(f"val.patience must be >= 1 or None, got {patience}; ")
    assert "use 1" in error.hint and "null" in error.hint


def test_patience_none_and_one_are_accepted():
    """val.patience may be None (never stop early) or any int >= 1."""
    assert build(val={"patience": None}).val.patience is None
    assert build(val={"patience": 1}).val.patience == 1


def test_wandb_mode_must_be_a_known_choice():
    """wandb.mode is one of offline, online or disabled, and the error lists them."""
    error = config_error({"epochs": 1, "wandb": {"mode": "cloud"}})
    assert str(error) == "wandb.mode must be one of 'offline', 'online', 'disabled', got 'cloud'"
    for mode in ("offline", "online", "disabled"):
        assert build(wandb={"mode": mode}).wandb.mode == mode


def test_dist_backend_must_be_a_known_choice():
    """dist.backend is one of auto, gloo or nccl."""
    assert "dist.backend must be one of 'auto', 'gloo', 'nccl'" in str(
        config_error({"epochs": 1, "dist": {"backend": "mpi"}})
    )


def test_direct_construction_runs_the_same_rules():
    """Building a record directly checks ranges too, naming the field."""
    with pytest.raises(ConfigError, match="epochs must be >= 1, got 0"):
        Config(epochs=0)


# ----- structure ----------------------------------------------------------------------------------


def test_missing_epochs_is_required():
    """A run needs a length: leaving out both epochs and max_steps is an error naming epochs and the way out."""
    error = config_error({"seed": 1})
    assert str(error) == "epochs is required; or max_steps: the run's length is epochs, max_steps, or both"
    assert (error.key, error.rule) == ("epochs", "is required")


def test_max_steps_alone_is_a_length():
    """max_steps may stand for epochs (a run measured in steps); both may be given; each is checked on its own."""
    assert Config.from_mapping({"max_steps": 10}).epochs is None
    assert Config.from_mapping({"max_steps": 10, "epochs": 2}).max_steps == 10
    error = config_error({"max_steps": 0})
    assert (error.key, error.value) == ("max_steps", 0)
    error = config_error({"epochs": 1, "val": {"every_n_steps": 0}})
    assert (error.key, error.value) == ("val.every_n_steps", 0)
    error = config_error({"epochs": 1, "log_every_n_steps": -3})
    assert (error.key, error.value) == ("log_every_n_steps", -3)


@pytest.mark.parametrize("section", [3, None, [1, 2], "val"])
def test_non_mapping_section_is_refused(section):
    """A section given as something other than a mapping is an error naming the section."""
    error = config_error({"epochs": 1, "val": section})
    assert str(error) == f"val must be a mapping, got {section!r}"


def test_non_mapping_config_is_refused():
    """The whole config must be a mapping too."""
    assert str(config_error([("epochs", 1)])) == "config must be a mapping, got [('epochs', 1)]"


def test_config_error_is_a_value_error_with_key_rule_and_value():
    """ConfigError is a TrainkitError and a ValueError, and carries the key, the rule and the value."""
    with pytest.raises(ValueError) as info:
        Config.from_mapping({"epochs": 1, "val": {"every_n_epochs": 0}})
    error = info.value
    assert isinstance(error, ConfigError) and isinstance(error, TrainkitError)
    assert (error.key, error.rule, error.value) == ("val.every_n_epochs", "must be >= 1", 0)


# ----- overrides ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        ("epochs=7", "epochs", 7),
        ("weight_decay=0.05", "weight_decay", 0.05),
        ("grad_clip=1e-3", "grad_clip", 1e-3),
        ("val.minimize=true", "val.minimize", True),
        ("val.minimize=False", "val.minimize", False),
        ("log_grad_stats=yes", "log_grad_stats", True),
        ("val.patience=null", "val.patience", None),
        ("val.patience=None", "val.patience", None),
        ("val.patience=4", "val.patience", 4),
        ("grad_clip=none", "grad_clip", None),
        ("wandb.tags=a,b", "wandb.tags", ("a", "b")),
        ("wandb.tags=[a, b]", "wandb.tags", ("a", "b")),
        ("wandb.tags=['a', 'b']", "wandb.tags", ("a", "b")),
        ("wandb.tags=[]", "wandb.tags", ()),
        ("wandb.tags=solo", "wandb.tags", ("solo",)),
        ("out_dir=runs/x", "out_dir", "runs/x"),
        ("out_dir='runs/quoted'", "out_dir", "runs/quoted"),
        ("wandb.project=123", "wandb.project", "123"),
        ("wandb.name=a=b", "wandb.name", "a=b"),
        (" seed = 3 ", "seed", 3),
    ],
)
def test_override_values_are_parsed_for_the_key_type(override, path, expected):
    """Override text becomes an int, float, bool, None, list or string according to the key's type."""
    value = Config(epochs=1).with_overrides([override])
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_apply_in_order_and_leave_the_original_unchanged():
    """Later overrides win, and with_overrides returns a new config."""
    cfg = Config(epochs=1)
    new = cfg.with_overrides(["epochs=2", "epochs=3"])
    assert new.epochs == 3 and cfg.epochs == 1


def test_from_mapping_applies_overrides_after_the_mapping():
    """from_mapping's overrides win over the mapping's values."""
    cfg = Config.from_mapping({"epochs": 3, "val": {"patience": 2}}, ["val.patience=5"])
    assert (cfg.epochs, cfg.val.patience) == (3, 5)


def test_an_override_past_a_mapping_field_sets_that_entry_and_keeps_the_others():
    """``ckpt.remote_options.endpoint_url=...`` sets one entry of the options (nested ones too), on top of what the
    mapping gave; a credential set so is refused as any other; an entry under a non-mapping value is refused."""
    base = {"epochs": 1, "ckpt": {"remote_options": {"endpoint_url": "http://a:1", "use_ssl": True}}}
    cfg = Config.from_mapping(
        base, ["ckpt.remote_options.endpoint_url=http://127.0.0.1:9000", "ckpt.remote_options.config_kwargs.retries=3"]
    )
    assert dict(cfg.ckpt.remote_options) == {
        "endpoint_url": "http://127.0.0.1:9000", "use_ssl": True, "config_kwargs": {"retries": 3}
    }  # fmt: skip
    with pytest.raises(ConfigError, match="must not hold credentials") as refused:
        Config.from_mapping({"epochs": 1}, ["ckpt.remote_options.client_kwargs.aws_secret_access_key=hunter2"])
    assert "hunter2" not in str(refused.value)
    with pytest.raises(ConfigError, match="ckpt.remote_options.use_ssl must be a mapping"):
        Config.from_mapping(base, ["ckpt.remote_options.use_ssl.x=1"])


@pytest.mark.parametrize("override", ["val.patience", "=3", "", "  =x"])
def test_malformed_override_is_refused(override):
    """An override without '=' or without a key is an error showing what was given."""
    error = override_error(override)
    assert str(error) == f"override must look like 'dotted.key=value', got {override!r}"


def test_overriding_a_section_is_refused():
    """A section cannot be replaced by an override; the error says to override one of its keys."""
    error = override_error("val=3")
    assert str(error) == "val is a section; override one of its keys, got '3'"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("epoch=3", "unknown config key 'epoch'; did you mean 'epochs'?"),
        ("val.paitence=3", "unknown config key 'val.paitence'; did you mean 'val.patience'?"),
        ("val.patience.x=3", "unknown config key 'val.patience.x'; did you mean 'val.patience'?"),
        ("seed.x=1", "unknown config key 'seed.x'; did you mean 'seed'?"),
    ],
)
def test_unknown_override_key_suggests_the_closest(override, message):
    """An override of an unknown key, at any depth, is an error with a suggestion."""
    assert str(override_error(override)) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("epochs=abc", "epochs must be an int or None, got 'abc'"),
        ("epochs=0", "epochs must be >= 1, got 0"),
        ("val.minimize=maybe", "val.minimize must be a bool (true or false), got 'maybe'"),
        ("val.patience=0", "val.patience must be >= 1 or None, got 0"),
        ("wandb.mode=cloud", "wandb.mode must be one of 'offline', 'online', 'disabled', got 'cloud'"),
    ],
)
def test_override_values_are_checked_like_mapping_values(override, message):
    """An overridden value goes through the same type and range rules as a mapping value."""
    assert str(override_error(override)).startswith(message)


# ----- round trips and subclasses -----------------------------------------------------------------


def test_to_dict_from_mapping_round_trip():
    """to_dict gives plain nested values (lists for tuples) that from_mapping turns back into an equal config."""
    cfg = Config.from_mapping(
        {
            "epochs": 5,
            "seed": 7,
            "val": {"every_n_epochs": 2, "minimize": True, "patience": 3, "start_patience": 1, "min_delta": 0.01},
            "wandb": {"mode": "disabled", "tags": ["a", "b"]},
            "grad_clip": 1.0,
            "no_weight_decay": ["bias"],
        }
    )
    data = cfg.to_dict()
    assert data["wandb"]["tags"] == ["a", "b"]
    assert isinstance(data["val"], dict)
    assert Config.from_mapping(data) == cfg


def test_from_mapping_accepts_built_sections():
    """A section may be given as an already built record instead of a mapping."""
    cfg = Config(epochs=2)
    assert Config.from_mapping({"epochs": 2, "val": cfg.val}) == cfg


def test_subclass_gets_type_checks():
    """A user subclass's own keys are type checked like the engine's."""
    with pytest.raises(ConfigError, match="lr must be a float, got 'fast'"):
        MyConfig.from_mapping({"epochs": 1, "lr": "fast"})
    with pytest.raises(ConfigError, match="lr must be a float, got 'fast'"):
        MyConfig(epochs=1).with_overrides(["lr=fast"])


def test_subclass_gets_unknown_key_errors():
    """A typo of a user key is an error that suggests the user key, in mappings and in overrides."""
    assert str(config_error({"epochs": 1, "lrr": 0.1}, cls=MyConfig)) == "unknown config key 'lrr'; did you mean 'lr'?"
    with pytest.raises(ConfigError, match="did you mean 'layers'"):
        MyConfig(epochs=1).with_overrides(["layer=1,2"])


def test_subclass_round_trips_and_overrides_keep_the_class():
    """A user subclass round-trips through to_dict/from_mapping and overrides return the subclass."""
    cfg = MyConfig.from_mapping({"epochs": 2, "lr": 0.1, "layers": [8, 4]})
    assert cfg.layers == (8, 4)
    assert MyConfig.from_mapping(cfg.to_dict()) == cfg
    new = cfg.with_overrides(["lr=0.5", "layers=[16, 16]", "val.patience=2"])
    assert type(new) is MyConfig
    assert (new.lr, new.layers, new.val.patience) == (0.5, (16, 16), 2)


@pytest.mark.parametrize("key", ["val.min_delta", "weight_decay", "grad_clip", "dist.timeout_s"])
def test_infinite_numbers_are_refused(key):
    """inf passes no range rule: the error names the key and says it must be finite."""
    with pytest.raises(ConfigError, match=rf"{key} must be a finite number, got inf"):
        Config(epochs=1).with_overrides([f"{key}=inf"])


@pytest.mark.parametrize(
    "key", ["val.min_delta", "weight_decay", "grad_clip", "ckpt.remote_wait_s", "ckpt.remote_lease_s", "max_steps"]
)
def test_an_int_too_large_for_a_float_is_refused_not_raised(key):
    """An int of 400 digits (a JSON config or a mapping can hold one) was an OverflowError traceback from the range
    check: it is refused in one line naming the key, by its size (its digits are not printed)."""
    section, _, name = key.rpartition(".")
    mapping = {"epochs": 1, **({section: {name: 10**400}} if section else {name: 10**400})}
    with pytest.raises(ConfigError, match=rf"{key} must be a finite number, got 'an int of 1329 bits'"):
        Config.from_mapping(mapping)


def test_misspelled_section_gets_a_suggestion():
    """A typo in a section name suggests the section."""
    with pytest.raises(ConfigError, match="did you mean 'val'"):
        Config.from_mapping({"epochs": 1, "vall": {"patience": 2}})


@pytest.mark.parametrize(
    ("section", "rule"),
    [
        ({"project": "team/project"}, "must not contain any of"),
        ({"project": "a:b"}, "must not contain any of"),
        ({"project": "x" * 129}, "must be 1 to 128 characters"),
        ({"project": ""}, "must be 1 to 128 characters"),
        ({"tags": ["ok", ""]}, "must hold tags of 1 to 64 characters"),
        ({"tags": ["x" * 65]}, "must hold tags of 1 to 64 characters"),
    ],
)
def test_wandb_names_that_wandb_refuses_are_config_errors(section, rule):
    """A wandb.project or tag that W&B would refuse at start-up is a ConfigError when the config is built."""
    key = "wandb." + next(iter(section))
    with pytest.raises(ConfigError, match=f"{key} {rule}"):
        Config.from_mapping({"epochs": 1, "wandb": section})


def test_a_required_key_may_come_from_an_override_alone():
    """config_from_argv(Cls, ["epochs=2"]) and from_mapping({}, ["epochs=2"]) build: overrides fill required keys."""
    from trainkit.cli import config_from_argv

    assert config_from_argv(Config, ["epochs=2"]).epochs == 2
    cfg = Config.from_mapping({"val": {"patience": 2}}, ["epochs=3", "val.minimize=true"])
    assert (cfg.epochs, cfg.val.patience, cfg.val.minimize) == (3, 2, True)
    with pytest.raises(ConfigError, match="epochs is required"):
        config_from_argv(Config, ["val.patience=2"])


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP"])
def test_a_requeue_signal_that_cannot_be_caught_is_refused(name):
    """ckpt.requeue_signal=SIGKILL would fail only when train() installs its handler: refused up front."""
    error = config_error({"epochs": 1, "ckpt": {"requeue_signal": name}})
    assert "ckpt.requeue_signal" in str(error) and "can catch" in str(error) and name in str(error)


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"client_kwargs": {"aws_secret_access_key": "hunter2"}}, "client_kwargs.aws_secret_access_key"),
        ({"headers": {"Authorization": "Bearer hunter2"}}, "headers.Authorization"),
        ({"connection_string": "AccountName=a;AccountKey=hunter2;"}, "connection_string (its text)"),
        ({"config_kwargs": {"proxies": ["http://u:hunter2@proxy"]}}, "config_kwargs.proxies[0] (its text)"),
    ],
    ids=["nested-key", "header", "connection-string", "url-in-a-list"],
)
def test_remote_options_refuse_credentials_at_any_depth_naming_where(options, where):
    """A credential nested in a store option (a client's kwargs, a header, a connection string, a proxy URL) is
    refused as a top-level one is: it would be saved with the config in every checkpoint."""
    with pytest.raises(ConfigError, match="ckpt.remote_options must not hold credentials") as refused:
        Config(epochs=1, ckpt={"remote_options": options})
    assert where in str(refused.value) and "hunter2" not in str(refused.value)
    Config(epochs=1, ckpt={"remote_options": {"client_kwargs": {"region_name": "eu", "endpoint_url": "http://h:9"}}})


def test_remote_options_refuse_credentials_without_showing_them():
    """ckpt.remote_options is saved with the config: a key named like a credential is refused, its value unshown;
    a URL's password is masked in the error of a malformed URL."""
    with pytest.raises(ConfigError, match="ckpt.remote_options must not hold credentials") as refused:
        Config(epochs=1, ckpt={"remote_options": {"secret_access_key": "hunter2"}})
    assert "hunter2" not in str(refused.value)
    with pytest.raises(ConfigError, match="ckpt.remote") as refused:
        Config(epochs=1, ckpt={"remote": "user:hunter2@bucket"})
    assert "hunter2" not in str(refused.value)
    cfg = Config(epochs=1, ckpt={"remote": "s3://bucket/p?api_key=hunter2", "remote_options": {"endpoint_url": "x"}})
    assert "hunter2" not in str(public_config(cfg))


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAKEY:hunter2@bucket/runs",
        "s3://AKIAKEY:hun/ter2@bucket/runs",
        "gs://hunter2@bucket/runs",
        "s3:///AKIAKEY:hunter2@bucket/runs",
        "simplecache::s3://AKIAKEY:hunter2@bucket/runs",
    ],
    ids=["key-secret", "secret-with-slash", "token", "third-slash", "chained"],
)
def test_a_remote_url_with_credentials_is_refused_in_one_line_that_does_not_repeat_them(url):
    """s3fs would take ``KEY:SECRET@bucket`` for the bucket's name and print it in a traceback: a URL with userinfo
    is refused when the config is built (from a mapping or an override), naming the key and the store's own way,
    in one line without the URL; an ``@`` in the prefix's path is not userinfo."""
    for build in (
        lambda: Config(epochs=1, ckpt={"remote": url}),
        lambda: Config.from_mapping({"epochs": 1}, [f"ckpt.remote={url}"]),
    ):
        with pytest.raises(ConfigError, match="ckpt.remote must not hold credentials") as refused:
            build()
        message = str(refused.value)
        assert "hunter2" not in message and "hun/ter2" not in message and "\n" not in message
        assert "environment variables" in message
    assert Config(epochs=1, ckpt={"remote": "file:///srv/me@site/runs"}).ckpt.remote == "file:///srv/me@site/runs"
