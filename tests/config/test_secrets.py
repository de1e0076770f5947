"""Secrets stay out of checkpoints, metrics, W&B's files and messages; ordinary keys are never dropped.

The name rule is pinned both ways by tables; the end-to-end test runs a real training process with an
offline W&B run and secrets in its config and on its command line, then greps every byte it wrote.

Run as ``python -m tests.config.test_secrets WORD...``, this module trains :class:`LeakyTrainer` on the config
those command-line words build: the end-to-end test starts it that way, so W&B sees a real ``sys.argv``.
"""

from __future__ import annotations

import sys
import warnings

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainkit
from tests.helpers.trainers import TinyConfig, TinyTrainer
from tests.helpers.wandb_files import offline_runs, read_records
from trainkit.config import (
    Config,
    is_secret_key,
    is_secret_name,
    public_config,
    redact_argv,
    redact_text,
    render_value,
    secret_field,
    strip_secrets,
)
from trainkit.config.schema import Section
from trainkit.errors import ConfigError

SECRET_NAMES = [
    "api_key",
    "apiKey",
    "APIKey",
    "api-key",
    "apikey",
    "API_KEY",
    "WANDB_API_KEY",
    "openai.api_key",
    "api_keys",
    "db_password",
    "password",
    "Password",
    "passwd",
    "db_pwd",
    "passphrase",
    "password2",
    "auth",
    "auth_token",
    "authToken",
    "oauth_token",
    "oauth2_token",
    "auth_mode",  # auth anywhere: keep such a field public with metadata={"secret": False}
    "Authorization",
    "credentials",
    "credential",
    "gcp_credentials_json",
    "creds",
    "secret",
    "client_secret",
    "aws_secret_access_key",
    "AWS_SECRET_ACCESS_KEY",
    "access_key",
    "access_key_id",
    "private_key",
    "privateKey",
    "ssh_key",
    "signing_key",
    "encryption_key",
    "session_key",
    "account_key",
    "AccountKey",
    "token",
    "hf_token",
    "HF_TOKEN",
    "github_token",
    "access_token",
    "refresh_token",
    "id_token",
    "session_token",
    "use_auth_token",
    "slack.bot_token",
    "cookie",
    "session_cookies",
    "bearer",
    "jwt",
    "db.password",
    "services.db.password",
]
"""Names the rule marks secret."""

PUBLIC_NAMES = [
    "max_tokens",
    "max_new_tokens",
    "num_tokens",
    "n_tokens",
    "tokens",
    "tokens_per_batch",
    "token_budget",
    "token_dropout",
    "token_file",
    "tokenizer",
    "tokenizer_name",
    "Tokenizer",
    "pad_token",
    "pad_token_id",
    "bos_token",
    "bos_token_id",
    "eos_token",
    "eos_token_id",
    "unk_token",
    "sep_token",
    "cls_token",
    "mask_token",
    "decoder_start_token_id",
    "image_token",
    "special_tokens",
    "max_token",
    "keypoint_weight",
    "keypointWeight",
    "keypoints",
    "key_dim",
    "num_keys",
    "keys",
    "key",
    "rng_key",
    "prng_key",
    "image_key",
    "label_key",
    "sort_key",
    "primary_key",
    "cache_key",
    "keyword",
    "monkey",
    "turkey_weight",
    "whiskey",
    "author",
    "authors",
    "authority",
    "passthrough",
    "bypass",
    "compass_heading",
    "secretary",
    "tokenize",
    "lr",
    "epochs",
    "out_dir",
    "wandb.project",
    "val.patience",
]
"""Names the rule leaves public: vocabulary tokens, counts, data keys, and words that merely contain a secret word."""


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_are_recognised(name):
    """Each name in SECRET_NAMES is secret by whole words (camelCase, snake_case, kebab-case, dotted, any case)."""
    assert is_secret_name(name), name
    assert is_secret_key(name), name


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_ordinary_names_are_not_secret(name):
    """Each name in PUBLIC_NAMES is ordinary: a substring (monkey, tokenizer) or a vocabulary token never counts."""
    assert not is_secret_name(name), name


def test_no_engine_key_is_secret():
    """None of the engine's own config keys is secret, so the saved config keeps them all."""
    from trainkit.config import all_keys

    assert [key for key in all_keys(Config) if is_secret_key(key, Config)] == []
    assert public_config(Config(epochs=1)) == Config(epochs=1).to_dict()


URLS = [
    ("postgres://bob:hunter2@db.example.com/runs", "postgres://bob:***@db.example.com/runs"),
    (
        "postgresql+psycopg://bob:hunter2@db:5432/runs?sslmode=require",
        "postgresql+psycopg://bob:***@db:5432/runs?sslmode=require",
    ),
    ("https://user:pass@example.com/path", "https://user:***@example.com/path"),
    ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0"),
    ("https://ghp_abc123@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
    ("mysql://bob:p@ss@db/runs", "mysql://bob:***@db/runs"),
    ("mongodb://bob:pa/ss#1@db/runs", "mongodb://bob:***@db/runs"),
    ("https://api.example.com/v1?token=abc123", "https://api.example.com/v1?token=***"),
    (
        "https://api.example.com/v1?model=x&api_key=abc&lang=en",
        "https://api.example.com/v1?model=x&api_key=***&lang=en",
    ),
    (
        "https://s3.example.com/b/o?X-Amz-Credential=AKIA%2F1&X-Amz-Expires=60",
        "https://s3.example.com/b/o?X-Amz-Credential=***&X-Amz-Expires=60",
    ),
    (
        "AccountName=acct;AccountKey=c2VjcmV0==;EndpointSuffix=core.windows.net",
        "AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net",
    ),
    ("see postgres://a:b@h/d and https://c:d@e/f", "see postgres://a:***@h/d and https://c:***@e/f"),
    ("password=hunter2", "password=***"),
    ("az://c/p?sv=2022-11-02&sig=c2VjcmV0%3D&se=2026", "az://c/p?sv=2022-11-02&sig=***&se=2026"),
    ("s3://b/k?X-Amz-Signature=f00d&X-Amz-Date=1", "s3://b/k?X-Amz-Signature=***&X-Amz-Date=1"),
    ("gs://b/o?X-Goog-Signature=beef", "gs://b/o?X-Goog-Signature=***"),
]
"""Strings with credentials, and what they become."""

UNCHANGED = [
    "https://example.com/path?page=2&max_tokens=512",
    "https://mastodon.social/@bob",
    "s3://bucket/prefix/model@v2.pt",
    "git@github.com:org/repo.git",
    "bob@example.com",
    "runs/default",
    "pad_token=<pad>",
    "signature_dim=3 sig=4",  # a signature is a credential in a URL's query only
    "",
]
"""Strings without credentials, left exactly as they are."""


@pytest.mark.parametrize(("text", "expected"), URLS)
def test_credentials_in_strings_are_masked(text, expected):
    """URL passwords, lone URL user names and secret-named query or connection-string pairs become ***, once."""
    assert redact_text(text) == expected
    assert redact_text(expected) == expected


@pytest.mark.parametrize("text", UNCHANGED)
def test_strings_without_credentials_are_left_alone(text):
    """A string with no URL credentials and no secret-named pair is returned unchanged."""
    assert redact_text(text) == text


@attrs.frozen(kw_only=True)
class DbSection(Section):  # a section record, like ValConfig
    """A user's own section with one secret leaf."""

    host: str = "db.example.com"
    password: str = "section-secret-1"


@attrs.frozen(kw_only=True)
class AuthSection(Section):
    """A section whose own name is secret: everything under it is."""

    method: str = "oauth"
    client: str = "client-name-2"


@attrs.frozen(kw_only=True)
class DeclaredConfig(Config):
    """Secrets declared, secrets by name, an opt-out, secret sections, and ordinary keys that look alike."""

    hub_login: str | None = secret_field(default=None)
    pin: int = secret_field(default=1234, validator=attrs.validators.instance_of(int))
    api_key: str | None = None
    auth_mode: str = attrs.field(default="oauth", metadata={"secret": False})
    db: DbSection = attrs.field(factory=DbSection)
    auth: AuthSection = attrs.field(factory=AuthSection)
    headers: dict = attrs.field(factory=lambda: {"Authorization": "Bearer header-secret-3", "Accept": "json"})
    db_url: str = "postgres://bob:url-secret-4@host/db"
    max_tokens: int = 512
    tokenizer: str = "gpt2"
    keypoint_weight: float = 0.25


def test_a_declared_secret_is_an_ordinary_value_in_code():
    """A secret_field is read as the plain value and round-trips through from_mapping, with_overrides and to_dict."""
    cfg = DeclaredConfig.from_mapping({"epochs": 1, "hub_login": "hf_abc"}, ["pin=9876"])
    assert cfg.hub_login == "hf_abc" and type(cfg.hub_login) is str
    assert cfg.pin == 9876
    again = cfg.with_overrides(["hub_login=hf_xyz"])
    assert again.hub_login == "hf_xyz" and again.pin == 9876
    assert cfg.to_dict()["hub_login"] == "hf_abc"
    assert DeclaredConfig.from_mapping(cfg.to_dict()) == cfg
    assert attrs.fields_dict(DeclaredConfig)["hub_login"].metadata == {"secret": True}
    assert "hf_abc" not in repr(cfg) and "9876" not in repr(cfg) and "hub_login='***'" in repr(cfg)
    assert "hub_login=None" in repr(DeclaredConfig(epochs=1))


def test_public_config_drops_secrets_and_keeps_every_ordinary_key():
    """public_config drops declared and name-matched secrets and secret sections, masks URLs, keeps the rest."""
    cfg = DeclaredConfig.from_mapping({"epochs": 1, "hub_login": "hf_abc", "api_key": "sk-live-5"})
    public = public_config(cfg)
    for dropped in ("hub_login", "pin", "api_key", "auth"):
        assert dropped not in public, dropped
    assert public["db"] == {"host": "db.example.com"}
    assert public["headers"] == {"Accept": "json"}
    assert public["db_url"] == "postgres://bob:***@host/db"
    assert public["auth_mode"] == "oauth"  # declared public despite its name
    assert public["max_tokens"] == 512 and public["tokenizer"] == "gpt2" and public["keypoint_weight"] == 0.25
    text = repr(public)
    for secret in (
        "hf_abc",
        "1234",
        "sk-live-5",
        "section-secret-1",
        "client-name-2",
        "header-secret-3",
        "url-secret-4",
    ):
        assert secret not in text, secret
    ordinary = {k for k in cfg.to_dict() if not is_secret_key(k, cfg)}
    assert ordinary <= public.keys()


def test_config_errors_about_a_secret_never_quote_its_value():
    """A wrong type or a failed validator on a secret key names the key and the rule but not the value."""
    cases = [
        lambda: DeclaredConfig.from_mapping({"epochs": 1, "hub_login": ["leaky-value-6"]}),
        lambda: DeclaredConfig(epochs=1).with_overrides(["pin=leaky-value-6"]),
        lambda: DeclaredConfig.from_mapping({"epochs": 1, "api_key": 123456}),
        lambda: DeclaredConfig.from_mapping({"epochs": 1, "db": {"password": ["leaky-value-6"]}}),
        lambda: DeclaredConfig.from_mapping({"epochs": 1, "auth": "leaky-value-6"}),
        lambda: DeclaredConfig(epochs=1).with_overrides(["auth=leaky-value-6"]),
    ]
    for case in cases:
        with pytest.raises(ConfigError) as info:
            case()
        message = str(info.value)
        assert "leaky-value-6" not in message and "123456" not in message, message
        assert info.value.value is None
    with pytest.raises(ConfigError, match=r"keypoint_weight must be a float, got 'x'"):
        DeclaredConfig.from_mapping({"epochs": 1, "keypoint_weight": "x"})  # ordinary keys still quote the value


def test_is_secret_key_follows_the_config_declarations():
    """Along a config's fields the declarations decide; beyond them, the name rule decides."""
    assert is_secret_key("hub_login", DeclaredConfig) and not is_secret_key("hub_login")
    assert not is_secret_key("auth_mode", DeclaredConfig) and is_secret_key("auth_mode")
    assert is_secret_key("auth.method", DeclaredConfig) and is_secret_key("db.password", DeclaredConfig)
    assert not is_secret_key("db.host", DeclaredConfig)
    assert is_secret_key("headers.Authorization", DeclaredConfig) and not is_secret_key(
        "headers.Accept", DeclaredConfig
    )
    assert is_secret_key("passwd", DeclaredConfig)  # a key this config does not have (say, from an old checkpoint)


def test_render_value_masks_secret_keys_and_credentials_in_messages():
    """render_value prints '***' for a secret key and masks URL passwords in any other value, like repr otherwise."""
    assert render_value("hub_login", "hf_abc", DeclaredConfig) == "'***'"
    assert render_value("passwd", "hunter2") == "'***'"
    assert render_value("db_url", "postgres://bob:hunter2@h/db") == "'postgres://bob:***@h/db'"
    assert (
        render_value("headers", {"Authorization": "Bearer x", "Accept": "json"}, DeclaredConfig) == "{'Accept': 'json'}"
    )
    assert render_value("keypoint_weight", 0.25) == "0.25"
    assert render_value("auth_mode", "oauth", DeclaredConfig) == "'oauth'"
    assert render_value("max_tokens", "<absent>") == "'<absent>'"


def test_strip_secrets_cleans_an_old_checkpoint_config():
    """A config saved by an older trainkit (passwd, credentials, a URL password in it) is cleaned for comparison."""
    old = {
        "epochs": 2,
        "passwd": "hunter2",
        "credentials": {"user": "bob"},
        "db_url": "postgres://bob:hunter2@h/db",
        "max_tokens": 512,
        "keypoint_weight": 0.5,
        "layers": (64, 64),
    }
    assert strip_secrets(old, DeclaredConfig) == {
        "epochs": 2,
        "db_url": "postgres://bob:***@h/db",
        "max_tokens": 512,
        "keypoint_weight": 0.5,
        "layers": [64, 64],
    }


@attrs.frozen(kw_only=True)
class VaultSection(Section):
    """A section whose declarations go against the name rule both ways."""

    address: str = "vault.example.com"
    location: str = secret_field(default="vault-secret-7")  # secret by declaration, not by name
    api_key_hint: str = attrs.field(default="ends in 42", metadata={"secret": False})  # public despite its name


@attrs.frozen(kw_only=True)
class NestedConfig(DeclaredConfig):
    """DeclaredConfig with a section two levels down from nothing secret by name."""

    vault: VaultSection = attrs.field(factory=VaultSection)


_KEY_WORDS = [
    *attrs.fields_dict(NestedConfig),
    *attrs.fields_dict(VaultSection),
    *attrs.fields_dict(DbSection),
    *attrs.fields_dict(AuthSection),
    "Authorization",
    "Accept",
    "hub-login",
    "db.password",
    "db.host",
    "vault.location",
    "vault.api_key_hint",
    "headers.Accept",
    "x.api_key",
    "",
]


def _stripped_by_path(data, config, prefix=""):
    """What strip_secrets promises, read off its docstring: a key goes when its dotted path from the top is secret."""
    if isinstance(data, dict):
        return {
            key: _stripped_by_path(value, config, f"{prefix}{key}.")
            for key, value in data.items()
            if not is_secret_key(f"{prefix}{key}", config)
        }
    if isinstance(data, list | tuple):
        return [_stripped_by_path(value, config, prefix) for value in data]
    return redact_text(data) if isinstance(data, str) else data


_PLAIN = st.one_of(st.integers(), st.sampled_from(["oauth", "postgres://bob:pw@h/db", "x api_key=abc"]))
_NESTED = st.recursive(
    _PLAIN,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEY_WORDS), inner, max_size=5),
    max_leaves=20,
)


@settings(deadline=None)
@given(data=st.dictionaries(st.sampled_from(_KEY_WORDS), _NESTED, max_size=8), key=st.sampled_from(_KEY_WORDS))
def test_strip_secrets_judges_every_key_by_its_dotted_path(data, key):
    """strip_secrets and render_value, which judge each key from its level's record class down, drop and mask
    exactly what is_secret_key says of the key's whole dotted path, declared sections and dict values alike."""
    assert public_config(NestedConfig(epochs=1))["vault"] == {
        "address": "vault.example.com",
        "api_key_hint": "ends in 42",
    }
    for config in (NestedConfig, None):
        assert strip_secrets(data, config) == _stripped_by_path(data, config)
        expected = "'***'" if is_secret_key(key, config) else repr(_stripped_by_path(data, config, f"{key}."))
        assert render_value(key, data, config) == expected


def test_redact_argv_masks_secret_overrides_flags_and_urls():
    """redact_argv masks secret key=value words (declared ones too), the word after a secret flag, URL passwords."""
    argv = [
        "conf.yaml",
        "epochs=3",
        "api_key=sk-1",
        "hub_login=hf_2",
        "--password",
        "pw-3",
        "--hf-token=hf-4",
        "db_url=postgres://bob:pw-5@h/db",
        "max_tokens=512",
        "tokenizer=gpt2",
        "auth_mode=oauth",
    ]
    assert redact_argv(argv, DeclaredConfig) == [
        "conf.yaml",
        "epochs=3",
        "api_key=***",
        "hub_login=***",
        "--password",
        "***",
        "--hf-token=***",
        "db_url=postgres://bob:***@h/db",
        "max_tokens=512",
        "tokenizer=gpt2",
        "auth_mode=oauth",
    ]
    assert redact_argv(["hub_login=hf_2"]) == ["hub_login=hf_2"]  # undeclared by name: only the config knows
    assert redact_argv(["api_key=", "sk-6", "epochs=3"]) == ["api_key=***", "***", "epochs=3"]  # api_key= VALUE


def test_a_stray_command_line_word_is_quoted_unless_it_is_a_secret():
    """config_from_argv quotes a stray word in its error, unless it is a secret's value or holds a URL password."""
    from trainkit.cli import config_from_argv

    with pytest.raises(ConfigError, match=r"got 'stray'"):
        config_from_argv(DeclaredConfig, ["epochs=1", "stray"])
    for argv in (["epochs=1", "api_key=", "sk-live-9"], ["epochs=1", "postgres://bob:sk-live-9@h/db"]):
        with pytest.raises(ConfigError, match=r"^argument must be a YAML file") as info:
            config_from_argv(DeclaredConfig, argv)
        assert "sk-live-9" not in str(info.value) and info.value.value is None


# ----- real runs -------------------------------------------------------------------------------------------

SENTINELS = {
    "A": "SENTINEL_A_url_pw_5c1e",
    "B": "SENTINEL_B_passwd_8d2f",
    "C": "SENTINEL_C_credentials_3a7b",
    "D": "SENTINEL_D_auth_9e40",
    "E": "SENTINEL_E_declared_61c8",
    "F": "SENTINEL_F_argv_api_key_d5b2",
    "A2": "SENTINEL_A2_url_pw_resumed_0f93",
    "B2": "SENTINEL_B2_passwd_resumed_7b15",
}
"""Secret values of the end-to-end runs; none may appear in any byte written."""

ORDINARY_TOKENIZER = "ORDINARY_tokenizer_2e9d"
"""An ordinary value that must appear, in raw bytes, in last.pt and the .wandb file: the grep can see strings."""


@attrs.frozen(kw_only=True)
class LeakyConfig(TinyConfig):
    """TinyConfig with every kind of secret the issue found on disk, and ordinary keys the old filter dropped."""

    db_url: str = f"postgres://bob:{SENTINELS['A']}@db.example.com/runs"
    passwd: str = SENTINELS["B"]
    credentials: str = SENTINELS["C"]
    auth: str = SENTINELS["D"]
    hub_login: str | None = secret_field(default=None)
    api_key: str | None = None
    max_tokens: int = 512
    tokenizer: str = ORDINARY_TOKENIZER
    keypoint_weight: float = 0.25


class LeakyTrainer(TinyTrainer):
    """TinyTrainer on LeakyConfig."""

    config_class = LeakyConfig


def start_run(tmp_path, log_name, words):
    """Start ``python -m tests.config.test_secrets WORDS`` with an isolated, offline W&B home; return the process."""
    from tests.faults.harness import Run, offline_wandb_env

    env = offline_wandb_env(tmp_path / "wandb-home")
    env.pop("WANDB_API_KEY", None)
    return Run(["-m", __name__, *words], tmp_path / log_name, env)


@pytest.mark.timeout(300)
def test_no_secret_reaches_any_file_or_message_of_a_real_offline_run(tmp_path):
    """A run and its resume, with secrets in the config and on the command line W&B records, write none of them.

    Needs the trainer wired to ``public_config(self.cfg)`` and ``WandbSink(..., config_class=self.cfg)``:
    until then the declared secret (SENTINEL_E) reaches last.pt, and this test fails there by design.
    """
    out = tmp_path / "run"
    common = [f"out_dir={out}", "wandb.mode=offline", "progress.enable=false", "val.minimize=true"]
    first = start_run(
        tmp_path, "first.log", [*common, "epochs=2", f"hub_login={SENTINELS['E']}", f"api_key={SENTINELS['F']}"]
    )
    assert first.wait(timeout=150) == 0, first.stderr[-3000:]
    resumed_words = [
        *common,
        "epochs=3",
        f"hub_login={SENTINELS['E']}",
        f"api_key={SENTINELS['F']}",
        f"passwd={SENTINELS['B2']}",
        f"db_url=postgres://bob:{SENTINELS['A2']}@db2.example.com/runs",
        "keypoint_weight=0.5",
    ]
    second = start_run(tmp_path, "second.log", resumed_words)
    assert second.wait(timeout=150) == 0, second.stderr[-3000:]

    # the resume reported its ordinary changes, with the URL's password masked
    assert "keypoint_weight: 0.25 -> 0.5" in second.stderr, second.stderr[-3000:]
    assert "postgres://bob:***@db2.example.com/runs" in second.stderr

    files = [p for p in [*tmp_path.rglob("*")] if p.is_file() and not p.is_symlink()]
    datastores = [p for p in files if p.suffix == ".wandb"]
    assert (
        len(datastores) == 2 and any(p.name == "last.pt" for p in files) and any(p.name == "output.log" for p in files)
    )
    # raw bytes of every file, and the records of every .wandb file reassembled across its 32 KiB blocks
    blobs = {str(p.relative_to(tmp_path)): p.read_bytes() for p in files}
    for path in datastores:
        blobs[f"{path.relative_to(tmp_path)} (records)"] = b"".join(r.SerializeToString() for r in read_records(path))
    leaks = [
        f"{key} in {where}"
        for where, data in blobs.items()
        for key, value in SENTINELS.items()
        if value.encode() in data
    ]
    assert not leaks, leaks

    # the grep can see strings: an ordinary value is there in raw bytes, and W&B did record the command line
    for path in (out / "last.pt", *datastores):
        assert ORDINARY_TOKENIZER.encode() in path.read_bytes(), path
    for path in datastores:
        assert b"api_key=***" in path.read_bytes() and b"hub_login=***" in path.read_bytes(), path

    saved = torch.load(out / "last.pt", weights_only=True)["config"]
    assert saved["max_tokens"] == 512 and saved["tokenizer"] == ORDINARY_TOKENIZER and saved["keypoint_weight"] == 0.5
    assert saved["db_url"] == "postgres://bob:***@db2.example.com/runs"
    assert not {"passwd", "credentials", "auth", "hub_login", "api_key"} & saved.keys()
    runs = offline_runs(out)
    assert len(runs) == 2
    for part in runs:
        assert part.config["max_tokens"] == 512 and part.config["tokenizer"] == ORDINARY_TOKENIZER
        assert "keypoint_weight" in part.config and part.config["db_url"].startswith("postgres://bob:***@")
        assert not {"passwd", "credentials", "auth", "hub_login", "api_key"} & part.config.keys()


@pytest.mark.timeout(120)
def test_wandb_sink_masks_the_command_line_it_records_and_restores_sys_argv(tmp_path, monkeypatch, wandb_env):
    """In this process, WandbSink shows W&B a masked sys.argv and gives the program back its own list unchanged."""
    from trainkit.run.wandb_run import WandbSink

    argv = ["train.py", "epochs=1", "hub_login=argv-secret-7", "--password", "argv-secret-8", "tokenizer=gpt2"]
    monkeypatch.setattr(sys, "argv", argv)
    cfg = DeclaredConfig(epochs=1, hub_login="argv-secret-7", out_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sink = WandbSink(
            mode="offline",
            run_id="secrets1",
            directory=tmp_path,
            config=public_config(cfg),
            project="trainkit",
            entity=None,
            name=None,
            tags=(),
            config_class=cfg,
        )
        assert sys.argv is argv and argv[2] == "hub_login=argv-secret-7"
        sink.log({"trainer/step": 1.0, "train/loss": 0.5})
        sink.finish()
    (run,) = offline_runs(tmp_path)
    data = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"argv-secret-7" not in data and b"argv-secret-8" not in data
    assert b"hub_login=***" in data and b"tokenizer=gpt2" in data
    assert run.config["tokenizer"] == "gpt2" and "hub_login" not in run.config


def main() -> None:
    """Train LeakyTrainer on the config built from this process's command-line words."""
    from trainkit.cli import config_from_argv

    trainkit.launch(LeakyTrainer, config_from_argv(LeakyConfig, sys.argv[1:], defaults={"epochs": 1}))


if __name__ == "__main__":
    main()
