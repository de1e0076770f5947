"""The W&B run (rank 0), and its history read back from the offline files a resumed run left.

Side effects: W&B runs, and reading W&B's run folders. The only trainkit module that imports wandb, lazily, when
a run is started in a mode other than ``disabled`` or resumed.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from trainkit.config import redact_argv, redact_text, strip_secrets
from trainkit.files.bounded_read import UnreadableFile, load_json, open_regular
from trainkit.messages import warn_user

__all__ = [
    "NullSink",
    "WandbSink",
    "WandbHistory",
    "read_wandb_history",
    "mark_as_synced",
]


@contextlib.contextmanager
def _masked_argv(config_class: Any) -> Iterator[None]:
    """Show W&B a copy of ``sys.argv`` with its secrets masked while it starts a run, then put the original back.

    W&B reads ``sys.argv[1:]`` once, when ``wandb.init`` sends its settings to the service, and records it
    in the run's metadata (the ``.wandb`` file, ``wandb-metadata.json``); no setting replaces it short of
    dropping all metadata (``x_disable_meta``). The list object the program holds is never changed.
    """
    original = sys.argv
    sys.argv = [*original[:1], *redact_argv(original[1:], config_class)]
    try:
        yield
    finally:
        sys.argv = original


class NullSink:
    """A sink that drops everything: W&B off, or a rank other than 0."""

    run_id: str | None = None
    next_step: int = 0

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Drop ``metrics``."""

    def summary(self, values: Mapping[str, Any]) -> None:
        """Drop ``values``."""

    def finish(self, exit_code: int = 0) -> None:
        """Do nothing."""


class WandbSink:
    """The rank-0 W&B run.

    Each row is logged at the step :class:`~trainkit.run.log.RunLog` gives it (its line in ``metrics.jsonl``),
    committed at once. Charts use the logged ``trainer/step`` as their x-axis (``define_metric``).

    No secret reaches W&B's files: the config goes through ``strip_secrets`` (secret keys dropped, URL
    credentials masked), and the command line W&B records in the run's metadata is a copy with
    ``key=value`` overrides of secret keys and URL passwords masked (``api_key=***``). The rest of W&B's
    metadata is kept: the git remote (W&B drops its password itself), program, host, Python and hardware.
    Console capture stays on; trainkit's own messages render config values with ``render_value``.

    :param mode: ``"offline"``, ``"online"`` or ``"disabled"``.
    :param run_id: The run id; a resumed trainer passes the one stored in its checkpoint.
    :param directory: Where W&B writes its files (``out_dir``).
    :param config: The config dict for W&B's config panel, best the output of ``public_config``.
    :param project: ``wandb.project``.
    :param entity: ``wandb.entity``.
    :param name: ``wandb.name``.
    :param tags: ``wandb.tags``.
    :param config_class: The config record (or its class) whose declared secrets (``secret_field``) are
        masked on the recorded command line and kept out of the config; None judges keys by name alone.
    """

    def __init__(
        self,
        *,
        mode: str,
        run_id: str,
        directory: Path,
        config: Mapping[str, Any],
        project: str | None,
        entity: str | None,
        name: str | None,
        tags: tuple[str, ...],
        config_class: Any = None,
    ) -> None:
        try:
            import wandb
        except ImportError:  # pragma: no cover - wandb is a dependency; a stripped install may lack it
            raise ImportError("wandb is not installed: pip install wandb, or set wandb.mode=disabled") from None
        self._wandb = wandb
        self.run_id = run_id
        directory.mkdir(parents=True, exist_ok=True)
        kwargs = dict(
            id=run_id,
            resume="allow",
            dir=str(directory),
            config=strip_secrets(dict(config), config_class),
            project=project,
            entity=entity,
            name=name,
            tags=list(tags) or None,
            reinit="create_new",
        )
        try:
            with _masked_argv(config_class):
                self._run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=60, silent=True), **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure to reach W&B must not stop training
            if mode == "offline":
                raise
            reason = redact_text(f"{type(exc).__name__}: {exc}")  # an error may quote a URL with its password
            warn_user(
                f"W&B could not start in {mode!r} mode ({reason}); logging offline to "
                f"{directory} instead, sync it later with `wandb sync`"
            )
            with _masked_argv(config_class):
                self._run = wandb.init(mode="offline", settings=wandb.Settings(silent=True), **kwargs)
        self._run.define_metric("trainer/step")
        self._run.define_metric("*", step_metric="trainer/step")
        # the step of the next row: 0 offline; online, one past the last step the server holds for this id
        self.next_step = int(self._run.step)

    @property
    def directory(self) -> Path:
        """The W&B run's local folder."""
        return Path(self._run.dir).parent

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log one push as one W&B history row at ``step``.

        :param metrics: Name to float, including ``trainer/step`` and ``trainer/epoch``; W&B may keep it.
        :param step: W&B's step for the row, by default the one after the last; steps only grow (W&B drops
            a row at a step below its last).
        """
        if step is None:
            step = self.next_step
        # W&B copies the row itself; trainkit hands it a fresh dict per push
        self._run.log(metrics if isinstance(metrics, dict) else dict(metrics), step=step, commit=True)
        self.next_step = step + 1

    def summary(self, values: Mapping[str, Any]) -> None:
        """Write values into the run summary.

        :param values: Name to value.
        """
        self._run.summary.update(dict(values))

    def finish(self, exit_code: int = 0) -> None:
        """Finish the run, flushing its files.

        :param exit_code: Non-zero marks the run as failed.
        """
        self._run.finish(exit_code=exit_code)


_WANDB_BLOCK = 32 * 1024


_CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, kind


_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_log_records(read_block: Callable[[int], bytes]) -> Iterator[bytes]:
    """The records of a W&B transaction log (``run-<id>.wandb``), oldest first, read one block at a time.

    The file is a 7-byte header then a LevelDB-style log: 32 KiB blocks of chunks, each with a CRC-32 of
    its kind and payload; a record spans one chunk or a first, middle and last. Reading stops at the first
    chunk that is cut short or fails its checksum, the tail a killed process leaves, and at a block that
    starts with zeros (W&B pads only a block's last bytes: a zeroed block is a sparse or preallocated tail,
    which holds no record and is not read through). Memory is one block and the record being assembled.

    :param read_block: Returns block ``n`` of the file (shorter at its end, empty past it).
    """
    block, number = read_block(0), 0
    if block[:4] != b":W&B":
        return
    position, pending = 7, None  # pending: the chunks so far of a record that spans several
    while True:
        if len(block) - position < _CHUNK_HEADER.size:  # a block's tail too short for a header is zero padding
            if len(block) < _WANDB_BLOCK:
                return
            number += 1
            block, position = read_block(number), 0
            continue
        checksum, length, kind = _CHUNK_HEADER.unpack_from(block, position)
        if checksum == 0 and length == 0 and kind == 0:  # the rest of the block is padding
            if position == 0:
                return
            position = len(block)
            continue
        start = position + _CHUNK_HEADER.size
        payload = block[start : start + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != checksum:
            return
        position = start + length
        if kind == _FULL and pending is None:
            yield payload
        elif kind == _FIRST and pending is None:
            pending = bytearray(payload)  # may be empty: a first chunk can hold no byte of the record
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += payload
            if kind == _LAST:
                yield bytes(pending)
                pending = None
        else:
            return


class WandbHistory(NamedTuple):
    """What the W&B run folders of one run id already hold."""

    next_step: int
    """The first step no row is held at (0 when there is none): W&B holds every step below it."""
    rows: dict[int, dict[str, Any]]
    """The rows at steps from ``since`` up to ``next_step``, by step, without W&B's own ``_`` keys."""
    empty: tuple[Path, ...] = ()
    """The ``.wandb`` files without a run record (a kill took everything W&B had not written yet)."""


class _Unusable(Exception):
    """A ``.wandb`` file that is skipped: not a regular file, or holding records trainkit's runs never write."""


def read_wandb_history(wandb_dirs: Iterable[Path], run_id: str, since: int = 0) -> WandbHistory:
    """Read the history rows of run ``run_id`` from the W&B folders under ``wandb_dirs``.

    Side effects: reads every ``*/run-<run_id>.wandb`` file there (a resumed offline run has one folder per
    session), except in linked folders; warns once per file it skips. A file whose tail a kill cut off counts up
    to its last complete record. A file that is not a regular file (a FIFO, a link, a device), or that holds a
    history record trainkit never writes (a value that is not JSON, or nested deeper than
    :data:`~trainkit.files.bounded_read.MAX_JSON_DEPTH`; a step that is not a non-negative int), is skipped whole,
    with a ``RuntimeWarning`` naming it, and its rows are sent to W&B again (W&B keeps the first row it got at a step);
    so are the rows of a file without a run record (W&B writes that record first).
    A row's W&B step is its line in ``metrics.jsonl``, and each session sends the steps W&B lacks in order, so
    the steps a run holds have no gap: the history ends at the first step no file holds, and rows at steps
    beyond it (a planted record at step 2**62, say) are ignored with a warning, never taken to mean that W&B
    holds every row below them. Without wandb installed nothing is read.

    :param wandb_dirs: The ``wandb`` folders W&B wrote the run into (``out_dir/wandb``).
    :param run_id: The W&B run id.
    :param since: Keep the rows from this step on.
    :returns: The next free step, the kept rows and the files without a run record.
    """
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:  # pragma: no cover - wandb is a dependency; a stripped install may lack it
        return WandbHistory(0, {})
    holder: dict[int, Path] = {}  # every step held, and the first file holding it
    rows: dict[int, dict[str, Any]] = {}
    empty = []
    for folder in wandb_dirs:
        for path in sorted(folder.glob(f"*/run-{run_id}.wandb")):
            if path.parent.is_symlink():  # W&B's latest-run link: the folder is read under its own name
                continue
            try:
                found, has_run = _read_datastore(path, wandb_internal_pb2, since)
            except _Unusable as exc:
                warn_user(
                    f"{path} {exc}; it is skipped, and the rows it holds are sent to W&B again (W&B keeps the first "
                    "row it got at a step)"
                )
                continue
            if not has_run:  # W&B writes the run record first: without it, nothing here was ever uploaded
                empty.append(path)
                if found:
                    warn_user(
                        f"{path} holds W&B history but no run record, which W&B always writes first: it is not this "
                        "run's W&B file, and its rows are not taken as sent"
                    )
                continue
            for step, row in found.items():
                if step not in holder:  # W&B keeps the first row it got at a step
                    holder[step] = path
                    if row is not None:
                        rows[step] = row
    next_step = 0
    while next_step in holder:
        next_step += 1
    beyond = sorted({str(path) for step, path in holder.items() if step > next_step})
    if beyond:
        warn_user(
            f"{', '.join(beyond)} hold W&B rows past step {next_step}, which no file holds: trainkit sends every step "
            "in order, so those rows are not this run's (a damaged or planted file); they are ignored, and the rows "
            f"from step {next_step} on are sent to W&B"
        )
    return WandbHistory(next_step, {step: row for step, row in rows.items() if step < next_step}, tuple(empty))


def _read_datastore(path: Path, protos: Any, since: int) -> tuple[dict[int, dict[str, Any] | None], bool]:
    """The steps of one ``.wandb`` file with their rows from ``since`` on (None before), and whether it holds a run
    record."""
    try:
        fd, _ = open_regular(path)
    except UnreadableFile as exc:
        raise _Unusable(f"cannot be read as a W&B file: {exc.reason}") from None
    rows: dict[int, dict[str, Any] | None] = {}
    has_run = False
    try:
        for payload in _wandb_log_records(lambda number: os.pread(fd, _WANDB_BLOCK, number * _WANDB_BLOCK)):
            record = protos.Record()
            try:
                record.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError; a damaged record ends the file
                break
            kind = record.WhichOneof("record_type")
            has_run = has_run or kind == "run"
            if kind != "history":
                continue
            try:
                items = {
                    item.key or "/".join(item.nested_key): load_json(item.value_json) for item in record.history.item
                }
            except ValueError as exc:
                raise _Unusable(f"holds a history value that is not the JSON trainkit logs ({exc})") from None
            step = record.history.step.num if record.history.HasField("step") else items.get("_step", 0)
            if type(step) is not int or step < 0:
                raise _Unusable(f"holds a history record at step {str(step)[:50]!r}, not a step number")
            if step not in rows:
                rows[step] = (
                    {key: value for key, value in items.items() if not key.startswith("_")} if step >= since else None
                )
    except OSError as exc:
        raise _Unusable(f"could not be read to its end ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    return rows, has_run


def mark_as_synced(datastore: Path) -> None:
    """Write W&B's "synced" marker beside a ``.wandb`` file that holds no run, so ``wandb sync`` skips it.

    ``wandb sync`` stops before uploading anything when one of the files it is given has no run record;
    such a file has nothing to upload.

    :param datastore: The ``run-<id>.wandb`` file.
    """
    marker = datastore.with_suffix(".wandb.synced")
    with contextlib.suppress(OSError):
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        os.close(fd)
