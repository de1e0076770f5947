"""tqdm bars: what a real run writes to stderr, how often, and that disabled or non-main bars write nothing."""

from __future__ import annotations

import io
import itertools
import re
import sys

import pytest
import tqdm.std

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer, train_and_close
from trainkit.loop.progress import NON_TTY_INTERVAL_S, TTY_INTERVAL_S, EpochBar, step_bar


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
