"""``python -m trainkit inspect CHECKPOINT``: what a checkpoint holds, read as untrusted input; or a run folder's
kept checkpoints with the rule keeping each (``inspect OUT_DIR``); or a remote prefix (``inspect URL``).

Side effects: reads the checkpoint, the run folder (links and files of other kinds are never followed) or the prefix
(``ckpt.remote``'s store, through fsspec); ``inspect`` of one remote checkpoint folder downloads and verifies it
into a temporary folder (removed after). Nothing is written.

Everything shown that came from the store (a lease's holder, a commit record's run id and version, what the
downloaded checkpoint holds) is escaped (:func:`~trainkit.messages.printable`): a planted value can neither drive
the terminal nor forge a line.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainkit import bookkeeping
from trainkit.bookkeeping import EpochPosition, resumable_world_sizes
from trainkit.checkpoint.formats.pt import BEST_CKPT, LAST_CKPT
from trainkit.checkpoint.kept import KEPT_DIR, directory_problem, folder_problem, kept_path, read_kept
from trainkit.checkpoint.remote import LAST, LAST_DIR, folder_step, shown
from trainkit.cli.report import format_value
from trainkit.cli.retain import keep_policy, open_remote_prefix
from trainkit.errors import ConfigError
from trainkit.messages import printable

__all__ = [
    "describe_checkpoint",
    "describe_remote",
    "describe_run_folder",
    "format_bytes",
    "is_run_folder",
]

_SHOWN_TENSORS = 20
"""Tensors listed per item by ``inspect`` (the rest are counted); ``--all`` lists every one."""


def format_bytes(nbytes: float) -> str:
    """A byte count as people read it: ``"512 B"``, ``"1.5 KiB"``, ``"20.0 MiB"``, ``"3.2 GiB"``.

    :param nbytes: The number of bytes.
    :returns: The count in the largest binary unit under 1024 of it (GiB at most).

    >>> format_bytes(512), format_bytes(1536)
    ('512 B', '1.5 KiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"  # pragma: no cover


def _global_order_lines(position: EpochPosition, pinned: str | None = None) -> list[str]:
    """What ``inspect`` says of a mid-epoch position's place in the epoch's global order, and the world sizes it
    resumes on (:func:`~trainkit.bookkeeping.resumable_world_sizes`; only its own when ``pinned`` says why).

    >>> p = EpochPosition(epoch=0, batches=2, batches_per_epoch=6, batch_size=3, dataset_length=36, world_size=2,
    ...                   samples=12, global_batch=6, order="DistributedSampler(shuffle=True, seed=0, drop_last=False)")
    >>> print("\\n".join(_global_order_lines(p)))
    global order: 12 samples consumed, a global batch of 6, DistributedSampler(shuffle=True, seed=0, drop_last=False)
    resumes on:   1 rank (batch_size=6), 2 ranks (batch_size=3), 3 ranks (batch_size=2), 6 ranks (batch_size=1)
    """
    if position.samples is None or position.global_batch is None:
        order = "not recorded (written before it was, or by a loader that carries its own per-rank position)"
    else:
        order = f"{position.samples} samples consumed, a global batch of {position.global_batch}, {position.order}"
    sizes = resumable_world_sizes(position)
    if pinned is not None:
        sizes = [(world, batch) for world, batch in sizes if world == position.world_size]
    ranks = ", ".join(f"{world} rank{'s' * (world > 1)} (batch_size={batch})" for world, batch in sizes)
    if pinned is not None:
        ranks += f" only ({pinned})"
    elif len(sizes) == 1:
        ranks += " only (its order depends on the world size, or is not recorded)"
    return [f"global order: {order}", f"resumes on:   {ranks or f'{position.world_size} ranks only'}"]


def _pinned(payload: Mapping[str, Any]) -> str | None:
    """Why a checkpoint resumes only on the world size that wrote it because of its registered items, or None."""
    from trainkit.checkpoint.payload import resume_refusal  # torch, only once a checkpoint is read

    refusal = resume_refusal({**payload, "trainkit": None}, payload["world_size"] + 1)
    return None if refusal is None else "registered items differ between its ranks"


def _where(payload: Mapping[str, Any], position: EpochPosition | None) -> str:
    """Where a ``last.pt`` stands, as ``inspect`` says it: epochs done and the step at an epoch's end, or the epoch
    it is inside, its step and its batches for a step checkpoint and for a run that stopped inside an epoch (at
    ``max_steps`` or a step validation's early stop: a raised budget continues from the next batch); a checkpoint
    of such a stop that recorded no batch position (an earlier trainkit's) says only where the run stopped.

    >>> _where({"epoch": 2, "step": 60, "loop": {}}, None)
    '2 done, step 60'
    >>> p = EpochPosition(epoch=0, batches=37, batches_per_epoch=100, batch_size=8, dataset_length=800, world_size=1)
    >>> _where({"epoch": 0, "step": 37, "loop": {"in_epoch": True}}, p)
    '0, step 37 (inside the epoch: 37 of 100 batches done)'
    >>> _where({"epoch": 0, "step": 37, "loop": {"in_epoch": True, "stop_reason": "max_steps"}}, p)
    '0, step 37 (inside the epoch: 37 of 100 batches done; the run stopped here: max_steps)'
    >>> _where({"epoch": 1, "step": 9, "loop": {"in_epoch": True, "stop_reason": "max_steps"}}, None)
    '1, step 9 (inside the epoch, where the run stopped: max_steps)'
    """
    loop = payload["loop"]
    if position is not None:
        stopped = f"; the run stopped here: {loop['stop_reason']}" if loop.get("stop_reason") else ""
        return f"{position.epoch}, step {payload['step']} (inside the epoch: {position.done} done{stopped})"
    if loop.get("in_epoch"):
        stopped = f"where the run stopped: {loop.get('stop_reason')}"
        return f"{payload['epoch']}, step {payload['step']} (inside the epoch, {stopped})"
    return f"{payload['epoch']} done, step {payload['step']}"


def _rank_items_lines(payload: Mapping[str, Any]) -> list[str]:
    """What ``inspect`` says of the registered items whose state differed between the ranks that wrote a checkpoint.

    >>> means = {"loss_mean": [{"sum": None, "count": 0}] * 2}
    >>> for line in _rank_items_lines({"world_size": 2, "rank_items": {"means": means, "differ": ["tally"]}}):
    ...     print(line)
    per rank:     loss_mean: a running mean per rank (each rank's own on 2 ranks, pooled on another world size)
    per rank:     tally: differs between ranks (resumes on 2 ranks only)
    """
    rank_items, world = payload.get("rank_items"), payload["world_size"]
    if rank_items is None:
        return []
    pooled = f"a running mean per rank (each rank's own on {world} ranks, pooled on another world size)"
    lines = [f"per rank:     {name}: {pooled}" for name in rank_items["means"]]
    return lines + [
        f"per rank:     {name}: differs between ranks (resumes on {world} ranks only)" for name in rank_items["differ"]
    ]


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
    from trainkit.checkpoint import load_checkpoint
    from trainkit.checkpoint.formats import dcp_directory, dcp_read
    from trainkit.checkpoint.payload import validate_best, validate_last
    from trainkit.errors import CheckpointCorruptError

    source = Path(path)
    path = source
    if source.is_dir():  # a sharded checkpoint: its manifest first, then its engine payload
        problem = dcp_read.verify_directory(source, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        path = source / dcp_directory.ENGINE_FILE
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
    lines = [f"checkpoint:   {source} ({format_bytes(size)}, {what}, schema {payload['schema_version']})"]
    best = payload.get("best")
    if kind == "last.pt":
        loop = payload["loop"]
        mid_epoch = payload.get("trainkit")
        position = None if mid_epoch is None else EpochPosition.from_dict(mid_epoch["position"])
        lines.append(f"epoch:        {_where(payload, position)}, world size {payload['world_size']}")
        validated = loop.get("last_validated", True)
        lines.append(f"loop:         stop_reason={loop.get('stop_reason')}, last epoch validated={validated}")
        if mid_epoch is not None and position is not None:
            samples = "samples unknown" if position.dataset_length is None else f"{position.dataset_length} samples"
            own = " (the loader's own state)" if "loader_state" in mid_epoch["ranks"][0] else ""
            lines.append(
                f"position:     inside epoch {position.epoch}: {position.done} done (batch size "
                f"{position.batch_size}, {samples}); a resume continues from the next batch{own}"
            )
            lines += _global_order_lines(position, _pinned(payload))
        elif loop.get("in_epoch"):
            lines.append(f"position:     inside epoch {payload['epoch']}, where the run stopped")
        else:
            lines.append("position:     at an epoch's end")
        lines += _rank_items_lines(payload)
    else:
        step = (best or {}).get("step")
        lines.append(f"best epoch:   {payload['epoch']}" + ("" if step is None else f", step {step}"))
    if best is not None:
        metrics = ", ".join(f"{k}={format_value(v)}" for k, v in sorted((best.get("metrics") or {}).items()))
        direction = "minimize" if best.get("minimize") else "maximize"
        at_step = "" if best.get("step") is None else f", step {best['step']}"
        lines.append(
            f"best:         score {format_value(best.get('score'))} at epoch {best.get('epoch')}{at_step} "
            f"({direction}, min_delta {best.get('min_delta')}){'; ' + metrics if metrics else ''}"
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
        if (isinstance(value, str) and value == dcp_directory.SHARDED) or (source.is_dir() and kind == "best.pt"):
            lines.append(f"  {name}: in the DCP shards (python -m trainkit export {source} OUT.pt --item {name})")
            continue
        tensors = _tensors(value, "")
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        kind = "" if tensors else f" ({type(value).__name__})"
        lines.append(f"  {name}: {len(tensors)} tensor(s), {format_bytes(total)}{kind}")
        shown = tensors if all_tensors else tensors[:_SHOWN_TENSORS]
        for where, tensor in shown:
            shape = "x".join(map(str, tensor.shape)) or "scalar"
            dtype = str(tensor.dtype).removeprefix("torch.")
            lines.append(f"    {where}: {dtype} {shape} ({format_bytes(tensor.numel() * tensor.element_size())})")
        if len(tensors) > len(shown):
            lines.append(f"    ... {len(tensors) - len(shown)} more (--all lists them)")
    return lines


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


def _rows(described: list[bookkeeping.Checkpoint], reasons: dict[int, tuple[str, ...]], directory: Path) -> list[str]:
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
        policy = bookkeeping.KeepAny()
    rules = policy.spec or "none recorded"
    lines.append(f"  {len(described)} kept checkpoints in {directory} (ckpt.keep={rules}):")
    lines.extend(_rows(described, bookkeeping.keep_reasons(policy, described, newest=folder.newest), directory))
    lines.extend(f"  {name}: not a file trainkit wrote; never followed nor deleted" for name in folder.refused)
    return lines


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
            tier = open_remote_prefix(head, Path(scratch))
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
    tier = open_remote_prefix(url, Path(tempfile.gettempdir()))
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
