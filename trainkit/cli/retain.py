"""``python -m trainkit retain OUT_DIR --keep ...``: apply retention rules to a run folder's kept checkpoints, or to
a remote prefix (``retain URL``).

Side effects: reads a run folder's ``checkpoints/`` (links and files of other kinds are never followed), or the
prefix (``ckpt.remote``'s store, through fsspec); without ``--dry-run`` deletes the kept checkpoints (the remote
folders) its rules do not keep, holding the run folder's lock (the prefix's lease) meanwhile: it refuses a folder or
a prefix a live run holds. Everything shown that came from the store is escaped
(:func:`~trainkit.messages.printable`, :func:`~trainkit.config.redact_text`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainkit import bookkeeping
from trainkit.checkpoint.kept import (
    KEPT_DIR,
    folder_problem,
    kept_path,
    read_kept,
    remove_kept,
    write_index,
)
from trainkit.checkpoint.remote import RemoteTier, open_store
from trainkit.config import redact_text
from trainkit.errors import BookkeepingError, ConfigError, OutDirError
from trainkit.run.lock import RunLock

__all__ = ["keep_policy", "open_remote_prefix", "retain_remote", "retain_run"]


def keep_policy(
    keep: tuple[str, ...] | str,
    minimize: bool | None,
    *,
    where: str,
    unknown: str = "the run folder does not record val.minimize",
) -> bookkeeping.KeepAny:
    """The rules as a policy; a ``best`` rule without a direction needs the run's (recorded in the index).

    :param keep: The rules (``ckpt.keep``'s form, or ``--keep``'s).
    :param minimize: The run's direction, or None when it is not known.
    :param where: The option or key named in an error.
    :param unknown: Why the direction is not known, for the error.
    :returns: The retention policy.
    :raises ConfigError: On rules that do not parse, or a ``best`` rule without a known direction.
    """
    try:
        lower, higher = bookkeeping.parse_keep(keep, minimize=True), bookkeeping.parse_keep(keep, minimize=False)
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


def _ranks_nothing(rule: bookkeeping.KeepBest, described: list[bookkeeping.Checkpoint]) -> str:
    """Say why a ``best`` rule ranks nothing, with the scores the kept checkpoints do have."""
    names = sorted({name for c in described for name in c.scores})
    have = f"the scores recorded are {', '.join(names)}" if names else "no kept checkpoint has a score"
    return f"{rule.spec} ranks no checkpoint: none has a finite {rule.metric!r} ({have})"


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
        reasons = bookkeeping.keep_reasons(policy, described, newest=folder.newest)
        doomed = [c for c in described if not reasons[c.step]]
        idle = [
            _ranks_nothing(rule, described) for rule in bookkeeping.unranked(policy, described, newest=folder.newest)
        ]
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


def open_remote_prefix(url: str, scratch: Path) -> RemoteTier:
    """The remote tier over a prefix, for a command's one look at it (``inspect``, ``retain``): a lease of 60 s if
    taken, never waited for.

    Side effects: opens the store (fsspec); nothing is read yet.

    :param url: ``ckpt.remote``.
    :param scratch: The tier's staging folder (a download lands there).
    :returns: The tier.
    :raises UsageError: When fsspec or the store's package is missing.
    """
    fs, root = open_store(url)
    return RemoteTier(url, fs, root, out_dir=scratch, lease_s=60.0, wait_s=0.0)


def retain_remote(url: str, keep: str, *, dry_run: bool) -> list[str]:
    """Apply retention rules to a remote prefix: say what is kept and why, delete the rest (and uncommitted folders).

    Side effects: without ``dry_run``, takes the prefix's lease (refused while a run holds it), deletes, lets go.

    :param url: ``ckpt.remote``.
    :param keep: The rules, as ``ckpt.keep`` spells them.
    :param dry_run: Only say what would be deleted.
    :returns: The lines to print.
    :raises ConfigError: On bad rules (naming ``--keep``), or a ``best`` rule without a direction when the commit
        records do not say the run's.
    :raises OutDirError: When a live run holds the prefix, or a folder could not be deleted (after every other one
        was; naming it, its cause and the folders left).
    """
    # the tier's scratch folder (its staging, removed at close) is a folder of its own, never the system's temp
    with tempfile.TemporaryDirectory(prefix="trainkit-retain-") as scratch:
        tier = open_remote_prefix(url, Path(scratch))
        # a best rule without a direction ranks by the direction the run recorded in its commit records
        recorded = {manifest.description.get("minimize") for _, manifest in tier.committed()}
        minimize = recorded.pop() if len(recorded) == 1 else True if not recorded else None  # none: nothing ranked
        unknown = (
            "the prefix's commit records disagree on val.minimize"
            if len(recorded) > 1 and None not in recorded
            else "the prefix's commit records do not record val.minimize (written by an older trainkit)"
        )
        policy = keep_policy(keep, minimize, where="--keep", unknown=unknown)
        leftovers = tier.uncommitted()  # taking the lease deletes them
        if not dry_run:
            tier.acquire(uploads=False)
        try:
            reasons, doomed = tier.plan(policy)
            doomed = sorted(set(doomed) | set(leftovers))
            lines = [f"{redact_text(url)}: {len(reasons)} kept, {len(doomed)} {'to delete' if dry_run else 'deleted'}"]
            lines += [f"  keep   {name}: {', '.join(why)}" for name, why in sorted(reasons.items())]
            lines += [f"  delete {name}" for name in sorted(doomed)]
            if not dry_run:
                tier.delete(doomed)
            return lines
        finally:
            tier.close()
