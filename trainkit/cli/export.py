"""``python -m trainkit export CHECKPOINT OUT``: one registered module's weights as a plain state dict.

Side effects: reads the checkpoint, writes ``OUT`` durably.
"""

from __future__ import annotations

from pathlib import Path

from trainkit.cli.inspect import format_bytes

__all__ = [
    "export_weights",
]


def export_weights(checkpoint: str | Path, out: str | Path, *, item: str = "model") -> list[str]:
    """Write one item's whole weights from a checkpoint as a plain state-dict file, e.g. for inference.

    Reads a sharded checkpoint directory (``last.ckpt``/``best.ckpt``, written by any number of ranks; its
    manifest is checked first) or a ``last.pt``/``best.pt``, in one process, and writes
    ``{name: tensor}`` with :func:`~trainkit.checkpoint.atomic_save`: ``model.load_state_dict(torch.load(out))``
    takes it, whatever wrap (DDP, FSDP2, none) wrote the checkpoint (DDP's ``module.`` prefix is dropped).

    Side effects: reads the checkpoint, writes ``out``.

    :param checkpoint: The checkpoint directory or file.
    :param out: The file to write.
    :param item: The registered item to export (a ``best`` checkpoint holds only the model, under any name).
    :returns: Lines describing what was written.
    :raises CheckpointError: When the checkpoint is damaged, is not a trainkit checkpoint, or has no such item.
    """
    import torch

    from trainkit import checkpoint as ckpt_io
    from trainkit.checkpoint import dcp as sharded
    from trainkit.checkpoint.payload import validate_best, validate_last
    from trainkit.errors import CheckpointCorruptError, CheckpointError

    source = Path(checkpoint)
    if source.is_dir():
        problem = sharded.verify_directory(source, rank=0, world_size=1)
        if problem is not None:
            raise CheckpointCorruptError(problem)
        engine = ckpt_io.load_checkpoint(source / sharded.ENGINE_FILE)
        if "loop" in engine:
            validate_last(engine, path=source / sharded.ENGINE_FILE)
            key = item
            if engine.get(item) != sharded.SHARDED:
                stored = [name for name in engine["items"] if engine[name] == sharded.SHARDED]
                raise CheckpointError(f"{source} holds no sharded item {item!r}; it holds {stored} (--item NAME)")
        else:
            validate_best(engine, path=source / sharded.ENGINE_FILE)
            key = "model"
        weights = sharded.read_whole(source, key)
    else:
        payload = ckpt_io.load_checkpoint(source)
        if "loop" in payload:
            validate_last(payload, path=source)
            if item not in payload["items"] or not isinstance(payload[item], dict):
                raise CheckpointError(f"{source} holds no item {item!r}; it holds {payload['items']} (--item NAME)")
            weights = payload[item]
        else:
            validate_best(payload, path=source)
            weights = payload["model"]
    if weights and all(name.startswith("module.") for name in weights):
        # a DDP-wrapped model was saved under DDP's names; a bare module (what inference builds) has none
        weights = {name.removeprefix("module."): value for name, value in weights.items()}
    tensors = {name: value for name, value in weights.items() if isinstance(value, torch.Tensor)}
    ckpt_io.atomic_save(weights, out)
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    return [f"wrote {out}: {len(tensors)} tensors, {format_bytes(size)}, from {source}"]
