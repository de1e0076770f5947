"""Where ``export`` may write: never a checkpoint, and never over anything but an earlier export it was told to
replace.

One set of rules for both formats (:func:`check_out`). Whatever the format, ``OUT`` is refused when it is the
checkpoint being exported (by any spelling: a hard link or a link to it included) or lies inside it, and when it is
named as trainkit names a checkpoint (``last.pt``, ``best.pt``, their ``.prev`` copies, ``last.ckpt/`` ...,
``checkpoints/step-N.pt``) or lies inside such a directory: a resume would take those names for a checkpoint; and
when it bears another name a run writes or deletes in its folder (``metrics.jsonl``, ``.trainkit.lock``,
``.trainkit-lineage.json``, ``.trainkit-folder-id``, ``checkpoints/index.json``, ``.remote-staging/``,
``.remote-fetch-*/``). The rules look at where ``OUT`` really is (its folder's links resolved). Then what is there
already:

- ``--format torch`` writes one file. An existing ``OUT`` is refused unless ``overwrite`` is given and it is a
  regular file (no link, no folder, no FIFO) that an earlier torch-format export wrote: :func:`is_torch_export` reads
  it with trainkit's safe loader and finds :data:`EXPORT_MARKER`.
- ``--format safetensors`` writes ``OUT`` ending in ``.safetensors`` as one file (an existing one replaced only with
  ``overwrite``; a link is replaced itself, never written through), any other ``OUT`` as a folder (an existing one
  must be empty, or with ``overwrite`` hold an earlier export's files and nothing else).

The marker of a torch-format export: the file is a ``torch.save`` of an ``OrderedDict`` ``{name: tensor}`` whose
``_metadata`` attribute (the one ``nn.Module.state_dict()`` sets, and ``torch.load(weights_only=True)`` keeps) holds
``{".trainkit-export": header}``, the header the safetensors format writes. ``nn.Module.load_state_dict`` reads
``_metadata`` by module path only, and no module path starts with ``.``, so the marker changes nothing a load does.

Side effects: :func:`check_out` reads ``OUT``'s ``lstat``, a folder's entries, and (torch, ``overwrite``) the file.
"""

from __future__ import annotations

import os
import re
import stat
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainkit.errors import CheckpointError, ConfigError

__all__ = ["EXPORT_MARKER", "check_out", "is_torch_export", "mark_export", "same_file_still"]

EXPORT_MARKER = ".trainkit-export"
"""The key of a torch-format export's header in its state dict's ``_metadata``."""

_CHECKPOINT_NAME = re.compile(r"(last|best)(\.prev)?\.(pt|ckpt)")
_KEPT_NAME = re.compile(r"step-\d+\.(pt|ckpt)")
_KEPT_DIR = "checkpoints"
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def mark_export(weights: Mapping[str, Any], header: Mapping[str, str]) -> dict[str, Any]:
    """The state dict a torch-format export saves: ``weights`` in their order, marked with ``header``.

    Pure.

    >>> marked = mark_export({"w": 1}, {"format": "pt", "trainkit_version": "1.0"})
    >>> dict(marked), is_torch_export(marked), is_torch_export({"w": 1})
    ({'w': 1}, True, False)

    :param weights: Names to tensors (or an item's state).
    :param header: Text metadata (the safetensors header).
    :returns: An ``OrderedDict`` whose ``_metadata`` holds ``{EXPORT_MARKER: header}``.
    """
    marked: OrderedDict[str, Any] = OrderedDict(weights)
    marked._metadata = {EXPORT_MARKER: dict(header)}  # type: ignore[attr-defined]
    return marked


def is_torch_export(payload: Any) -> bool:
    """Whether a loaded file is what a torch-format export writes: marked (:func:`mark_export`), and not a
    trainkit checkpoint (no ``loop``, no ``items``).

    Pure.

    >>> is_torch_export(mark_export({"loop": {}}, {"format": "pt", "trainkit_version": "1.0"}))
    False

    :param payload: What the safe loader returned.
    :returns: True for an earlier export.
    """
    if not isinstance(payload, dict) or "loop" in payload or "items" in payload:
        return False
    metadata = getattr(payload, "_metadata", None)
    header = metadata.get(EXPORT_MARKER) if isinstance(metadata, dict) else None
    return isinstance(header, dict) and header.get("format") == "pt" and isinstance(header.get("trainkit_version"), str)


def _real(path: Path) -> Path:
    """Where ``path`` really is: its folder's links resolved, its own name kept (a link there is not followed)."""
    return Path(os.path.realpath(path.parent)) / path.name


def _run_owned(real: Path) -> str | None:
    """How ``real`` is a name of a run folder that a run writes or deletes, besides its checkpoints (its lock, its
    metrics, the lineage record, the folder's identity, the remote tier's staging and download folders, the kept
    checkpoints' index);
    None when it is not one."""
    from trainkit.checkpoint.checkpointer import LINEAGE_RECORD
    from trainkit.checkpoint.remote import FETCH_PREFIX, FOLDER_ID_FILE, STAGING_DIR
    from trainkit.run.folder import METRICS_FILE
    from trainkit.run.lock import LOCK_FILE

    if real.name in (LOCK_FILE, METRICS_FILE, LINEAGE_RECORD, FOLDER_ID_FILE) or (
        real.name == "index.json" and real.parent.name == _KEPT_DIR
    ):
        return f"is named as the {real.name} of"
    for place in [real, *real.parents][:-1]:
        if place.name == STAGING_DIR or place.name.startswith(FETCH_PREFIX):
            return "is named as a folder of" if place == real else f"lies inside {place}, named as a folder of"
    return None


def _refuse_checkpoint_place(path: Path, source: Path | None) -> None:
    """Refuse an ``OUT`` that is the checkpoint, lies in it, or bears a checkpoint's name (see the module)."""
    real = _real(path)
    if source is not None:
        real_source = Path(os.path.realpath(source))
        same = real == real_source or real_source in real.parents
        if not same and os.path.lexists(path):
            try:
                same = os.path.samefile(path, source)
            except OSError:
                same = False
        if same:
            raise ConfigError(
                "OUT", f"must not be the checkpoint being exported ({source}) or lie inside it", str(path),
                hint="name a new file or folder for the export",
            )  # fmt: skip
    places = [real, *real.parents]
    owned = _run_owned(real)
    if owned is not None:
        raise ConfigError(
            "OUT", f"{owned} a run folder trainkit keeps for itself (a run replaces or deletes it, and the export with "
            "it)", str(path), hint="name the export otherwise, e.g. model.pt",
        )  # fmt: skip
    for depth, place in enumerate(places[:-1]):
        kept = place.parent.name == _KEPT_DIR and _KEPT_NAME.fullmatch(place.name)
        if _CHECKPOINT_NAME.fullmatch(place.name) or kept:
            where = "is named" if depth == 0 else f"lies inside {place}, named"
            raise ConfigError(
                "OUT", f"{where} as trainkit names a checkpoint (last.pt, best.pt, *.prev.pt, last.ckpt/, "
                "checkpoints/step-N.pt ...): a resume would take it for one", str(path),
                hint="name the export otherwise, e.g. model.pt",
            )  # fmt: skip


def check_out(
    out: str | os.PathLike[str],
    *,
    overwrite: bool,
    format: str = "safetensors",  # noqa: A002 - the CLI's --format
    source: str | os.PathLike[str] | None = None,
) -> os.stat_result | None:
    """Refuse an ``OUT`` that an export must not write (the rules are the module's): nothing is ever lost unless it
    is an earlier export and ``overwrite`` says so.

    Side effects: none; reads ``out``'s ``lstat``, a folder's entries, and (``format="torch"`` with ``overwrite``)
    the file, with trainkit's safe loader.

    :param out: The file or folder to write.
    :param overwrite: Whether an earlier export there may be replaced.
    :param format: ``"torch"`` (one file) or ``"safetensors"``.
    :param source: The checkpoint being exported, when known.
    :returns: ``out``'s ``lstat`` when something is there (to check before the rename that it is still the same
        file: :func:`~trainkit.checkpoint.export.target.same_file_still`), else None.
    :raises ConfigError: When ``out`` is the checkpoint, lies inside it, or bears a checkpoint's name.
    :raises FileExistsError: When ``out`` is there and may not be replaced, or a folder on its way is a file,
        saying what to do.
    """
    if os.fspath(out) in ("-", ""):  # not a file a user means: ``-`` is a shell's stdout, which an export never is
        raise ConfigError(
            "OUT", "must name a file or folder to write (an export is not written to stdout)", os.fspath(out),
            hint="name the export, e.g. model.pt",
        )  # fmt: skip
    path = Path(out)
    _refuse_checkpoint_place(path, None if source is None else Path(source))
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise FileExistsError(f"{path} cannot be written: a folder on its way is a file; name another OUT") from None
    if format == "torch":
        _check_torch_file(path, info, overwrite=overwrite)
    elif path.name.endswith(".safetensors"):
        if stat.S_ISDIR(info.st_mode):
            raise FileExistsError(
                f"{path} is a folder; name a .safetensors file to write, or a folder without .safetensors"
            )
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")
    else:
        _check_folder(path, info, overwrite=overwrite)
    return info


def _check_torch_file(path: Path, info: os.stat_result, *, overwrite: bool) -> None:
    from trainkit.files.weights_only_load import load_checkpoint

    rule = "--format torch replaces only a file an earlier torch-format export wrote, with --overwrite"
    if stat.S_ISLNK(info.st_mode):
        raise FileExistsError(f"{path} is a link; {rule}: remove the link or name another OUT")
    if stat.S_ISDIR(info.st_mode):
        raise FileExistsError(f"{path} is a folder; --format torch writes one file: name it, e.g. {path}/model.pt")
    if not stat.S_ISREG(info.st_mode):
        raise FileExistsError(f"{path} is not a regular file; {rule}")
    if not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace an earlier export there")
    try:
        earlier = load_checkpoint(path)
    except CheckpointError as exc:
        raise FileExistsError(f"{path} is not an earlier export ({exc}); {rule}") from None
    if not is_torch_export(earlier):
        raise FileExistsError(f"{path} holds no trainkit export marker; {rule} (remove it by hand if it is yours)")


def _check_folder(path: Path, info: os.stat_result, *, overwrite: bool) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise FileExistsError(
            f"{path} exists and is not a folder; name a folder to write the hub's layout into, or a path ending in "
            ".safetensors to write one file"
        )
    with os.scandir(path) as listing:
        entries = list(listing)
    foreign = [
        entry.name for entry in entries if not (_export_file(entry.name) and entry.is_file(follow_symlinks=False))
    ]
    if entries and (not overwrite or foreign):
        raise FileExistsError(
            f"{path} exists and is not an empty folder; --overwrite (overwrite=True) replaces only a folder that "
            f"holds an export's files alone ({_SINGLE_FILE}, model-NNNNN-of-NNNNN.safetensors, {_INDEX_FILE})"
            + (f", and it holds {', '.join(sorted(foreign)[:5])}" if foreign else "")
        )


def _export_file(name: str) -> bool:
    return name in (_SINGLE_FILE, _INDEX_FILE) or _SHARD_NAME.fullmatch(name) is not None


def same_file_still(out: str | os.PathLike[str], checked: os.stat_result | None) -> None:
    """Refuse to publish over ``out`` when what is there is no longer what :func:`check_out` checked.

    Side effects: reads ``out``'s ``lstat``.

    :param out: The file about to be replaced.
    :param checked: :func:`check_out`'s result.
    :raises FileExistsError: When something appeared, went, or changed at ``out`` since.
    """
    try:
        now: os.stat_result | None = os.lstat(out)
    except FileNotFoundError:
        now = None
    if _identity(now) != _identity(checked):
        raise FileExistsError(f"{out} changed while the export was read; nothing was written: run it again")


def _identity(info: os.stat_result | None) -> tuple[int, ...] | None:
    return None if info is None else (info.st_dev, info.st_ino, info.st_mode, info.st_size, info.st_mtime_ns)
