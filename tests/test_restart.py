"""Real torchrun jobs: an automatic restart after a rank dies resumes exactly; a failing rank ends the job promptly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.faults.harness import ROOT, Run, assert_same_training, child_env, write_run
from tests.helpers.configs import make_cfg

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]


def ddp_cfg(out_dir, **overrides):
    """A 2-process gloo config: 6 epochs, a test at the end, collectives bounded by 30 s."""
    return make_cfg(out_dir, epochs=6, test={"enable": True}, dist={"backend": "gloo", "timeout_s": 30}, **overrides)


def torchrun(run_json, log, max_restarts=0) -> Run:
    """Start ``torchrun --standalone --nproc_per_node=2`` on tests/faults/train.py."""
    return Run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1", "-m", "tests.faults.train", str(run_json)], log)


def test_torchrun_restart_after_a_dead_rank_resumes_bit_identically(tmp_path):
    """Rank 1 dying mid-run on the first attempt: torchrun --max-restarts=1 exits 0 with the uninterrupted weights."""
    ref = torchrun(write_run(tmp_path / "ref.json", ddp_cfg(tmp_path / "ref")), tmp_path / "ref.log")
    assert ref.wait(timeout=180) == 0, ref.stderr[-4000:]

    out = tmp_path / "run"
    fault = {"exit_rank": 1, "exit_epoch": 2}
    run = torchrun(write_run(tmp_path / "run.json", ddp_cfg(out), fault), tmp_path / "run.log", max_restarts=1)
    code = run.wait(timeout=180)
    assert code == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert sum(line.startswith("epoch 2 rank 1 ") for line in lines) == 2, "rank 1 must run epoch 2 on both attempts"
    assert sum(line.startswith("epoch 0 rank 0 ") for line in lines) == 1, "the restart must resume, not start over"
    assert "trainkit: resuming" in run.stderr and "at epoch 2" in run.stderr
    assert len(run.worker_pids()) == 4  # two ranks, two attempts: all gone (checked by wait)
    assert_same_training(out, tmp_path / "ref")


def test_exception_on_one_rank_ends_the_torchrun_job_promptly(tmp_path):
    """An exception on rank 1 ends the torchrun job promptly, non-zero, with its traceback and no process left."""
    # collectives bounded by 600 s, not 30: a rank that waited for the timeout is told from a loaded host's slow start
    cfg = {**ddp_cfg(tmp_path / "run", fail_rank=1, fail_epoch=1), "dist": {"backend": "gloo", "timeout_s": 600}}
    start = time.monotonic()
    run = torchrun(write_run(tmp_path / "run.json", cfg), tmp_path / "run.log")
    code = run.wait(timeout=200)
    elapsed = time.monotonic() - start
    assert code != 0
    assert elapsed < 150, f"the job took {elapsed:.0f} s to end: a rank waited for the 600 s collective timeout"
    assert "Traceback" in run.stderr and "RuntimeError: injected failure on rank 1 at epoch 1" in run.stderr
    assert "tests/helpers/trainers.py" in run.stderr  # the original frame, not just torchrun's summary
    assert len(run.worker_pids()) == 2


def test_sigterm_to_torchrun_saves_and_torchrun_exits_1_with_the_run_unfinished(tmp_path):
    """SIGTERM to torchrun: its agent forwards it to the workers, which stop after saving (exit 143 each), but
    torchrun itself exits 1 (its SignalException), not 143; last.pt holds the stop and inspect says the run goes on,
    which is what a requeue script checks (docs: "Stopping on a signal")."""
    out = tmp_path / "run"
    cfg = make_cfg(out, epochs=40, dist={"backend": "gloo", "timeout_s": 30})
    run = torchrun(write_run(tmp_path / "run.json", cfg, {"batch_sleep": 0.01}), tmp_path / "log")
    assert run.wait_for("epoch 1 rank 0 "), run.stderr[-4000:]
    run.signal(signal.SIGTERM)
    code = run.wait(timeout=120)
    assert code == 1, run.stderr[-4000:]
    assert "SignalException" in run.stderr and "SIGTERM received: stopped after epoch" in run.stderr
    shown = subprocess.run([sys.executable, "-m", "trainkit", "inspect", str(out / "last.pt")], cwd=ROOT,
                           env=child_env(), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "results: none yet (the run goes on)" in " ".join(shown.stdout.split())
