"""Suite-wide settings and the fixtures the test files share.

One torch thread per test process: the suite runs one pytest worker per core (``-n auto``), and the training
processes the tests start run with ``OMP_NUM_THREADS=1``; a worker that also used every core for its own tensors
would only contend with them, and with one thread it computes what those processes compute.

trainkit leaves a SIGINT the process inherited as ignored alone (a run started in the background by a shell).
The tests that press Ctrl-C stand for a run started from a terminal, so a suite started in the background
puts Python's own handler back: the processes it starts then get SIGINT as a terminal's would (the one test
of an ignored SIGINT ignores it on purpose).

What is slow because it repeats (more rounds of a fuzz, more parameters of one kind of case, more examples of a
property) is marked ``slow`` and skipped unless ``TRAINKIT_SLOW=1``; the default run keeps at least one case of
every kind (each fault, each format, each store). Hypothesis runs the ``default`` profile (30 examples a property)
unless ``TRAINKIT_SLOW=1`` loads the ``slow`` one (300, at least what each property asked for before).

The helpers these fixtures build on (trainers, config builders, file readers) live in ``tests/helpers/``.
"""

from __future__ import annotations

import secrets
import signal

import pytest
import torch
from hypothesis import settings

from tests.helpers.configs import make_cfg
from tests.helpers.slow import SLOW
from tests.helpers.trainers import TinyTrainer

torch.set_num_threads(1)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# No deadline in either: a deadline is a clock, and a loaded host would miss it. The counts live here, not on the
# tests: 30 examples find what a property test is for in the default run, 300 search longer in the slow one.
settings.register_profile("default", max_examples=30, deadline=None)
settings.register_profile("slow", max_examples=300, deadline=None)
settings.load_profile("slow" if SLOW else "default")


LONGEST_FIRST = (
    "tests/test_step_resume.py",
    "tests/test_step_resume_loaders.py",
    "tests/test_examples.py",
    "tests/test_benchmarks.py",
    "tests/test_fsdp.py",
    "tests/checkpoint/test_remote_kills.py",
    "tests/test_faults.py",
    "tests/distributed/test_elastic_agent.py",
    "tests/distributed/test_elastic_resume.py",
    "tests/run/test_wandb.py",
    "tests/test_restart.py",
    "tests/test_ddp.py",
    "tests/loop/test_sample_generator.py",
    "tests/test_docs.py",
)
"""The files that take longest, longest first. ``--dist loadfile`` with ``--no-loadscope-reorder`` (pyproject) hands
whole files to the workers in collection order, so a long file collected last would keep one worker busy while the
other idles; handed out first, the short files fill the gaps (the longest-processing-time rule). The rest keep their
order."""


def pytest_collection_modifyitems(config, items):
    """Hand the longest files out first (:data:`LONGEST_FIRST`); skip the cases marked ``slow`` unless
    ``TRAINKIT_SLOW=1``."""
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))  # stable: rest in order
    if SLOW:
        return
    skip = pytest.mark.skip(reason="repeats a kind the default run covers: set TRAINKIT_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
def tiny_trainer(tmp_path):
    """A factory of TinyTrainers on ``make_cfg(tmp_path, **overrides)``; each one made is closed when the test ends."""
    made: list[TinyTrainer] = []

    def make(**overrides) -> TinyTrainer:
        trainer = TinyTrainer(make_cfg(tmp_path, **overrides))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Quiet, offline-friendly W&B settings that no user file or variable can change: a fresh W&B home in tmp_path."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "wandb-home"
    home.mkdir()
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc"))


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API server on localhost for the whole session (moto), with dummy credentials in the environment."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.helpers.remote_store import s3_server

    with s3_server() as endpoint:
        yield endpoint


STORES = ["s3", "file", "memory"]
"""The stores the remote tier's tests run on: a real S3 API server (moto), a file system, fsspec's memory."""


@pytest.fixture(params=STORES)
def remote_url(request, tmp_path):
    """A fresh remote prefix on each store."""
    token = secrets.token_hex(4)
    if request.param == "s3":
        request.getfixturevalue("s3_endpoint")
        return f"s3://trainkit-{token}/runs/a"
    if request.param == "memory":
        return f"memory://trainkit-{token}/runs/a"
    return f"file://{tmp_path}/remote/runs/a"
