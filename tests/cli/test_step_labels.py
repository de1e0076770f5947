"""A run measured in steps reads as steps in ``inspect`` and ``report``: where a step checkpoint stands, the best's
step, the steps run, a best line labelled with its step, one throughput panel, a grad-norm panel, and a metric that
was never finite said so instead of an empty panel.

The run is real (11 optimizer steps of GuardTrainer's 6 an epoch, a row every step, validation every 4 steps); the
inf-only metric is a ``metrics.jsonl`` written by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import GuardTrainer, train_and_close
from trainkit.cli import main as cli_main
from trainkit.cli.inspect import describe_checkpoint
from trainkit.cli.report import curve_panels, draw_curves, summarize_run
from trainkit.run.read_metrics import read_metrics

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(scope="module")
def steps_run(tmp_path_factory) -> Path:
    """11 steps with max_steps (6 an epoch: it ends inside epoch 1), a row every step with throughput and the grad
    norm, validation every 4 steps."""
    out = tmp_path_factory.mktemp("steps")
    cfg = make_cfg(out, epochs=None, max_steps=11, push_every_step=True, log_throughput=True, val={"every_n_steps": 4})
    train_and_close(GuardTrainer(cfg))
    return out


def labels(rows, summary, axis="step") -> list[list[str]]:
    """Each panel's legend labels as :func:`draw_curves` draws them."""
    fig = draw_curves(rows, summary, axis=axis)
    try:
        return [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]
    finally:
        plt.close(fig)


def test_inspect_says_where_a_step_checkpoint_stands_inside_its_epoch(steps_run):
    """The last.pt of the run stopped at step 11 is inside epoch 1 (5 of its 6 batches done, where a raised
    max_steps continues), not 'epoch 1 done' at an epoch's end; best.pt says the best's step beside its epoch."""
    lines = describe_checkpoint(steps_run / "last.pt")
    stopped = "epoch:        1, step 11 (inside the epoch: 5 of 6 batches done; the run stopped here: max_steps)"
    assert f"{stopped}, world size 1" in lines
    assert any(line.startswith("position:     inside epoch 1: 5 of 6 batches done") for line in lines), lines
    best = summarize_run(steps_run)
    assert best["best_step"] in (4, 8) and best["best_epoch"] == (best["best_step"] - 1) // 6
    assert f"best epoch:   {best['best_epoch']}, step {best['best_step']}" in describe_checkpoint(steps_run / "best.pt")


def test_report_gives_the_steps_run_and_the_best_step_and_labels_the_best_line_with_it(steps_run, capsys):
    """report prints the steps run, the epoch it stopped inside and the best's step; its best line is labelled with
    the step; the three rates make one throughput panel and the grad norm a panel of its own."""
    assert cli_main(["report", str(steps_run)]) == 0
    out = capsys.readouterr().out
    summary = summarize_run(steps_run)
    step = summary["best_step"]
    assert "epochs run:   1 (stopped inside epoch 1)\nsteps run:    11\nstop reason:  max_steps\n" in out
    assert f"best epoch:   {summary['best_epoch']}, step {step}  (score " in out
    rows = read_metrics(steps_run)
    panels = curve_panels(rows)
    assert panels["throughput"]["keys"] == ["perf/samples_per_s"] and not any(
        name.endswith("_per_s") for name in panels
    )
    assert panels["grad_norm"]["keys"] == ["train/grad_norm"]
    drawn = labels(rows, summary)
    assert all(f"best (step {step})" in panel for panel in drawn)
    assert not any("best (epoch" in label for panel in drawn for label in panel)


def test_a_metric_that_was_never_finite_is_said_so_not_drawn_as_an_empty_panel(tmp_path, capsys):
    """A val/loss that is inf in every row leaves its curve empty: the panel says there is no finite value, and
    report's summary says which metric and what it held."""
    rows = [
        {"trainer/step": step, "trainer/epoch": 0, "train/loss": 1.0 / step, "val/bpb": float("inf")}
        for step in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli_main(["report", str(tmp_path)]) == 0
    assert "note: val/bpb has no finite value (inf in all 3 rows): its curve is empty" in capsys.readouterr().out
    fig = draw_curves(read_metrics(tmp_path), summarize_run(tmp_path), axis="step")
    try:
        texts = [text.get_text() for ax in fig.axes for text in ax.texts]
        assert texts == ["no finite value to draw\nval/bpb: inf in all 3 rows"]
        (bpb,) = [line for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith("val/bpb")]
        assert bpb.get_label() == "val/bpb (3 non-finite not drawn)" and len(bpb.get_xdata()) == 0
    finally:
        plt.close(fig)
