"""``python -m trainkit report OUT_DIR``: a run's summary, and its curves drawn from ``metrics.jsonl``.

Side effects: reads the run folder; writes ``curves.png`` into it when asked to plot (matplotlib).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainkit.run.read_metrics import read_metrics

__all__ = [
    "summarize_run",
    "curve_panels",
    "plot_curves",
    "report",
    "format_value",
]


def summarize_run(out_dir: str | Path) -> dict[str, Any]:
    """Summarize a run folder: best epoch and metrics, stop reason, epochs run, test metrics.

    :param out_dir: The run folder.
    :returns: The summary as plain values.
    """
    rows = read_metrics(out_dir)
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
            stop_reason=loop.get("stop_reason") or "not finished",
            best_epoch=best.get("epoch"),
            best_score=best.get("score"),
            best_metrics=best.get("metrics", {}),
        )
    latest: dict[str, float] = {}
    for row in rows:
        latest.update(row)
    summary["test_metrics"] = {k: v for k, v in latest.items() if k.startswith("test/")}
    return summary


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """The key's numeric values against their epochs (a row without a numeric epoch counts as the next one)."""
    xs, ys = [], []
    for row in rows:
        value, epoch = row.get(key), row.get("trainer/epoch")
        if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
            xs.append(epoch if isinstance(epoch, int | float) and not isinstance(epoch, bool) else len(xs))
            ys.append(value)
    return xs, ys


def curve_panels(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Decide the panels of ``curves.png``: one per metric name, its train/val curves and test point together.

    Pure. ``train/loss``, ``val/loss`` and ``test/loss`` share the ``loss`` panel; every ``lr/...`` key goes on
    the ``lr`` panel; each ``perf/...`` rate (``log_throughput``) gets a panel of its own, before ``lr``; grad
    norms are left out. A panel whose values are all positive and span more than a decade (a loss, a decaying
    learning rate) gets a log axis.

    :param rows: The rows of ``metrics.jsonl``.
    :returns: Panel name to ``{"keys": [...], "log": bool}``, in drawing order (loss first, lr last).

    >>> panels = curve_panels([{"train/loss": 100.0, "lr/opt/0": 0.1}, {"train/loss": 0.5, "val/loss": 0.6,
    ...                        "test/loss": 0.7, "lr/opt/0": 0.1}])
    >>> panels["loss"], panels["lr"]
    ({'keys': ['test/loss', 'train/loss', 'val/loss'], 'log': True}, {'keys': ['lr/opt/0'], 'log': False})
    >>> list(curve_panels([{"train/loss": 1.0, "perf/samples_per_s": 900.0, "perf/steps_per_s": 14.0, "lr/o/0": 1}]))
    ['loss', 'samples_per_s', 'steps_per_s', 'lr']
    """
    keys = sorted({key for row in rows for key in row})
    groups: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith(("train/", "val/", "test/")) and "grad_norm" not in key:
            groups.setdefault(key.split("/", 1)[1], []).append(key)
        elif key.startswith("lr/"):
            groups.setdefault("lr", []).append(key)
        elif key.startswith("perf/") and key.endswith("_per_s"):
            groups[key.split("/", 1)[1]] = [key]
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


def plot_curves(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Draw the train/val curves per epoch, test points, the learning rate and the best epoch into ``curves.png``.

    Panels come from :func:`curve_panels` (a loss spanning more than a decade gets a log axis).

    :param out_dir: The run folder.
    :param summary: What :func:`summarize_run` returned.
    :returns: The image path.
    :raises ImportError: When matplotlib is not installed, saying how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(
            "matplotlib is needed to draw curves: pip install 'trainkit[report]' (or matplotlib)"
        ) from None
    rows = read_metrics(out_dir)
    panels = curve_panels(rows)
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(7, 2.6 * max(len(panels), 1)), squeeze=False)
    for ax, (name, panel) in zip(axes[:, 0], panels.items()):
        for key in panel["keys"]:
            xs, ys = _series(rows, key)
            if key.startswith("test/"):  # measured once, at the end, on the best weights: a point, not a curve
                ax.plot(xs[-1:], ys[-1:], marker="*", markersize=11, linestyle="none", label=f"{key} (best weights)")
            else:
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        if panel["log"]:
            ax.set_yscale("log")
        if summary.get("best_epoch") is not None:
            ax.axvline(summary["best_epoch"], color="tab:red", linestyle="--", linewidth=1, label="best epoch")
        ax.set_ylabel(name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("epoch")
    fig.suptitle(f"{Path(out_dir).name}: stopped by {summary.get('stop_reason')}")
    fig.tight_layout()
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


def report(out_dir: str, plot: bool = True) -> int:
    """Print a run's summary and draw its curves; the ``report`` command.

    :param out_dir: The run folder.
    :param plot: Also write ``curves.png``.
    :returns: The process exit code.
    """
    summary = summarize_run(out_dir)
    print(f"run:          {out_dir}")
    print(f"epochs run:   {summary.get('epochs_run')}")
    print(f"stop reason:  {summary.get('stop_reason')}")
    print(f"best epoch:   {summary.get('best_epoch')}  (score {format_value(summary.get('best_score'))})")
    for key, value in sorted((summary.get("best_metrics") or {}).items()):
        print(f"  {key}: {format_value(value)}")
    for key, value in sorted(summary["test_metrics"].items()):
        print(f"{key}: {format_value(value)}")
    if plot:
        try:
            path = plot_curves(out_dir, summary)
        except ImportError as exc:
            print(f"no curves: {exc}", file=sys.stderr)
            return 0
        print(f"curves:       {path}")
    return 0
