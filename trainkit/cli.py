"""Command-line helpers: build a config from ``argv``, and ``python -m trainkit report OUT_DIR``.

Side effects: reads YAML files and run folders, writes ``curves.png``. PyYAML and matplotlib are
optional and imported only when used.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainkit.config import Config, redact_argv
from trainkit.errors import ConfigError
from trainkit.metrics_file import read_metrics

__all__ = [
    "config_from_argv",
    "load_yaml",
    "read_metrics",
    "summarize_run",
    "curve_panels",
    "describe_checkpoint",
    "export_weights",
    "main",
]

C = TypeVar("C", bound=Config)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict.

    :param path: The file.
    :returns: Its top-level mapping (empty for an empty file).
    :raises ConfigError: When the file is missing or its top level is not a mapping.
    :raises ImportError: When PyYAML is not installed, saying how to get it.
    """
    try:
        import yaml
    except ImportError:
        raise ImportError(
            "PyYAML is needed to read YAML configs: pip install 'trainkit[examples]' (or pyyaml)"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file", "does not exist", str(path))
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}", "must hold a mapping at the top level", type(data).__name__)
    return data


def config_from_argv(
    config_class: type[C], argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> C:
    """Build a config from command-line words: YAML files (``*.yaml``/``*.yml``) then ``dotted.key=value`` overrides.

    Later files override earlier ones key by key; overrides apply last, in order. Without ``argv`` it reads
    the process's command line and, as ``argparse`` does, reports a bad word in one line on stderr
    (``digits.py: error: unknown config key 'val.paitence'; did you mean 'val.patience'?``) and exits with
    status 2; with ``argv`` given, it raises instead.

    :param config_class: The config record to build.
    :param argv: The words after the program name, e.g. ``["conf.yaml", "epochs=40", "val.patience=5"]``;
        None reads ``sys.argv[1:]``.
    :param defaults: Values applied before any file (a script's own defaults).
    :returns: The validated config.
    :raises ConfigError: On an unknown key, a bad value, or a word that is neither a file nor an override,
        when ``argv`` is given.
    :raises SystemExit: With status 2 for the same errors, when ``argv`` is None.
    """
    if argv is None:
        try:
            return config_from_argv(config_class, sys.argv[1:], defaults)
        except ConfigError as exc:
            print(f"{Path(sys.argv[0]).name or 'trainkit'}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    data: dict[str, Any] = {}
    _merge(data, defaults or {})
    overrides = []
    for index, word in enumerate(argv):
        if "=" in word:
            overrides.append(word)
        elif word.endswith((".yaml", ".yml")):
            _merge(data, load_yaml(word))
        else:
            secret = redact_argv(argv, config_class)[index] != word  # say, the value of ``api_key= VALUE``
            rule = "must be a YAML file (*.yaml) or a dotted.key=value override"
            raise ConfigError("argument", rule, None if secret else word, show_value=not secret)
    return config_class.from_mapping(data, overrides)


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


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
        from trainkit.payload import validate_last

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


def _format(value: Any) -> str:
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
    print(f"best epoch:   {summary.get('best_epoch')}  (score {_format(summary.get('best_score'))})")
    for key, value in sorted((summary.get("best_metrics") or {}).items()):
        print(f"  {key}: {_format(value)}")
    for key, value in sorted(summary["test_metrics"].items()):
        print(f"{key}: {_format(value)}")
    if plot:
        try:
            path = plot_curves(out_dir, summary)
        except ImportError as exc:
            print(f"no curves: {exc}", file=sys.stderr)
            return 0
        print(f"curves:       {path}")
    return 0


_SHOWN_TENSORS = 20
"""Tensors listed per item by ``inspect`` (the rest are counted); ``--all`` lists every one."""


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"  # pragma: no cover


def _tensors(value: Any, path: str) -> list[tuple[str, Any]]:
    """Every tensor inside ``value`` with its key path, depth first, without recursion."""
    import torch

    found = []
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append((where, item))
        elif isinstance(item, Mapping):
            stack.extend((f"{where}.{key}" if where else str(key), v) for key, v in reversed(list(item.items())))
        elif isinstance(item, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return found


def describe_checkpoint(path: str | Path, *, all_tensors: bool = False) -> list[str]:
    """Describe what a trainkit checkpoint holds, after the integrity check and safe load that a resume uses.

    Side effects: reads the file (``load_checkpoint``: CRCs verified, ``weights_only=True``, nothing runs).

    :param path: A ``last.pt`` or ``best.pt``, or a sharded checkpoint directory (``last.ckpt``, ``best.ckpt``:
        its manifest is checked, and items stored in its DCP files are named, not listed).
    :param all_tensors: List every tensor of every item instead of the first few.
    :returns: The lines to print.
    :raises CheckpointError: When the file is damaged, unsafe, or not a trainkit checkpoint.
    """
    from trainkit import sharded
    from trainkit.checkpoint import load_checkpoint
    from trainkit.errors import CheckpointCorruptError
    from trainkit.payload import validate_best, validate_last

    source = Path(path)
    path = source
    if source.is_dir():  # a sharded checkpoint: its manifest first, then its engine payload
        problem = sharded.verify_directory(source, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        path = source / sharded.ENGINE_FILE
    payload = load_checkpoint(path)
    if "loop" in payload:
        kind = "last.pt"
        validate_last(payload, path=path)
    elif "model" in payload and "best" in payload:
        kind = "best.pt"
        validate_best(payload, path=path)
    else:
        raise CheckpointCorruptError(
            f"checkpoint {path} is not a trainkit checkpoint (it has neither a 'loop' entry, as last.pt does, nor "
            "'model' and 'best', as best.pt does)"
        )
    if source.is_dir():
        files = [entry for entry in source.iterdir() if entry.is_file()]
        size = sum(entry.stat().st_size for entry in files)
        what = f"a sharded trainkit {kind.replace('.pt', '')} checkpoint, {len(files)} files"
    else:
        size, what = path.stat().st_size, f"a trainkit {kind}"
    lines = [f"checkpoint:   {source} ({_size(size)}, {what}, schema {payload['schema_version']})"]
    best = payload.get("best")
    if kind == "last.pt":
        loop = payload["loop"]
        lines.append(
            f"epoch:        {payload['epoch']} done, step {payload['step']}, world size {payload['world_size']}"
        )
        validated = loop.get("last_validated", True)
        lines.append(f"loop:         stop_reason={loop.get('stop_reason')}, last epoch validated={validated}")
        mid_epoch = payload.get("trainkit")
        if mid_epoch is not None:
            position = mid_epoch["position"]
            lines.append(
                f"position:     inside epoch {position['epoch']}: {position['batches']} of "
                f"{position['batches_per_epoch']} batches done (batch size {position['batch_size']}, "
                f"{position['dataset_length']} samples); a resume continues from the next batch"
            )
        else:
            lines.append("position:     at an epoch's end")
    else:
        lines.append(f"best epoch:   {payload['epoch']}")
    if best is not None:
        metrics = ", ".join(f"{k}={_format(v)}" for k, v in sorted((best.get("metrics") or {}).items()))
        direction = "minimize" if best.get("minimize") else "maximize"
        lines.append(
            f"best:         score {_format(best.get('score'))} at epoch {best.get('epoch')} ({direction}, "
            f"min_delta {best.get('min_delta')}){'; ' + metrics if metrics else ''}"
        )
    patience = payload.get("patience")
    if patience is not None:
        left = (
            "never stops"
            if patience.get("patience") is None
            else f"{patience.get('remaining')} of {patience.get('patience')} left"
        )
        lines.append(f"patience:     {left} (start_patience {patience.get('start_patience')})")
    if kind == "last.pt":
        rng = payload.get("rng") or []
        owners = "; ".join(f"rank {rank}: {', '.join(sorted(state))}" for rank, state in enumerate(rng))
        lines.append(f"rng:          {owners or 'none'}")
        lines.append(f"wandb run:    {payload.get('wandb_run_id')}")
        results = payload.get("results")
        finished = "none yet (the run goes on)" if results is None else f"{len(results)} final metrics"
        lines.append(f"metrics:      metrics.jsonl at {payload.get('metrics_offset')} bytes; results: {finished}")
    lines.append("config:")
    stack = [("", payload.get("config") or {})]
    flat = []
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, Mapping):
                stack.append((f"{prefix}{key}.", value))
            else:
                flat.append((f"{prefix}{key}", value))
    lines += [f"  {key} = {value!r}" for key, value in sorted(flat)]
    items = {"model": payload["model"]} if kind == "best.pt" else {name: payload[name] for name in payload["items"]}
    lines.append("items:" if kind == "last.pt" else "weights:")
    for name, value in items.items():
        if (isinstance(value, str) and value == sharded.SHARDED) or (source.is_dir() and kind == "best.pt"):
            lines.append(f"  {name}: in the DCP shards (python -m trainkit export {source} OUT.pt --item {name})")
            continue
        tensors = _tensors(value, "")
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        lines.append(
            f"  {name}: {len(tensors)} tensor(s), {_size(total)}" + ("" if tensors else f" ({type(value).__name__})")
        )
        shown = tensors if all_tensors else tensors[:_SHOWN_TENSORS]
        for where, tensor in shown:
            shape = "x".join(map(str, tensor.shape)) or "scalar"
            dtype = str(tensor.dtype).removeprefix("torch.")
            lines.append(f"    {where}: {dtype} {shape} ({_size(tensor.numel() * tensor.element_size())})")
        if len(tensors) > len(shown):
            lines.append(f"    ... {len(tensors) - len(shown)} more (--all lists them)")
    return lines


def export_weights(checkpoint: str | Path, out: str | Path, *, item: str = "model") -> list[str]:
    """Write one item's whole weights from a checkpoint as a plain state-dict file, e.g. for inference.

    Reads a sharded checkpoint directory (``last.ckpt``/``best.ckpt``, written by any number of ranks; its
    manifest is checked first) or a ``last.pt``/``best.pt``, in one process, and writes
    ``{name: tensor}`` with :func:`~trainkit.checkpoint.atomic_save`: ``model.load_state_dict(torch.load(out))``
    takes it, whatever wrap (DDP, FSDP2, none) wrote the checkpoint (DDP's ``module.`` prefix is dropped).

    Side effects: reads the checkpoint, writes ``out``.

    :param checkpoint: The checkpoint directory or file.
    :param out: The file to write.
    :param item: The registered item to export (a ``best`` checkpoint holds only the model, under any name).
    :returns: Lines describing what was written.
    :raises CheckpointError: When the checkpoint is damaged, is not a trainkit checkpoint, or has no such item.
    """
    import torch

    from trainkit import checkpoint as ckpt_io
    from trainkit import sharded
    from trainkit.errors import CheckpointCorruptError, CheckpointError
    from trainkit.payload import validate_best, validate_last

    source = Path(checkpoint)
    if source.is_dir():
        problem = sharded.verify_directory(source, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        engine = ckpt_io.load_checkpoint(source / sharded.ENGINE_FILE)
        if "loop" in engine:
            validate_last(engine, path=source / sharded.ENGINE_FILE)
            key = item
            if engine.get(item) != sharded.SHARDED:
                stored = [name for name in engine["items"] if engine[name] == sharded.SHARDED]
                raise CheckpointError(f"{source} holds no sharded item {item!r}; it holds {stored} (--item NAME)")
        else:
            validate_best(engine, path=source / sharded.ENGINE_FILE)
            key = "model"
        weights = sharded.read_whole(source, key)
    else:
        payload = ckpt_io.load_checkpoint(source)
        if "loop" in payload:
            validate_last(payload, path=source)
            if item not in payload["items"] or not isinstance(payload[item], dict):
                raise CheckpointError(f"{source} holds no item {item!r}; it holds {payload['items']} (--item NAME)")
            weights = payload[item]
        else:
            validate_best(payload, path=source)
            weights = payload["model"]
    if weights and all(name.startswith("module.") for name in weights):
        # a DDP-wrapped model was saved under DDP's names; a bare module (what inference builds) has none
        weights = {name.removeprefix("module."): value for name, value in weights.items()}
    tensors = {name: value for name, value in weights.items() if isinstance(value, torch.Tensor)}
    ckpt_io.atomic_save(weights, out)
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    return [f"wrote {out}: {len(tensors)} tensors, {_size(size)}, from {source}"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m trainkit``.

    :param argv: The arguments after the program name; ``sys.argv[1:]`` by default.
    :returns: The process exit code.
    """
    parser = argparse.ArgumentParser(prog="python -m trainkit", description="trainkit command-line tools")
    commands = parser.add_subparsers(dest="command", required=True)
    report_parser = commands.add_parser("report", help="summarize a run folder and draw its curves")
    report_parser.add_argument("out_dir", help="the run's out_dir")
    report_parser.add_argument("--no-plot", action="store_true", help="skip curves.png")
    inspect_parser = commands.add_parser(
        "inspect", help="show what a checkpoint holds (after the resume's checks), or a run folder's kept checkpoints"
    )
    inspect_parser.add_argument(
        "checkpoint", help="a last.pt or best.pt, a last.ckpt/best.ckpt directory, or a run folder (out_dir)"
    )
    inspect_parser.add_argument("--all", action="store_true", help="list every tensor of every item")
    export_parser = commands.add_parser("export", help="write a checkpoint's weights as one plain state-dict file")
    export_parser.add_argument("checkpoint", help="a sharded checkpoint directory (last.ckpt, best.ckpt) or a .pt")
    export_parser.add_argument("out", help="the file to write, e.g. model.pt")
    export_parser.add_argument("--item", default="model", help="the registered item to export (model)")
    retain_parser = commands.add_parser("retain", help="apply retention rules to a run folder's kept checkpoints")
    retain_parser.add_argument("out_dir", help="the run's out_dir (not while a run uses it)")
    retain_parser.add_argument("--keep", required=True, help="rules as ckpt.keep spells them: latest:3,best:2,...")
    retain_parser.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    replay_parser = commands.add_parser(
        "replay", help="replay a run's validation scores under other early-stopping settings (no torch)"
    )
    replay_parser.add_argument("out_dir", help="the run's out_dir")
    replay_parser.add_argument(
        "settings", nargs="*", help="val.patience=5 val.min_delta=0.01 ... (with --guard: guard.max_skips=3 ...)"
    )
    replay_parser.add_argument("--metric", default="val/loss", help="the score the run selected on (val/loss)")
    replay_parser.add_argument(
        "--guard",
        action="store_true",
        help="replay the recorded grad norms and losses through the divergence guard; settings are guard.* words",
    )
    args = parser.parse_args(argv)
    if args.command == "replay" and args.guard:
        from trainkit.replay import format_guard_replay, replay_guard_run

        try:
            guarded = replay_guard_run(args.out_dir, args.settings)
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(format_guard_replay(guarded, args.settings)))
        return 0
    if args.command == "replay":
        from trainkit.replay import format_replay, replay_run

        try:
            recorded, replayed = replay_run(args.out_dir, args.settings, metric=args.metric)
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(format_replay(recorded, replayed, args.settings, args.metric)))
        return 0
    if args.command == "export":
        from trainkit.errors import CheckpointError

        try:
            lines = export_weights(args.checkpoint, args.out, item=args.item)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    if args.command == "retain":
        from trainkit.errors import OutDirError
        from trainkit.retention_cli import retain_run

        try:
            lines = retain_run(args.out_dir, args.keep, dry_run=args.dry_run)
        except (ConfigError, OutDirError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    if args.command == "inspect":
        from trainkit.errors import CheckpointError
        from trainkit.retention_cli import describe_run_folder, is_run_folder

        try:
            if is_run_folder(Path(args.checkpoint)):
                lines = describe_run_folder(args.checkpoint)
            else:
                lines = describe_checkpoint(args.checkpoint, all_tensors=args.all)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    from trainkit.errors import CheckpointError

    try:
        return report(args.out_dir, plot=not args.no_plot)
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
