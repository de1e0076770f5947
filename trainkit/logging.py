"""Metric buffering and where pushed metrics go: ``metrics.jsonl`` and W&B (rank 0), through one :class:`RunLog`.

Side effects: W&B runs, file appends, and reading the W&B run folders a resumed run left. This is the only
trainkit module that imports wandb, and it does so lazily, when a run is started in a mode other than
``disabled`` or resumed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import struct
import sys
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainkit.bookkeeping import is_real
from trainkit.config import WandbConfig, redact_argv, redact_text, strip_secrets
from trainkit.errors import OutDirError
from trainkit.messages import say, warn_user
from trainkit.run_files import same_directory
from trainkit.safe_read import UnreadableFile, load_json, open_regular

__all__ = [
    "LogBuffer",
    "TrainerMetrics",
    "WandbSink",
    "NullSink",
    "JsonlSink",
    "RunLog",
    "WandbHistory",
    "read_wandb_history",
    "mark_as_synced",
    "open_run_log",
    "new_run_id",
]


def new_run_id() -> str:
    """Return a fresh W&B-compatible run id (8 lowercase alphanumerics)."""
    return uuid.uuid4().hex[:8]


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


class LogBuffer:
    """Metrics waiting for the next push, kept on their device until then.

    ``add`` keeps a device-side copy of each accelerator tensor (no host sync) and reads a CPU tensor at once
    (it is on the host: nothing to wait for); ``drain`` moves every tensor to the host in one transfer per
    device. A key logged twice before a push keeps its last value; later in-place changes to a logged tensor
    stay out of it.
    """

    read_cpu_at_log: bool = True
    """Read a CPU tensor at ``add`` (the default); False keeps it on the CPU until the push, as an accelerator's
    tensor is kept (the tests set it to run the accelerator path on a machine without one)."""

    def __init__(self) -> None:
        self._scalars: dict[str, Any] = {}
        self._vectors: dict[tuple[str, ...], torch.Tensor] = {}
        # one float64 scalar per tensor-valued key, reused from push to push: logging once per step
        # copies into it instead of allocating a tensor per step (drain reads slots, they never escape)
        self._slots: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._scalars) + sum(len(keys) for keys in self._vectors)

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Buffer scalar metrics: floats, ints, or 1-element tensors (an accelerator's kept on it).

        :param metrics: Name to value.
        :raises TypeError: When a value is not a number or a 1-element tensor.
        """
        slots = self._slots
        for key, value in metrics.items():
            key = str(key)
            if isinstance(value, torch.Tensor) and value.is_cpu and self.read_cpu_at_log:
                # a CPU tensor is on the host already: reading it now waits for nothing, is the snapshot, and is the
                # one tensor call a logged row needs (a device-side copy costs a few times more on a cold cache)
                try:
                    value = float(value.item())
                except (RuntimeError, TypeError, ValueError):
                    if value.numel() != 1:
                        raise TypeError(
                            f"logged metric {key!r} must be a 1-element tensor, got shape {tuple(value.shape)}"
                        ) from None
                    raise TypeError(
                        f"logged metric {key!r} must be a real-valued 1-element tensor, got dtype {value.dtype}"
                    ) from None
            elif isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise TypeError(f"logged metric {key!r} must be a 1-element tensor, got shape {tuple(value.shape)}")
                value = value.detach()
                if value.dim():
                    value = value.reshape(())
                slot = slots.get(key)
                if slot is None or slot.device != value.device:
                    slot = slots[key] = torch.empty((), dtype=torch.float64, device=value.device)
                # one device-side copy is the snapshot (later in-place changes stay out) and the cast for drain
                value = slot.copy_(value)
            elif isinstance(value, str | bytes):
                raise TypeError(f"logged metric {key!r} must be a number or a tensor, got {value!r}")
            elif not is_real(value):
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise TypeError(f"logged metric {key!r} must be a number or a tensor, got {value!r}") from None
            self._scalars[key] = value

    def add_vector(self, keys: list[str], values: torch.Tensor) -> None:
        """Buffer many metrics held in one 1-D tensor, e.g. per-parameter statistics.

        :param keys: One name per element.
        :param values: The values, on any device.
        """
        if len(keys) != values.numel():
            raise ValueError(f"add_vector got {len(keys)} keys for {values.numel()} values")
        if keys:
            # the same keys logged again before a push replace the older values, so memory stays bounded
            self._vectors.pop(tuple(keys), None)
            self._vectors[tuple(keys)] = values.detach().reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        """The buffered metrics as host values, without draining them (what a step checkpoint keeps).

        Side effects: one device-to-host transfer per buffered tensor.

        :returns: ``{"scalars": [[key, float], ...], "vectors": [[[key, ...], [float, ...]], ...]}``, in logging order.
        """
        return {
            "scalars": [
                [key, float(value.item()) if isinstance(value, torch.Tensor) else float(value)]
                for key, value in self._scalars.items()
            ],
            "vectors": [[list(keys), values.to(torch.float64).tolist()] for keys, values in self._vectors.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned, replacing the buffer's content.

        :param state: The saved buffer.
        """
        self._scalars = {str(key): float(value) for key, value in state["scalars"]}
        self._vectors = {tuple(keys): torch.tensor(values, dtype=torch.float64) for keys, values in state["vectors"]}

    def drain(self) -> dict[str, float]:
        """Return every buffered metric as a Python float and empty the buffer.

        Side effects: one device-to-host transfer per device that holds buffered tensors.

        :returns: Name to float, in logging order.
        """
        if len(self._scalars) == 1 and not self._vectors:  # a push per step of one metric: the short way
            ((key, value),) = self._scalars.items()
            self._scalars.clear()
            return {key: value.item() if isinstance(value, torch.Tensor) else float(value)}
        scalars: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        vectors: dict[torch.device, list[tuple[tuple[str, ...], torch.Tensor]]] = {}
        result: dict[str, float] = {}
        for key, value in self._scalars.items():
            if isinstance(value, torch.Tensor):
                scalars.setdefault(value.device, []).append((key, value))
                result[key] = math.nan  # placeholder keeps logging order
            else:
                result[key] = float(value)
        for keys, values in self._vectors.items():
            vectors.setdefault(values.device, []).append((keys, values))
        for device in {**scalars, **vectors}:
            names: list[str] = []
            parts: list[torch.Tensor] = []
            if scalars.get(device):
                entries = scalars[device]
                names += [key for key, _ in entries]
                parts.append(entries[0][1].reshape(1) if len(entries) == 1 else torch.stack([v for _, v in entries]))
            for keys, values in vectors.get(device, []):
                names += keys
                parts.append(values.to(torch.float64))
            flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the one transfer per device
            result.update(zip(names, flat))
        self._scalars.clear()
        self._vectors.clear()
        return result


class TrainerMetrics:
    """The trainer's metrics between pushes: what waits for the next push, what was pushed last, and the
    epoch's grad-norm mean.

    :ivar buffer: The :class:`LogBuffer` of metrics logged since the last push.
    :ivar latest: The last pushed value of every key (the final metrics ``train()`` returns).
    :ivar grad_norm: The running mean of the epoch's grad norms (``log_epoch_grad_norm``).
    :ivar guard: The divergence guard (:class:`~trainkit.guard.DivergenceGuard`), None when ``guard.nonfinite``
        is off.
    :ivar throughput: The ``perf/*`` counters (a :class:`trainkit.throughput.Throughput`) with
        ``log_throughput``, else None.
    :ivar drain: What ``push_logs`` drains by: :meth:`LogBuffer.drain` itself when neither the guard nor the
        throughput counters are on (nothing in between on the per-row path), else :meth:`drain_with_parts`.
    """

    __slots__ = ("buffer", "latest", "grad_norm", "guard", "throughput", "drain")

    def __init__(self, guard_config: Any = None, world_size: int = 1, throughput: Any = None) -> None:
        from trainkit.guard import DivergenceGuard
        from trainkit.optim import RunningMean

        self.buffer = LogBuffer()
        self.latest: dict[str, float] = {}
        self.grad_norm = RunningMean()
        self.guard = None if guard_config is None else DivergenceGuard.build(guard_config, world_size, self)
        self.throughput = throughput
        parts = self.guard is not None or throughput is not None
        self.drain: Callable[[], dict[str, float]] = self.drain_with_parts if parts else self.buffer.drain

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """Take a step's pre-clip grad norm: into the epoch mean, the buffer, and the guard when there is one.

        :param norm: The 0-d norm on the device.
        """
        self.grad_norm.add(norm)
        self.buffer.add({"train/grad_norm": norm})
        if self.guard is not None:
            read = self.buffer._scalars["train/grad_norm"]  # a float when the buffer read the norm (a CPU one)
            self.guard.observe(norm, read if read.__class__ is float else None)

    def watch(self, objects: Iterable[Any], trainer: Any) -> None:
        """Hand the optimizers among newly registered checkpoint items to the guard (nothing when it is off).

        :param objects: What ``add_checkpoint_items`` was given.
        :param trainer: The trainer, held weakly: where its loop stands names the step in the guard's error.
        """
        if self.guard is not None:
            from trainkit.guard import locator

            self.guard.watch(objects, locator(trainer), trainer._position)

    def last_value(self, key: str) -> Any:
        """The value of ``key`` waiting in the buffer, else the last one pushed, else None.

        :param key: The metric's name.
        """
        value = self.buffer._scalars.get(key)
        if isinstance(value, torch.Tensor):
            return value.item()
        return value if value is not None else self.latest.get(key)

    def drain_with_parts(self) -> dict[str, float]:
        """:meth:`LogBuffer.drain`, with the divergence guard's skip count added to a non-empty buffer first and
        the throughput counters' ``perf/*`` rates after.

        :returns: Name to float, in logging order.
        """
        if self.guard is not None and len(self.buffer):
            self.buffer.add(self.guard.count())
        if self.throughput is not None:
            return self.throughput.drain(self.buffer)
        return self.buffer.drain()

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a step checkpoint keeps of this rank's metrics: the unpushed buffer (with the guard's skip count,
        when there is a guard) and the grad-norm mean.

        :returns: ``(buffer state, grad-norm state)``.
        """
        if self.guard is not None:
            self.buffer.add(self.guard.count())
        return self.buffer.state_dict(), self.grad_norm.state_dict()

    def load_state_dict(self, logs: Mapping[str, Any], grad_norm: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned.

        :param logs: The buffer's state.
        :param grad_norm: The grad-norm mean's state.
        """
        self.buffer.load_state_dict(logs)
        self.grad_norm.load_state_dict(grad_norm)


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

    Each row is logged at the step :class:`RunLog` gives it (its line in ``metrics.jsonl``), committed at
    once. Charts use the logged ``trainer/step`` as their x-axis (``define_metric``).

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


_JOURNAL_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | os.O_APPEND
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
"""Append-only, created if missing, never through a symbolic link, and never blocking on a FIFO."""


class JsonlSink:
    """``out_dir/metrics.jsonl``: one JSON object per push, appended and flushed; synced before a checkpoint.

    The journal and ``last.pt`` agree after any crash: :meth:`sync` makes the rows durable before a
    checkpoint records the journal's size, and a resumed run cuts the file back to that size (dropping
    the rows of the epoch that was lost, so no step appears twice or goes backwards) or, when a crash cut
    the file below it, pads it to that size with a warning (ending a torn last row, which readers skip).
    The file is never opened through a symbolic link, and anything but a regular file is refused.

    :param path: The file.
    :param truncate_to: The byte size recorded in the checkpoint; None keeps the file as it is.
    :param history: Bytes to start the file with, replacing what is there (a run resumed from another
        folder carries that folder's rows over).
    :raises OutDirError: When ``path`` is a symbolic link or not a regular file.
    """

    def __init__(self, path: Path, truncate_to: int | None = None, history: bytes | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            fd = os.open(path, _JOURNAL_FLAGS, 0o666)
        except OSError as exc:
            raise OutDirError(_unusable_journal(path, exc)) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OutDirError(f"{path} is not a regular file; move it away so the run can keep its metrics")
            if info.st_nlink != 1:  # cutting it back or appending would change the file it shares a name with
                raise OutDirError(
                    f"{path} has {info.st_nlink} hard links: another file shares it, and trainkit does not write into "
                    "a file with other names; move it away so the run can keep its metrics"
                )
            os.set_blocking(fd, True)
            if history is not None:
                os.ftruncate(fd, 0)
                _write_all(fd, history)
            size = os.fstat(fd).st_size
            if truncate_to is not None and size > truncate_to:
                os.ftruncate(fd, truncate_to)
                size = truncate_to
            elif truncate_to is not None and size < truncate_to:
                missing = truncate_to - size
                _write_all(fd, b" " * (missing - 1) + b"\n")
                warn_user(
                    f"{path} is {missing} bytes shorter than the checkpoint recorded (a crash cut its tail before "
                    "it reached the disk); the rows in those bytes are lost, and the file was padded to the "
                    "recorded size so the next rows start on a line of their own"
                )
                size = truncate_to
            rows = _count_lines(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._size = size
        self._rows = rows
        # the size the last fsync made durable: a file empty at open and still empty has nothing to make durable;
        # anything found or changed at open (a resumed run's rows, history, a cut, padding) goes with the first sync()
        self._synced: int | None = 0 if size == 0 and info.st_size == 0 else None

    def tell(self) -> int:
        """The file's current size in bytes, for the checkpoint."""
        return self._size

    @property
    def rows(self) -> int:
        """The lines the file holds, which is the 0-based line number of the next row."""
        return self._rows

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Append one row (one ``write``, so it is never interleaved).

        :param metrics: Name to float.
        :param step: Ignored: a row's step here is its line.
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        line = json.dumps(dict(metrics), allow_nan=True).encode() + b"\n"
        _write_all(self._fd, line)
        self._size += len(line)
        self._rows += 1

    def rows_from(self, first: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """The rows at line ``first`` and after, each with its line; a line that is not a JSON object is skipped.

        :param first: The 0-based line to start at.
        :returns: An iterator of (line, row).
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        line, position, pending = 0, 0, b""
        while position < self._size:
            chunk = os.pread(self._fd, min(1 << 20, self._size - position), position)
            if not chunk:
                break
            position += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for text in complete:
                if line >= first:
                    with contextlib.suppress(ValueError):  # a torn row, or one nested deeper than any row
                        row = load_json(text)
                        if isinstance(row, dict):
                            yield line, row
                line += 1

    def sync(self) -> None:
        """Make the rows written so far durable (``fsync``); called before a checkpoint records :meth:`tell`.

        No ``fsync`` when no row was written since the last one (the file only grows through :meth:`log`): an
        epoch that logged nothing costs its checkpoint no second ``fsync`` (~0.1 ms even on an unchanged file).
        """
        if self._fd is not None and self._synced != self._size:
            os.fsync(self._fd)
            self._synced = self._size

    def finish(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _count_lines(fd: int, size: int) -> int:
    count, position = 0, 0
    while position < size:
        chunk = os.pread(fd, min(1 << 20, size - position), position)
        if not chunk:
            break
        count += chunk.count(b"\n")
        position += len(chunk)
    return count


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unusable_journal(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{path} is a symbolic link; trainkit does not write through links it did not create; remove it"
    return f"{path} cannot be opened for appending ({exc.strerror or exc})"


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
    :data:`~trainkit.safe_read.MAX_JSON_DEPTH`; a step that is not a non-negative int), is skipped whole, with a
    ``RuntimeWarning`` naming it, and its rows are sent to W&B again (W&B keeps the first row it got at a step);
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


def _same_row(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in ((a[k], b[k]) for k in a)
    )


class RunLog:
    """Where the pushed rows go: ``metrics.jsonl`` (the record) and the W&B run (rank 0).

    A row's W&B step is its 0-based line in ``metrics.jsonl``, so W&B's ``_step`` continues across the
    offline folders a resumed run writes and ``wandb sync`` uploads them as one history. Rows the file holds
    but W&B lost (a kill -9 takes the rows W&B had not written yet) are sent when the run resumes. A row
    whose step W&B already holds (a crash cut an epoch short after W&B got some of its rows, and the resumed run
    redoes them) is written to the file but not sent again: W&B keeps the first row it got at a step, as it
    does online. When those kept rows differ from the redone ones (the rerun was not bit-exact), one line
    on stderr says which steps and how many.

    :param journal: ``metrics.jsonl``; None when checkpoints are off (rows are then numbered from 0).
    :param wandb: The W&B run, or a :class:`NullSink`.
    :param wandb_history: What W&B's folders of this run already hold (offline); the W&B run's own next
        step counts as well (online).
    :param run_id: The run's W&B id, kept in checkpoints also while W&B is off (so a later run with W&B on
        continues the same run); the W&B run's own id when None.
    """

    def __init__(
        self,
        journal: JsonlSink | None = None,
        wandb: WandbSink | NullSink | None = None,
        wandb_history: WandbHistory | None = None,
        run_id: str | None = None,
    ) -> None:
        self._journal = journal
        self._wandb = wandb if wandb is not None else NullSink()
        self._run_id = run_id if run_id is not None else self._wandb.run_id
        history = wandb_history or WandbHistory(0, {})
        self._next_row = journal.rows if journal is not None else 0
        self._first_new = max(history.next_step, self._wandb.next_step)  # W&B holds the steps below this
        self._earlier = history.rows
        self._kept: list[int] = []
        self._differing = 0
        if journal is not None and not isinstance(self._wandb, NullSink) and self._first_new < journal.rows:
            # rows the file kept but W&B never got (a kill took them before W&B wrote them): send them now
            for step, row in journal.rows_from(self._first_new):
                self._wandb.log(row, step)
            self._first_new = journal.rows

    @property
    def run_id(self) -> str | None:
        """The W&B run id; None when neither given nor a W&B run."""
        return self._run_id

    def offset(self) -> int | None:
        """The size of ``metrics.jsonl`` for the checkpoint; None without the file."""
        return self._journal.tell() if self._journal is not None else None

    def sync(self) -> None:
        """Make the rows written so far durable, before a checkpoint records :meth:`offset`."""
        if self._journal is not None:
            self._journal.sync()

    def log(self, row: Mapping[str, float]) -> None:
        """Append ``row`` to the file, then send it to W&B unless W&B already holds its step.

        :param row: Name to float, with ``trainer/step`` and ``trainer/epoch``.
        """
        step = self._next_row
        if self._journal is not None:
            self._journal.log(row)
        self._next_row = step + 1
        if step >= self._first_new:
            if self._kept:
                self._report_kept()
            self._wandb.log(row, step)
            return
        self._kept.append(step)
        earlier = self._earlier.get(step)
        if earlier is not None and not _same_row(earlier, row):
            self._differing += 1

    def summary(self, values: Mapping[str, Any]) -> None:
        """Write values into the W&B run summary.

        :param values: Name to value.
        """
        self._wandb.summary(values)

    def finish(self, failed: bool = False) -> None:
        """Finish the W&B run and close the file (idempotent).

        :param failed: Marks the W&B run as failed (exit code 1).
        """
        self._report_kept()
        self._wandb.finish(exit_code=1 if failed else 0)
        self._wandb = NullSink()
        if self._journal is not None:
            self._journal.finish()
            self._journal = None

    def _report_kept(self) -> None:
        if self._kept and self._differing:
            say(
                f"W&B already held steps {self._kept[0]}-{self._kept[-1]} of this run from before the "
                f"interruption and keeps them; {self._differing} of those {len(self._kept)} rows differ from the "
                "rerun's rows in metrics.jsonl (the rerun was not bit-exact)"
            )
        self._kept, self._differing = [], 0


def open_run_log(
    journal: JsonlSink | None,
    *,
    wandb: WandbConfig | None,
    run_id: str,
    out_dir: Path,
    resumed_from: Path | None,
    config: Mapping[str, Any],
    config_class: Any = None,
) -> RunLog:
    """Start rank 0's :class:`RunLog`: ``metrics.jsonl`` and, unless W&B is off, the W&B run.

    Side effects: starts a W&B run; on a resume first reads what the run's earlier W&B folders hold (in
    ``out_dir`` and, for ``ckpt.resume=<path>``, in the folder resumed from) and marks as synced the empty
    ones in ``out_dir`` (:func:`mark_as_synced`). A failure closes ``journal``.

    :param journal: ``metrics.jsonl``, already cut back to the checkpoint's offset; None without checkpoints.
    :param wandb: The ``wandb`` config section; None for no W&B run.
    :param run_id: The W&B run id.
    :param out_dir: The run folder (W&B writes under ``out_dir/wandb``).
    :param resumed_from: The folder of the checkpoint the run resumed from; None for a fresh run.
    :param config: The config for W&B's config panel (``public_config``'s output).
    :param config_class: The config record, whose declared secrets stay out of W&B.
    :returns: The run log.
    """
    if wandb is None:
        return RunLog(journal, run_id=run_id)
    try:
        history = None
        if resumed_from is not None:  # read before this session's folder exists
            folders = [out_dir / "wandb"]
            if not same_directory(resumed_from, out_dir):
                folders.append(resumed_from / "wandb")
            history = read_wandb_history(folders, run_id, since=journal.rows if journal is not None else 0)
            for datastore in history.empty:  # only in this run's own folder: never write where it resumed from
                if same_directory(datastore.parent.parent, out_dir / "wandb"):
                    mark_as_synced(datastore)
        sink = WandbSink(
            mode=wandb.mode,
            run_id=run_id,
            directory=out_dir,
            config=config,
            project=wandb.project,
            entity=wandb.entity,
            name=wandb.name,
            tags=wandb.tags,
            config_class=config_class,
        )
    except BaseException:
        if journal is not None:
            journal.finish()
        raise
    return RunLog(journal, sink, history, run_id=run_id)
