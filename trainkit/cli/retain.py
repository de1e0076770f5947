"""``python -m trainkit inspect OUT_DIR`` and ``python -m trainkit retain OUT_DIR --keep ...``: kept checkpoints.

Side effects: reads a run folder's ``checkpoints/`` (links and files of other kinds are never followed);
``retain`` without ``--dry-run`` deletes the kept checkpoints its rules do not keep, holding the run folder's
lock meanwhile (it refuses a folder a live run holds).
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from trainkit import bookkeeping as core
from trainkit.checkpoint.formats.pt import BEST_CKPT, LAST_CKPT
from trainkit.checkpoint.kept import (
    KEPT_DIR,
    directory_problem,
    folder_problem,
    kept_path,
    read_kept,
    remove_kept,
    write_index,
)
from trainkit.cli.inspect import format_bytes
from trainkit.errors import BookkeepingError, ConfigError, OutDirError
from trainkit.run.lock import RunLock

__all__ = ["describe_run_folder", "retain_run", "is_run_folder"]


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is a run folder rather than a sharded checkpoint directory (``*.ckpt``, or one holding a
    manifest or an engine payload, even a damaged one).

    :param path: What ``inspect`` was given.
    """
    from trainkit.checkpoint.formats.dcp_directory import ENGINE_FILE, MANIFEST_FILE

    if not path.is_dir() or path.suffix == ".ckpt":
        return False
    return not (path / MANIFEST_FILE).exists() and not (path / ENGINE_FILE).exists()


def _size(path: Path) -> str:
    """What ``path`` takes on disk, as people read it; a directory's files together (none of them followed)."""
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):  # a sharded checkpoint: its files together (none of them followed)
            return format_bytes(sum(entry.stat(follow_symlinks=False).st_size for entry in os.scandir(path)))
        return format_bytes(info.st_size)
    except OSError:
        return "?"


def keep_policy(
    keep: tuple[str, ...] | str,
    minimize: bool | None,
    *,
    where: str,
    unknown: str = "the run folder does not record val.minimize",
) -> core.KeepAny:
    """The rules as a policy; a ``best`` rule without a direction needs the run's (recorded in the index).

    :param keep: The rules (``ckpt.keep``'s form, or ``--keep``'s).
    :param minimize: The run's direction, or None when it is not known.
    :param where: The option or key named in an error.
    :param unknown: Why the direction is not known, for the error.
    :returns: The retention policy.
    :raises ConfigError: On rules that do not parse, or a ``best`` rule without a known direction.
    """
    try:
        lower, higher = core.parse_keep(keep, minimize=True), core.parse_keep(keep, minimize=False)
    except BookkeepingError as exc:
        raise ConfigError(where, "must be comma-separated retention rules", keep, hint=str(exc)) from None
    if where == "--keep" and not lower.policies:  # no rule would keep only the newest: say so, delete nothing
        raise ConfigError(
            where,
            "must name at least one retention rule (with none, every kept checkpoint but the newest is deleted)",
            keep,
            hint="e.g. --keep latest:3; to keep only the newest, say --keep latest:1",
        )
    if lower != higher and minimize is None:
        raise ConfigError(
            where,
            f"has a best rule without a direction, and {unknown}",
            keep,
            hint="write best:N:score:min or best:N:score:max",
        )
    return lower if minimize else higher


def _ranks_nothing(rule: core.KeepBest, described: list[core.Checkpoint]) -> str:
    """Say why a ``best`` rule ranks nothing, with the scores the kept checkpoints do have."""
    names = sorted({name for c in described for name in c.scores})
    have = f"the scores recorded are {', '.join(names)}" if names else "no kept checkpoint has a score"
    return f"{rule.spec} ranks no checkpoint: none has a finite {rule.metric!r} ({have})"


def _rows(described: list[core.Checkpoint], reasons: dict[int, tuple[str, ...]], directory: Path) -> list[str]:
    lines = [f"  {'step':>8}  {'epoch':>5}  {'score':>10}  {'size':>10}  kept by"]
    for c in described:
        score = c.scores.get("score")
        shown = f"{score:.6g}" if score is not None and math.isfinite(score) else "-"
        epoch = f"{c.epoch}" if c.epoch_end else f"{c.epoch}+"  # "+": written inside that epoch
        why = ", ".join(reasons[c.step]) or "(no rule: deleted at the next save)"
        lines.append(f"  {c.step:>8}  {epoch:>5}  {shown:>10}  {_size(kept_path(directory, c.step)):>10}  {why}")
    return lines


def describe_run_folder(out_dir: str | Path) -> list[str]:
    """Describe a run folder's checkpoints: ``last.pt``/``best.pt`` and every kept one, with the rule keeping it.

    Side effects: reads ``out_dir`` and ``out_dir/checkpoints`` (no checkpoint is loaded).

    :param out_dir: The run folder.
    :returns: The lines to print.
    """
    out = Path(out_dir)
    lines = [f"{out}: a run folder"]
    for name in (LAST_CKPT, BEST_CKPT, "last.ckpt", "best.ckpt"):
        if (out / name).exists():
            lines.append(f"  {name}: {_size(out / name)}")
    directory = out / KEPT_DIR
    problem = directory_problem(directory)
    if problem is not None:
        lines.append(f"  {problem}: not followed (a run keeps nothing there, retain refuses it)")
        return lines
    problem = folder_problem(directory)
    if problem is not None:
        lines.append(f"  {problem}: a run keeps nothing there while it is so, retain refuses the folder")
    folder = read_kept(directory)
    described = list(folder.described)
    if not described and not folder.refused:
        lines.append(f"  no kept checkpoints in {directory} (ckpt.keep is empty, or nothing was kept yet)")
        return lines
    try:
        policy = keep_policy(folder.keep or (), folder.minimize, where="ckpt.keep")
    except ConfigError:
        policy = core.KeepAny()
    rules = policy.spec or "none recorded"
    lines.append(f"  {len(described)} kept checkpoints in {directory} (ckpt.keep={rules}):")
    lines.extend(_rows(described, core.keep_reasons(policy, described, newest=folder.newest), directory))
    lines.extend(f"  {name}: not a file trainkit wrote; never followed nor deleted" for name in folder.refused)
    return lines


def retain_run(out_dir: str | Path, keep: str, *, dry_run: bool) -> list[str]:
    """Apply retention rules to a run folder's kept checkpoints: say what is kept and why, delete the rest.

    Side effects: without ``dry_run``, deletes ``checkpoints/step-<step>.pt`` files and ``step-<step>.ckpt``
    directories (those kinds only, never through a link) and rewrites ``checkpoints/index.json``, holding the run
    folder's lock.

    :param out_dir: The run folder.
    :param keep: The rules, as ``ckpt.keep`` spells them (``"latest:3,best:2"``).
    :param dry_run: Only say what would be deleted.
    :returns: The lines to print.
    :raises ConfigError: On bad rules (naming ``--keep``).
    :raises OutDirError: When the folder does not exist, a live run holds it, or its ``checkpoints`` is a symbolic
        link (or not a directory): nothing outside the run folder is ever deleted or written.
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise OutDirError(f"{out} is not a run folder (no such directory)")
    lock = RunLock(out)
    lock.acquire()  # refused while a run holds the folder; and no run starts while this deletes
    try:
        directory = out / KEPT_DIR
        problem = folder_problem(directory)  # before anything is deleted: the index must be writable after
        if problem is not None:
            raise OutDirError(
                f"{problem}; retain deletes and writes nothing there (a run keeps nothing there either): move it away"
            )
        folder = read_kept(directory)
        described, minimize = list(folder.described), folder.minimize
        policy = keep_policy(keep, minimize, where="--keep")
        # the newest is the one the run recorded: a larger step (a planted step-999.pt) is left alone
        reasons = core.keep_reasons(policy, described, newest=folder.newest)
        doomed = [c for c in described if not reasons[c.step]]
        idle = [_ranks_nothing(rule, described) for rule in core.unranked(policy, described, newest=folder.newest)]
        if idle and described and not dry_run:
            raise ConfigError(
                "--keep",
                f"has a best rule that ranks no checkpoint, which would keep nothing: {'; '.join(idle)}",
                keep,
                hint="fix the metric's name or drop the rule; --dry-run shows what the rules keep",
            )
        verb = "would delete" if dry_run else "deleted"
        lines = [f"{directory}: {len(described)} kept checkpoints; rules {policy.spec or '(none)'}"]
        if described:
            lines.extend(f"  warning: {why}; without --dry-run nothing is deleted while it is so" for why in idle)
        for c in described:
            what = ", ".join(reasons[c.step]) if reasons[c.step] else None
            name = kept_path(directory, c.step).name
            lines.append(f"  keep    {name}  ({what})" if what else f"  {verb:<7} {name}")
        lines.extend(f"  ignore  {name}: not a file trainkit wrote" for name in folder.refused)
        if not dry_run and doomed:
            for c in doomed:
                remove_kept(kept_path(directory, c.step))
            left = [c for c in described if reasons[c.step]]
            write_index(directory, left, minimize, folder.keep, newest=folder.newest)
        lines.append(f"{len(doomed)} {'to delete' if dry_run else 'deleted'}, {len(described) - len(doomed)} kept")
        return lines
    finally:
        lock.release()
