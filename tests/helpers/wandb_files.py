"""W&B's offline ``.wandb`` files, read back and written by hand.

A ``.wandb`` file is a LevelDB-style log of protobuf ``Record`` messages in 32 KiB blocks; wandb ships no reader
of its own, so the tests read (and, to plant hostile files, write) the framing themselves.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import attrs

BLOCK = 32 * 1024
"""The size of a block of the log: no chunk header crosses a block's end."""
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
"""The chunk kinds: a whole record, or the first, a middle or the last piece of one cut at block ends."""


def read_records(path: Path):
    """Yield the protobuf records of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B datastore"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    """The key of a config, history or summary item (a nested key joined with ``/``)."""
    return item.key or "/".join(item.nested_key)


@attrs.frozen
class OfflineRun:
    """What one offline run folder holds."""

    folder: Path
    run_id: str
    config: dict
    history: list[dict]
    summary: dict
    exit_code: int | None

    @classmethod
    def read(cls, folder: Path) -> OfflineRun:
        (datastore,) = folder.glob("run-*.wandb")
        run_id, config, history, summary, exit_code = None, {}, [], {}, None
        for record in read_records(datastore):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({item_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({item_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                history.append({item_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                summary.update({item_key(i): json.loads(i.value_json) for i in record.summary.update if item_key(i)})
            elif kind == "exit":
                exit_code = record.exit.exit_code
        return cls(folder=folder, run_id=run_id, config=config, history=history, summary=summary, exit_code=exit_code)


def offline_runs(out_dir: Path, timeout_s: float = 30.0) -> list[OfflineRun]:
    """Every finished offline run under ``out_dir/wandb``, oldest first.

    ``run.finish()`` returns before W&B's service has written the run's records, so this waits until each
    datastore holds its exit record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [OfflineRun.read(folder) for folder in sorted((out_dir / "wandb").glob("offline-run-*"))]
        if all(part.exit_code is not None for part in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


def leveldb_log(records: list[bytes], header: bytes = b":W&B\x00\x00\x01") -> bytes:
    """Frame records as W&B's writer does (LevelDB's log format with W&B's CRC-32)."""
    import zlib

    out = bytearray(header)
    for record in records:
        rest, first = record, True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out += b"\0" * left
                continue
            fragment, rest = rest[: left - 7], rest[left - 7 :]
            kind = (FULL if not rest else FIRST) if first else (LAST if not rest else MIDDLE)
            out += struct.pack("<IHB", zlib.crc32(fragment, zlib.crc32(bytes((kind,)))), len(fragment), kind)
            out += fragment
            first = False
            if not rest:
                break
    return bytes(out)


def run_record(run_id: str) -> bytes:
    """A serialized W&B run record, the first record W&B writes to a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.run.run_id = run_id
    return record.SerializeToString()


def history_record(step: int, padding: int) -> bytes:
    """A serialized W&B history record at ``step`` with a ``padding``-character string item (to size it)."""
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.history.step.num = step
    for key, value in (("_step", step), ("trainer/step", step * 10), ("note", "x" * padding)):
        item = record.history.item.add()
        item.key = key
        item.value_json = json.dumps(value)
    return record.SerializeToString()
