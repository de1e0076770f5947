"""``python -m trainkit inspect URL`` and ``python -m trainkit retain URL --keep ...``: a remote checkpoint prefix.

Side effects: reads the prefix (``ckpt.remote``'s store, through fsspec); ``inspect`` of one checkpoint folder
downloads and verifies it into a temporary folder (removed after); ``retain`` without ``--dry-run`` deletes the
folders its rules do not keep, holding the prefix's lease meanwhile (it refuses a prefix a live run holds).

Everything shown that came from the store (a lease's holder, a commit record's run id and version, what the
downloaded checkpoint holds) is escaped (:func:`~trainkit.messages.printable`): a planted value can neither
drive the terminal nor forge a line.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from trainkit.checkpoint.remote import LAST, LAST_DIR, RemoteTier, folder_step, open_store, shown
from trainkit.cli.inspect import describe_checkpoint, format_bytes
from trainkit.config import redact_text
from trainkit.messages import printable

__all__ = ["is_remote", "describe_remote", "retain_remote"]


def is_remote(target: str) -> bool:
    """Whether a command's argument is a URL (``s3://...``) rather than a local path.

    >>> is_remote("s3://bucket/runs/a"), is_remote("runs/a"), is_remote("file:///tmp/x")
    (True, False, True)
    """
    return "://" in target


def _tier(url: str, directory: Path) -> RemoteTier:
    fs, root = open_store(url)
    return RemoteTier(url, fs, root, out_dir=directory, lease_s=60.0, wait_s=0.0)


def describe_remote(url: str, *, all_tensors: bool = False) -> list[str]:
    """Describe a remote prefix (its committed checkpoints, uncommitted folders and lease) or, for a URL naming one
    committed folder, that checkpoint's ``last.pt`` (or a sharded one's ``last.ckpt/``) after the resume's checks
    (downloaded, verified, loaded safely).

    :param url: ``ckpt.remote``, or ``ckpt.remote/step-<step>-<token>``.
    :param all_tensors: List every tensor (one checkpoint).
    :returns: The lines to print.
    :raises CheckpointError: When the named folder is not committed, damaged or unsafe.
    :raises UsageError: When fsspec or the store's package is missing.
    """
    from trainkit.errors import CheckpointCorruptError

    where = shown(url)
    head, _, last = url.rstrip("/").rpartition("/")
    if folder_step(last) is not None:
        with tempfile.TemporaryDirectory(prefix="trainkit-inspect-") as scratch:
            tier = _tier(head, Path(scratch))
            found = dict(tier.committed())
            if last not in found:
                raise CheckpointCorruptError(f"{where} is not a committed remote checkpoint (no valid commit record)")
            tops = {item.name.split("/")[0] for item in found[last].objects}
            if not tops & {LAST, LAST_DIR}:
                raise CheckpointCorruptError(f"{where}: its commit record lists neither {LAST} nor {LAST_DIR}/")
            folder = tier.download(last, found[last])
            lines = describe_checkpoint(folder / (LAST if LAST in tops else LAST_DIR), all_tensors=all_tensors)
            described = [printable(line, limit=4096) for line in lines[1:]]  # what the store's checkpoint holds
            return [f"remote:       {where} (verified: sizes and CRC-32 of its commit record)", *described]
    tier = _tier(url, Path(tempfile.gettempdir()))
    lines = [f"{where}: a remote checkpoint prefix"]
    lease = tier.lease()
    if lease is None:
        lines.append("lease:        none (no run writes here)")
    else:
        state = "expired" if lease.expired(time.time()) else "held"
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(lease.expires))
        lines.append(f"lease:        {state} by {printable(lease.holder)} until {until}")
    committed = tier.committed()
    for name, manifest in committed:
        size = format_bytes(sum(o.size for o in manifest.objects))
        names = ", ".join(o.name for o in manifest.objects)
        lines.append(
            f"  {name}: step {manifest.step}, epoch {manifest.epoch}, {size} ({names}), "
            f"W&B run {printable(manifest.run_id)}, trainkit {printable(manifest.version)}"
        )
    uncommitted = tier.uncommitted()
    if uncommitted:
        lines.append(f"uncommitted (never read; the next writer deletes them): {', '.join(sorted(uncommitted))}")
    if not committed:
        lines.append("no committed checkpoint")
    return lines


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
    from trainkit.cli.retain import keep_policy

    # the tier's scratch folder (its staging, removed at close) is a folder of its own, never the system's temp
    with tempfile.TemporaryDirectory(prefix="trainkit-retain-") as scratch:
        tier = _tier(url, Path(scratch))
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
