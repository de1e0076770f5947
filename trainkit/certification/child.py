"""One rank of one ``certify`` attempt: the user's trainer, run as it is, interrupted where certify says.

:func:`run_rank` is what :func:`torch.multiprocessing.start_processes` starts in each process of an attempt (a fork
of a server that imported torch once). It builds the trainer from the config certify resolved, notes what could
break an exact resume (:func:`unregistered_objects`, and the ``DataLoader`` objects ``train_epoch()`` iterates
without :meth:`~trainkit.BaseTrainer.progress`), installs a global optimizer step post-hook that interrupts the run
at the step certify chose (``SIGTERM``: the engine stops at that step boundary and saves; ``SIGKILL``: the process
dies before the boundary's checkpoint), and trains. The user's code is not changed: the hook, the loader watch and
the interruption live in this process only.

Side effects: the trainer's run folder (certify's own temporary one), the attempt's log and findings files, and the
signal this process sends itself.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import signal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "batch_digest",
    "load_object",
    "loader_coverage",
    "rng_kind",
    "snapshot_values",
    "stateful_loaders",
    "unregistered_objects",
    "run_rank",
]

MAX_WALK_OBJECTS = 2000
"""The most objects one walk of a trainer's attributes visits (:func:`loader_coverage`, :func:`snapshot_values`)."""

MAX_WALK_ENTRIES = 64
"""The most entries of one list, tuple or dict such a walk looks into."""


def load_object(spec: str, what: str = "trainer class") -> Any:
    """Import ``MODULE:NAME`` (``NAME`` may be dotted) and return the object.

    Side effects: imports the module.

    :param spec: E.g. ``"examples.digits:DigitsTrainer"``.
    :param what: What the object is, for the error message.
    :returns: The object.
    :raises UsageError: When the spec has no ``:``, the module cannot be imported, or it has no such name.
    """
    from trainkit.errors import UsageError

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"the {what} must be given as MODULE:NAME (e.g. examples.digits:DigitsTrainer), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"the {what} {spec!r}: module {module_name!r} cannot be imported ({exc})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"the {what} {spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def rng_kind(value: Any) -> str | None:
    """Name the kind of random generator ``value`` is, if it is one whose state a trainkit checkpoint misses unless it
    is registered.

    Pure. trainkit captures the process's global generators (Python's ``random``, numpy's ``np.random``, torch's);
    these are generators of their own.

    :param value: Any object.
    :returns: ``"torch.Generator"``, ``"random.Random"``, ``"numpy.random.Generator"``,
        ``"numpy.random.RandomState"``, or None.

    >>> rng_kind(random.Random(0)), rng_kind(3)
    ('random.Random', None)
    """
    if isinstance(value, random.Random):
        return "random.Random"
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.random.Generator):
            return "numpy.random.Generator"
        if isinstance(value, numpy.random.RandomState):
            return "numpy.random.RandomState"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Generator):
        return "torch.Generator"
    return None


def _torch_kind(value: Any) -> str | None:
    import torch

    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "LR scheduler"
    if isinstance(value, torch.nn.Module):
        trained = any(p.requires_grad for p in value.parameters()) or any(True for _ in value.buffers())
        return "module" if trained else None
    return rng_kind(value)


def _children(name: str, value: Any) -> Iterable[tuple[str, Any]]:
    """What sits one level inside an attribute: a container's entries, a loader's generators and dataset, an
    object's own attributes."""
    from torch.utils.data import DataLoader

    if isinstance(value, list | tuple):
        return ((f"{name}[{i}]", item) for i, item in enumerate(value))
    if isinstance(value, Mapping):
        return ((f"{name}[{key!r}]", item) for key, item in value.items())
    if isinstance(value, DataLoader):
        sampler = value.batch_sampler.sampler if value.batch_sampler is not None else value.sampler
        found = [(f"{name}.generator", value.generator), (f"{name}.dataset", value.dataset)]
        return [*found, (f"{name}.sampler.generator", getattr(sampler, "generator", None))]
    own = getattr(value, "__dict__", None)
    if own is None:
        return ()
    if type(value).__module__.startswith(("torch", "trainkit")):  # a sampler's generator, say; not torch's insides
        return [(f"{name}.generator", own["generator"])] if "generator" in own else ()
    return ((f"{name}.{key}", item) for key, item in own.items())


def unregistered_objects(
    attributes: Mapping[str, Any], registered: Iterable[Any], covered: Mapping[int, str] | None = None
) -> list[tuple[str, str]]:
    """Find the optimizers, LR schedulers, modules and random generators a trainer holds but never registered.

    Looks at each attribute, and one level inside it (a list's or dict's entries, a ``DataLoader``'s generator,
    sampler generator and dataset, a torch object's ``generator``, a plain object's own attributes, and a dataset's
    attributes below a loader). A
    module inside a registered module is covered by it; a module with no trainable parameter and no buffer is
    left out (nothing of it changes). trainkit's own parts are not looked into.

    Pure: reads the objects only.

    :param attributes: The trainer's attributes (``vars(trainer)``), name to object.
    :param registered: The registered checkpoint items (``trainer.checkpoint_items.values()``).
    :param covered: Objects a registered loader's state covers (:func:`loader_coverage`), by ``id``: not named.
    :returns: ``(attribute path, kind)`` for each, in attribute order.
    """
    import torch

    by_loader = covered or {}
    covered = {id(obj) for obj in registered} | set(by_loader)
    for obj in registered:
        if isinstance(obj, torch.nn.Module):
            covered.update(id(module) for module in obj.modules())
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    queue = [(name, value, 0) for name, value in attributes.items() if not _engine_owned(value)]
    while queue:
        name, value, depth = queue.pop(0)
        if value is None or id(value) in seen or isinstance(value, str | bytes | int | float | bool):
            continue
        seen.add(id(value))
        kind = _torch_kind(value)
        if kind is not None:
            if id(value) not in covered:
                found.append((name, kind))
            continue
        if depth < 2:
            queue.extend((child, item, depth + 1) for child, item in _children(name, value))
    return found


def _engine_owned(value: Any) -> bool:
    return type(value).__module__.startswith("trainkit.")


def _inside(value: Any) -> Iterable[tuple[str, Any]]:
    """``(step, child)`` for what a walk looks into below ``value``: a container's first entries, a loader's dataset,
    samplers and generator, a sampler's generator, a module's public attributes, a user object's own attributes."""
    import torch
    from torch.utils.data import DataLoader

    if isinstance(value, list | tuple):
        return ((f"[{i}]", item) for i, item in enumerate(value[:MAX_WALK_ENTRIES]))
    if isinstance(value, Mapping):
        items = list(value.items())[:MAX_WALK_ENTRIES]
        return ((f"[{key!r}]", item) for key, item in items if isinstance(key, str | int))
    if isinstance(value, torch.Tensor | torch.Generator) or _engine_owned(value):
        return ()
    if isinstance(value, DataLoader):
        names = ("dataset", "sampler", "batch_sampler", "generator")
        return ((f".{name}", getattr(value, name, None)) for name in names)
    own = getattr(value, "__dict__", None)
    if not isinstance(own, dict):
        return ()
    if isinstance(value, torch.nn.Module):
        return ((f".{key}", item) for key, item in own.items() if not key.startswith("_") and key != "training")
    if type(value).__module__.startswith("torch"):  # a sampler's generator, say; not torch's insides
        return [(".generator", own["generator"])] if "generator" in own else ()
    return ((f".{key}", item) for key, item in list(own.items())[:MAX_WALK_ENTRIES])


def _walk(roots: Iterable[tuple[str, Any]], max_depth: int) -> Iterable[tuple[str, Any, Any]]:
    """``(path, object, parent)`` for each object reachable from ``roots`` (each once, breadth first), at most
    ``max_depth`` steps below a root and :data:`MAX_WALK_OBJECTS` in all."""
    seen: set[int] = set()
    queue: list[tuple[str, Any, int, Any]] = [(name, value, 0, None) for name, value in roots]
    visited = 0
    while queue and visited < MAX_WALK_OBJECTS:
        name, value, depth, parent = queue.pop(0)
        if value is None or isinstance(value, str | bytes | bool):
            continue
        if not isinstance(value, int | float):  # numbers are values, not shared objects
            if id(value) in seen:
                continue
            seen.add(id(value))
        visited += 1
        yield name, value, parent
        if depth < max_depth and not isinstance(value, int | float):
            queue.extend((name + step, child, depth + 1, value) for step, child in _inside(value))


def _public(attributes: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The trainer's own attributes a walk starts from: not the engine's (private names, trainkit's objects)."""
    return [
        (name, value) for name, value in attributes.items() if not name.startswith("_") and not _engine_owned(value)
    ]


def loader_coverage(loaders: Mapping[str, Any]) -> dict[int, str]:
    """What the state of loaders that carry their own position covers: every object reachable from them (their
    dataset, the dataset's generator, a sampler's generator...), a bounded walk.

    Such a loader's ``state_dict()`` is saved in each step checkpoint and loaded when a resumed epoch starts
    (:mod:`trainkit.loop.stateful_batches`): what its batches depend on is its to save (a dataset's ``state_dict()``,
    which torchdata's ``StatefulDataLoader`` saves with its own) or to replay (a ``StatefulDataLoader`` fast-forwards
    a dataset without one). Whether it really does shows in the run: :func:`snapshot_values` records its state.

    Pure: reads the objects only.

    :param loaders: The loaders, by the name the report gives them (an attribute's name).
    :returns: ``id`` of each covered object, to the name of the first loader that reaches it.
    """
    covered: dict[int, str] = {}
    for name, loader in loaders.items():
        for _, value, _ in _walk([(name, loader)], max_depth=4):
            if not isinstance(value, int | float):
                covered.setdefault(id(value), name)
    return covered


def stateful_loaders(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's attributes (and their list or dict entries) that are loaders carrying their own position: iterable,
    with ``state_dict()`` and ``load_state_dict()`` (:func:`trainkit.loop.stateful_batches.carries_own_position`), and
    no optimizer, scheduler or module; a dataset with both methods inside such a loader is the loader's.

    :param attributes: The trainer's attributes.
    :returns: Path to loader.
    """
    from trainkit.loop.stateful_batches import carries_own_position

    found = {}
    for name, value, _ in _walk(_public(attributes), max_depth=1):
        iterable = callable(getattr(value, "__iter__", None)) and not isinstance(value, type)
        if iterable and carries_own_position(value) and _torch_kind(value) is None:  # not a scheduler, a module
            found[name] = value
    inside = {key for name, loader in found.items() for key in loader_coverage({name: loader}) if key != id(loader)}
    return {name: loader for name, loader in found.items() if id(loader) not in inside}  # a loader's own dataset


def _state_digest(value: Any) -> str | None:
    """A short digest of a random generator's state, or None for anything else."""
    kind = rng_kind(value)
    if kind is None:
        return None
    if kind == "torch.Generator":
        data = value.get_state().numpy().tobytes()
    elif kind == "random.Random":
        data = repr(value.getstate()).encode()
    elif kind == "numpy.random.Generator":
        data = repr(value.bit_generator.state).encode()
    else:
        data = repr(value.get_state()).encode()
    return f"{kind} state {hashlib.sha256(data).hexdigest()[:12]}"


def snapshot_values(attributes: Mapping[str, Any], covered: Mapping[int, str] | None = None) -> dict[str, str]:
    """The plain values (ints, floats) and random generators' states held by a trainer's attributes and what they
    reach (its dataset, a loader's dataset...), each as a short text, by path.

    certify records them at every step of both runs: a value that differs right after a resume is state no
    checkpoint restored (a counter kept on the dataset, a generator a resume made afresh). Pure: reads the objects
    only (a bounded walk; tensors and registered modules' parameters are not values here).

    :param attributes: The trainer's attributes (``vars(trainer)``).
    :param covered: :func:`loader_coverage`'s result: a value held by (a generator that is) a covered object is
        named with its loader, after ``@``.
    :returns: Path to ``repr`` of the number, or to a digest of the generator's state.

    >>> from types import SimpleNamespace
    >>> snapshot_values({"data": SimpleNamespace(seen=3, name="man pages"), "_engine": 1})
    {'data.seen': '3'}
    """
    covered = covered or {}
    values: dict[str, str] = {}
    for path, value, parent in _walk(_public(attributes), max_depth=4):
        if isinstance(value, int | float):
            text, owner = repr(value), parent
        else:
            text, owner = _state_digest(value), value
            if text is None:
                continue
        loader = covered.get(id(owner))
        values[path if loader is None else f"{path}@{loader}"] = text
    return values


class _StepLog:
    """Writes, at each new optimizer step (rank 0), a row with the step, the epoch and :func:`snapshot_values`, and
    a row at each validation: what certify plans its interruptions by and names a diverged value from."""

    def __init__(self, trainer: Any, path: Path | None, covered: Mapping[int, str]) -> None:
        self.trainer, self.path, self.covered, self.last = trainer, path, covered, -1

    def write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as log:
                log.write(json.dumps(row) + "\n")

    def hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.trainer.step
        if self.path is not None and step > self.last:  # rank 0 only: the other ranks walk nothing
            self.last = step
            values = snapshot_values(vars(self.trainer), self.covered)
            self.write({"step": step, "epoch": self.trainer.epoch, "values": values})


class _LoaderWatch:
    """Notes the ``DataLoader`` objects iterated while ``train_epoch()`` runs, those handed to ``progress()``, and
    (rank 0) a digest of every batch ``progress()`` yields in ``train_epoch()``, by epoch and index in the epoch."""

    def __init__(self, batches: Path | None) -> None:
        self.in_train = False
        self.iterated: dict[int, Any] = {}
        self.handed: set[int] = set()
        self.trained: dict[int, Any] = {}
        self.batches = batches

    def outside(self, attributes: Mapping[str, Any]) -> list[str]:
        names = {id(value): name for name, value in attributes.items()}
        return [
            names.get(key, f"a {type(loader).__name__} made inside train_epoch()")
            for key, loader in self.iterated.items()
            if key not in self.handed
        ]

    def record(self, epoch: int, index: int, batch: Any) -> None:
        if self.batches is not None and self.in_train:
            with self.batches.open("a") as log:
                log.write(json.dumps({"epoch": epoch, "index": index, "digest": batch_digest(batch)}) + "\n")


def batch_digest(batch: Any) -> str:
    """A digest of a batch's content: every tensor's dtype, shape and bytes, and the ``repr`` of anything else.

    Pure.

    :param batch: A batch as a loader yields it (tensors in tuples, lists and dicts; numbers; strings).
    :returns: A hex SHA-256 digest, equal for equal batches.

    >>> import torch
    >>> batch_digest((torch.ones(2), 3)) == batch_digest((torch.ones(2), 3)) != batch_digest((torch.zeros(2), 3))
    True
    """
    import torch

    digest = hashlib.sha256()
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensor = item.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(item, Mapping):
            digest.update(repr(list(item)).encode())
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            digest.update(f"{type(item).__name__}{len(item)}".encode())
            stack.extend(reversed(item))
        else:
            digest.update(repr(item).encode())
    return digest.hexdigest()


class _Recorded:
    """What ``progress()`` returned, yielding the same batches and handing each to the watch first (``len()`` and the
    wrapped object's attributes read through)."""

    def __init__(self, inner: Any, trainer: Any, watch: _LoaderWatch) -> None:
        self.inner, self.trainer, self.watch = inner, trainer, watch

    def __iter__(self) -> Any:
        epoch, first = self.trainer.epoch, self.trainer.first_batch
        for offset, batch in enumerate(self.inner):
            self.watch.record(epoch, first + offset, batch)
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _watch_loaders(trainer: Any, watch: _LoaderWatch, steps: _StepLog | None = None) -> None:
    """Wrap this trainer's ``train_epoch``, ``val_epoch`` and ``progress`` (on the instance) and
    ``DataLoader.__iter__`` (in this process) so that ``watch`` sees what training iterates (a validation inside the
    epoch is not training)."""
    from torch.utils.data import DataLoader

    train_epoch, val_epoch, progress = trainer.train_epoch, trainer.val_epoch, trainer.progress
    iterate = DataLoader.__iter__

    def watched_train_epoch(*args: Any, **kwargs: Any) -> Any:
        watch.in_train = True
        try:
            return train_epoch(*args, **kwargs)
        finally:
            watch.in_train = False

    def watched_val_epoch(*args: Any, **kwargs: Any) -> Any:
        training, watch.in_train = watch.in_train, False  # a validation inside the epoch (val.every_n_steps)
        if steps is not None:
            steps.write({"val": trainer.step})
        try:
            return val_epoch(*args, **kwargs)
        finally:
            watch.in_train = training

    def watched_progress(iterable: Any, *args: Any, **kwargs: Any) -> Any:
        watch.handed.add(id(iterable))
        if watch.in_train:
            watch.trained[id(iterable)] = iterable
        shown = progress(iterable, *args, **kwargs)
        return _Recorded(shown, trainer, watch) if watch.in_train and watch.batches is not None else shown

    def watched_iter(loader: Any) -> Any:
        if watch.in_train:
            watch.iterated.setdefault(id(loader), loader)
        return iterate(loader)

    trainer.train_epoch, trainer.val_epoch, trainer.progress = watched_train_epoch, watched_val_epoch, watched_progress
    DataLoader.__iter__ = watched_iter


def _interrupt_at(trainer: Any, how: str, step: int, fired: Path) -> Any:
    """A global optimizer step post-hook: at the first optimizer step that brings ``trainer.step`` to ``step`` or
    past it, note the step in ``fired`` and send this process ``SIGTERM`` (``how="term"``) or ``SIGKILL``
    (``"kill"``), once. It runs after the optimizers' own hooks, so the trainer's step counter has already moved (and
    a resumed run's counter starts where its checkpoint was)."""
    sent = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not sent and trainer.step >= step:
            sent.append(step)
            if trainer.rank == 0:
                fired.write_text(json.dumps({"step": trainer.step, "epoch": trainer.epoch}))
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)

    return hook


def _redirect_output(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _found(attributes: Mapping[str, Any], trainer: Any, loaders: Mapping[str, Any]) -> dict[str, Any]:
    """What the scan finds: objects not registered, and those a loader's state covers (with the loader's name)."""
    registered = list(trainer.checkpoint_items.values())
    uncovered = unregistered_objects(attributes, registered, loader_coverage(loaders))
    covered = [
        [name, kind, _covering(name, loaders)]
        for name, kind in unregistered_objects(attributes, registered)
        if (name, kind) not in uncovered
    ]
    return {"unregistered": uncovered, "covered": covered}


def _covering(path: str, loaders: Mapping[str, Any]) -> str:
    """The loader a covered object's path goes through, else the first loader."""
    for name, loader in loaders.items():
        if path == name or path.startswith((f"{name}.", f"{name}[")):
            return f"{name} ({type(loader).__name__})"
    name, loader = next(iter(loaders.items()))
    return f"{name} ({type(loader).__name__})"


def run_rank(rank: int, spec: Mapping[str, Any]) -> None:
    """Run one rank of one certify attempt (the target of ``torch.multiprocessing.start_processes``).

    Side effects: trains in ``spec["config"]["out_dir"]``; writes ``spec["log"]`` (this rank's output),
    ``spec["findings"]``, ``spec["batches"]`` (a digest of each training batch), ``spec["fired"]`` before it sends
    itself the signal, and ``spec["done"]`` when the run finished (rank 0).

    :param rank: This process's rank.
    :param spec: Plain values: ``target`` and ``config_class`` (``MODULE:NAME``), ``config`` (a mapping),
        ``world_size``, ``env`` (the caller's environment), ``threads``, ``log``, ``findings``, ``fired``, ``done``,
        ``batches`` and ``steps`` (paths, with ``{rank}`` in the log's; ``steps``: a row per step and per
        validation), and ``interrupt`` (None, or ``{"how": "term" | "kill", "step": int}``).
    :raises SystemExit: With ``128 + signal`` when the trainer stopped on a signal.
    """
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from trainkit.errors import TrainingInterrupted

    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec["world_size"]))
    _redirect_output(Path(spec["log"].format(rank=rank)))
    torch.set_num_threads(spec["threads"])
    trainer_class = load_object(spec["target"])
    config_class = load_object(spec["config_class"], "config class")
    trainer = trainer_class(config_class.from_mapping(spec["config"]), rank, spec["world_size"])
    attributes = dict(vars(trainer))
    loaders = stateful_loaders(attributes)
    findings = _found(attributes, trainer, loaders)
    if rank == 0:  # now: a SIGKILL later leaves what setup() built on record
        Path(spec["findings"]).write_text(json.dumps(findings))
    watch = _LoaderWatch(Path(spec["batches"]) if rank == 0 else None)
    coverage = {key: f"{name} ({type(loaders[name]).__name__})" for key, name in loader_coverage(loaders).items()}
    steps = _StepLog(trainer, Path(spec["steps"]) if rank == 0 and spec.get("steps") else None, coverage)
    _watch_loaders(trainer, watch, steps)
    register_optimizer_step_post_hook(steps.hook)  # before the interruption's: the step it fires at is recorded
    interrupt = spec["interrupt"]
    if interrupt is not None:
        hook = _interrupt_at(trainer, interrupt["how"], interrupt["step"], Path(spec["fired"]))
        register_optimizer_step_post_hook(hook)
    try:
        try:
            trainer.train()
        finally:
            names = {id(value): name for name, value in attributes.items()}
            from trainkit.loop.stateful_batches import carries_own_position

            for key, loader in watch.trained.items():
                if carries_own_position(loader) and all(loader is not seen for seen in loaders.values()):
                    loaders[names.get(key, f"the {type(loader).__name__} given to progress()")] = loader
            findings = _found(attributes, trainer, loaders)
            findings["loaders_outside_progress"] = watch.outside(attributes)
            if rank == 0:
                Path(spec["findings"]).write_text(json.dumps(findings))
            trainer.close()
    except TrainingInterrupted as exc:
        raise SystemExit(exc.exit_code) from None
    if rank == 0:
        Path(spec["done"]).write_text(json.dumps({"step": trainer.step}))
