"""Security: hostile checkpoints never load or run code, torch's allowlist is untouched, secrets stay out of files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy  # noqa: F401 - loaded so the trainer also captures and restores numpy's RNG
import pytest
import torch

from tests.faults.harness import ROOT, child_env, offline_wandb_env, train, write_run
from tests.faults.hostile import CODE_RUNNING, SENTINEL_NAME, build_corpus
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit import CheckpointCorruptError, CheckpointMismatchError, CheckpointUnsafeError
from trainkit.checkpoint import load_checkpoint

EXPECTED_REFUSAL = {
    "os_system": "posix.system",
    "eval": "eval",
    "raw_global_posix_system": "posix.system",
    "unlisted_class": "tests.faults.hostile.Unlisted",
    "whole_module": "torch.nn.modules.linear.Linear",
    "numpy_datetime_array": "numpy dtype",
    "legacy_format": "not a torch checkpoint",
}
"""What the refusal of some corpus files names."""

DAMAGED = {"legacy_format"}
"""Corpus files that are not intact torch zip checkpoints: corrupt. Every other one is intact but holds a type
trainkit does not load: unsafe, never called corrupt."""


def expected_error(name: str) -> type[Exception]:
    return CheckpointCorruptError if name in DAMAGED else CheckpointUnsafeError


@pytest.fixture
def corpus(tmp_path):
    """The hostile files, one hidden inside a real trainkit checkpoint, and the sentinel their code would create."""
    TinyTrainer(make_cfg(tmp_path / "real", epochs=1)).train()
    valid = torch.load(tmp_path / "real" / "last.pt", weights_only=True)
    sentinel = tmp_path / SENTINEL_NAME
    return build_corpus(tmp_path / "corpus", sentinel, valid), sentinel


def test_the_corpus_really_is_hostile(tmp_path):
    """Unpickled without weights_only, every code-running corpus file runs its code: the refusals mean something."""
    proof = tmp_path / "PROOF"
    paths = build_corpus(tmp_path / "proof", proof, {"config": {}})
    for name in CODE_RUNNING:
        proof.unlink(missing_ok=True)
        torch.load(paths[name], weights_only=False)
        assert proof.exists(), f"{name} did not run its code when unpickled unsafely"


def test_hostile_checkpoints_are_refused_by_load_and_resume(corpus, tmp_path):
    """Every hostile file is refused by load_checkpoint and by ckpt.resume=<file> with a typed error; no code runs."""
    paths, sentinel = corpus
    assert len(paths) >= 12
    for name, path in paths.items():
        with pytest.raises((CheckpointCorruptError, CheckpointUnsafeError)) as info:
            load_checkpoint(path)
        assert type(info.value) is expected_error(name), (name, info.value)
        assert str(path) in str(info.value)
        assert EXPECTED_REFUSAL.get(name, "") in str(info.value), str(info.value)
        with pytest.raises((expected_error(name), CheckpointMismatchError)):
            TinyTrainer(make_cfg(tmp_path / "resume" / name, ckpt={"resume": str(path)}))
        assert not sentinel.exists(), f"{name} ran its code"


def test_hostile_intact_last_pt_stops_the_resume_and_is_never_renamed(corpus, tmp_path):
    """An intact last.pt holding a code-running global is refused on auto-resume, naming the type: it is not
    called corrupt, not renamed, and not skipped for last.prev.pt (an older state would be lost silently)."""
    paths, sentinel = corpus
    out = tmp_path / "run"
    TinyTrainer(make_cfg(out, epochs=2)).train()
    os.replace(paths["hidden_in_real_checkpoint"], out / "last.pt")
    # the run's lock is the claim of whichever run holds the folder (it names its start, to the second), not state
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".trainkit.lock"}
    with pytest.raises(CheckpointUnsafeError, match=r"last.pt was refused: it holds posix.system.*not corrupt"):
        TinyTrainer(make_cfg(out, epochs=3))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".trainkit.lock"} == before
    assert not (out / "last.corrupt.pt").exists()
    assert not sentinel.exists()


def test_hostile_checkpoints_are_refused_even_with_torch_force_no_weights_only_load(corpus, tmp_path):
    """With TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 from process start, every hostile file is still refused; no code runs."""
    paths, sentinel = corpus
    env = child_env(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.hostile", str(tmp_path / "corpus"), str(tmp_path / "env-out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = {row["name"]: row for row in map(json.loads, proc.stdout.splitlines())}
    assert outcomes.keys() == paths.keys()
    for row in outcomes.values():
        assert row["load"] == expected_error(row["name"]).__name__, row
        assert row["resume"] in (expected_error(row["name"]).__name__, "CheckpointMismatchError"), row
    assert not sentinel.exists()


def test_trainkit_leaves_torchs_safe_globals_alone(tmp_path):
    """A full train, test and resume (numpy RNG included) leaves torch's weights_only allowlist as it was."""
    before = list(torch.serialization.get_safe_globals())
    TinyTrainer(make_cfg(tmp_path, epochs=2, test={"enable": True})).train()
    resumed = TinyTrainer(make_cfg(tmp_path, epochs=3, test={"enable": True}))
    resumed.train()
    assert "numpy" in torch.load(tmp_path / "last.pt", weights_only=True)["rng"][0]
    assert set(torch.serialization.get_safe_globals()) == set(before)  # torch keeps them in a set: order varies


SECRETS = {"WANDB_API_KEY": "wandbkey-5e1f0c2a9b7d4e36", "MY_SERVICE_TOKEN": "svc-token-8c3d1a7f6e2b9054"}


@pytest.mark.timeout(180)
def test_secrets_in_the_environment_never_reach_a_file(tmp_path):
    """An offline W&B run with API keys and tokens in its environment writes none of them into any file."""
    out = tmp_path / "run"
    home = tmp_path / "wandb-home"
    env = offline_wandb_env(home, **SECRETS)
    cfg = make_cfg(out, epochs=2, wandb={"mode": "offline"}, test={"enable": True})
    run = train(write_run(tmp_path / "run.json", cfg), tmp_path / "log", env=env)
    assert run.wait(timeout=150) == 0, run.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "last.pt" for p in files)
    leaks = [
        f"{name} in {path.relative_to(tmp_path)}"
        for path in [*files, *home.rglob("*")]
        if path.is_file()
        for name, value in SECRETS.items()
        if value.encode() in path.read_bytes()
    ]
    assert not leaks, leaks


def test_secret_named_config_keys_never_reach_a_checkpoint(tmp_path):
    """A config key named like a secret (api_token) is kept out of last.pt and best.pt."""
    import attrs
    import torch

    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyConfig, TinyTrainer

    @attrs.frozen(kw_only=True)
    class WithToken(TinyConfig):
        api_token: str = "sentinel-not-for-disk"

    class TokenTrainer(TinyTrainer):
        config_class = WithToken

    TokenTrainer(make_cfg(tmp_path, epochs=2)).train()
    for name in ("last.pt", "best.pt", "last.prev.pt", "metrics.jsonl"):
        assert b"sentinel-not-for-disk" not in (tmp_path / name).read_bytes(), name
    assert "api_token" not in torch.load(tmp_path / "last.pt", weights_only=True)["config"]
    TokenTrainer(make_cfg(tmp_path, epochs=3)).train()  # resumes without a changed-config warning error
