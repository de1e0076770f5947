"""``python -m trainkit report OUT_DIR [--x step|epoch]``: a run's summary, and its curves drawn from ``metrics.jsonl``.

Side effects: reads the run folder; writes ``curves.png`` into it when asked to plot (matplotlib).

The curves' x axis is the optimizer step (``trainer/step``) or the epoch (``trainer/epoch``), both in every row
the trainer pushes. By default it is the step when the rows are per step (:func:`rows_per_step`: within one
epoch, the rows that hold a drawn metric sit at more than one step), else the epoch; an epoch-level run is drawn
as before. Rows from before ``trainer/step`` was logged are drawn against the epoch whatever is asked.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainkit.bookkeeping import best_metric_key
from trainkit.errors import ConfigError
from trainkit.run.read_metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "X_AXES",
    "summarize_run",
    "curve_panels",
    "rows_per_step",
    "choose_x_axis",
    "draw_curves",
    "plot_curves",
    "report",
    "format_value",
    "never_finite",
]

X_AXES = ("step", "epoch")
"""The x axes ``report --x`` takes: the optimizer step (``trainer/step``) or the epoch (``trainer/epoch``)."""

_AXIS_KEYS = {"step": "trainer/step", "epoch": "trainer/epoch"}

_RATES = ("perf/tokens_per_s", "perf/samples_per_s", "perf/steps_per_s")
"""The ``throughput`` panel's candidates, finest first: one rate in three units, so only the first logged is drawn."""


def summarize_run(out_dir: str | Path, rows: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Summarize a run folder: best epoch, step and metrics, stop reason, epochs and steps run, test metrics, and
    the drawn metrics that never had a finite value.

    :param out_dir: The run folder.
    :param rows: Its ``metrics.jsonl`` rows when already read; None reads them.
    :returns: The summary as plain values.
    """
    rows = read_metrics(out_dir) if rows is None else rows
    summary: dict[str, Any] = {"rows": len(rows)}
    last_path = Path(out_dir) / "last.pt"
    if last_path.is_file():
        from trainkit.checkpoint import load_checkpoint
        from trainkit.checkpoint.payload import validate_last

        ckpt = load_checkpoint(last_path)
        validate_last(ckpt, path=last_path)
        loop = ckpt.get("loop") or {}
        best = ckpt.get("best") or {}
        summary.update(
            epochs_run=loop.get("epoch"),
            steps_run=loop.get("step"),
            stopped_inside=bool(loop.get("in_epoch")),
            stop_reason=loop.get("stop_reason") or "not finished",
            best_epoch=best.get("epoch"),
            best_step=best.get("step"),
            best_score=best.get("score"),
            best_metrics=best.get("metrics", {}),
        )
    latest: dict[str, float] = {}
    for row in rows:
        latest.update(row)
    summary["test_metrics"] = {k: v for k, v in latest.items() if k.startswith("test/")}
    summary["never_finite"] = never_finite(rows)
    return summary


def _non_finite(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[int, int]:
    """How many of the key's numeric values are finite, and how many are not (NaN, inf: a curve leaves them out)."""
    values = [row[key] for row in rows if _is_number(row.get(key))]
    finite = sum(1 for value in values if math.isfinite(value))
    return finite, len(values) - finite


def never_finite(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The drawn metrics whose every value is NaN or infinite: their curves are empty.

    Pure.

    :param rows: The rows of ``metrics.jsonl``.
    :returns: Metric name to what it held, e.g. ``{"val/loss": "inf in all 3 rows"}``.

    >>> never_finite([{"val/loss": float("inf")}, {"val/loss": float("inf"), "train/loss": 1.0}])
    {'val/loss': 'inf in all 2 rows'}
    """
    empty = {}
    for key in (key for panel in curve_panels(rows).values() for key in panel["keys"]):
        finite, other = _non_finite(rows, key)
        if finite == 0 and other > 0:
            kinds = sorted({str(row[key]) for row in rows if _is_number(row.get(key))})
            empty[key] = f"{' or '.join(kinds)} in all {other} row{'s' * (other > 1)}"
    return empty


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _series(rows: Sequence[Mapping[str, Any]], key: str, axis: str = "epoch") -> tuple[list[float], list[float]]:
    """The key's finite values against ``axis`` (a row without a numeric epoch counts as the next one; on the
    step axis, a row without a numeric step is left out; NaN and inf are left out: :func:`draw_curves` says so)."""
    xs, ys = [], []
    for row in rows:
        value, x = row.get(key), row.get(_AXIS_KEYS[axis])
        if _is_number(value) and math.isfinite(value) and (axis == "epoch" or _is_number(x)):
            xs.append(x if _is_number(x) else len(xs))
            ys.append(value)
    return xs, ys


def curve_panels(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Decide the panels of ``curves.png``: one per metric name, its train/val curves and test point together.

    Pure. ``train/loss``, ``val/loss`` and ``test/loss`` share the ``loss`` panel; every ``lr/...`` key goes on
    the ``lr`` panel; the ``perf/...`` rates (``log_throughput``) are one measurement in three units, so one
    ``throughput`` panel draws the finest one logged (tokens, else samples, else steps per second); the training
    grad norms (``train/grad_norm``, ``train/grad_norm_epoch``) share a ``grad_norm`` panel, before ``lr``; the
    per-parameter ones (``params/...``) are left out. A panel whose values are all positive and span more than a
    decade (a loss, a decaying learning rate) gets a log axis.

    :param rows: The rows of ``metrics.jsonl``.
    :returns: Panel name to ``{"keys": [...], "log": bool}``, in drawing order (loss first, lr last).

    >>> panels = curve_panels([{"train/loss": 100.0, "lr/opt/0": 0.1}, {"train/loss": 0.5, "val/loss": 0.6,
    ...                        "test/loss": 0.7, "lr/opt/0": 0.1}])
    >>> panels["loss"], panels["lr"]
    ({'keys': ['test/loss', 'train/loss', 'val/loss'], 'log': True}, {'keys': ['lr/opt/0'], 'log': False})
    >>> panels = curve_panels([{"train/loss": 1.0, "perf/samples_per_s": 900.0, "perf/steps_per_s": 14.0,
    ...                         "train/grad_norm": 0.5, "lr/o/0": 1}])
    >>> list(panels), panels["throughput"]["keys"], panels["grad_norm"]["keys"]
    (['loss', 'grad_norm', 'throughput', 'lr'], ['perf/samples_per_s'], ['train/grad_norm'])
    """
    keys = sorted({key for row in rows for key in row})
    groups: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith("train/grad_norm"):
            groups.setdefault("grad_norm", []).append(key)
        elif key.startswith(("train/", "val/", "test/")) and "grad_norm" not in key:
            groups.setdefault(key.split("/", 1)[1], []).append(key)
        elif key.startswith("lr/"):
            groups.setdefault("lr", []).append(key)
    rate = next((key for key in _RATES if key in keys), None)
    if rate is not None:
        groups["throughput"] = [rate]
    order = sorted(groups, key=lambda name: (name != "loss", name == "lr", name))
    panels: dict[str, dict[str, Any]] = {}
    for name in order:
        values = [
            row[key]
            for row in rows
            for key in groups[name]
            if isinstance(row.get(key), int | float) and math.isfinite(row[key])
        ]
        log = bool(values) and min(values) > 0 and max(values) / min(values) > 10
        panels[name] = {"keys": groups[name], "log": log}
    return panels


def _drawn_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows holding a metric drawn as a curve: a ``train/``, ``val/``, ``lr/`` or ``perf/`` one (a test
    metric is one point at the end, a rollback or skipped-samples row no curve)."""
    keys = {key for panel in curve_panels(rows).values() for key in panel["keys"] if not key.startswith("test/")}
    return [row for row in rows if any(key in row for key in keys)]


def rows_per_step(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Tell whether a run's rows are per step: the rule that makes ``step`` the curves' default x axis.

    Pure. True when every row holding a drawn ``train/``, ``val/``, ``lr/`` or ``perf/`` metric carries a numeric
    ``trainer/step``, and those of some one ``trainer/epoch`` carry more than one step. A trainer that pushes
    once per epoch (its train and val metrics in the epoch's one row, or in rows pushed at the same step) is not
    per step; one that pushes inside the epoch (``push_logs()`` in its loop, every N steps) is, even when it
    pushes there only once per epoch: that row and the epoch's last sit at different steps.

    :param rows: The rows of ``metrics.jsonl``.
    :returns: Whether the rows are per step.

    >>> per_epoch = [{"trainer/step": 6, "trainer/epoch": 0, "train/loss": 2.0, "val/loss": 2.1},
    ...              {"trainer/step": 12, "trainer/epoch": 1, "train/loss": 1.0, "val/loss": 1.2}]
    >>> rows_per_step(per_epoch)
    False
    >>> rows_per_step([{"trainer/step": 5, "trainer/epoch": 0, "train/loss": 2.0},
    ...                {"trainer/step": 6, "trainer/epoch": 0, "val/loss": 2.1}])
    True
    >>> rows_per_step([{"trainer/epoch": 0, "train/loss": 2.0}, {"trainer/epoch": 0, "train/loss": 1.9}])
    False
    """
    drawn = _drawn_rows(rows)
    if not all(_is_number(row.get("trainer/step")) for row in drawn):
        return False
    steps: dict[Any, set[float]] = {}
    for row in drawn:
        steps.setdefault(row.get("trainer/epoch"), set()).add(row["trainer/step"])
    return any(len(seen) > 1 for seen in steps.values())


def _check_x(x: str | None, name: str = "--x", *, optional: bool = True) -> None:
    if not (x in X_AXES or (optional and x is None)):
        raise ConfigError(name, f"must be {' or '.join(map(repr, X_AXES))}", x)


def choose_x_axis(rows: Sequence[Mapping[str, Any]], asked: str | None = None) -> tuple[str, str]:
    """Choose the curves' x axis: the one asked, else ``step`` for rows per step (:func:`rows_per_step`), else
    ``epoch``.

    Pure. The step axis needs ``trainer/step`` in every row that holds a drawn metric; a run from before it was
    logged is drawn against the epoch even when the step was asked, and the note says so.

    :param rows: The rows of ``metrics.jsonl``.
    :param asked: ``"step"``, ``"epoch"``, or None for the default.
    :returns: The axis, and a note for the user when it is not the one asked (else empty).
    :raises ConfigError: When ``asked`` is none of :data:`X_AXES`, naming ``--x``.

    >>> rows = [{"trainer/epoch": 0, "train/loss": 2.0}, {"trainer/epoch": 1, "train/loss": 1.0}]
    >>> choose_x_axis(rows)
    ('epoch', '')
    >>> choose_x_axis(rows, "step")[0]
    'epoch'
    >>> choose_x_axis(rows, "foo")
    Traceback (most recent call last):
    ...
    trainkit.errors.ConfigError: --x must be 'step' or 'epoch', got 'foo'
    """
    _check_x(asked)
    if asked == "step" and not all(_is_number(row.get("trainer/step")) for row in _drawn_rows(rows)):
        return "epoch", (
            "--x step: some rows of metrics.jsonl carry no trainer/step (a run from an older trainkit);"
            " drawing against the epoch"
        )
    if asked is not None:
        return asked, ""
    return ("step" if rows_per_step(rows) else "epoch"), ""


def _best_x(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], axis: str) -> float | None:
    """Where the best line goes: the best epoch; on the step axis, the best's recorded step, else (a checkpoint
    from before it was recorded) the step of that epoch's validation row (the one holding the best metrics, else
    its last row with a ``val/`` metric)."""
    epoch = summary.get("best_epoch")
    if epoch is None or axis == "epoch":
        return epoch
    if summary.get("best_step") is not None:
        return summary["best_step"]
    validated = [row for row in rows if row.get("trainer/epoch") == epoch and any(k.startswith("val/") for k in row)]
    best = summary.get("best_metrics") or {}

    def holds_best(row: Mapping[str, Any]) -> bool:  # best/val/loss was logged as val/loss
        seen = {best_metric_key(k): v for k, v in row.items() if k.startswith("val/")}
        return bool(best) and all(seen.get(k) == v for k, v in best.items())

    chosen = ([row for row in validated if holds_best(row)] or validated)[-1:]
    return chosen[0]["trainer/step"] if chosen else None


def draw_curves(
    rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], *, axis: str = "epoch", title: str = ""
) -> Figure:
    """Draw the train/val curves, test points, the learning rate and the best epoch into a new figure.

    Side effects: creates a matplotlib figure (with the Agg backend); the caller closes it
    (``matplotlib.pyplot.close(fig)``). Panels come from :func:`curve_panels`. Each legend sits to the right of
    its panel and the title above them all, placed by matplotlib's constrained layout: none overlaps another.

    :param rows: The rows of ``metrics.jsonl``.
    :param summary: What :func:`summarize_run` returned.
    :param axis: The x axis, one of :data:`X_AXES` (see :func:`choose_x_axis`).
    :param title: The figure's title.
    :returns: The figure.
    :raises ConfigError: When ``axis`` is none of :data:`X_AXES`.
    :raises ImportError: When matplotlib is not installed, saying how to get it.
    """
    _check_x(axis, "axis", optional=False)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(
            "matplotlib is needed to draw curves: pip install 'trainkit[report]' (or matplotlib)"
        ) from None
    panels = curve_panels(rows)
    # a panel is as tall as its legend (a line of 8-point text per entry, the best line included), 2.6 in at least
    heights = [max(2.6, 0.5 + 0.19 * (len(panel["keys"]) + 1)) for panel in panels.values()] or [2.6]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(8.5, sum(heights)),
        height_ratios=heights,
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    best_x = _best_x(rows, summary, axis)
    for ax, (name, panel) in zip(axes[:, 0], panels.items()):
        empty = []
        for key in panel["keys"]:
            xs, ys = _series(rows, key, axis)
            finite, other = _non_finite(rows, key)
            label = key if not other else f"{key} ({other} non-finite not drawn)"
            if not finite:
                empty.append(key)
            if key.startswith("test/"):  # measured once, at the end, on the best weights: a point, not a curve
                ax.plot(xs[-1:], ys[-1:], marker="*", markersize=11, linestyle="none", label=f"{label} (best weights)")
            else:  # a dot per point while there are few enough to tell apart
                ax.plot(xs, ys, marker="o" if len(xs) <= 60 else None, markersize=3, label=label)
        if empty:  # an empty panel says why rather than look like a drawing bug
            held = summary.get("never_finite") or {}
            text = "\n".join(f"{key}: {held.get(key, 'no finite value')}" for key in empty)
            ax.text(0.5, 0.5, f"no finite value to draw\n{text}", transform=ax.transAxes, ha="center", va="center")
        if panel["log"]:
            ax.set_yscale("log")
        if best_x is not None:
            label = "best epoch" if axis == "epoch" else f"best (step {best_x})"
            ax.axvline(best_x, color="tab:red", linestyle="--", linewidth=1, label=label)
        ax.set_ylabel(name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step" if axis == "step" else "epoch")
    fig.suptitle(title)
    return fig


def plot_curves(
    out_dir: str | Path,
    summary: dict[str, Any],
    *,
    x: str | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> Path:
    """Draw the curves of :func:`draw_curves` into ``curves.png``, against the axis :func:`choose_x_axis` picks.

    Side effects: writes ``out_dir/curves.png`` (a new file renamed over it).

    :param out_dir: The run folder.
    :param summary: What :func:`summarize_run` returned.
    :param x: ``"step"``, ``"epoch"``, or None for the default (step for rows per step).
    :param rows: Its ``metrics.jsonl`` rows when already read; None reads them.
    :returns: The image path.
    :raises ConfigError: When ``x`` is none of :data:`X_AXES`.
    :raises ImportError: When matplotlib is not installed, saying how to get it.
    """
    rows = read_metrics(out_dir) if rows is None else rows
    axis, _ = choose_x_axis(rows, x)
    fig = draw_curves(rows, summary, axis=axis, title=f"{Path(out_dir).name}: stopped by {summary.get('stop_reason')}")
    import matplotlib.pyplot as plt

    path = Path(out_dir) / "curves.png"
    from trainkit.checkpoint import current_umask

    # drawn into a file of its own, then renamed over curves.png: a planted link is replaced, never written through
    fd, tmp = tempfile.mkstemp(prefix=".curves.", suffix=".png.tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, dpi=110, format="png")
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def format_value(value: Any) -> str:
    """A value as the command-line tools print it: a float to 4 significant digits, anything else as ``str``.

    :param value: The value.
    :returns: Its text.

    >>> format_value(0.123456), format_value(3)
    ('0.1235', '3')
    """
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def report(out_dir: str, plot: bool = True, x: str | None = None) -> int:
    """Print a run's summary and draw its curves; the ``report`` command.

    :param out_dir: The run folder.
    :param plot: Also write ``curves.png``.
    :param x: The curves' x axis, ``"step"`` or ``"epoch"``; None: step for rows per step, else epoch
        (:func:`choose_x_axis`).
    :returns: The process exit code.
    :raises ConfigError: When ``x`` is none of :data:`X_AXES`, before anything is read.
    :raises FileNotFoundError: When the run folder has no readable ``metrics.jsonl``.
    """
    _check_x(x)
    rows = read_metrics(out_dir)
    summary = summarize_run(out_dir, rows)
    inside = f" (stopped inside epoch {summary['epochs_run']})" if summary.get("stopped_inside") else ""
    best_step = summary.get("best_step")
    if best_step is None and summary.get("best_epoch") is not None:
        best_step = _best_x(rows, summary, "step")  # a checkpoint from before the best's step was recorded
    print(f"run:          {out_dir}")
    print(f"epochs run:   {summary.get('epochs_run')}{inside}")
    print(f"steps run:    {summary.get('steps_run')}")
    print(f"stop reason:  {summary.get('stop_reason')}")
    at_step = "" if best_step is None else f", step {best_step}"
    print(f"best epoch:   {summary.get('best_epoch')}{at_step}  (score {format_value(summary.get('best_score'))})")
    for key, value in sorted((summary.get("best_metrics") or {}).items()):
        print(f"  {key}: {format_value(value)}")
    for key, value in sorted(summary["test_metrics"].items()):
        print(f"{key}: {format_value(value)}")
    for key, what in summary["never_finite"].items():
        print(f"note: {key} has no finite value ({what}): its curve is empty")
    if plot:
        axis, note = choose_x_axis(rows, x)
        if note:
            print(f"note: {note}", file=sys.stderr)
        try:
            path = plot_curves(out_dir, summary, x=axis, rows=rows)
        except ImportError as exc:
            print(f"no curves: {exc}", file=sys.stderr)
            return 0
        print(f"curves:       {path} (against the {axis})")
    return 0
