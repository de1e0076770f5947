"""``python -m trainkit COMMAND``: the argument parser, and one dispatch for every command.

Each command is a function of the parsed arguments that returns the lines to print (``report`` its exit status);
the errors it may raise on bad input are listed beside it, and :func:`main` turns any of them into one
``error: ...`` line on stderr and exit status 2. The commands themselves live in a module each
(:mod:`~trainkit.cli.report`, :mod:`~trainkit.cli.inspect`, :mod:`~trainkit.cli.export`, :mod:`~trainkit.cli.retain`,
:mod:`~trainkit.cli.replay`, :mod:`~trainkit.cli.certify`), imported when their command runs.

Side effects: those of the command run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from trainkit.errors import CheckpointError, ConfigError, OutDirError, TrainkitError, UsageError

__all__ = ["is_remote", "main"]


def is_remote(target: str) -> bool:
    """Whether a command's argument is a URL (``s3://...``) rather than a local path (``inspect`` and ``retain``
    answer both).

    :param target: The argument.
    :returns: True for a URL.

    >>> is_remote("s3://bucket/runs/a"), is_remote("runs/a"), is_remote("file:///tmp/x")
    (True, False, True)
    """
    return "://" in target


def _report(args: argparse.Namespace) -> int:
    from trainkit.cli.report import report

    return report(args.out_dir, plot=not args.no_plot, x=args.x)


def _inspect(args: argparse.Namespace) -> list[str]:
    from trainkit.checkpoint.remote import store_errors
    from trainkit.cli.inspect import describe_checkpoint, describe_remote, describe_run_folder, is_run_folder

    if is_remote(args.checkpoint):
        with store_errors(args.checkpoint, "reading the prefix"):
            return describe_remote(args.checkpoint, all_tensors=args.all)
    if is_run_folder(Path(args.checkpoint)):
        return describe_run_folder(args.checkpoint)
    return describe_checkpoint(args.checkpoint, all_tensors=args.all)


def _export(args: argparse.Namespace) -> list[str]:
    from trainkit.checkpoint.export.safetensors_files import parse_size
    from trainkit.cli.export import export_weights

    limit = parse_size(args.max_shard_size) if args.max_shard_size is not None else None
    return export_weights(
        args.checkpoint, args.out, item=args.item, format=args.format, max_shard_size=limit, overwrite=args.overwrite
    )


def _retain(args: argparse.Namespace) -> list[str]:
    from trainkit.checkpoint.remote import store_errors
    from trainkit.cli.retain import retain_remote, retain_run

    if is_remote(args.out_dir):
        with store_errors(args.out_dir, "applying retention"):
            return retain_remote(args.out_dir, args.keep, dry_run=args.dry_run)
    return retain_run(args.out_dir, args.keep, dry_run=args.dry_run)


def _replay(args: argparse.Namespace) -> list[str]:
    from trainkit.cli import replay

    if args.guard:
        return replay.format_guard_replay(replay.replay_guard_run(args.out_dir, args.settings), args.settings)
    recorded, replayed = replay.replay_run(args.out_dir, args.settings, metric=args.metric)
    return replay.format_replay(recorded, replayed, args.settings, args.metric)


def _certify(args: argparse.Namespace) -> int:
    from trainkit.cli.certify import certify_main

    return certify_main(args)


_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], list[str] | int], tuple[type[Exception], ...]]] = {
    "report": (_report, (ConfigError, FileNotFoundError, CheckpointError)),
    "inspect": (_inspect, (CheckpointError, OutDirError, UsageError)),
    "export": (_export, (CheckpointError, ConfigError, ImportError, FileExistsError)),
    "retain": (_retain, (ConfigError, OutDirError, UsageError)),
    "replay": (_replay, (ConfigError, ValueError, FileNotFoundError)),
    "certify": (_certify, (TrainkitError,)),
}
"""Each command's function, and the errors on bad input it reports as ``error: ...`` and exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainkit", description="trainkit command-line tools")
    commands = parser.add_subparsers(dest="command", required=True)
    report_parser = commands.add_parser("report", help="summarize a run folder and draw its curves")
    report_parser.add_argument("out_dir", help="the run's out_dir")
    report_parser.add_argument("--no-plot", action="store_true", help="skip curves.png")
    report_parser.add_argument(
        "--x",
        metavar="step|epoch",
        help="the curves' x axis: the optimizer step or the epoch (default: step when the rows are per step)",
    )
    inspect_parser = commands.add_parser(
        "inspect", help="show what a checkpoint holds (after the resume's checks), or a run folder's kept checkpoints"
    )
    inspect_parser.add_argument(
        "checkpoint",
        help="a last.pt or best.pt, a last.ckpt/best.ckpt directory, a run folder (out_dir), a ckpt.remote URL, or "
        "one of its step-<step>-<token> folders",
    )
    inspect_parser.add_argument("--all", action="store_true", help="list every tensor of every item")
    export_parser = commands.add_parser(
        "export", help="write a checkpoint's weights as a plain state-dict file or as safetensors"
    )
    export_parser.add_argument("checkpoint", help="a sharded checkpoint directory (last.ckpt, best.ckpt) or a .pt")
    export_parser.add_argument(
        "out",
        help="the file to write (model.pt; with --format safetensors: model.safetensors), or for safetensors a folder "
        "(the hub's layout: model.safetensors, or shards and model.safetensors.index.json)",
    )
    export_parser.add_argument("--item", default="model", help="the registered item to export (model)")
    export_parser.add_argument("--format", default="torch", choices=("torch", "safetensors"), help="torch (default)")
    export_parser.add_argument(
        "--max-shard-size", metavar="SIZE", help="safetensors folder: the largest shard, e.g. 500MB, 5GB (default 5GB)"
    )
    export_parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export at OUT (nothing else: never a checkpoint)"
    )
    retain_parser = commands.add_parser("retain", help="apply retention rules to a run folder's kept checkpoints")
    retain_parser.add_argument("out_dir", help="the run's out_dir or ckpt.remote URL (not while a run uses it)")
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
    from trainkit.cli.certify import add_certify_parser

    add_certify_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m trainkit``.

    :param argv: The arguments after the program name; ``sys.argv[1:]`` by default.
    :returns: The process exit code: 0, 2 on bad input (one ``error: ...`` line on stderr), or ``report``'s.
    """
    args = _parser().parse_args(argv)
    command, refused = _COMMANDS[args.command]
    try:
        result = command(args)
    except refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    print("\n".join(result))
    return 0
