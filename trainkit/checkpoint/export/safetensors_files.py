"""Weights as safetensors files: one file, or the hub's shards beside ``model.safetensors.index.json``.

Side effects: :func:`write_safetensors` writes files; the names, sizes and shard plans are pure, and
:func:`unique_storages` only reads tensors (copying the ones safetensors cannot write as they are).

A folder is laid out as ``huggingface_hub.save_torch_state_dict`` lays one out, so that the hub, ``transformers`` and
inference servers read it: ``model.safetensors`` when the weights fit in one shard, else
``model-00001-of-00003.safetensors`` ... and ``model.safetensors.index.json``
(``{"metadata": {"total_size": N, ...}, "weight_map": {name: file}}``), tensors assigned to shards in their order,
a new shard begun where the next tensor would overflow the current one, a tensor larger than the limit alone in a
shard of its own. A safetensors file holds no code by construction: reading one runs nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.export.target import check_out
from trainkit.errors import CheckpointError, ConfigError
from trainkit.files.durable import TEMP_SUFFIX, atomic_write_bytes, current_umask, fsync_directory
from trainkit.state.modules import canonical_name

__all__ = [
    "SINGLE_FILE",
    "INDEX_FILE",
    "DEFAULT_MAX_SHARD_SIZE",
    "parse_size",
    "export_names",
    "plan_shards",
    "unique_storages",
    "check_out",
    "require_safetensors",
    "write_safetensors",
]

SINGLE_FILE = "model.safetensors"
"""The one file of a folder whose weights fit in one shard."""

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded folder: every tensor's file, and the total size."""

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
"""The hub's default shard size, 5GB (``huggingface_hub``'s ``MAX_SHARD_SIZE``)."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_COUNTER = itertools.count()


def parse_size(text: str, *, option: str = "--max-shard-size") -> int:
    """Read a size as the hub spells one: ``"5GB"`` (decimal units, as the hub's), ``"2GiB"`` (binary), or bytes.

    Pure.

    >>> parse_size("5GB"), parse_size("500MB"), parse_size("1.5KiB"), parse_size("1024")
    (5000000000, 500000000, 1536, 1024)

    :param text: The size.
    :param option: The option it was given to, for the error message.
    :returns: The size in bytes, at least 1.
    :raises ConfigError: When ``text`` is no such size, naming the option, the rule and the value.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else None
    try:
        size = int(Decimal(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    except InvalidOperation:
        size = 0
    if size < 1:
        raise ConfigError(
            option,
            "must be a size of at least 1 byte: a number of bytes, or a number and a unit (B, KB, MB, GB, TB, KiB, "
            "MiB, GiB, TiB), e.g. 5GB or 500MB",
            text,
        )
    return size


def export_names(names: Iterable[str]) -> dict[str, str]:
    """Map state-dict names to the names a bare module has: without DDP's ``module.`` and compile's ``_orig_mod.``.

    Pure. An ``_orig_mod`` segment is dropped wherever it is (:func:`~trainkit.state.modules.canonical_name`); a
    ``module`` segment wherever it is the only child of what holds it, as in every name under DDP's wrapper, at the
    top or deeper (``encoder.module.fc.weight``). A submodule named ``module`` beside others keeps its name.

    >>> export_names(["module._orig_mod.0.weight", "module._orig_mod.0.bias"])
    {'module._orig_mod.0.weight': '0.weight', 'module._orig_mod.0.bias': '0.bias'}
    >>> export_names(["enc.module.fc.weight", "dec.module.w", "dec.norm.w"])
    {'enc.module.fc.weight': 'enc.fc.weight', 'dec.module.w': 'dec.module.w', 'dec.norm.w': 'dec.norm.w'}

    :param names: The checkpoint's names.
    :returns: Each name and the name it is exported under, in the order given.
    :raises CheckpointError: When two names become one.
    """
    split = {name: canonical_name(name).split(".") for name in names}
    children: dict[tuple[str, ...], set[str]] = {}
    for parts in split.values():
        for depth, part in enumerate(parts):
            children.setdefault(tuple(parts[:depth]), set()).add(part)
    exported: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name, parts in split.items():
        kept = [
            part
            for depth, part in enumerate(parts)
            if not (part == "module" and depth < len(parts) - 1 and children[tuple(parts[:depth])] == {"module"})
        ]
        new = ".".join(kept)
        if new in seen:
            raise CheckpointError(f"tensors {seen[new]!r} and {name!r} would both be exported as {new!r}")
        seen[new] = exported[name] = new
    return exported


def plan_shards(sizes: Mapping[str, int], max_shard_size: int) -> dict[str, list[str]]:
    """Assign tensors to files as ``huggingface_hub.split_torch_state_dict_into_shards`` does.

    Pure. In the tensors' order: a tensor larger than ``max_shard_size`` gets a shard of its own; any other joins
    the current shard, or begins the next one when it would take the current one past the limit.

    >>> plan_shards({"a": 4, "b": 4, "c": 4}, 8)
    {'model-00001-of-00002.safetensors': ['a', 'b'], 'model-00002-of-00002.safetensors': ['c']}
    >>> plan_shards({"a": 4, "b": 4}, 8)
    {'model.safetensors': ['a', 'b']}

    :param sizes: Each tensor's name and size in bytes, in the order to write them.
    :param max_shard_size: The limit of a shard's tensor bytes.
    :returns: Each file's name and the tensors it holds: ``model.safetensors`` alone when one shard holds them all.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {SINGLE_FILE: list(sizes)}
    return {f"model-{index:05d}-of-{len(shards):05d}.safetensors": shard for index, shard in enumerate(shards, 1)}


def _alias_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What two names of one tensor (a tied weight) have in common; None for a tensor with no memory."""
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0 or tensor.numel() == 0:
        return None
    return (tensor.device, pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def unique_storages(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Make tensors safetensors can write: one name per tied tensor, each tensor contiguous in memory of its own.

    Side effects: none on ``tensors``; copies a tensor where it must. As ``safetensors.torch.save_model`` does, a
    name for the very tensor another name holds (same memory, offset, shape, strides and dtype: a tied weight) is
    dropped and reported, the first name in ``tensors``' order kept (a model's embedding, registered before the
    head tied to it). A non-contiguous tensor, a view of part of a larger storage, and a tensor that shares memory
    with another kept one are copied, contiguous: safetensors refuses them as they are.

    :param tensors: The tensors by name.
    :returns: The tensors to write, and each dropped name with the name kept for it.
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owners: dict[tuple[Any, ...], str] = {}
    for name, tensor in tensors.items():
        key = _alias_key(tensor)
        if key in owners:
            aliases[name] = owners[key]
            continue
        if key is not None:
            owners[key] = name
        kept[name] = tensor.detach()
    sharing = Counter(tensor.untyped_storage().data_ptr() for tensor in kept.values() if _alias_key(tensor))
    for name, tensor in kept.items():
        nbytes = tensor.numel() * tensor.element_size()
        whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes
        if not whole or sharing[tensor.untyped_storage().data_ptr()] > 1:
            kept[name] = tensor.clone(memory_format=torch.contiguous_format)
    return kept, aliases


def require_safetensors() -> Any:
    """Import ``safetensors.torch.save``, or say in one line how to install it.

    :returns: The function.
    :raises ImportError: When safetensors is not installed: ``pip install 'trainkit[safetensors]'``.
    """
    try:
        from safetensors.torch import save
    except ImportError:
        raise ImportError("safetensors is not installed: pip install 'trainkit[safetensors]'") from None
    return save


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    out: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str],
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write tensors as one safetensors file, or as a folder the hub reads (shards and their index when they must).

    Side effects: ``out`` ending in ``.safetensors`` is written as one file with
    :func:`~trainkit.checkpoint.atomic_write_bytes`. Any other ``out`` is a folder, built under a temp name of its
    own beside it (each file durable, the folder fsynced) and renamed into place: ``model.safetensors`` when the
    tensors fit in one shard of ``max_shard_size`` (5GB by default), else shards and ``model.safetensors.index.json``.
    A previous export replaced (``overwrite``) is renamed away first and deleted after. One shard's bytes are in
    memory at a time. Every file's header holds ``metadata``; the index's metadata holds it too, beside
    ``total_size`` (an int, as the hub writes it).

    :param tensors: Names to tensors: contiguous, no two sharing memory (:func:`unique_storages`' output).
    :param out: A ``.safetensors`` file, or a folder.
    :param metadata: The header's text metadata (``"format": "pt"`` for the hub, among the rest).
    :param max_shard_size: The largest shard's tensor bytes; for a ``.safetensors`` file, a limit the tensors must
        fit in.
    :param overwrite: Replace what an earlier export wrote at ``out``
        (:func:`~trainkit.checkpoint.export.target.check_out`).
    :returns: The files written.
    :raises ImportError: When safetensors is not installed, saying how to get it.
    :raises ConfigError: When a single file would exceed ``max_shard_size``.
    :raises FileExistsError: When ``out`` may not be written
        (:func:`~trainkit.checkpoint.export.target.check_out`).
    """
    save = require_safetensors()
    target = Path(out)
    check_out(target, overwrite=overwrite)
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    header = dict(metadata)
    if target.name.endswith(".safetensors"):
        if max_shard_size is not None and sum(sizes.values()) > max_shard_size:
            raise ConfigError(
                "--max-shard-size",
                f"must hold the weights' {sum(sizes.values())} bytes when OUT ({target}) is one file",
                max_shard_size,
                hint="name a folder (no .safetensors suffix) to write shards",
            )
        atomic_write_bytes(save(dict(tensors), metadata=header), target)
        return [target]
    plan = plan_shards(sizes, DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    files: dict[str, Any] = {
        name: (lambda names=names: save({key: tensors[key] for key in names}, metadata=header))
        for name, names in plan.items()
    }
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values()), **header},
            "weight_map": {key: name for name, names in plan.items() for key in names},
        }
        files[INDEX_FILE] = lambda: json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    _publish_folder(files, target, overwrite=overwrite)
    return [target / name for name in files]


def _publish_folder(files: Mapping[str, Any], out: Path, *, overwrite: bool) -> None:
    """Build ``out`` under a temp name beside it (mode 0700 while built), one durable file at a time, then rename
    it into place; a previous export there goes first, renamed away, and is deleted once the new one is in place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:  # a folder of our own (mode 0700): nothing planted in it, no link to write through
        temporary = out.parent / f".{out.name}.{os.getpid()}.{next(_COUNTER)}{TEMP_SUFFIX}"
        try:
            os.mkdir(temporary, 0o700)
            break
        except FileExistsError:  # a leftover, or something planted under a name we would use: take another
            continue
    retired = None
    try:
        for name, build in files.items():
            atomic_write_bytes(build(), temporary / name)
        fsync_directory(temporary)
        os.chmod(temporary, 0o777 & ~current_umask())
        check_out(out, overwrite=overwrite)  # again: what is there now is what may be replaced
        if os.path.lexists(out) and os.listdir(out):
            retired = out.parent / f".{out.name}.{os.getpid()}.{next(_COUNTER)}.old{TEMP_SUFFIX}"
            os.rename(out, retired)
        os.rename(temporary, out)  # over an empty folder, or where nothing is
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        if retired is not None and not os.path.lexists(out):
            os.rename(retired, out)
        raise
    fsync_directory(out.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
