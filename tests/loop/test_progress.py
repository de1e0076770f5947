"""tqdm bars: what a real run writes to stderr, how often, and that disabled or non-main bars write nothing."""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tqdm.std

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer, train_and_close
from trainkit.loop.progress import NON_TTY_INTERVAL_S, TTY_INTERVAL_S, EpochBar, StepBar, step_bar

ROOT = Path(__file__).resolve().parents[2]


class TTYStream(io.StringIO):
    """An in-memory stderr that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


BARS = {"epochs": 2, "ckpt": {"enable": False}, "progress": {"enable": True}, "val": {"minimize": False}}
"""What this module's runs put over make_cfg's defaults: 2 epochs, no checkpoints, the bars on, and the engine's
default direction (the validation loss maximized)."""


def fake_terminal(monkeypatch) -> TTYStream:
    """Make stderr a terminal, as far as the bars can tell (call it in the test body: pytest's capture
    reinstalls its own sys.stderr after fixtures are set up)."""
    stream = TTYStream()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


@pytest.fixture
def slow_clock(monkeypatch):
    """Make every tqdm clock read one second later than the last, so each step looks like it took a second."""
    ticks = itertools.count(1_000_000.0, 1.0)
    monkeypatch.setattr(tqdm.std, "time", lambda: next(ticks))


def redraws(text: str, desc: str) -> int:
    """How many times a bar labelled ``desc`` was drawn."""
    return len(re.findall(rf"\r{re.escape(desc)}:", text))


def test_epoch_bar_shows_best_metrics_without_prefix(tmp_path, capsys):
    """With progress.enable a run writes an epoch bar to stderr whose postfix is the best metrics minus best/val/."""
    trainer = TinyTrainer(make_cfg(tmp_path, BARS))
    train_and_close(trainer)
    err = capsys.readouterr().err
    best = trainer.best_metrics["best/val/loss"]
    final = err.rsplit("\r", 1)[-1]
    assert final.startswith("epochs: 100%")
    assert "2/2" in final
    assert f"loss={best:.4g}" in final
    assert "best/val" not in err and "val/loss" not in err


def test_a_run_on_a_terminal_also_draws_step_bars(tmp_path, monkeypatch):
    """On a terminal self.progress() adds a transient per-step bar labelled with the epoch under the epoch bar."""
    tty = fake_terminal(monkeypatch)
    trainer = TinyTrainer(make_cfg(tmp_path, BARS))
    train_and_close(trainer)
    out = tty.getvalue()
    assert redraws(out, "epoch 0") >= 1 and redraws(out, "epoch 1") >= 1
    assert f"loss={trainer.best_metrics['best/val/loss']:.4g}" in out


def test_disabled_progress_writes_nothing_to_stderr(tmp_path, capfd):
    """With progress.enable false a whole run writes nothing to stderr."""
    train_and_close(TinyTrainer(make_cfg(tmp_path, BARS, progress={"enable": False})))
    captured = capfd.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("trainkit: ")  # the rank-0 summary still prints, to stdout


def test_epoch_bar_redraws_rarely_when_stderr_is_not_a_terminal(capsys, slow_clock):
    """Off a terminal the epoch bar redraws at most every NON_TTY_INTERVAL_S: 200 one-second epochs draw a handful."""
    bar = EpochBar(total=200, initial=0, enabled=True)
    for _ in range(200):
        bar.update({"loss": 0.5})
    bar.close()
    count = redraws(capsys.readouterr().err, "epochs")
    assert 2 <= count <= 200 / NON_TTY_INTERVAL_S + 3


def test_epoch_bar_redraws_often_on_a_terminal(monkeypatch, slow_clock):
    """On a terminal the same epoch bar redraws about every epoch (the contrast to the test above)."""
    tty = fake_terminal(monkeypatch)
    bar = EpochBar(total=200, initial=0, enabled=True)
    for _ in range(200):
        bar.update({"loss": 0.5})
    bar.close()
    assert redraws(tty.getvalue(), "epochs") > 100


def test_step_bar_off_a_terminal_draws_at_most_a_handful_of_times(capsys, slow_clock):
    """Off a terminal 200 one-second steps through step_bar() write at most a handful of redraws (or no bar at all)."""
    bar = step_bar(range(200), desc="steps", total=None, enabled=True)
    assert getattr(bar, "mininterval", NON_TTY_INTERVAL_S) == NON_TTY_INTERVAL_S
    assert list(bar) == list(range(200))
    assert redraws(capsys.readouterr().err, "steps") <= 200 / NON_TTY_INTERVAL_S + 3


def test_step_bar_on_a_terminal_redraws_often(monkeypatch, slow_clock):
    """On a terminal step_bar() is a tqdm bar at TTY_INTERVAL_S that redraws about every step."""
    tty = fake_terminal(monkeypatch)
    bar = step_bar(range(200), desc="steps", total=None, enabled=True)
    assert bar.mininterval == TTY_INTERVAL_S
    assert list(bar) == list(range(200))
    assert redraws(tty.getvalue(), "steps") > 100


def test_long_run_off_a_terminal_writes_few_lines(tmp_path, capsys, slow_clock):
    """A real 192-step epoch with stderr not a terminal writes only a handful of bar redraws in all."""
    train_and_close(TinyTrainer(make_cfg(tmp_path, BARS, epochs=1, batch_size=1)))
    err = capsys.readouterr().err
    assert redraws(err, "epoch 0") <= 192 / NON_TTY_INTERVAL_S + 3
    assert 1 <= redraws(err, "epochs") <= 3
    assert err.count("\r") <= 192 / NON_TTY_INTERVAL_S + 6


def test_disabled_step_bar_is_the_iterable_itself():
    """step_bar(..., enabled=False) hands back the very iterable it was given, at zero cost per step."""
    batches = [1, 2, 3]
    assert step_bar(batches, desc="x", total=3, enabled=False) is batches


def test_non_main_rank_gets_no_bars(tmp_path, monkeypatch, capsys):
    """Off rank 0, progress() returns the iterable itself and a whole run draws no bar, even on a terminal."""
    tty = fake_terminal(monkeypatch)
    trainer = TinyTrainer(make_cfg(tmp_path, BARS))
    trainer.is_main = False  # what rank 1 of a process group sees; progress.enable stays true
    batches = [1, 2, 3]
    assert trainer.progress(batches) is batches
    train_and_close(trainer)
    assert tty.getvalue() == ""
    assert capsys.readouterr().out == ""  # the summary is rank 0's too


def test_main_rank_progress_wraps_the_iterable(tmp_path, monkeypatch):
    """On rank 0 with bars on (and a terminal), progress() yields the same items under a bar labelled with the epoch."""
    tty = fake_terminal(monkeypatch)
    trainer = TinyTrainer(make_cfg(tmp_path, BARS))
    try:
        trainer.epoch = 3
        batches = [1, 2, 3]
        wrapped = trainer.progress(batches)
        assert wrapped is not batches
        assert list(wrapped) == batches
        assert "epoch 3:" in tty.getvalue()
    finally:
        trainer.close()


STEPS = {"epochs": None, "max_steps": 7}
"""A run measured in steps: 7 optimizer steps, which end inside the second epoch of TinyTrainer's 6."""


def test_a_run_measured_in_steps_ends_with_a_line_in_steps(tmp_path, capsys):
    """The final line of a max_steps run leads with the steps run, says inside which epoch it stopped, and gives
    the stop reason at its step."""
    train_and_close(TinyTrainer(make_cfg(tmp_path, BARS, STEPS, progress={"enable": False})))
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "trainkit: steps_run=7, epochs_run=1 (stopped inside epoch 1), stop_reason=max_steps (step 7), "
    )
    assert "best/step=" in line


def test_a_run_measured_in_steps_draws_one_bar_of_optimizer_steps_with_eta_and_loss(tmp_path, monkeypatch):
    """On a terminal a max_steps run draws a 'steps' bar out of max_steps (with an ETA and the latest train loss),
    not a bar of micro-batches per epoch nor an epoch bar without a total."""
    tty = fake_terminal(monkeypatch)
    train_and_close(TinyTrainer(make_cfg(tmp_path, BARS, STEPS)))
    out = tty.getvalue()
    final = out.rsplit("\rsteps:", 1)[-1]
    assert re.search(r"7/7 \[\d\d:\d\d<\d\d:\d\d", final) and "loss=" in final
    assert redraws(out, "steps") >= 2 and redraws(out, "epoch 0") == 0 and redraws(out, "epochs") == 0


def test_a_resumed_step_bar_starts_at_the_resumed_step(monkeypatch):
    """A resumed run's bar stands at its step out of max_steps from the start."""
    tty = fake_terminal(monkeypatch)
    bar = StepBar(total=150, initial=50, enabled=True)
    bar.advance(51, {"loss": 2.5})
    bar.close()
    assert "51/150" in tty.getvalue() and "loss=2.5" in tty.getvalue()


def test_off_a_terminal_the_step_bar_prints_plain_lines_at_a_bounded_rate(capsys):
    """Off a terminal 200 one-second steps print a plain 'trainkit: step N/200' line at most every 30 s (and one
    at the end), with the rate and ETA of this run's steps: no tqdm redraws."""
    ticks = itertools.count(0.0, 1.0)
    bar = StepBar(total=200, initial=20, enabled=True, plain_interval_s=30.0, clock=lambda: next(ticks))
    for step in range(21, 201):
        bar.advance(step, {"loss": 1.0 / step})
    bar.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 4 <= len(lines) <= 180 / 30 + 2
    assert all(
        re.fullmatch(r"trainkit: step \d+/200 \(\d+%\), [\d.]+ steps/s, ETA [\d:]+, loss=[\d.e-]+", x) for x in lines
    )
    assert lines[-1].startswith("trainkit: step 200/200 (100%)")


def test_a_run_with_stderr_in_a_file_writes_plain_step_lines(tmp_path):
    """A real max_steps run whose stderr is a file (a job's log) writes plain step lines there, bounded by
    progress.plain_interval_s (an hour: only the closing line), and no carriage return."""
    script = (
        "from tests.helpers.configs import make_cfg\n"
        "from tests.helpers.trainers import TinyTrainer, train_and_close\n"
        f"cfg = make_cfg({str(tmp_path / 'run')!r}, {BARS!r}, {STEPS!r}, progress={{'plain_interval_s': 3600}})\n"
        "train_and_close(TinyTrainer(cfg))\n"
    )
    log = tmp_path / "job.log"
    with open(log, "w") as handle:
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=handle, text=True, timeout=120
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-2000:]
    steps = [line for line in text.splitlines() if line.startswith("trainkit: step ")]
    assert len(steps) == 1 and steps[0].startswith("trainkit: step 7/7 (100%)") and "\r" not in text
