"""Error types raised by trainkit.

Every error is a :class:`TrainkitError` and also the builtin it refines, so callers can catch either:
``except ValueError`` keeps working for a bad config value.
"""

from __future__ import annotations

__all__ = [
    "TrainkitError",
    "ConfigError",
    "BookkeepingError",
    "RegistryError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointUnsafeError",
    "CheckpointMismatchError",
    "DistributedError",
    "DivergenceError",
    "OutDirError",
    "UsageError",
    "HookNotImplementedError",
    "TrainingInterrupted",
]


class TrainkitError(Exception):
    """Base class of every error trainkit raises on purpose."""


class ConfigError(TrainkitError, ValueError):
    """A configuration key is unknown, or its value breaks the key's type or range rule.

    :param key: The dotted key, e.g. ``"val.every_n_epochs"``.
    :param rule: What the value must satisfy, e.g. ``"must be >= 1"``.
    :param value: The value received.
    :param hint: An optional fix appended to the message.
    """

    def __init__(
        self, key: str, rule: str, value: object = None, *, hint: str = "", show_value: bool = True, message: str = ""
    ):
        self.key = key
        self.rule = rule
        self.value = value
        self.hint = hint
        self.show_value = show_value
        if not message:
            message = f"{key} {rule}"
            if show_value:
                message += f", got {value!r}"
        if hint:
            message += f"; {hint}"
        self._message = message
        super().__init__(message)

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with its key qualified by a parent section.

        :param prefix: The parent's dotted key, e.g. ``"val"``; empty leaves the key as it is.
        :returns: A new error whose key reads ``prefix.key``.
        """
        if not prefix or self.rule == "is unknown":
            return self
        return ConfigError(f"{prefix}.{self.key}", self.rule, self.value, hint=self.hint, show_value=self.show_value)


class BookkeepingError(TrainkitError, ValueError):
    """A bookkeeping record was built or advanced with a value that breaks one of its rules."""


class RegistryError(TrainkitError, ValueError):
    """A checkpoint item name is reserved, registered twice, missing or unexpected."""


class CheckpointError(TrainkitError, RuntimeError):
    """A checkpoint could not be written, read or applied."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, fails its integrity check, or is not a pickle ``torch.save`` writes."""


class CheckpointUnsafeError(CheckpointError):
    """A value has a type that trainkit does not load: refused before a save, or found in an intact file on load.

    trainkit loads checkpoints only with ``torch.load(..., weights_only=True)``, which builds tensors and plain
    values and never runs code from the file. Unlike :class:`CheckpointCorruptError` the file is not damaged,
    so the trainer does not fall back to ``last.prev.pt``: it stops and says which type to replace.

    :param message: The whole message: the item and key path (before a save) or the file (on load), the type,
        and the fix.
    :param type_name: The refused type's dotted name, e.g. ``"numpy.random._generator.Generator"``.
    :param location: Where the value sits in the payload, e.g. ``"sampler['rng']"``; empty on load, where only
        the type is known.
    """

    def __init__(self, message: str, type_name: str = "", location: str = ""):
        self.type_name = type_name
        self.location = location
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # errors cross process boundaries (spawn, the DDP tests): keep the fields, not just the message
        return type(self), (str(self), self.type_name, self.location)


class CheckpointMismatchError(CheckpointError):
    """A checkpoint is intact but was written by an incompatible run (world size, schema, config)."""


class DistributedError(TrainkitError, RuntimeError):
    """The ranks of a distributed run disagree, or one of them failed."""


class TorchInternalsError(TrainkitError, RuntimeError):
    """The installed torch lacks a private name trainkit relies on (:mod:`trainkit.torch_private`): torch moved or
    removed it. The message names the thing, the torch version found and the versions trainkit supports.
    Not exported: it says to change the installed torch, not something a caller handles."""


class OutDirError(TrainkitError, RuntimeError):
    """The run folder (``out_dir``) is in use by another run, or cannot be used (read-only, a file in the
    way of a checkpoint, a symbolic link trainkit would have to write through).

    One run holds an exclusive lock on its ``out_dir`` for its whole life; a second run on the same folder
    is refused at once, naming the holder (pid, host, since when). A lock left by a crashed run never blocks.
    """


class UsageError(TrainkitError, RuntimeError):
    """An API was called at a moment or with a value that the trainer's contract does not allow."""


class HookNotImplementedError(TrainkitError, NotImplementedError):
    """A subclass did not implement a hook that the trainer had to call."""


class DivergenceError(TrainkitError, RuntimeError):
    """The divergence guard (``guard.nonfinite``) stopped training before an optimizer step whose gradients
    are not finite; nothing of that step was applied.

    :param message: What happened and what to do.
    :param step: The 0-based index of the optimizer step that was not taken.
    :param epoch: The 0-based epoch.
    :param batch: The 0-based index in the epoch of the step's last batch, when the loop is counted
        (``ckpt.every_n_steps`` with ``self.progress(loader)``), else None.
    """

    def __init__(self, message: str, *, step: int, epoch: int, batch: int | None) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.batch = batch


class RollbackNeeded(DivergenceError):
    """The guard's window is exhausted under ``guard.nonfinite="rollback"``: the trainer rolls back.

    Raised by the divergence guard's step pre-hook and caught around ``train_epoch()``
    (:class:`trainkit.loop.rollback.Rollback`); a :class:`DivergenceError`, which is what the user sees if it escapes
    the loop (e.g. raised outside ``train_epoch()``). Not exported: no user code raises or catches it.

    :param bad: ``(step, epoch, batches)`` of every non-finite step in the window, oldest first: the batches (0-based
        positions in the epoch) it trained on, every one yielded since the step before (a gradient-accumulation
        window's).
    """

    def __init__(self, message: str, *, step: int, epoch: int, batch: int | None, bad: tuple[tuple, ...]) -> None:
        super().__init__(message, step=step, epoch=epoch, batch=batch)
        self.bad = bad


class TrainingInterrupted(TrainkitError):
    """A signal (SIGTERM, SIGINT, or the requeue signal) stopped training at an epoch or step boundary.

    The epoch that was running finished (or, with ``ckpt.every_n_steps``, the optimizer step that was
    running) and ``last.pt`` holds it; running the same command again resumes from there.
    :func:`trainkit.launch` turns this into the exit code :attr:`exit_code`.

    :param signal_name: The signal's name, e.g. ``"SIGTERM"``.
    :param signal_number: The signal's number.
    :param epoch: The 0-based epoch that finished before stopping (or that was stopped inside).
    :param save_seconds: How long saving ``last.pt`` took, or None when checkpoints are disabled.
    :param step: The optimizer step it stopped after, when it stopped inside the epoch.
    :param batches: ``(consumed, per epoch)`` batches of ``epoch``, when it stopped inside the epoch (per epoch None
        for a loader without a length).
    """

    def __init__(
        self,
        signal_name: str,
        signal_number: int,
        epoch: int,
        save_seconds: float | None = None,
        *,
        step: int | None = None,
        batches: tuple[int, int | None] | None = None,
    ):
        self.signal_name = signal_name
        self.signal_number = signal_number
        self.epoch = epoch
        self.save_seconds = save_seconds
        self.step = step
        self.batches = batches
        saved = f"last.pt saved in {save_seconds:.3f} s" if save_seconds is not None else "checkpoints are disabled"
        where = f"after epoch {epoch}"
        if batches is not None:
            of = "" if batches[1] is None else f" of {batches[1]}"
            where = f"after step {step}, batch {batches[0]}{of} of epoch {epoch}"
        super().__init__(f"{signal_name} received: stopped {where} ({saved}); run again to resume")

    @property
    def exit_code(self) -> int:
        """``128 + signal number``, the code a shell reports for a process ended by that signal."""
        return 128 + self.signal_number
