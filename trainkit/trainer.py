"""BaseTrainer: the API and the epoch loop, wiring the pure core to the parts that do the side effects.

Every decision (improved? stop? validate now? which epoch next?) comes from :mod:`trainkit.bookkeeping`; every
side effect goes through one part: the :class:`~trainkit.checkpoint.checkpointer.Checkpointer` (files), the
:class:`~trainkit.loop.epoch_tracker.EpochTracker` (the epoch's position), the :class:`~trainkit.run.log.RunLog`
(``metrics.jsonl`` and W&B), :class:`~trainkit.loop.stop_signals.StopSignals` and
:mod:`trainkit.distributed.collectives`.
"""

from __future__ import annotations

import abc
import contextlib
import operator
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import attrs
import torch
from torch import nn

from trainkit import bookkeeping
from trainkit.bookkeeping import planned_steps, save_if_best
from trainkit.checkpoint.checkpointer import Checkpointer, Resume, SaveRecord
from trainkit.checkpoint.payload import SCHEMA_VERSION
from trainkit.checkpoint.remote import RemoteTier
from trainkit.config import Config, public_config
from trainkit.config.schema import skip_batches
from trainkit.distributed import collectives, fsdp
from trainkit.errors import BookkeepingError, DistributedError, HookNotImplementedError, TrainingInterrupted, UsageError
from trainkit.loop import optim
from trainkit.loop.divergence_guard import DivergenceGuard
from trainkit.loop.epoch_tracker import EpochTracker
from trainkit.loop.progress import EpochBar, StepBar, step_bar
from trainkit.loop.rollback import Rollback, rolled_back
from trainkit.loop.stop_signals import StopSignals
from trainkit.loop.throughput import CountedBatches, Throughput, check_token_count
from trainkit.loop.tracked_batches import TrackedBatches
from trainkit.loop.trainer_metrics import TrainerMetrics
from trainkit.loop.weight_snapshot import WeightSnapshot, modes_kept, weights_swapped_in
from trainkit.messages import say, warn_user
from trainkit.run.log import RunLog, new_run_id, open_run_log
from trainkit.state.modules import module_state
from trainkit.state.rng import GeneratorItem, seed_everything, start_persistent_workers

__all__ = ["BaseTrainer", "CHECKPOINT_SCHEMA_VERSION"]

T = TypeVar("T")

CHECKPOINT_SCHEMA_VERSION = SCHEMA_VERSION
"""Version of the checkpoint layout written by this trainkit (as :mod:`trainkit.checkpoint.payload` describes it)."""


class _Records(NamedTuple):
    """The engine's records: the loop, and the best and patience once tracked."""

    loop: bookkeeping.LoopState
    best: bookkeeping.BestState | None
    patience: bookkeeping.PatienceState | None


_RECORD_ATTRIBUTES = {"best_state": "best", "patience_state": "patience"}
"""The public names of the engine's records, and their fields in :class:`_Records`."""


def _step_counter(position: EpochTracker) -> Any:
    """An optimizer post-step hook that advances the position part's ``step`` (the trainer's ``step``).

    It holds the position part, not the trainer: a hook holding the trainer would make a cycle (trainer ->
    optimizer -> hook -> trainer) that keeps the model, and under DDP its process group, alive until the garbage
    collector runs, possibly at interpreter exit.
    """

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        position.step += 1

    return count


def _step_counting_optimizer(registry: bookkeeping.CkptRegistry, items: Mapping[str, Any]) -> Any:
    """The optimizer among ``items`` that drives ``step``: the first one, unless one is registered already."""
    if any(isinstance(obj, torch.optim.Optimizer) for obj in registry.items.values()):
        return None
    return next((obj for obj in items.values() if isinstance(obj, torch.optim.Optimizer)), None)


def _generators(registry: bookkeeping.CkptRegistry) -> list[torch.Generator]:
    """The ``torch.Generator`` objects registered as checkpoint items."""
    return [obj.generator for obj in registry.items.values() if isinstance(obj, GeneratorItem)]


def _fresh_patience(cfg: Config) -> bookkeeping.PatienceState:
    """Patience as ``val.patience`` and ``val.start_patience`` set it, nothing counted yet."""
    return bookkeeping.PatienceState(patience=cfg.val.patience, start_patience=cfg.val.start_patience)


def _device(rank: int) -> torch.device:
    """``cuda:LOCAL_RANK`` (made current) when CUDA is there, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _parts(
    cfg: Config, rank: int, world_size: int, device: torch.device
) -> tuple[StopSignals, EpochTracker, Checkpointer, TrainerMetrics]:
    """The trainer's parts, each built from plain values: the signals, the epoch's position (the one owner of the
    batches left out), the checkpointer, and the metrics with the guard and throughput counters that are on."""
    ckpt, timeout_s, guard = cfg.ckpt, cfg.dist.timeout_s, cfg.guard
    signals = StopSignals(["SIGTERM", "SIGINT", *([ckpt.requeue_signal] if ckpt.requeue_signal else [])])
    position = EpochTracker(
        every_n_steps=ckpt.every_n_steps, enabled=ckpt.enable, world_size=world_size, timeout_s=timeout_s,
        left_out=skip_batches(guard), count_always=guard.nonfinite == "rollback",  # a rollback names batches
        max_steps=cfg.max_steps, val_every_n_steps=cfg.val.every_n_steps, log_every_n_steps=cfg.log_every_n_steps,
    )
    checkpointer = Checkpointer(
        Path(cfg.out_dir),
        ckpt,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        device=device,
        config=public_config(cfg),
        remote=RemoteTier.build(ckpt, Path(cfg.out_dir), rank=rank),
    )
    throughput = Throughput.build(cfg.log_throughput, cfg.throughput, position.read_step, world_size, device)
    metrics = TrainerMetrics(guard=DivergenceGuard.build(guard, world_size), throughput=throughput)
    return signals, position, checkpointer, metrics


def _open_run_log(cfg: Config, checkpointer: Checkpointer, resume: Resume | None) -> RunLog:
    """Rank 0's ``metrics.jsonl`` (cut back to the checkpoint) and, unless W&B is off, the W&B run."""
    run_id = (resume.ckpt.get("wandb_run_id") if resume is not None else None) or new_run_id()
    finished = resume is not None and resume.results is not None  # a finished run only returns its results
    return open_run_log(
        checkpointer.open_journal(resume),
        wandb=None if cfg.wandb.mode == "disabled" or finished else cfg.wandb,
        run_id=run_id,
        out_dir=Path(cfg.out_dir),
        resumed_from=resume.path.parent if resume is not None else None,
        config=checkpointer.config,  # stripped once, for both
        config_class=cfg,
    )


def _test_metrics(result: Any) -> dict[str, Any]:
    """What ``test_epoch()`` returned, under ``test/`` names (None: nothing)."""
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise UsageError(f"test_epoch() must return a dict of metrics or None, got {type(result).__name__}")
    return {key if key.startswith("test/") else f"test/{key}": value for key, value in result.items()}


def _validated_config(cls: type[Config], cfg: Config | Mapping[str, Any]) -> Config:
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, Config):
        return cls.from_mapping(cfg.to_dict())
    if isinstance(cfg, Mapping):
        return cls.from_mapping(cfg)
    raise UsageError(f"cfg must be a {cls.__name__} or a mapping, got {type(cfg).__name__}")


def _verdict(verdict: Any) -> bool:
    """What ``val_epoch()`` returned, read by its truth; an ambiguous one refused, a truthy non-bool warned."""
    try:
        stop = bookkeeping.as_verdict(verdict)
    except BookkeepingError:
        raise UsageError(
            f"val_epoch() must return True to stop early or a falsey value to go on, got {type(verdict).__name__} "
            f"{verdict!r}, whose truth is ambiguous; return what step_patience() returned"
        ) from None
    if stop and not bookkeeping.is_bool_like(verdict):  # a score or a metrics dict returned by mistake, say
        warn_user(
            f"val_epoch() returned {type(verdict).__name__} {verdict!r}, which is truthy: training stops early now; "
            "return what step_patience() returned (a bool)"
        )
    return stop


def _agree_on_stop(stop: bool, signalled: bool, *, epoch: int, rank: int) -> tuple[bool, bool]:
    """Check every rank's stop verdict agrees and learn whether any rank got a signal, in one all-reduce."""
    if not collectives.is_distributed():
        return stop, signalled
    (anyone, any_signal), (everyone, _) = collectives.any_all([stop, signalled])
    if anyone != everyone:
        raise DistributedError(
            f"ranks disagree on early stopping at epoch {epoch} (rank {rank} said {stop}); select on a "
            "rank-invariant score (reduce_mean() or a torchmetrics compute()), or broadcast a rank-0-only verdict "
            "with broadcast() before step_patience()"
        )
    return stop, any_signal


def _summary(records: _Records, best_metrics: Mapping[str, float], latest: Mapping[str, float]) -> dict[str, Any]:
    """The run summary: epochs (completed) and optimizer steps run, why it stopped, the best metrics, epoch and step,
    the test metrics."""
    summary: dict[str, Any] = {
        "epochs_run": records.loop.epoch,
        "steps_run": records.loop.step,
        "stop_reason": records.loop.stop_reason,
        **best_metrics,
        **{key: value for key, value in latest.items() if key.startswith("test/")},
    }
    if records.best is not None and records.best.score is not None:
        summary["best/epoch"] = records.best.epoch
        if records.best.step is not None:
            summary["best/step"] = records.best.step
        summary["best/score"] = records.best.score
    return summary


def _final_line(summary: Mapping[str, Any], cfg: Config, loop: bookkeeping.LoopState) -> str:
    """The summary as rank 0 prints it, in the run's own unit: a run measured in steps (``max_steps`` without
    ``epochs``) leads with ``steps_run`` and says inside which epoch it stopped; the stop reason says the step or
    epoch it acted at (``stop_reason=max_steps (step 150)``)."""
    in_steps = cfg.epochs is None
    values = dict(summary)
    if loop.stop_reason == bookkeeping.STOP_MAX_STEPS or (in_steps and loop.stop_reason is not None):
        values["stop_reason"] = f"{loop.stop_reason} (step {loop.step})"
    elif loop.stop_reason is not None:
        values["stop_reason"] = f"{loop.stop_reason} (epoch {loop.current_epoch})"
    if in_steps:
        inside = f" (stopped inside epoch {loop.current_epoch})" if loop.in_epoch else ""
        values = {"steps_run": values.pop("steps_run"), "epochs_run": f"{values.pop('epochs_run')}{inside}", **values}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _bars(cfg: Config, loop: bookkeeping.LoopState, enabled: bool) -> tuple[EpochBar, StepBar | None]:
    """The run's bars: over epochs (not drawn for a run measured in steps alone: it has no epoch total), and over
    optimizer steps for a run with ``max_steps``."""
    epochs = EpochBar(total=cfg.epochs, initial=loop.epoch, enabled=enabled and cfg.epochs is not None)
    if cfg.max_steps is None:
        return epochs, None
    interval = cfg.progress.plain_interval_s
    return epochs, StepBar(total=cfg.max_steps, initial=loop.step, enabled=enabled, plain_interval_s=interval)


def _closed(epochs: EpochBar, steps: StepBar | None) -> None:
    """Close the run's bars; None, the step bar a trainer holds once they are closed."""
    epochs.close()
    if steps is not None:
        steps.close()


def _budget(cfg: Config) -> str:
    """The run's length as configured, for messages: ``epochs=3``, ``max_steps=900``, or both."""
    return " and ".join(
        f"{key}={value}" for key, value in (("epochs", cfg.epochs), ("max_steps", cfg.max_steps)) if value is not None
    )


def _validates_now(cfg: Config, epoch: int, step: int, position: EpochTracker) -> bool:
    """Whether the epoch that just ended is validated now (:func:`~trainkit.bookkeeping.validates_at_epoch_end`)."""
    return bookkeeping.validates_at_epoch_end(
        epoch, step, epochs=cfg.epochs, every_n_epochs=cfg.val.every_n_epochs, max_steps=cfg.max_steps,
        every_n_steps=cfg.val.every_n_steps, validated_at=position.validated_at, stopped_early=position.stopped_early,
    )  # fmt: skip


def _end_epoch(
    cfg: Config, loop: bookkeeping.LoopState, step: int, position: EpochTracker, *, stop: bool, validated: bool
) -> tuple[bookkeeping.LoopState, bool]:
    """Close the epoch (:func:`~trainkit.bookkeeping.end_epoch`) once its steps are checked: a run measured in steps
    must take some each epoch (it would never end), and a ``max_steps`` passed at the epoch's end (no loop through
    ``progress()``) is warned about."""
    if cfg.epochs is None and step == loop.step and not loop.in_epoch:  # a resumed epoch may have none left
        raise UsageError(
            f"max_steps={cfg.max_steps} counts optimizer steps (the first registered optimizer's step()), but epoch "
            f"{loop.epoch} took none and epochs is not set, so the run would never end; register the optimizer with "
            "add_checkpoint_items(), or set epochs"
        )
    if cfg.max_steps is not None and step > cfg.max_steps and not position.ended_inside:
        warn_user(
            f"max_steps={cfg.max_steps} is acted on at the step boundaries of the loop train_epoch() iterates through "
            f"self.progress(); epoch {loop.epoch} ended at step {step} without one, so the run stops there"
        )
    validated = validated or position.validated_at == step
    return bookkeeping.end_epoch(
        loop, epochs=cfg.epochs, early_stop=stop, step=step, validated=validated, max_steps=cfg.max_steps,
        in_epoch=position.ended_inside,
    )  # fmt: skip


def _save_record(records: _Records, loop: bookkeeping.LoopState, tracker: EpochTracker, **values: Any) -> SaveRecord:
    """What a save writes: the records (with ``loop`` for this save), the position part's batches left out, and the
    metrics, results, run id, journal offset and epoch position given as ``values``; a save with no position (an
    epoch's end) also the loader state the position part keeps for the next epoch."""
    loader_state = tracker.epoch_end_loader_state() if values.get("position") is None else None
    return SaveRecord(
        loop=loop, best=records.best, patience=records.patience, left_out=tuple(tracker.left_out()),
        loader_state=loader_state, **values,
    )  # fmt: skip


def _position_field(name: str, doc: str) -> Any:
    """A trainer attribute that lives in the position part (``epoch``, ``step``): read and set there, where the parts
    that need it (the guard, the throughput counters, the rollback) read it too. Read through a C-level getter: the
    loop reads ``step`` every step."""

    def set_field(trainer: BaseTrainer, value: int) -> None:
        setattr(trainer._position, name, value)

    return property(operator.attrgetter(f"_position.{name}"), set_field, doc=doc)


def _refuse_hidden_counters(cls: type, **kwargs: Any) -> None:
    """``BaseTrainer.__init_subclass__``: refuse a subclass that defines ``step`` or ``epoch`` itself (a method, a
    class-level default), which would hide the position part's counters from the loop: it would record, save and
    resume step 0. Setting ``self.step`` in ``setup()`` (or annotating it) is fine.

    :raises TypeError: Naming the attribute, when the class is made.
    """
    super(BaseTrainer, cls).__init_subclass__(**kwargs)
    for name in ("step", "epoch"):
        value = cls.__dict__.get(name, BaseTrainer.__dict__.get(name))
        if value is not BaseTrainer.__dict__.get(name):
            raise TypeError(
                f"{cls.__qualname__} defines {name!r} ({type(value).__name__}), which hides BaseTrainer.{name}, "
                f"the {'optimizer steps taken' if name == 'step' else 'epoch being run'} that the loop reads and "
                f"saves; rename it (set self.{name} in setup() to change the count)"
            )


class BaseTrainer(abc.ABC):
    """The epoch loop, and everything around it that depends on neither task nor model.

    Logging, checkpointing, DDP, early stopping and best-model selection live here; a subclass supplies
    :meth:`setup` and the epoch internals. Construction runs, in order: distributed setup (when
    ``world_size > 1``), seeding (``cfg.seed + rank``), checkpoint load (``ckpt.resume``), logging setup,
    :meth:`setup`, then the restore of every registered item and the RNG states.

    A subclass reads ``cfg``, ``device`` (``cuda:LOCAL_RANK`` or cpu), ``rank``, ``world_size``, ``is_main``,
    ``epoch`` (0-based), ``step`` (optimizer steps: advanced by the first registered optimizer's ``step()``),
    :attr:`first_batch`, ``model`` (set in :meth:`setup`), :attr:`best_model` and :attr:`best_metrics`.
    A subclass may set ``step`` and ``epoch`` but not define them (refused with a ``TypeError`` when it is made).

    :param cfg: A :class:`~trainkit.Config` (or this trainer's :attr:`config_class`), or a nested mapping
        validated into one.
    :param rank: This process's rank.
    :param world_size: The number of processes.
    """

    config_class: ClassVar[type[Config]] = Config
    """The config record this trainer validates ``cfg`` into; subclasses with extra keys override it."""

    __init_subclass__ = _refuse_hidden_counters  # a subclass's own step or epoch would hide the loop's

    def __init__(self, cfg: Config | Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        self.cfg = _validated_config(self.config_class, cfg)
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UsageError(
                f"rank must be in [0, world_size) and world_size >= 1, got rank={rank!r}, world_size={world_size!r}"
            )
        self.rank, self.world_size, self.device = rank, world_size, _device(rank)
        self.is_main = rank == 0  # an attribute: code that stands in for another rank may set it
        self.model: nn.Module | None = None
        parts = _parts(self.cfg, rank, world_size, self.device)
        self._signals, self._position, self._checkpointer, self._metrics = parts
        self._best = WeightSnapshot()
        self._records = _Records(bookkeeping.LoopState(), None, None)
        self._registry = bookkeeping.CkptRegistry()
        self._results: dict[str, float] | None = None
        self._validating: bool | None = None  # None outside val_epoch(); True once step_patience() ran in it
        self._step_bar: StepBar | None = None  # a run with max_steps, while train() runs its epochs
        self._failed = False
        self._run_log = RunLog()
        dist = self.cfg.dist
        self._owns_process_group = world_size > 1 and collectives.init_process_group(
            rank, world_size, backend=dist.backend, timeout_s=dist.timeout_s, device=self.device
        )
        try:
            self._start()
        except BaseException:
            # a failed construction leaves nothing open and the folder free (the error may keep self alive)
            self._run_log.finish(failed=True)
            self._checkpointer.release_folder()
            raise

    def _start(self) -> None:
        self._checkpointer.claim()
        seed_everything(self.cfg.seed + self.rank)
        resume = self._checkpointer.load(self.cfg)
        if self.is_main:
            self._run_log = _open_run_log(self.cfg, self._checkpointer, resume)
        self.setup(resume.ckpt if resume is not None else None)
        self._checkpointer.check_format(self._registry)
        if resume is not None:
            self._restore(resume)
        self._checkpointer.catch_up_remote(resume)  # what a kill kept from the remote goes up in the background

    def __getattr__(self, name: str) -> Any:
        # only when normal lookup fails: a subclass's attribute of these names wins; no best tracked, no attribute
        field = _RECORD_ATTRIBUTES.get(name)
        records = self.__dict__.get("_records")
        if field is not None and records is not None and getattr(records, field) is not None:
            return getattr(records, field)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``, as torchrun sets it; ``rank`` otherwise)."""
        return int(os.environ.get("LOCAL_RANK", self.rank))

    epoch = _position_field("epoch", "The epoch being run (0-based); after the last one, the last one that ran.")
    step = _position_field("step", "The optimizer steps taken (advanced by the first registered optimizer's step()).")

    @property
    def out_dir(self) -> Path:
        """``cfg.out_dir``."""
        return Path(self.cfg.out_dir)

    def planned_steps(self, steps_per_epoch: int | None = None) -> int:
        """The run's planned length in optimizer steps, to size a learning-rate schedule from: ``max_steps``, or
        ``epochs * steps_per_epoch``, the smaller when both are set (:func:`~trainkit.bookkeeping.planned_steps`).

        :param steps_per_epoch: Optimizer steps per epoch (``len(loader) // accumulation``); needed with ``epochs``.
        :returns: The number of optimizer steps the run plans to take.
        :raises BookkeepingError: When ``epochs`` is set and ``steps_per_epoch`` is not given.
        """
        return planned_steps(epochs=self.cfg.epochs, max_steps=self.cfg.max_steps, steps_per_epoch=steps_per_epoch)

    @property
    def first_batch(self) -> int:
        """The index in the epoch of the first batch :meth:`progress` yields (0, or a resumed epoch's consumed
        batches): ``enumerate(self.progress(loader), start=self.first_batch)`` counts the whole epoch."""
        return self._position.first_batch

    @property
    def best_model(self) -> dict[str, Any] | None:
        """A copy of the best weights (a state dict on :attr:`device`; None before any improvement), loaded by
        :meth:`test`; no tensor handed out is ever written into (docs: "Rolling back"). Setting it replaces it."""
        return self._best.hand_out()

    @best_model.setter
    def best_model(self, state: dict[str, Any] | None) -> None:
        self._best.replace(state)

    @property
    def best_metrics(self) -> dict[str, float]:
        """The ``best/val/*`` metrics recorded with the best score (empty before the first improvement)."""
        best = self._records.best
        return dict(best.metrics) if best is not None else {}

    # ------------------------------------------------------------------ hooks a subclass implements

    @abc.abstractmethod
    def setup(self, ckpt: dict[str, Any] | None) -> None:
        """Set up the trainer.

        This method is called after setting up distributed, loading the checkpoint, and setting up logging.
        Build the model, data and optimizer; registered items are restored from ``ckpt`` after it returns.

        :param ckpt: The checkpoint dictionary, if any.
        """

    @abc.abstractmethod
    def train_epoch(self) -> None:
        """Perform a training epoch."""

    @abc.abstractmethod
    def val_epoch(self) -> bool | None:
        """Perform a validation epoch.

        Called every ``val.every_n_epochs`` epochs, and at the end of training.

        :returns: True if early stopping should be triggered, False (or None) otherwise.
        """

    def test_epoch(self) -> Mapping[str, Any] | None:
        """Evaluate the test set with the best weights loaded; log metrics or return them (``test/`` is added).

        :returns: The test metrics, or None when they were logged directly.
        :raises HookNotImplementedError: Unless a subclass overrides it.
        """
        raise HookNotImplementedError(
            f"{type(self).__name__} must implement test_epoch() to evaluate its test set, or set test.enable=false"
        )

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float] | None:
        """Run the full training loop.

        Iterates over epochs, calling train_epoch() each epoch and val_epoch() every val.every_n_epochs epochs
        and at the final epoch. Checkpoints are saved after each epoch. Supports early stopping via the return
        value of val_epoch(). Then :meth:`test` (if ``test.enable``) and :meth:`log_training_results`.

        :returns: Final metrics dict (the last pushed value of every key, with ``best/val/*`` and any
            ``test/*``), or None if no metrics were logged.
        :raises DistributedError: When the ranks disagree on stopping.
        """
        if self._results is not None:
            self._checkpointer.finish_rerun()
            if self.cfg.test.enable:  # as the run that finished left it: the tested (best) weights loaded
                self._best.load_into(collectives.unwrap(self.model))
            return dict(self._results) or None
        try:
            with self._signals:  # installed until the cleanup is done: a signal during it is recorded, not fatal
                try:
                    self._run_epochs()
                    return self._finish()
                except BaseException as exc:
                    self._fail(exc)
                    raise
        finally:
            self._checkpointer.release_folder()  # after the last write: the next run on this folder may start

    def _run_epochs(self) -> None:
        bar, self._step_bar = _bars(self.cfg, loop := self._records.loop, self._bars_enabled)
        try:
            if loop.finished and not loop.last_validated:  # the budget lowered below where a resumed run stood
                self.epoch = loop.current_epoch
                _verdict(self._validate())
                self._records = self._records._replace(loop=attrs.evolve(loop, last_validated=True))
                self._push_if_any()
            parts = self._checkpointer, self._position, self._metrics, self._run_log  # the rollback's, when on:
            rollback = Rollback.build(self.cfg, *parts, restore=self._restore, is_main=self.is_main)
            more = not loop.finished
            while more:
                more = self._run_epoch(bar, rollback)
        finally:
            self._step_bar = _closed(bar, self._step_bar)

    def _run_epoch(self, bar: EpochBar, rollback: Rollback | None) -> bool:
        """One epoch: train, validate on schedule, agree on stopping, push, save; act on a signal."""
        self._position.set_epoch(self._records.loop.epoch)
        with rolled_back(rollback) as rolled, self._position.running_epoch():  # rollback: the epoch again
            self.train_epoch()
        if rolled:
            return True
        position, cfg = self._position, self.cfg
        validated = _validates_now(cfg, self.epoch, self.step, position)
        stop = _verdict(self._validate()) if validated else position.stopped_early
        stop, signalled = _agree_on_stop(stop, self._signals.received is not None, epoch=self.epoch, rank=self.rank)
        loop, more = _end_epoch(cfg, self._records.loop, self.step, position, stop=stop, validated=validated)
        self._records = self._records._replace(loop=loop)
        self._push_if_any()
        # after the last epoch without a test, _finish() writes the same state (plus results) at once
        seconds = self._save() if more or cfg.test.enable else None
        if bar.shown:  # the metrics are formatted for a bar that shows only
            bar.update(self.get_best_pbar_metrics())
        if signalled and more:
            self._stop_for_signal(seconds)
        return more

    def _fail(self, exc: BaseException) -> None:
        """The run ends with ``exc``: let background saves end, close the sinks (a clean signal stop is no failure)."""
        self._failed = True
        self._checkpointer.abandon()  # this rank is failing; the others may be gone
        interrupted = isinstance(exc, TrainingInterrupted)
        if interrupted and self.is_main:
            say(str(exc))
        self._run_log.finish(failed=not interrupted)

    def _stop_for_signal(self, seconds: float | None, batches: TrackedBatches | None = None) -> None:
        self._checkpointer.wait()  # every rank is here: a background save just started is published first
        seconds = self._checkpointer.last_seconds if self.is_main else seconds
        where = {} if batches is None else {"step": self.step, "batches": batches.where}
        raise self._signals.interrupted(self.epoch, seconds, **where)

    def _at_step_boundary(self, batches: TrackedBatches) -> bool:
        """Between two batches, right after an optimizer step: validate, push, save what is due, act on a signal;
        True ends the epoch's loop here (``max_steps``, or a step validation's early stop)."""
        due = self._position.boundary(self.step, self._signals.received is not None)
        if due is None:
            return False
        stop = due.validate and _agree_on_stop(self._validate(inside=True), False, epoch=self.epoch, rank=self.rank)[0]
        if due.push or due.validate:
            self._push_if_any()
        if due.end or stop:
            self._position.end_inside(batches, stopped_early=stop)
            return True
        seconds = self._save(batches) if due.save else None
        if due.stop:
            self._stop_for_signal(seconds, batches)
        return False

    def _save(self, batches: TrackedBatches | None = None) -> float | None:
        """Save through the checkpointer (inside an epoch, with ``batches``: a step checkpoint)."""
        if not self.cfg.ckpt.enable:  # nothing would be written: the record is not built
            return None
        records, run_log, best = self._records, self._run_log, self._best.state
        loop = records.loop if batches is None else attrs.evolve(records.loop, step=self.step, in_epoch=True)
        position, rank_position = self._position.save_position(batches, loop.epoch, self._metrics.state_dict())
        record = _save_record(
            records, loop, self._position, latest_metrics=self._metrics.latest, results=self._results,
            run_id=run_log.run_id, metrics_offset=run_log.offset(), position=position, rank_position=rank_position,
        )  # fmt: skip
        with self._metrics.outside_training("ckpt"):
            seconds = self._checkpointer.save(record, self._registry, best_weights=best, before=run_log.pending_sync())
        if batches is not None:
            self._position.saved(self.step)
        return seconds

    def _validate(self, inside: bool = False) -> Any:
        """``val_epoch()``; ``inside`` an epoch's loop (a step validation): its verdict read, the modes put back."""
        self._validating = False
        self._position.validated(self.step)
        kept = self.model if inside else None  # the DDP wrapper's own flag too: a resume restores it
        try:
            with self._metrics.outside_training("val"), self._position.validating(inside), modes_kept(kept):
                verdict = self.val_epoch()
            return _verdict(verdict) if inside else verdict
        finally:
            self._validating = None

    def _finish(self) -> dict[str, float] | None:
        model = collectives.unwrap(self.model)
        # test() leaves the best weights loaded; the final last.pt holds the last epoch's, as a resume needs
        tested = self.cfg.test.enable and model is not None and self._best.state is not None
        trained = WeightSnapshot().take(module_state(model)) if tested else None
        if self.cfg.test.enable:
            self.test()
        self.log_training_results()
        self._results = {**self._metrics.latest, **self.best_metrics}
        best = self._records.best
        self._checkpointer.keep_best_on_disk(self._best.state is not None and best is not None, best and best.epoch)
        with weights_swapped_in(model, trained) if model is not None else contextlib.nullcontext():
            self._save()  # a background save has copied the state before this returns
        self._checkpointer.finish()
        self._run_log.finish()
        return dict(self._results) or None

    def test(self) -> dict[str, float]:
        """Perform a test epoch.

        Called at the end of training if test.enable is True. Loads :attr:`best_model` into ``self.model``, calls
        :meth:`test_epoch` and pushes the ``test/*`` metrics; the best weights stay loaded (train/eval modes are
        put back). The final ``last.pt`` still holds the last epoch's weights.

        :returns: The ``test/*`` metrics.
        :raises HookNotImplementedError: When the subclass has no :meth:`test_epoch`.
        """
        self._checkpointer.wait_local()
        model = collectives.unwrap(self.model)
        if not self._best.load_into(model) and model is not None:
            warn_user("test(): no best model was recorded (save_if_best never improved); testing the current weights")
        with modes_kept(model), self._metrics.outside_training("test"):
            result = self.test_epoch()
        self.log(_test_metrics(result))
        return {key: value for key, value in self.push_logs().items() if key.startswith("test/")}

    def log_training_results(self) -> None:
        """Log the training results, at the end of training.

        The best validation metrics and epoch, the test metrics, the epochs run and why training stopped go into
        the W&B run summary; rank 0 prints them in one line.
        """
        summary = _summary(self._records, self.best_metrics, self._metrics.latest)
        self._run_log.summary(summary)
        if self.is_main:
            say(_final_line(summary, self.cfg, self._records.loop), stream=sys.stdout)

    def add_checkpoint_items(self, **kwargs: Any) -> None:
        """Add items to the checkpoint dictionary, saved and restored by state_dict.

        Registering is what makes an object survive a resume, so every rank does it; writing the file stays rank
        zero's job. Objects with ``state_dict()`` (and a ``torch.Generator``) are restored in place, plain values
        read back from :attr:`checkpoint_items`. The first optimizer registered drives :attr:`step`.

        :param kwargs: The items to add to the checkpoint dictionary.
        :raises RegistryError: When a name is reserved or already registered.
        """
        counting = _step_counting_optimizer(self._registry, kwargs)
        # a generator has no state_dict(): registered as its state, restored into it in place
        items = {name: GeneratorItem(obj) if isinstance(obj, torch.Generator) else obj for name, obj in kwargs.items()}
        self._registry, _ = bookkeeping.register_items(self._registry, items)
        if self._metrics.guard is not None:  # the divergence guard's hooks on its optimizers
            self._metrics.guard.watch(kwargs.values(), self._position)
        if counting is not None:
            counting.register_step_post_hook(_step_counter(self._position))

    @property
    def checkpoint_items(self) -> Mapping[str, Any]:
        """The registered checkpoint items (after a resume, plain values hold the restored ones)."""
        items = self._registry.items
        if not any(isinstance(obj, GeneratorItem) for obj in items.values()):
            return items
        return {name: obj.generator if isinstance(obj, GeneratorItem) else obj for name, obj in items.items()}

    def add_samplers(self, *samplers: Any) -> None:
        """Hand samplers to the trainer, which calls ``set_epoch(epoch)`` on each before every epoch.

        A ``DistributedSampler``, say: shuffling then differs per epoch and a resume shuffles exactly the same.

        :param samplers: Objects with a ``set_epoch(int)`` method.
        :raises UsageError: When one has no ``set_epoch``.
        """
        self._position.add_samplers(samplers)

    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpointer part (:class:`~trainkit.checkpoint.checkpointer.Checkpointer`): the checkpoint files."""
        return self._checkpointer

    @property
    def guard(self) -> DivergenceGuard | None:
        """The :class:`~trainkit.loop.divergence_guard.DivergenceGuard`; None with guard.nonfinite off."""
        return self._metrics.guard

    @property
    def last_ckpt_path(self) -> Path:
        """``out_dir/last.pt``; with ``ckpt.format="sharded"``, the directory ``out_dir/last.ckpt``."""
        return self._checkpointer.last_path

    @property
    def best_ckpt_path(self) -> Path:
        """``out_dir/best.pt``; with ``ckpt.format="sharded"``, the directory ``out_dir/best.ckpt``."""
        return self._checkpointer.best_path

    def _restore(self, resume: Resume) -> Iterable[Any]:
        """After ``setup()`` or in a rollback: restore the items, records, best weights and position; return items."""
        self._registry = self._checkpointer.restore(resume, self._registry)
        records = resume.records
        self._records = _Records(records.loop, records.best, records.patience)
        self.epoch, self.step = records.loop.current_epoch, records.loop.step
        if records.best is not None and records.best.score is not None:
            loaded = self._checkpointer.read_best(resume.path.parent, records.best, collectives.unwrap(self.model))
            if loaded is not None:
                self._best.replace(loaded.weights, private=loaded.private)
        self._results = resume.results
        budget = _budget(self.cfg)
        state = self._position.resume(resume.path, resume.ckpt, rank=self.rank, loop=records.loop, budget=budget)
        self._metrics.resume(resume.ckpt.get("latest_metrics"), state)
        return self._registry.items.values()

    # ------------------------------------------------------------------ best model and early stopping

    def reset_best_tracking(self, minimize: bool | None = None) -> None:
        """Initialize the best-score bookkeeping used by :meth:`save_if_best`.

        save_if_best() calls this itself on first use, so a trainer only needs it to pin a direction that config
        does not carry: pass minimize when the trainer fixes it in code, or call it from setup after deciding
        val.minimize there. Direction otherwise comes from val.minimize, defaulting to maximizing.

        A trainer that never tracks a best never gets these attributes (``best_state``, ``patience_state``), so
        it stays free to use those names itself. Only best_model and best_metrics are always defined.

        :param minimize: The direction; None takes ``val.minimize``.
        """
        direction = self.cfg.val.minimize if minimize is None else bool(minimize)
        best = bookkeeping.BestState(minimize=direction, min_delta=self.cfg.val.min_delta)
        self._records = self._records._replace(best=best, patience=_fresh_patience(self.cfg))
        self._best.replace(None)

    def save_if_best(self, score: Any, metrics: Mapping[str, Any] | None = None) -> bool:
        """Keep this epoch's weights if its score is the best seen so far.

        On an improvement: records the score and epoch, snapshots the weights into best_model, and writes
        best.pt. The two have different readers: best_model is what test reloads in this same process, and it
        survives ckpt.enable=false; best.pt is what a later run loads. Pass metrics to also record the
        best/val/* dict for logging. Feed the result to step_patience() to early-stop as well; a trainer that
        only wants best-model selection can call this alone.

        Call it on every rank, since every rank's test reloads its own best_model; the best.pt write self-gates
        to rank 0 on its own. A trainer whose score only exists on rank 0 may call it under a rank guard, but
        then owes step_patience() a verdict broadcast to the other ranks (:meth:`broadcast`).

        :param score: The scalar being tracked, in val.minimize direction. A non-finite score never counts as
            an improvement.
        :param metrics: The epoch's val metrics, if they should be recorded too.
        :returns: True if the score improved, i.e. the weights were kept.
        """
        if self._records.best is None:
            self.reset_best_tracking()
        best, improved = save_if_best(self._records.best, score, epoch=self.epoch, metrics=metrics, step=self.step)
        if improved:
            model = collectives.unwrap(self.model)
            if model is None:
                raise UsageError("save_if_best() snapshots self.model, which is not set; assign it in setup()")
            self._best.take(module_state(model))  # written (best.pt) at the end of the epoch, before last.pt
        self._records = self._records._replace(best=best)  # after the snapshot: a failed one leaves the record
        self._checkpointer.scored(score, step=self.step, improved=improved, minimize=best.minimize)
        return improved

    def step_patience(self, improved: bool) -> bool:
        """Advance the early-stopping counter with this epoch's outcome.

        An improvement refills the counter; otherwise it ticks down, but only once the epoch reaches
        val.start_patience. Call it once per validation, inside val_epoch().

        Every rank has to reach the same verdict, or one leaves the epoch loop while the others block in the
        next collective. That holds on its own when the score is rank-invariant, i.e. a torchmetrics compute()
        or a reduce_mean() result; a rank-0-only score has to be broadcast by the caller instead.

        :param improved: What save_if_best() returned for this epoch.
        :returns: True once patience is exhausted, i.e. training should stop.
        """
        if self._validating is None:
            raise UsageError("step_patience() counts validation outcomes; call it inside val_epoch()")
        if self._validating:
            raise UsageError(f"step_patience() was already called in epoch {self.epoch}'s validation; call it once")
        patience = self._records.patience or _fresh_patience(self.cfg)
        patience, stop = bookkeeping.step_patience(patience, improved, epoch=self.epoch)
        self._records = self._records._replace(patience=patience)
        self._validating = True
        return stop

    def get_best_pbar_metrics(self) -> dict[str, float]:
        """Return the best validation metrics formatted for the epoch progress bar.

        :returns: Best validation metrics with the best/val/ prefix stripped, or an empty dict if no validation
            has been run yet.
        """
        return {key.removeprefix("best/val/"): value for key, value in self.best_metrics.items()}

    def make_ddp(self, module: nn.Module, find_unused_parameters: bool = False) -> nn.Module:
        """Wrap a module in DistributedDataParallel if running in distributed mode.

        :param module: The module to wrap (moved to :attr:`device` first).
        :param find_unused_parameters: Passed to DDP. Set to True if some parameters are not used in the
            forward pass. Defaults to False.
        :returns: The DDP-wrapped module, or the original module if not distributed.
        """
        return collectives.wrap_ddp(module.to(self.device), self.world_size, find_unused_parameters)

    def make_fsdp(
        self,
        module: nn.Module,
        *,
        shard: Iterable[nn.Module] | type | tuple[type, ...] | None = None,
        mp_policy: Any = None,
        reshard_after_forward: bool = True,
        mesh: Any = None,
    ) -> nn.Module:
        """Shard a module's parameters, gradients and optimizer state across the ranks with FSDP2.

        FSDP2's ``fully_shard`` on a 1-D mesh over every rank (torch >= 2.6); build the optimizer after it. On
        one process the module is returned on :attr:`device`. Docs: "Sharded checkpoints and FSDP2".

        :param module: The module to shard (moved to :attr:`device` first).
        :param shard: Units sharded before the root (submodules, or module classes); None: the root alone.
        :param mp_policy: A ``torch.distributed.fsdp.MixedPrecisionPolicy``; None trains in full precision.
        :param reshard_after_forward: Free gathered parameters after each unit's forward (FSDP2's default).
        :param mesh: The ``DeviceMesh`` to shard over; None builds one over every rank.
        :returns: The sharded module, or the module itself on one process.
        """
        options = {"shard": shard, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
        return fsdp.shard_on(module.to(self.device), self.device, self.world_size, mesh=mesh, **options)

    def barrier(self) -> None:
        """Synchronize all processes in the distributed group (a rank late by ``dist.timeout_s`` fails them)."""
        if self.world_size > 1:
            collectives.barrier(self.cfg.dist.timeout_s)

    def reduce_mean(self, total: Any, count: Any) -> float:
        """Mean over the whole split rather than over this rank's shard of it.

        A distributed sampler hands every rank a different slice, so a locally divided sum leaves the ranks
        disagreeing on the score they select on. Every rank must call this the same number of times, in the
        same order. Sums are taken in float64.

        :param total: This rank's summed quantity.
        :param count: This rank's number of terms in that sum.
        :returns: The pooled mean, NaN if no rank contributed a term.
        """
        return collectives.reduce_mean(total, count)

    def broadcast(self, value: T, src: int = 0) -> T:
        """Give every rank ``src``'s value, e.g. a verdict computed from a rank-0-only score.

        :param value: The value on ``src`` (ignored on the other ranks).
        :param src: The rank whose value wins.
        :returns: ``src``'s value, on every rank.
        """
        return collectives.broadcast_object(value, src=src)

    def _modules(self, modules: tuple[nn.Module, ...], caller: str) -> tuple[nn.Module, ...]:
        if modules:
            return modules
        if self.model is None:
            raise UsageError(
                f"{caller}() defaults to self.model, which is not set; assign it in setup() or pass modules"
            )
        return (self.model,)

    def get_param_groups(self, *modules: nn.Module) -> list[dict]:
        """Split parameters into a weight-decayed and an undecayed optimizer group.

        A parameter skips weight decay if it is 1-D (biases, norm and other scale vectors) or if its name
        contains one of cfg.no_weight_decay. The default list covers biases, norms and every \\*_emb lookup
        table; a model overrides it only when a name lies about what it is. Each group has ``name``,
        ``params`` and ``weight_decay``; every trainable parameter is in one, once.

        :param modules: Modules to take parameters from, self.model when none are given. Pass more when
            parameters outside the model are trained by the same optimizer, such as an objective with its own
            projection head.
        :returns: The groups, ready for any torch optimizer.
        """
        return optim.make_param_groups(
            self._modules(modules, "get_param_groups"),
            weight_decay=self.cfg.weight_decay,
            no_weight_decay=self.cfg.no_weight_decay,
        )

    def clip_and_log_grad_norm(self, *modules: nn.Module) -> torch.Tensor:
        """Clip gradients in place and log the pre-clip norm as ``train/grad_norm``.

        The norm is measured even when grad_clip is unset so the metric does not vanish on unclipped runs. Call
        once per optimizer step, after backward() (under AMP, after unscaling); no host sync; ``guard.*`` judges it.

        :param modules: Modules to clip over, self.model by default. Pass the same ones as
            :meth:`get_param_groups`, so the norm spans every parameter stepped.
        :returns: The pre-clip total L2 norm, a 0-d tensor on the gradients' device.
        """
        params = optim.trainable_parameters(self._modules(modules, "clip_and_log_grad_norm"))
        norm = optim.total_grad_norm(params)
        if self.cfg.grad_clip is not None:
            optim.clip_grads_(params, self.cfg.grad_clip, norm)
        norm = fsdp.plain(norm.detach())  # over FSDP2 shards a replicated DTensor: its local value is the norm
        self._metrics.add_grad_norm(norm)  # and to the divergence guard (guard.nonfinite), when on
        return norm

    def log_epoch_grad_norm(self) -> None:
        """Log the epoch-mean grad norm, the counterpart to the epoch-mean train loss.

        Logs ``train/grad_norm_epoch``, the mean of the norms measured since the last call (nothing if none); with
        ``guard.nonfinite`` on, of the finite ones (a skipped step's NaN/inf left out; NaN when all were skipped).
        """
        self._metrics.log_grad_norm_mean()

    def log_param_grad_stats(self, *modules: nn.Module) -> None:
        """Log per-parameter weight norm, grad norm, and grad-to-weight ratio.

        Each gate costs one W&B key per parameter, so both are throttled to every log_stats_every_n_steps
        steps. Call after backward(), before any clip (``log_weight_stats``/``log_grad_stats`` are the gates).

        :param modules: Modules to measure, ``self.model`` by default.
        """
        cfg = self.cfg
        if (cfg.log_weight_stats or cfg.log_grad_stats) and self.step % cfg.log_stats_every_n_steps == 0:
            named = optim.named_trainable_parameters(self._modules(modules, "log_param_grad_stats"))
            keys, values = optim.param_stats(named, weights=cfg.log_weight_stats, grads=cfg.log_grad_stats)
            self._metrics.buffer.add_vector(keys, fsdp.plain(values))  # over FSDP2 shards: one all-reduce

    def log_lr(self) -> None:
        """Log the current learning rate for each optimizer parameter group.

        Keys are ``lr/<optimizer>/<group>``: the registered name (or the attribute holding an unregistered
        optimizer) and the group's ``name`` or index.
        """
        self._metrics.buffer.add(optim.learning_rates(self._registry.items, or_else=vars(self)))

    @property
    def _bars_enabled(self) -> bool:
        return self.cfg.progress.enable and self.is_main

    def log(self, metrics: Mapping[str, Any] | None = None, **named: Any) -> None:
        """Buffer numbers and 1-element tensors for :meth:`push_logs`; an accelerator's stay on it (CPU's: read now).

        :param metrics: Name to value.
        :param named: More metrics as keyword arguments (for names that are identifiers).
        :raises TypeError: When a value is not a number or a 1-element tensor.
        """
        if metrics:
            self._metrics.buffer.add(metrics)
        if named:
            self._metrics.buffer.add(named)

    def push_logs(self) -> dict[str, float]:
        """Flush accumulated logs to W&B, including current epoch and step.

        One transfer to the host, one row (with ``trainer/epoch`` and ``trainer/step``) appended to
        ``metrics.jsonl`` and sent to W&B by rank 0; every rank drains its buffer.

        :returns: The pushed metrics, without the epoch and step entries.
        """
        metrics = self._metrics.drain()
        if not metrics:
            return metrics
        self._metrics.latest.update(metrics)
        if self.is_main:
            self._run_log.log({"trainer/step": self.step, "trainer/epoch": self.epoch, **metrics})
        return metrics

    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Count tokens for ``perf/tokens_per_s``, no host sync; ``log_throughput`` off: only ``n`` is checked.

        :param n: A number, or a tensor (e.g. ``attention_mask.sum()``) summed on its device until the next push.
        :raises TypeError: When ``n`` is no number or real tensor (whether or not ``log_throughput`` is on).
        :raises ValueError: When the number ``n`` is NaN, infinite, negative or too large for a float (a tensor's
            count is checked on its device: a bad one drops the next row's token rate, with a warning).
        """
        (check_token_count if self._metrics.throughput is None else self._metrics.throughput.count_tokens)(n)

    def _push_if_any(self) -> None:
        if len(self._metrics.buffer):
            self.push_logs()

    def progress(self, iterable: Iterable[T], desc: str | None = None, total: int | None = None) -> Iterable[T]:
        """Iterate with a per-step progress bar: ``for x, y in self.progress(loader)``.

        The bar shows on rank 0 (``progress.enable``, stderr a terminal; ``max_steps``: the run's step bar). With
        ``ckpt.every_n_steps`` the ``DataLoader`` iterated here is counted: step checkpoints and signals act at step
        boundaries, and a resumed epoch skips its trained batches at the index level (docs: "Step checkpoints").

        :param iterable: The batches.
        :param desc: The bar's label; defaults to the current epoch.
        :param total: The number of batches when ``len(iterable)`` does not give it.
        :returns: An iterable over the same batches (``len()`` and a loader's attributes read through); the iterable
            itself when bars and step checkpoints are off and it is no DataLoader iterated in ``train_epoch()``.
        :raises CheckpointMismatchError: When a resumed epoch's loader differs or cannot be skipped into.
        """
        start_persistent_workers(iterable)
        self._position.check_loader(iterable, epoch=self.epoch, registered=lambda: _generators(self._registry))
        tracked = self._position.track(iterable, self._at_step_boundary)
        shown, initial = (self._position.epoch_tagged(iterable), 0) if tracked is None else (tracked, tracked.skip)
        shown = shown if self._metrics.throughput is None else CountedBatches(shown, self._metrics.throughput)
        steps = self._step_bar if self._validating is None else None  # a validation loop gets a bar of its own
        return steps.follow(shown, lambda: self.step, self._metrics.latest) if steps is not None else step_bar(
            shown, desc=desc or f"epoch {self.epoch}", total=total, enabled=self._bars_enabled, initial=initial
        )

    def close(self) -> None:
        """Finish the W&B run, close ``metrics.jsonl`` and leave the process group if the trainer made it.

        ``launch``/``spawn`` call it. After a successful ``train()`` the ranks meet in a barrier first; after a
        failed one they do not (the others may be gone).
        """
        self._checkpointer.close(self._failed, before_release=self._run_log.finish)
        if self._owns_process_group and collectives.is_distributed():
            collectives.teardown(self.cfg.dist.timeout_s, meet=not self._failed)
            self._owns_process_group = False
