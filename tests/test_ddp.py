"""Real 2-process gloo runs: pooled means, rank-consistent early stopping, exact DDP resume, failures."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import torch.multiprocessing as mp

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import EchoTrainer, ReportingTrainer

pytestmark = pytest.mark.ddp


DDP_DEFAULTS = {"epochs": 4, "val": {"patience": 2}, "test": {"enable": True}, "dist": {"timeout_s": 60}}
"""What the 2-process runs add to test_trainer's quiet config: patience, a test phase, a short timeout."""


def cfg(out_dir, **overrides):
    """A quiet 2-process config with a short collective timeout."""
    return make_cfg(out_dir, **{**DDP_DEFAULTS, **overrides})


def reports(out_dir):
    """Each rank's report, in rank order."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(autouse=True)
def children_before():
    """The child processes this pytest process had before the test (a W&B service an earlier test started)."""
    global _CHILDREN_BEFORE
    _CHILDREN_BEFORE = {child.pid for child in psutil.Process().children(recursive=True)}
    yield


_CHILDREN_BEFORE: set[int] = set()


def no_children_left():
    """Assert that no child process started during the test lives on (spawned ranks and their server reaped)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [
            c for c in psutil.Process().children(recursive=True)
            if c.pid not in _CHILDREN_BEFORE and c.status() != psutil.STATUS_ZOMBIE
        ]
        # the resource tracker of multiprocessing may linger briefly; ranks must not
        ranks = [c for c in alive if "resource_tracker" not in " ".join(c.cmdline())]
        if not ranks:
            return
        time.sleep(0.2)
    raise AssertionError(f"leftover processes: {[c.cmdline() for c in ranks]}")


def test_two_ranks_agree_and_resume_bit_identical(tmp_path):
    """reduce_mean pools uneven shards as one process would; a 2-rank run killed mid-way resumes bit-identically."""
    ref_dir = tmp_path / "ref"
    expected = trainkit.spawn(ReportingTrainer, cfg(ref_dir), 2)
    ref = reports(ref_dir)
    assert ref[0]["pooled"] == ref[1]["pooled"] == pytest.approx(sum([1, 2, 3, 10, 11, 12, 13, 14]) / 8)
    assert ref[0]["empty_is_nan"] == ref[1]["empty_is_nan"] == "nan"
    assert ref[0]["digest"] == ref[1]["digest"]  # DDP keeps replicas identical
    assert ref[0]["epochs_trained"] == ref[1]["epochs_trained"]

    out = tmp_path / "resumed"
    with pytest.raises(mp.ProcessRaisedException, match="injected failure on rank 1 at epoch 2"):
        trainkit.spawn(ReportingTrainer, cfg(out, fail_rank=1, fail_epoch=2), 2)
    no_children_left()
    result = trainkit.spawn(ReportingTrainer, cfg(out), 2)
    got = reports(out)
    assert [r["epochs_trained"] for r in got] == [[2, 3], [2, 3]]
    assert got[0]["digest"] == got[1]["digest"] == ref[0]["digest"]
    assert result == expected


def test_disagreeing_verdicts_fail_on_every_rank_instead_of_hanging(tmp_path):
    """When ranks select on rank-local scores and disagree on stopping, every rank raises DistributedError promptly."""
    start = time.monotonic()
    # a hang would end at the collective timeout of 600 s: a bound of 150 s tells the two apart on a loaded host
    scripted = cfg(tmp_path, scripted_scores=[1.0, 2.0, 3.0, 4.0], local_scores_differ=True, val={"patience": 1},
                   dist={"timeout_s": 600})
    with pytest.raises(trainkit.DistributedError, match="ranks disagree on early stopping at epoch 1"):
        trainkit.spawn(ReportingTrainer, scripted, 2)
    assert time.monotonic() - start < 150
    no_children_left()


def test_a_refusal_in_the_ranks_is_raised_by_spawn_as_its_own_class_and_line(tmp_path):
    """A refusal the user caused (here a config the ranks validate) comes out of spawn as the same TrainkitError,
    its one line and its fields, without the rank's internal traceback; a bug keeps ProcessRaisedException."""
    with pytest.raises(trainkit.ConfigError) as refused:
        trainkit.spawn(ReportingTrainer, {**cfg(tmp_path), "epochs": -3}, 2)
    assert refused.value.key == "epochs" and refused.value.value == -3
    assert "epochs" in str(refused.value) and "-3" in str(refused.value)
    assert "Traceback" not in str(refused.value) and "\n" not in str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    no_children_left()


def test_pooled_score_stops_both_ranks_at_the_same_epoch(tmp_path):
    """Local losses differ per rank, but the reduce_mean score makes both ranks stop at the same epoch."""
    run = cfg(tmp_path, epochs=12, val={"patience": 1})
    trainkit.spawn(ReportingTrainer, run, 2)
    got = reports(tmp_path)
    assert got[0]["epochs_trained"] == got[1]["epochs_trained"]
    assert got[0]["best"] == got[1]["best"]


def test_spawn_reports_the_rank_that_failed_first_not_the_first_to_exit(tmp_path):
    """Rank 1 fails and then takes a while to exit; rank 0, left waiting in a collective, fails at its timeout
    and exits first. spawn raises rank 1's error, the cause, and names rank 0's after it."""
    from tests.helpers.trainers import SlowToExitTrainer

    failing = cfg(tmp_path, fail_rank=1, fail_epoch=1, fail_in="val", dist={"timeout_s": 3})
    with pytest.raises(Exception, match="injected failure on rank 1 at epoch 1") as raised:
        trainkit.spawn(SlowToExitTrainer, failing, 2)
    assert raised.value.error_index == 1
    assert "rank 0 failed after it" in str(raised.value)
    no_children_left()


def test_spawn_reports_a_killed_rank_even_when_another_rank_raised_after_it(tmp_path):
    """Rank 1 is SIGKILLed (no traceback, no record of when); rank 0 fails later at its collective timeout. The
    kill is the cause: spawn reports rank 1's death, not rank 0's recorded timeout."""
    from tests.helpers.trainers import KilledTrainer

    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGKILL"):
        trainkit.spawn(KilledTrainer, cfg(tmp_path, fail_rank=1, fail_epoch=1, dist={"timeout_s": 3}), 2)
    no_children_left()


def test_one_fork_server_serves_every_spawn_with_the_callers_environment_and_output(tmp_path, capfd, monkeypatch):
    """Inside fork_server() the ranks of every spawn are forked by one server, started before the calls: each
    rank still sees the environment and writes to the output its caller has at that call; then nothing is left."""
    with trainkit.fork_server():
        for mark in ("first", "second"):
            monkeypatch.setenv("TRAINKIT_TEST_MARK", mark)
            trainkit.spawn(EchoTrainer, cfg(tmp_path / mark, epochs=1), 2)
            out = capfd.readouterr().out
            assert f"rank 0 saw {mark}" in out and f"rank 1 saw {mark}" in out, out
    no_children_left()


@pytest.mark.timeout(120)
def test_the_ranks_of_a_spawn_die_with_a_parent_killed_by_sigkill(tmp_path):
    """SIGKILL the process that called trainkit.spawn while its 2 ranks train: the fork server and both ranks are
    gone within seconds (a parent-death signal), not training on to the end of an epoch that never ends; no
    process of the job is left."""
    import signal

    from tests.faults.harness import Run

    run = Run(["-m", "tests.faults.orphans", str(tmp_path / "run")], tmp_path / "log")
    try:
        deadline = time.monotonic() + 90
        while run.stdout.count(" pid ") < 2 and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("rank ")]
        assert len(pids) == 2, run.stderr[-3000:]
        run.signal(signal.SIGKILL)
        assert run.proc.wait(timeout=30) == -signal.SIGKILL
        gone = time.monotonic() + 15
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            assert time.monotonic() < gone, f"ranks {pids} outlived their parent"
            time.sleep(0.05)
        run.assert_nothing_left(grace=15)  # the fork server and multiprocessing's resource tracker too
    finally:
        run.kill_session()
