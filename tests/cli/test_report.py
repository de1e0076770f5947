"""``python -m trainkit report``: the curves' x axis (``--x step|epoch``, step by default for rows per step) and
a layout in which the title and the legends overlap nothing.

The runs are real (a trainer that pushes a row every step, one that pushes once per epoch) or real
``metrics.jsonl`` files written by hand (a run from before ``trainer/step`` was logged); the checks read the drawn
lines' data, not pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import GuardTrainer, TinyTrainer, train_and_close
from trainkit.cli import main as cli_main
from trainkit.cli.report import choose_x_axis, draw_curves, rows_per_step, summarize_run
from trainkit.run.read_metrics import read_metrics

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(scope="module")
def per_step_run(tmp_path_factory) -> Path:
    """A 2-epoch run of 6 steps an epoch that pushes a train/loss row after every step, and val/loss at the end."""
    out = tmp_path_factory.mktemp("per_step")
    train_and_close(GuardTrainer(make_cfg(out, epochs=2, push_every_step=True)))
    return out


@pytest.fixture(scope="module")
def per_epoch_run(tmp_path_factory) -> Path:
    """A 3-epoch run that pushes one row an epoch (train/loss, val/loss, the learning rate)."""
    out = tmp_path_factory.mktemp("per_epoch")
    TinyTrainer(make_cfg(out, epochs=3)).train()
    return out


def write_rows(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def drawn(out: Path, axis: str) -> dict[str, list[float]]:
    """Each line's x data by its legend label, as :func:`draw_curves` draws the run against ``axis``."""
    fig = draw_curves(read_metrics(out), summarize_run(out), axis=axis)
    try:
        return {line.get_label(): list(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()}
    finally:
        plt.close(fig)


def steps_of(out: Path, key: str) -> list[int]:
    return [row["trainer/step"] for row in read_metrics(out) if key in row]


def test_a_run_that_pushes_every_step_is_drawn_against_the_step_by_default(per_step_run, capsys):
    """Per-step rows go on the step axis by default: train/loss at each of its steps, in order (no stack of
    points at a whole epoch), val/loss at the epochs' last steps, the best line at the best validation's step."""
    rows = read_metrics(per_step_run)
    assert choose_x_axis(rows) == ("step", "")
    assert cli_main(["report", str(per_step_run)]) == 0
    assert f"curves:       {per_step_run / 'curves.png'} (against the step)" in capsys.readouterr().out
    lines = drawn(per_step_run, "step")
    train = lines["train/loss"]
    assert train == steps_of(per_step_run, "train/loss") and train == sorted(set(train)) and len(train) >= 12
    assert lines["val/loss"] == [6, 12]
    summary = summarize_run(per_step_run)
    best_step = 6 * (summary["best_epoch"] + 1)
    assert summary["best_step"] == best_step and lines[f"best (step {best_step})"] == [best_step] * 2


def test_a_run_that_pushes_once_an_epoch_is_still_drawn_against_the_epoch(per_epoch_run, capsys):
    """An epoch-level run keeps today's axis: one point an epoch at 0, 1, 2, the best line at the best epoch."""
    assert not rows_per_step(read_metrics(per_epoch_run))
    assert cli_main(["report", str(per_epoch_run)]) == 0
    assert "(against the epoch)" in capsys.readouterr().out
    lines = drawn(per_epoch_run, "epoch")
    assert lines["train/loss"] == lines["val/loss"] == [0, 1, 2]
    assert lines["best epoch"] == [summarize_run(per_epoch_run)["best_epoch"]] * 2


@pytest.mark.parametrize(("run", "asked"), [("per_step_run", "epoch"), ("per_epoch_run", "step")])
def test_x_picks_the_other_axis_when_asked(request, capsys, run, asked):
    """--x overrides the default either way: per-step rows at their epochs, per-epoch rows at their steps."""
    out = request.getfixturevalue(run)
    assert cli_main(["report", str(out), "--x", asked]) == 0
    captured = capsys.readouterr()
    assert f"(against the {asked})" in captured.out and captured.err == ""
    key = "trainer/epoch" if asked == "epoch" else "trainer/step"
    assert drawn(out, asked)["train/loss"] == [row[key] for row in read_metrics(out) if "train/loss" in row]


@pytest.mark.parametrize("extra", [[], ["--no-plot"]])
def test_an_unknown_x_is_one_line_naming_the_option_and_exit_status_2(per_epoch_run, capsys, extra):
    """--x foo is refused before anything is printed: one error line naming --x, the allowed values and foo."""
    assert cli_main(["report", str(per_epoch_run), "--x", "foo", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["error: --x must be 'step' or 'epoch', got 'foo'"]


def test_rows_without_trainer_step_are_drawn_against_the_epoch_with_a_note_when_step_was_asked(tmp_path, capsys):
    """A run from before trainer/step was logged: --x step draws against the epoch and says why in one line;
    without --x there is nothing to say."""
    out = write_rows(tmp_path / "old", [{"trainer/epoch": e, "train/loss": 1 / (e + 1)} for e in range(3)])
    assert cli_main(["report", str(out), "--x", "step"]) == 0
    captured = capsys.readouterr()
    assert "(against the epoch)" in captured.out
    assert captured.err.splitlines() == [
        "note: --x step: some rows of metrics.jsonl carry no trainer/step (a run from an older trainkit);"
        " drawing against the epoch"
    ]
    assert drawn(out, choose_x_axis(read_metrics(out), "step")[0])["train/loss"] == [0, 1, 2]
    assert cli_main(["report", str(out)]) == 0
    assert capsys.readouterr().err == ""


def test_rows_per_step_counts_the_steps_of_the_drawn_rows_of_one_epoch():
    """The rule: rows pushed inside an epoch (even once, every N steps) make a run per step; rows pushed at one
    step (train and val apart), rollback and test rows do not; a row without trainer/step makes it per epoch."""
    end = {"trainer/step": 12, "trainer/epoch": 1, "val/loss": 1.0, "lr/opt/0": 0.1}
    every_10 = [{"trainer/step": 10, "trainer/epoch": 1, "train/loss": 1.5}, end]
    assert rows_per_step(every_10)
    apart = [{"trainer/step": 12, "trainer/epoch": 1, "train/loss": 1.5}, end]
    assert not rows_per_step(apart)
    others = [{"trainer/step": 9, "trainer/epoch": 1, "guard/rollback": 9}, {"trainer/step": 3, "trainer/epoch": 1}]
    assert not rows_per_step([*apart, *others, {"trainer/step": 13, "trainer/epoch": 1, "test/loss": 1.1}])
    assert not rows_per_step([{"trainer/epoch": 1, "train/loss": 1.5}, *every_10])


metric_keys = st.sampled_from(["train/loss", "val/loss", "val/acc", "lr/opt/0", "perf/steps_per_s"])


@given(
    epochs=st.lists(st.lists(st.sets(metric_keys, min_size=1), min_size=1, max_size=3), min_size=1, max_size=5),
    data=st.data(),
)
def test_rows_split_at_each_epochs_end_are_per_epoch_and_one_row_inside_an_epoch_makes_them_per_step(epochs, data):
    """However an epoch-level run splits its pushes, rows at one step an epoch are per epoch; one more row with
    a drawn metric at another step of any epoch makes them per step, and the default axis follows."""
    rows = [
        {"trainer/step": 6 * (epoch + 1), "trainer/epoch": epoch, **dict.fromkeys(keys, 1.0)}
        for epoch, pushes in enumerate(epochs)
        for keys in pushes
    ]
    assert not rows_per_step(rows) and choose_x_axis(rows) == ("epoch", "")
    epoch = data.draw(st.integers(0, len(epochs) - 1))
    inside = {"trainer/step": 6 * epoch + data.draw(st.integers(1, 5)), "trainer/epoch": epoch}
    rows.insert(data.draw(st.integers(0, len(rows))), {**inside, data.draw(metric_keys): 2.0})
    assert rows_per_step(rows) and choose_x_axis(rows) == ("step", "")


@pytest.mark.parametrize("axis", ["step", "epoch"])
def test_the_title_and_the_legends_overlap_nothing(axis):
    """With every kind of panel and a legend of 20 learning rates, the title overlaps no legend and no panel,
    and each legend lies inside the figure, clear of every panel and every other legend."""
    rows = [
        {
            "trainer/step": 10 * (epoch + 1),
            "trainer/epoch": epoch,
            "train/loss": 1 / (epoch + 1),
            "val/loss": 1.1 / (epoch + 1),
            "val/acc": 0.5 + epoch / 10,
            "perf/samples_per_s": 900.0 + epoch,
            **{f"lr/opt/group{group}": 0.1 * group for group in range(20)},
        }
        for epoch in range(4)
    ]
    rows.append({"trainer/step": 40, "trainer/epoch": 3, "test/loss": 0.3, "test/acc": 0.8})
    summary = {"best_epoch": 2, "best_metrics": {"best/val/loss": 1.1 / 3}}
    fig = draw_curves(rows, summary, axis=axis, title="a run: stopped by max_epochs")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (title,) = [text.get_window_extent(renderer) for text in fig.texts if text.get_text().startswith("a run")]
        panels = [ax.get_window_extent(renderer) for ax in fig.axes]
        legends = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes]
        assert len(legends) == 4 and not any(box.overlaps(title) for box in [*panels, *legends])
        for index, legend in enumerate(legends):
            assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)
            assert not any(legend.overlaps(other) for other in [*panels, *legends[:index], *legends[index + 1 :]])
        best = [list(line.get_xdata()) for line in fig.axes[0].get_lines() if line.get_label().startswith("best")]
        assert best == [[{"step": 30, "epoch": 2}[axis]] * 2]
    finally:
        plt.close(fig)
