"""``python -m trainkit export CHECKPOINT OUT``: one registered module's weights as a plain state dict or safetensors.

Side effects: reads the checkpoint (with trainkit's checks, before anything is written), writes ``OUT`` durably.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from trainkit.cli.inspect import format_bytes

__all__ = [
    "FORMATS",
    "config_sha256",
    "export_weights",
]

FORMATS = ("torch", "safetensors")
"""What ``--format`` writes: a ``torch.save`` state dict, or safetensors."""


def config_sha256(config: Any) -> str:
    """Hash a config as an export's header records it: sha256 of its canonical JSON.

    Pure. The JSON is ``json.dumps(config, sort_keys=True, separators=(",", ":"))``, so the same config hashes the
    same whatever its keys' order.

    >>> config_sha256({"b": 1, "a": [0.5]}) == config_sha256({"a": [0.5], "b": 1})
    True

    :param config: The config a checkpoint records (its ``config`` entry).
    :returns: The hex digest.
    """
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read(source: Path, item: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One item's whole weights from a checkpoint, and the payload they came from (``trainkit.pt``'s, sharded)."""
    from trainkit.checkpoint import load_checkpoint
    from trainkit.checkpoint.formats import dcp_directory, dcp_read
    from trainkit.checkpoint.payload import validate_best, validate_last
    from trainkit.errors import CheckpointCorruptError, CheckpointError

    if source.is_dir():
        problem = dcp_read.verify_directory(source, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        engine = load_checkpoint(source / dcp_directory.ENGINE_FILE)
        if "loop" in engine:
            validate_last(engine, path=source / dcp_directory.ENGINE_FILE)
            key = item
            if engine.get(item) != dcp_directory.SHARDED:
                stored = [name for name in engine["items"] if engine[name] == dcp_directory.SHARDED]
                raise CheckpointError(f"{source} holds no sharded item {item!r}; it holds {stored} (--item NAME)")
        else:
            validate_best(engine, path=source / dcp_directory.ENGINE_FILE)
            key = "model"
        return dcp_directory.read_whole(source, key), engine
    payload = load_checkpoint(source)
    if "loop" not in payload:
        validate_best(payload, path=source)
        return payload["model"], payload
    validate_last(payload, path=source)
    if item not in payload["items"] or not isinstance(payload[item], dict):
        raise CheckpointError(f"{source} holds no item {item!r}; it holds {payload['items']} (--item NAME)")
    return payload[item], payload


def _header(payload: dict[str, Any], item: str) -> dict[str, str]:
    """An export's header (the safetensors metadata, the torch file's marker): what the weights are, and of which
    run (text only, as safetensors wants)."""
    try:
        version = importlib.metadata.version("trainkit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "unknown"
    last = "loop" in payload
    header = {"format": "pt", "trainkit_version": version, "checkpoint": "last" if last else "best"}
    header["item"] = item if last else "model"
    if payload.get("epoch") is not None:  # a best checkpoint's epoch and step are the best one's
        header["epoch"] = str(payload["epoch"])
    step = payload["step"] if last else (payload.get("best") or {}).get("step")
    if step is not None:  # a best checkpoint written before trainkit recorded the best's step has none
        header["step"] = str(step)
    header["config_sha256"] = config_sha256(payload["config"])
    return header


def export_weights(
    checkpoint: str | Path,
    out: str | Path,
    *,
    item: str = "model",
    format: str = "torch",  # noqa: A002 - the CLI's --format
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write one item's whole weights from a checkpoint as a plain state-dict file or as safetensors, for inference.

    Reads a sharded checkpoint directory (``last.ckpt``/``best.ckpt``, written by any number of ranks; its
    manifest is checked first) or a ``last.pt``/``best.pt``, in one process, with trainkit's checks (nothing in it
    runs; a refused checkpoint writes nothing). Names are a bare module's, whatever wrap (DDP, FSDP2,
    ``torch.compile``, none) wrote the checkpoint: DDP's ``module.`` and compile's ``_orig_mod.`` are dropped
    (:func:`~trainkit.checkpoint.export.safetensors_files.export_names`).

    ``format="torch"`` writes ``{name: tensor}`` (an ``OrderedDict`` marked as an export:
    :func:`~trainkit.checkpoint.export.target.mark_export`) with :func:`~trainkit.checkpoint.atomic_save` to the file
    ``out`` (a temp file in its folder, fsynced, renamed into place):
    ``model.load_state_dict(torch.load(out, weights_only=True))`` takes it. ``format="safetensors"`` writes
    ``out`` ending in ``.safetensors`` as one file, and any other ``out`` as a folder the Hugging Face hub reads
    (:func:`~trainkit.checkpoint.export.safetensors_files.write_safetensors`). In both formats an existing ``out`` is
    refused unless ``overwrite`` and it is an earlier export, and ``out`` is never the checkpoint, inside it, or
    named as a checkpoint (:func:`~trainkit.checkpoint.export.target.check_out`), all before the checkpoint is read.
    Each file's header (the torch file's marker) records ``format: pt``, the trainkit version, the
    item, which checkpoint (``last``/``best``), its epoch and step (a best one's are the best's) and ``config_sha256``
    (:func:`config_sha256` of the config it records); a tied weight is written once, each dropped name recorded as
    ``{dropped: kept}`` as ``safetensors.torch.save_model`` records it (``safetensors.torch.load_model`` loads it
    into a model that ties them).

    Side effects: reads the checkpoint (and, to replace it, an earlier export at ``out``), writes ``out``.

    :param checkpoint: The checkpoint directory or file.
    :param out: The file to write, or (safetensors) the folder.
    :param item: The registered item to export (a ``best`` checkpoint holds only the model, under any name).
    :param format: ``"torch"`` or ``"safetensors"``.
    :param max_shard_size: safetensors only: the largest shard's bytes (``parse_size`` in
        :mod:`~trainkit.checkpoint.export.safetensors_files` reads ``"5GB"``).
    :param overwrite: Replace an earlier export at ``out`` (nothing else).
    :returns: Lines describing what was written.
    :raises CheckpointError: When the checkpoint is damaged, is not a trainkit checkpoint, or has no such item.
    :raises ConfigError: When ``format`` is unknown, an option does not go with it, or ``out`` is the checkpoint,
        inside it, or named as a checkpoint.
    :raises ImportError: When safetensors is wanted and not installed, saying how to get it.
    :raises FileExistsError: When ``out`` exists and may not be replaced.
    """
    import torch

    from trainkit.checkpoint import atomic_save, payload_nbytes
    from trainkit.checkpoint.export import safetensors_files
    from trainkit.checkpoint.export.target import check_out, mark_export, same_file_still
    from trainkit.errors import ConfigError

    if format not in FORMATS:
        raise ConfigError("--format", f"must be one of {', '.join(FORMATS)}", format)
    if format == "torch" and max_shard_size is not None:
        raise ConfigError(
            "--max-shard-size", "goes with --format safetensors", show_value=False,
            hint="--format torch writes one file",
        )  # fmt: skip
    if format == "safetensors":
        safetensors_files.require_safetensors()
    source = Path(checkpoint)
    checked = check_out(out, overwrite=overwrite, format=format, source=source)  # before the read: it can take minutes
    weights, payload = _read(source, item)
    names = safetensors_files.export_names(weights)
    weights = {names[name]: value for name, value in weights.items()}
    tensors = {name: value for name, value in weights.items() if isinstance(value, torch.Tensor)}
    if format == "torch":
        same_file_still(out, checked)
        atomic_save(mark_export(weights, _header(payload, item)), out)
        written, aliases = [Path(out)], {}
    else:
        tensors, aliases = safetensors_files.unique_storages(tensors)
        header = {**aliases, **_header(payload, item)}
        written = safetensors_files.write_safetensors(
            tensors, out, metadata=header, max_shard_size=max_shard_size, overwrite=overwrite
        )
    size = payload_nbytes(tensors)  # a tied weight's memory once, as both formats write it
    where = f"{len(written)} files in {out}" if len(written) > 1 else str(written[0])
    tied = [f"{alias} = {kept}" for alias, kept in aliases.items()]
    notes = [f"tied, written once: {', '.join(tied[:3])}{', ...' if len(tied) > 3 else ''}"] if tied else []
    if format == "safetensors" and len(weights) > len(tensors) + len(aliases):
        notes.append(f"{len(weights) - len(tensors) - len(aliases)} entries that are not tensors left out")
    told = f" ({'; '.join(notes)})" if notes else ""
    return [f"wrote {where}: {len(tensors)} tensors{told}, {format_bytes(size)}, from {source}"]
