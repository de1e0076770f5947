"""Metric buffering and the sinks pushed metrics go to: W&B (rank 0) and ``metrics.jsonl``.

Side effects: W&B runs and file appends. This is the only trainkit module that imports wandb, and it
does so lazily, when a run is started in a mode other than ``disabled``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import sys
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from trainkit.config import redact_argv, redact_text, strip_secrets
from trainkit.errors import OutDirError

__all__ = ["LogBuffer", "WandbSink", "NullSink", "JsonlSink", "new_run_id"]


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

    ``add`` keeps a device-side copy of each tensor (no host sync); ``drain`` moves every tensor to the
    host in one transfer per device. A key logged twice before a push keeps its last value.
    """

    def __init__(self) -> None:
        self._scalars: dict[str, Any] = {}
        self._vectors: dict[tuple[str, ...], torch.Tensor] = {}
        # one float64 scalar per tensor-valued key, reused from push to push: logging once per step
        # copies into it instead of allocating a tensor per step (drain reads slots, they never escape)
        self._slots: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._scalars) + sum(len(keys) for keys in self._vectors)

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Buffer scalar metrics: floats, ints, or 1-element tensors (kept on their device).

        :param metrics: Name to value.
        :raises TypeError: When a value is not a number or a 1-element tensor.
        """
        slots = self._slots
        for key, value in metrics.items():
            key = str(key)
            if isinstance(value, torch.Tensor):
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
            elif isinstance(value, bool) or not isinstance(value, int | float):
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


class NullSink:
    """A sink that drops everything: W&B off, or a rank other than 0."""

    run_id: str | None = None

    def log(self, metrics: Mapping[str, float]) -> None:
        """Drop ``metrics``."""

    def summary(self, values: Mapping[str, Any]) -> None:
        """Drop ``values``."""

    def finish(self, exit_code: int = 0) -> None:
        """Do nothing."""


class WandbSink:
    """The rank-0 W&B run.

    trainkit never passes ``step=`` to ``wandb.log``: W&B's own step counter only grows, so steps in
    W&B never go backwards, also after a resume from an older checkpoint. Charts use the logged
    ``trainer/step`` as their x-axis (``define_metric``).

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
            warnings.warn(
                f"W&B could not start in {mode!r} mode ({reason}); logging offline to "
                f"{directory} instead, sync it later with `wandb sync`",
                RuntimeWarning,
                stacklevel=3,
            )
            with _masked_argv(config_class):
                self._run = wandb.init(mode="offline", settings=wandb.Settings(silent=True), **kwargs)
        self._run.define_metric("trainer/step")
        self._run.define_metric("*", step_metric="trainer/step")

    @property
    def directory(self) -> Path:
        """The W&B run's local folder."""
        return Path(self._run.dir).parent

    def log(self, metrics: dict[str, float]) -> None:
        """Log one push as one W&B history row.

        :param metrics: Name to float, including ``trainer/step`` and ``trainer/epoch``; W&B may keep it.
        """
        self._run.log(metrics)

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
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OutDirError(f"{path} is not a regular file; move it away so the run can keep its metrics")
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
                warnings.warn(
                    f"{path} is {missing} bytes shorter than the checkpoint recorded (a crash cut its tail before "
                    "it reached the disk); the rows in those bytes are lost, and the file was padded to the "
                    "recorded size so the next rows start on a line of their own",
                    RuntimeWarning,
                    stacklevel=3,
                )
                size = truncate_to
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._size = size

    def tell(self) -> int:
        """The file's current size in bytes, for the checkpoint."""
        return self._size

    def log(self, metrics: Mapping[str, float]) -> None:
        """Append one row (one ``write``, so it is never interleaved).

        :param metrics: Name to float.
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        line = json.dumps(dict(metrics), allow_nan=True).encode() + b"\n"
        _write_all(self._fd, line)
        self._size += len(line)

    def sync(self) -> None:
        """Make the rows written so far durable (``fsync``); called before a checkpoint records :meth:`tell`."""
        if self._fd is not None:
            os.fsync(self._fd)

    def finish(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unusable_journal(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{path} is a symbolic link; trainkit does not write through links it did not create; remove it"
    return f"{path} cannot be opened for appending ({exc.strerror or exc})"
