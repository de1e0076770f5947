"""Real checkpoint files taken apart, rewritten and damaged on purpose, for the tests of hostile and careless files."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch


def small_checkpoint(tmp_path: Path, payload: dict | None = None) -> Path:
    """A real torch.save file of a small payload with tensors."""
    path = tmp_path / "small.pt"
    torch.save(payload or {"w": torch.arange(6.0), "n": 3}, path)
    return path


def members_of(path: Path) -> dict[str, bytes]:
    """Every member of a real torch.save archive, by name, in file order."""
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def rewrite(source: Path, target: Path, compression: int = zipfile.ZIP_STORED, **replace: bytes) -> None:
    """Rewrite a real archive with Python's zipfile, members replaced by suffix (``data_pkl=...``) and compressed."""
    with zipfile.ZipFile(target, "w", compression) as archive:
        for name, data in members_of(source).items():
            key = name.split("/", 1)[1].replace("/", "_").replace(".", "_")
            archive.writestr(name, replace.get(key, data))


def flip_bit_in_tensor_data(path, offset_in_member=7):
    """Flip one bit inside the first tensor storage of a torch zip checkpoint."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 16)
    raw = bytearray(path.read_bytes())
    header = info.header_offset
    name_len = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(raw[header + 28 : header + 30], "little")
    data_start = header + 30 + name_len + extra_len
    raw[data_start + offset_in_member] ^= 0x10
    path.write_bytes(bytes(raw))


def export_header(payload: dict, *, epoch: int, checkpoint: str = "last", item: str = "model") -> dict[str, str]:
    """The header both export formats write for ``item`` of a checkpoint ``payload`` (safetensors metadata, and the
    torch file's marker in its state dict's ``_metadata``)."""
    import trainkit
    from trainkit.cli.export import config_sha256

    return {
        "format": "pt",
        "trainkit_version": trainkit.__version__,
        "checkpoint": checkpoint,
        "item": item,
        "epoch": str(epoch),
        "step": str(payload["step"]),
        "config_sha256": config_sha256(payload["config"]),
    }
