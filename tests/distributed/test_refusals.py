"""A refusal a user can cause (a ``TrainkitError``) is one line on stderr and exit status 2 under ``python -m`` and
torchrun, printed once for the job; a bug keeps its traceback; a finished run says so on any world size."""

from __future__ import annotations

import json

import pytest

import trainkit
from tests.faults.harness import Run, child_env
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import StepTrainer

WORKER = "tests.distributed.refusing_worker"
QUIET_ENV = {"PYTHONWARNINGS": "ignore::UserWarning"}  # torchdata's own deprecation warning is not ours to test


def _run_json(path, out, **overrides):
    path.write_text(json.dumps({"config": make_cfg(out, epochs=2, **overrides)}))
    return str(path)


def _torchrun(run_json, log):
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=0.1", "-m", WORKER]
    return Run([*args, run_json], log, child_env(**QUIET_ENV))


def _refusal_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("refusing_worker.py: error: ")]


@pytest.mark.timeout(300)
def test_world_size_refusal_is_one_line_under_torchrun_and_a_finished_run_says_it_finished(tmp_path):
    """A run that ended at max_steps inside an epoch (its order a plain shuffle) reruns on 2 ranks: unchanged, it
    says it has finished (exit 0); continued (a raised max_steps), each rank refuses, and the job's stderr holds the
    refusal once, no traceback of trainkit's, and the workers' exit status 2 in torchrun's report."""
    out = tmp_path / "run"
    steps = {"ckpt": {"every_n_steps": 1}}
    first = Run(["-m", WORKER, _run_json(tmp_path / "a.json", out, max_steps=2, **steps)], tmp_path / "a.log")
    assert first.wait(timeout=120) == 0, first.stderr[-3000:]

    finished = _torchrun(_run_json(tmp_path / "a.json", out, max_steps=2, **steps), tmp_path / "b.log")
    assert finished.wait(timeout=120) == 0, finished.stderr[-3000:]
    assert "finished after 2 steps (max_steps); nothing to train" in finished.stderr

    refused = _torchrun(_run_json(tmp_path / "c.json", out, max_steps=4, **steps), tmp_path / "c.log")
    assert refused.wait(timeout=120) != 0
    stderr = refused.stderr
    [line] = _refusal_lines(stderr)
    assert "world_size=1, this run has world_size=2" in line and "RandomSampler" in line
    assert "exitcode  : 2" in stderr  # torchrun's report of its workers
    assert "trainkit/" not in stderr  # no frame of trainkit's


@pytest.mark.timeout(120)
def test_rollback_over_a_stateful_loader_is_refused_in_one_line_before_training(tmp_path):
    """guard.nonfinite=rollback with a StatefulDataLoader stops at the first progress(), before any step: one line
    naming the key, the loader and what to do, exit 2, nothing trained."""
    out = tmp_path / "run"
    run_json = _run_json(tmp_path / "a.json", out, loader="stateful", guard={"nonfinite": "rollback"})
    run = Run(["-m", WORKER, run_json], tmp_path / "a.log", child_env(**QUIET_ENV))
    assert run.wait(timeout=100) == 2
    assert run.stderr.splitlines() == _refusal_lines(run.stderr), run.stderr[-3000:]
    [line] = run.stderr.splitlines()
    assert "guard.nonfinite=rollback" in line and "StatefulDataLoader" in line and "guard.nonfinite=skip" in line
    assert not (out / "last.pt").exists()


@pytest.mark.timeout(120)
def test_a_bug_keeps_its_traceback_under_python_m(tmp_path):
    """A plain exception in the user's code is no refusal: its traceback, exit status 1."""
    run_json = tmp_path / "a.json"
    run_json.write_text(json.dumps({"config": make_cfg(tmp_path / "run", epochs=1), "bug": True}))
    run = Run(["-m", WORKER, str(run_json)], tmp_path / "a.log")
    assert run.wait(timeout=100) == 1
    assert "Traceback (most recent call last)" in run.stderr and "RuntimeError: a bug in setup()" in run.stderr


def test_launch_ends_a_refusal_with_one_line_and_status_2(tmp_path, capfd):
    """In-process: a config refusal out of launch is SystemExit(2) with one line on stderr, no chained error."""
    with pytest.raises(SystemExit) as ended:
        trainkit.launch(StepTrainer, make_cfg(tmp_path / "run", epochs=0))
    assert ended.value.code == 2 and ended.value.__cause__ is None
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: epochs must be >= 1, got 0"), err
