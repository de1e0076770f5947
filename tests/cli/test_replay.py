"""``python -m trainkit replay``: a run's validation scores replayed through the pure core under other settings.

Checked against the real stop epochs of runs trained with those settings.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import StepValTrainer, TinyTrainer
from trainkit.cli.replay import format_replay, replay_guard_run, replay_run

SETTINGS = [
    {"patience": 1, "min_delta": 0.05},
    {"patience": 2, "min_delta": 0.05},
    {"patience": 1, "min_delta": 0.02, "start_patience": 4},
    {"patience": 3, "min_delta": 0.2},
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 10-epoch run without early stopping: the recording every replay reads."""
    out = tmp_path_factory.mktemp("recorded")
    TinyTrainer(make_cfg(out, epochs=10, lr=0.2)).train()
    return out


@pytest.mark.parametrize("val", SETTINGS, ids=lambda v: " ".join(f"{k}={w}" for k, w in v.items()))
def test_replay_predicts_the_stop_and_best_epochs_of_a_real_run(recorded, tmp_path, val):
    """Replaying the recording with some val.* settings gives the stop and best epochs a run trained with them had."""
    words = [f"val.{key}={value}" for key, value in val.items()]
    _, replayed = replay_run(recorded, words, metric="val/loss")
    trained = TinyTrainer(make_cfg(tmp_path, epochs=10, lr=0.2, val={"minimize": True, **val}))
    trained.train()
    import torch

    stop_reason = torch.load(tmp_path / "last.pt", weights_only=True)["loop"]["stop_reason"]
    stopped = trained.epochs_trained[-1] if stop_reason == "early_stop" else None
    assert replayed.stop_epoch == stopped
    assert (replayed.best_epoch, replayed.best_score) == (trained.best_state.epoch, trained.best_state.score)


def test_the_settings_do_stop_somewhere_in_the_recording(recorded):
    """The settings above are not vacuous: most of them stop the recorded run early."""
    stops = [replay_run(recorded, [f"val.{k}={v}" for k, v in val.items()])[1].stop_epoch for val in SETTINGS]
    assert sum(stop is not None for stop in stops) >= 2, stops


def test_replay_command_prints_both_sides_and_imports_no_torch(recorded):
    """The command prints what happened and what would have, and never imports torch."""
    code = (
        "import sys; from trainkit.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "replay", str(recorded), "val.patience=1", "val.min_delta=0.05"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "recorded:     validated up to epoch 9" in proc.stdout
    assert "with val.patience=1 val.min_delta=0.05:" in proc.stdout
    assert "would have stopped after epoch" in proc.stdout or "would have continued past epoch 9" in proc.stdout


def test_replay_of_a_short_recording_says_it_cannot_tell(tmp_path):
    """A patience the recording never exhausts is reported as 'would have continued past', not as a stop."""
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"trainer/epoch": e, "val/loss": 1.0 / (e + 1)}) for e in range(4)) + "\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit", "replay", str(tmp_path), "val.patience=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "would have continued past epoch 3" in proc.stdout


def test_replay_errors_are_one_line(tmp_path):
    """A typo in a setting, or a metric the run never logged, is one line and exit status 2."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"trainer/epoch": 0, "val/loss": 1.0}) + "\n")
    for words in (["val.paitence=2"], ["--metric", "val/acc"]):
        proc = subprocess.run(
            [sys.executable, "-m", "trainkit", "replay", str(tmp_path), *words],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_guard_replay_fires_where_the_guard_of_a_real_run_fires(tmp_path):
    """A run that skipped three planted NaNs (one row per step) replays, under a budget of 2 within 3 steps, into
    a stop at the step where a run trained with that budget stopped; the command says so without torch."""
    from tests.helpers.trainers import GuardTrainer
    from trainkit.errors import DivergenceError

    planted = {"nan_batches": (3, 7, 9), "push_every_step": True, "epochs": 2}
    skipper = GuardTrainer(make_cfg(tmp_path / "skip", **planted, guard={"nonfinite": "skip"}))
    skipper.train()
    skipper.close()
    budget = ["guard.max_skips=2", "guard.window=3"]
    replayed = replay_guard_run(tmp_path / "skip", budget)
    assert replayed.recorded_skips == 3 and replayed.non_finite == 3
    budgeted = {"nonfinite": "skip", "max_skips": 2, "window": 3}
    stopper = GuardTrainer(make_cfg(tmp_path / "stop", **planted, guard=budgeted))
    try:
        with pytest.raises(DivergenceError) as info:
            stopper.train()
    finally:
        stopper.close()
    # a row's trainer/step counts the steps taken by its push: the step judged, plus one
    assert replayed.fired == ((4, "skip"), (8, "skip"), (info.value.step + 1, "raise"))
    assert info.value.step + 1 == 10
    narrower = replay_guard_run(tmp_path / "skip", ["window=2", "max_skips=2"])
    assert narrower.fired == ((4, "skip"), (8, "skip"), (10, "skip"))
    code = (
        "import sys; from trainkit.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "replay", "--guard", str(tmp_path / "skip"), *budget],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 non-finite; guard/skipped_steps 3" in proc.stdout
    assert "would have skipped steps 4, 8\n  would have stopped (raise) before step 10" in proc.stdout


def test_replay_understands_validation_every_n_steps(tmp_path):
    """A run measured in steps (one epoch, validated every 2 steps, patience off) replayed with patience 2: it
    would have stopped at the validation of the step where patience ran out, told in steps."""
    scores = (5.0, 1.0, 3.0, 4.0, 0.5, 0.4)
    trainer = StepValTrainer(make_cfg(tmp_path, epochs=None, max_steps=12, val={"every_n_steps": 2,
                                      "every_n_epochs": 100}, scripted_scores=scores))
    try:
        trainer.train()
    finally:
        trainer.close()
    recorded, replayed = replay_run(tmp_path, ["val.patience=2"])
    assert recorded.per_step and (recorded.best_step, recorded.last_step) == (12, 12)
    assert (replayed.stop_step, replayed.best_step, replayed.best_score) == (8, 4, 1.0)
    lines = format_replay(recorded, replayed, ["val.patience=2"], "val/loss")
    assert "would have stopped at the validation of step 8 (epoch 1)" in lines[3]
