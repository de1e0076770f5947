"""Command-line helpers: build a config from ``argv``, and ``python -m trainkit report OUT_DIR``.

Side effects: reads YAML files and run folders, writes ``curves.png``. PyYAML and matplotlib are
optional and imported only when used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from trainkit.cli.export import export_weights
from trainkit.cli.inspect import describe_checkpoint
from trainkit.cli.report import report
from trainkit.errors import ConfigError
from trainkit.run.read_metrics import read_metrics

__all__ = [
    "read_metrics",
    "describe_checkpoint",
    "export_weights",
    "main",
]


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
        from trainkit.cli.replay import format_guard_replay, replay_guard_run

        try:
            guarded = replay_guard_run(args.out_dir, args.settings)
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(format_guard_replay(guarded, args.settings)))
        return 0
    if args.command == "replay":
        from trainkit.cli.replay import format_replay, replay_run

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
        from trainkit.cli.retain import retain_run
        from trainkit.errors import OutDirError

        try:
            lines = retain_run(args.out_dir, args.keep, dry_run=args.dry_run)
        except (ConfigError, OutDirError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    if args.command == "inspect":
        from trainkit.cli.retain import describe_run_folder, is_run_folder
        from trainkit.errors import CheckpointError

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
