"""The configuration: a frozen, validated tree of records, dotted-key overrides, and secrets kept out of logs.

Pure: stdlib and attrs only. The records and their construction live in :mod:`~trainkit.config.schema`, the rules a
value is checked against in :mod:`~trainkit.config.rules`, dotted overrides in :mod:`~trainkit.config.overrides`,
and secret detection and masking in :mod:`~trainkit.config.secrets`. This face is what user code imports.
"""

from trainkit.config.overrides import all_keys, apply_overrides
from trainkit.config.schema import (
    DEFAULT_NO_WEIGHT_DECAY,
    RESUME_SAFE_KEYS,
    RETUNED_KEYS,
    CkptConfig,
    Config,
    DistConfig,
    GuardConfig,
    ProgressConfig,
    TestConfig,
    ThroughputConfig,
    ValConfig,
    WandbConfig,
    changed_on_resume,
    public_config,
)
from trainkit.config.secrets import (
    is_secret_key,
    is_secret_name,
    redact_argv,
    redact_text,
    render_value,
    secret_field,
    strip_secrets,
)

__all__ = [
    "Config",
    "ValConfig",
    "TestConfig",
    "CkptConfig",
    "WandbConfig",
    "ProgressConfig",
    "DistConfig",
    "GuardConfig",
    "ThroughputConfig",
    "DEFAULT_NO_WEIGHT_DECAY",
    "secret_field",
    "public_config",
    "is_secret_name",
    "is_secret_key",
    "redact_text",
    "strip_secrets",
    "render_value",
    "redact_argv",
    "all_keys",
    "apply_overrides",
    "changed_on_resume",
    "RESUME_SAFE_KEYS",
    "RETUNED_KEYS",
]
