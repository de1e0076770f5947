"""BaseTrainer: the only class that wires the pure core to torch, files, collectives, W&B and tqdm.

The trainer holds immutable bookkeeping records and rebinds them; every decision (improved? stop?
validate now? which epoch next?) comes from :mod:`trainkit.bookkeeping`.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import os
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import attrs
import torch
from torch import nn

from trainkit import bookkeeping as core
from trainkit import checkpoint as ckpt_io
from trainkit import distributed as dist_utils
from trainkit import optim as optim_utils
from trainkit import sharded, sharding
from trainkit.batches import RankPosition, TrackedBatches, loader_shape, unskippable_reason
from trainkit.config import Config, changed_on_resume, public_config, render_value, strip_secrets
from trainkit.errors import (
    BookkeepingError,
    CheckpointError,
    CheckpointMismatchError,
    DistributedError,
    HookNotImplementedError,
    OutDirError,
    TrainingInterrupted,
    UsageError,
)
from trainkit.logging import JsonlSink, LogBuffer, RunLog, new_run_id, open_run_log
from trainkit.messages import say
from trainkit.modules import load_module_state, module_state, restore_training_modes, training_modes
from trainkit.payload import SCHEMA_VERSION, best_payload, last_payload, mid_epoch_state
from trainkit.progress import EpochBar, step_bar
from trainkit.rng import (
    GeneratorItem,
    capture_rng,
    loader_generators,
    restore_rng,
    seed_everything,
    start_persistent_workers,
)
from trainkit.run_files import RunFiles, same_directory
from trainkit.sharded_files import ShardedFiles
from trainkit.signals import StopSignals
from trainkit.snapshot import WeightSnapshot, modes_kept, weights_swapped_in

__all__ = ["BaseTrainer", "CHECKPOINT_SCHEMA_VERSION"]

T = TypeVar("T")

CHECKPOINT_SCHEMA_VERSION = SCHEMA_VERSION
"""Version of the checkpoint layout written by this trainkit (the layout :mod:`trainkit.payload` describes)."""

_RECORD_ATTRIBUTES = {"best_state": "_best_state", "patience_state": "_patience_state"}
"""The public names of the engine's records, and where the engine keeps them."""


def _step_counter(trainer: BaseTrainer) -> Any:
    """An optimizer post-step hook that advances ``trainer.step``, holding the trainer only weakly.

    A strong reference would make a cycle (trainer -> optimizer -> hook -> trainer) that keeps the model,
    and under DDP its process group, alive until the garbage collector runs, possibly at interpreter exit.
    """
    ref = weakref.ref(trainer)

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:
            owner.step += 1

    return count


def _item_state(obj: Any) -> Any:
    """A registered object's state: modules under names free of ``torch.compile``'s ``_orig_mod.``."""
    return module_state(obj) if isinstance(obj, nn.Module) else obj.state_dict()


def _load_item(obj: Any, state: Any) -> None:
    """Load a registered object's state; a module takes names saved with compile on or off. An item whose state
    is in a sharded checkpoint's DCP files (marked in its ``trainkit.pt``) was loaded from there already."""
    if isinstance(state, str) and state == sharded.SHARDED:
        return
    if isinstance(obj, nn.Module):
        load_module_state(obj, state)
    else:
        obj.load_state_dict(state)


class _Resume(NamedTuple):
    """A loaded checkpoint's records reconciled with the current config, where it was read, its results."""

    path: Path
    records: core.Resumed
    results: dict[str, float] | None


class BaseTrainer(abc.ABC):
    """The epoch loop, and everything around it that depends on neither task nor model.

    Logging, checkpointing, DDP, early stopping and best-model selection live here; a subclass supplies
    :meth:`setup` and the epoch internals (:meth:`train_epoch`, :meth:`val_epoch`, and
    :meth:`test_epoch` when ``test.enable``).

    Construction runs, in order: set up distributed (when ``world_size > 1``), seed every RNG from
    ``cfg.seed + rank``, load the checkpoint (``ckpt.resume``), set up logging, call
    :meth:`setup` with the loaded checkpoint dict (or None), then restore every item registered with
    :meth:`add_checkpoint_items` (and the RNG states) from that checkpoint.

    Attributes a subclass reads: ``cfg`` (the validated config), ``device`` (``cuda:LOCAL_RANK`` when
    CUDA is available, else cpu), ``rank``, ``world_size``, ``is_main`` (rank 0), ``epoch`` (the 0-based
    epoch being run), ``step`` (optimizer steps taken: advanced automatically after every ``step()`` of
    the first optimizer registered with :meth:`add_checkpoint_items`; a subclass without a registered
    optimizer advances it itself), ``first_batch`` (the index in the epoch of the first batch
    :meth:`progress` yields: 0, or in an epoch resumed from a step checkpoint the batches trained on before
    it, so ``enumerate(self.progress(loader), start=self.first_batch)`` counts batches of the whole epoch),
    ``model`` (set by the subclass in :meth:`setup`), ``best_model`` (the
    snapshotted best weights, a state dict on ``device``, or None) and ``best_metrics`` (the ``best/val/*``
    dict).

    :param cfg: A :class:`~trainkit.Config` (or this trainer's :attr:`config_class`), or a nested mapping
        validated into one.
    :param rank: This process's rank.
    :param world_size: The number of processes.
    """

    config_class: ClassVar[type[Config]] = Config
    """The config record this trainer validates ``cfg`` into; subclasses with extra keys override it."""

    def __init__(self, cfg: Config | Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        self.cfg = self._validate_config(cfg)
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UsageError(
                f"rank must be in [0, world_size) and world_size >= 1, got rank={rank!r}, world_size={world_size!r}"
            )
        self.rank = rank
        self.world_size = world_size
        self.is_main = rank == 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.out_dir = Path(self.cfg.out_dir)
        # the config is frozen: one plain copy serves every save; secrets never reach a file
        self._cfg_dict = public_config(self.cfg)
        self.model: nn.Module | None = None
        self._best = WeightSnapshot()
        # the engine's records; public as best_state/patience_state once tracked (see __getattr__)
        self._best_state: core.BestState | None = None
        self._patience_state: core.PatienceState | None = None
        self.best_metrics: dict[str, float] = {}
        self.epoch = 0
        self.step = 0
        self._registry = core.CkptRegistry()
        self._samplers: list[Any] = []
        self._loop = core.LoopState()
        self._logs = LogBuffer()
        self._latest_metrics: dict[str, float] = {}
        self._results: dict[str, float] | None = None
        self._in_validation = False
        self._patience_stepped = False
        self._best_dirty = False
        self._step_hook: Any = None
        self._grad_norm_mean = optim_utils.RunningMean()
        # weak sets, not ids: a loader built anew each epoch may reuse a freed one's id
        self._loaders_checked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._samplers_unchecked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._owns_process_group = False
        self._failed = False
        # where the epoch stands, for step checkpoints (ckpt.every_n_steps) and mid-epoch resumes
        self._in_train_epoch = False
        self._epoch_tracked = False
        self._pending_position: tuple[core.EpochPosition, RankPosition] | None = None
        self._step_checkpoint_at: float = math.inf  # the step from which one is due (this epoch's tracked loop)
        self._voting = False  # whether this epoch's step boundaries take part in the ranks' stop vote
        self._vote = dist_utils.DelayedVote(self.cfg.dist.timeout_s)
        self._untracked_warned = False
        self.first_batch = 0
        ckpt_cfg = self.cfg.ckpt
        requeue = [ckpt_cfg.requeue_signal] if ckpt_cfg.requeue_signal else []
        self._signals = StopSignals(["SIGTERM", "SIGINT", *requeue])
        in_shards = ckpt_cfg.format == "sharded"
        self._files = RunFiles(
            self.out_dir, enabled=ckpt_cfg.enable, writer=self.is_main, async_save=ckpt_cfg.async_save and not in_shards
        )
        # ckpt.format=sharded: every rank's shards in directories (also read, in a file run, to convert one)
        self._shards = ShardedFiles(
            self.out_dir,
            enabled=ckpt_cfg.enable,
            rank=rank,
            world_size=world_size,
            async_save=in_shards and ckpt_cfg.async_save,
            timeout_s=self.cfg.dist.timeout_s,
        )
        self._run_log = RunLog()
        self._run_id: str | None = None

        if world_size > 1:
            self._owns_process_group = dist_utils.init_process_group(
                rank, world_size, backend=self.cfg.dist.backend, timeout_s=self.cfg.dist.timeout_s, device=self.device
            )
        try:
            self._claim_out_dir()
            seed_everything(self.cfg.seed + rank)
            ckpt, path = self._load_resume_checkpoint()
            resume = self._reconcile(ckpt, path) if ckpt is not None and path is not None else None
            self._setup_logging(ckpt, resume)
            self.setup(ckpt)
            self._check_format()
            if ckpt is not None and resume is not None:
                self._restore(ckpt, resume)
        except BaseException:
            # a failed construction leaves nothing open and the folder free (the error may keep self alive)
            self._close_sinks(failed=True)
            self._files.release()
            raise

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: an attribute a subclass set under these names wins, and a
        # trainer that never tracks a best has neither (see reset_best_tracking).
        private = _RECORD_ATTRIBUTES.get(name)
        if private is not None:
            value = self.__dict__.get(private)
            if value is not None:
                return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def best_model(self) -> dict[str, Any] | None:
        """A snapshot of the best weights (a state dict on :attr:`device`), or None before the first improvement.

        :meth:`test` loads it into :attr:`model`. It is a copy: it shares no tensor with the model, and
        :meth:`save_if_best` never writes into a tensor you were given. Once you have read this attribute
        (to roll back with ``model.load_state_dict(trainer.best_model, assign=True)``, to hand it to
        another module, or only to look), the next improvement snapshots into new tensors and leaves the
        ones you hold alone; while nobody reads it, improvements refill the same tensors in place. With
        ``assign=True`` the model trains on the snapshot's own tensors, so this dict follows the model
        until the next improvement replaces it; roll back without ``assign`` to keep it apart. Setting
        the attribute replaces the snapshot (None forgets it).
        """
        return self._best.hand_out()

    @best_model.setter
    def best_model(self, state: dict[str, Any] | None) -> None:
        self._best.replace(state)

    # ------------------------------------------------------------------ hooks a subclass implements

    @abc.abstractmethod
    def setup(self, ckpt: dict[str, Any] | None) -> None:
        """Set up the trainer.

        This method is called after setting up distributed, loading the checkpoint, and setting up
        logging. Build the model (``self.model``), data and optimizer here and register what must
        survive a resume with :meth:`add_checkpoint_items`; the registered items are restored from
        ``ckpt`` right after this returns.

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
        """Evaluate the test set; :meth:`test` calls it with the best weights loaded.

        Log metrics with :meth:`log` or return them as a dict (keys get a ``test/`` prefix).

        :returns: The test metrics, or None when they were logged directly.
        :raises HookNotImplementedError: Unless a subclass overrides it.
        """
        raise HookNotImplementedError(
            f"{type(self).__name__} must implement test_epoch() to evaluate its test set, or set test.enable=false"
        )

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float] | None:
        """Run the full training loop.

        Iterates over epochs, calling :meth:`train_epoch` each epoch and :meth:`val_epoch` every
        ``val.every_n_epochs`` epochs and at the final epoch. Checkpoints are saved after each epoch
        (after validation, so they hold that epoch's bookkeeping), with buffered logs pushed first.
        Supports early stopping via the return value of :meth:`val_epoch`; every rank must reach the
        same verdict, and a disagreement raises :class:`~trainkit.DistributedError` on every rank.
        Then :meth:`test` runs if ``test.enable``, then :meth:`log_training_results`. A run resumed from
        the checkpoint of a finished run does no more epochs and returns its final metrics.

        :returns: Final metrics dict (the last pushed value of every key, with ``best/val/*`` and any
            ``test/*``), or None if no metrics were logged.
        :raises DistributedError: When the ranks disagree on stopping.
        """
        if self._results is not None:
            self._files.release()
            if self.cfg.test.enable:  # as the run that finished left it: the tested (best) weights loaded
                self._load_best_into_model()
            return dict(self._results) or None
        more = not self._loop.finished  # a resume already reconciled the loop with the config
        try:
            # the handlers stay until the cleanup below is done: a signal during it is recorded, not fatal
            with self._signals:
                try:
                    bar = EpochBar(total=self.cfg.epochs, initial=self._loop.epoch, enabled=self._bars_enabled)
                    try:
                        self._run_epochs(more, bar)
                    finally:
                        bar.close()
                    return self._finish()
                except TrainingInterrupted as exc:
                    self._files.wait_quietly()
                    self._shards.abandon()  # a background sharded save: _stop_for_signal published it already
                    if self.is_main:
                        say(str(exc))
                    self._failed = True
                    # a clean stop at an epoch boundary, saved and resumable: not a failed W&B run (exit code 0)
                    self._close_sinks(failed=False)
                    raise
                except BaseException:
                    self._failed = True
                    self._files.wait_quietly()
                    self._shards.abandon()  # this rank is failing; the others may be gone
                    self._close_sinks(failed=True)
                    raise
        finally:
            self._files.release()  # after the last write: the next run on this folder may start

    def _run_epochs(self, more: bool, bar: EpochBar) -> None:
        if not more and not self._loop.last_validated:
            # epochs was lowered below where a resumed run stood: its last epoch is still validated
            self.epoch = self._loop.epoch - 1
            self._validate()
            self._loop = attrs.evolve(self._loop, last_validated=True)
            if len(self._logs):
                self.push_logs()
        while more:
            self.epoch = self._loop.epoch
            for sampler in self._samplers:
                sampler.set_epoch(self.epoch)
            self._train_one_epoch()
            stop = False
            validated = core.should_validate(self.epoch, self.cfg.epochs, self.cfg.val.every_n_epochs)
            if validated:
                stop = self._validate()
            stop, signalled = self._agree_on_stop(stop)
            self._loop, more = core.end_epoch(
                self._loop, epochs=self.cfg.epochs, early_stop=stop, step=self.step, validated=validated
            )
            if len(self._logs):
                self.push_logs()
            # after the last epoch without a test, _finish() writes the same state (plus results) at once
            seconds = self._save_checkpoint() if more or self.cfg.test.enable else None
            bar.update(self.get_best_pbar_metrics())
            if signalled and more:
                self._stop_for_signal(seconds)

    def _train_one_epoch(self) -> None:
        self._in_train_epoch = True
        self._epoch_tracked = False
        try:
            self.train_epoch()
        finally:
            self._in_train_epoch = False
            self.first_batch = 0
        if self._pending_position is not None:
            position = self._pending_position[0]
            self._pending_position = None
            warnings.warn(
                f"the run resumed inside epoch {position.epoch} (after {position.batches} of "
                f"{position.batches_per_epoch} batches), but train_epoch() did not iterate a DataLoader through "
                "self.progress(), so the epoch ran from its first batch: the batches before the checkpoint were "
                "trained on twice",
                RuntimeWarning,
                stacklevel=3,
            )

    def _stop_for_signal(self, save_seconds: float | None, batches: TrackedBatches | None = None) -> None:
        self._shards.wait()  # every rank is here: a background save just started is published before the exit
        if self.is_main:
            self._files.wait()
            save_seconds = self._files.last_seconds
        number = self._signals.received if self._signals.received is not None else signal.SIGTERM
        raise TrainingInterrupted(
            self._signals.name or "SIGTERM",
            int(number),
            self.epoch,
            save_seconds,
            step=self.step if batches is not None else None,
            batches=(batches.consumed, len(batches)) if batches is not None else None,
        )

    def _at_step_boundary(self, batches: TrackedBatches) -> None:
        """Between two batches, right after an optimizer step: write a due step checkpoint, act on a signal.

        The ranks agree on a signal through a vote started at the previous boundary, so no rank waits here;
        a signal is acted on one step later under DDP than on one process.
        """
        signalled = self._signals.received is not None
        if not (signalled or self._voting or self.step >= self._step_checkpoint_at):
            return  # one process, no signal, nothing due: what almost every step boundary is
        stop = self._vote.cast(signalled)
        seconds = None
        if stop or self.step >= self._step_checkpoint_at:
            seconds = self._save_checkpoint(batches)
            self._mark_step_saved()
        if stop:
            self._stop_for_signal(seconds, batches)

    def _mark_step_saved(self) -> None:
        """Record that ``last.pt`` holds the current step (or that the tracked epoch starts here)."""
        due_at = core.next_step_checkpoint(self.step, self.cfg.ckpt.every_n_steps)
        self._step_checkpoint_at = math.inf if due_at is None else due_at

    def _validate(self) -> bool:
        self._in_validation = True
        self._patience_stepped = False
        try:
            verdict = self.val_epoch()
        finally:
            self._in_validation = False
        try:
            stop = core.as_verdict(verdict)
        except BookkeepingError:
            raise UsageError(
                f"val_epoch() must return True to stop early or a falsey value to go on, got "
                f"{type(verdict).__name__} {verdict!r}, whose truth is ambiguous; return what step_patience() "
                "returned"
            ) from None
        if stop and not core.is_bool_like(verdict):  # a score or a metrics dict returned by mistake, say
            warnings.warn(
                f"val_epoch() returned {type(verdict).__name__} {verdict!r}, which is truthy: training stops "
                "early now; return what step_patience() returned (a bool)",
                RuntimeWarning,
                stacklevel=4,
            )
        return stop

    def _agree_on_stop(self, stop: bool) -> tuple[bool, bool]:
        """Check every rank's stop verdict agrees and learn whether any rank got a signal, in one all-reduce."""
        signalled = self._signals.received is not None
        if self.world_size == 1:
            return stop, signalled
        (anyone, any_signal), (everyone, _) = dist_utils.any_all([stop, signalled])
        if anyone != everyone:
            raise DistributedError(
                f"ranks disagree on early stopping at epoch {self.epoch} (rank {self.rank} said {stop}); "
                "select on a rank-invariant score (reduce_mean() or a torchmetrics compute()), or broadcast a "
                "rank-0-only verdict with broadcast() before step_patience()"
            )
        return stop, any_signal

    def _finish(self) -> dict[str, float] | None:
        model = dist_utils.unwrap(self.model)
        trained = None
        if self.cfg.test.enable:
            # test() leaves the best weights loaded; the final last.pt holds the last epoch's, as a resume needs
            if model is not None and self._best.state is not None:
                trained = WeightSnapshot().take(module_state(model))
            self.test()
        self.log_training_results()
        self._results = {**self._latest_metrics, **self.best_metrics}
        self._restore_lost_best_file()
        with weights_swapped_in(model, trained) if model is not None else contextlib.nullcontext():
            self._save_checkpoint()  # a background save has copied the state before this returns
        self._shards.wait()  # a background sharded save published (its failure raised) on every rank
        self._shards.release()
        if self.is_main:
            self._files.wait()
        self._close_sinks()
        return dict(self._results) or None

    def _restore_lost_best_file(self) -> None:
        """Say so at the end when ``best.pt`` went missing from disk during the run, and write it again.

        A sharded ``best.ckpt`` is written by every rank, so rank 0's finding is broadcast: all ranks save it, or
        none does.
        """
        every_rank = self.cfg.ckpt.format == "sharded"
        tracked = self._best.state is not None and self._best_state is not None
        # the sharded case decides on every rank alike (a rank without a best still joins the broadcast)
        if not self.cfg.ckpt.enable or (not every_rank and not (self.is_main and tracked)):
            return
        lost = False
        if self.is_main and tracked:
            self._files.wait()  # a background write may be about to put it there
            lost = not self._best_dirty and not self.best_ckpt_path.exists()
            if lost:
                warnings.warn(
                    f"{self.best_ckpt_path} was removed during the run; the best weights (epoch "
                    f"{self._best_state.epoch}) were still in memory and are written to it again",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if every_rank:
            lost = dist_utils.broadcast_object(lost)
        if lost:
            self._best_dirty = True

    def test(self) -> dict[str, float]:
        """Perform a test epoch.

        Called at the end of training if ``test.enable`` is True. Loads :attr:`best_model` into
        ``self.model`` (the best weights, not the last), calls :meth:`test_epoch` and pushes the ``test/*``
        metrics. The best weights stay loaded afterwards, so the model in memory is the one that was tested
        (to export it or keep evaluating it, as Keras' ``restore_best_weights`` and HF's
        ``load_best_model_at_end`` leave it); its train/eval modes are put back. The final ``last.pt`` that
        ``train()`` writes after this still holds the last epoch's weights, so a resume that extends the run
        continues from them.

        :returns: The ``test/*`` metrics.
        :raises HookNotImplementedError: When the subclass has no :meth:`test_epoch`.
        """
        self._files.wait()
        model = dist_utils.unwrap(self.model)
        if not self._load_best_into_model() and model is not None:
            warnings.warn(
                "test(): no best model was recorded (save_if_best never improved); testing the current weights",
                RuntimeWarning,
                stacklevel=2,
            )
        with modes_kept(model):
            result = self.test_epoch()
        if result is not None:
            if not isinstance(result, Mapping):
                raise UsageError(f"test_epoch() must return a dict of metrics or None, got {type(result).__name__}")
            self.log({key if key.startswith("test/") else f"test/{key}": value for key, value in result.items()})
        pushed = self.push_logs()
        return {key: value for key, value in pushed.items() if key.startswith("test/")}

    def _load_best_into_model(self) -> bool:
        """Load the best weights into ``self.model``; False (nothing loaded) when either is missing."""
        model, best = dist_utils.unwrap(self.model), self._best.state
        if model is None or best is None:
            return False
        load_module_state(model, best)  # a copy into the model's own tensors: the snapshot stays apart
        return True

    def log_training_results(self) -> None:
        """Log the training results, at the end of training.

        Puts the best validation metrics, the best epoch, the test metrics, the epochs run and why
        training stopped into the W&B run summary, and prints a short summary on rank 0.
        """
        summary: dict[str, Any] = {
            "epochs_run": self._loop.epoch,
            "stop_reason": self._loop.stop_reason,
            **self.best_metrics,
            **{k: v for k, v in self._latest_metrics.items() if k.startswith("test/")},
        }
        best = self._best_state
        if best is not None and best.score is not None:
            summary["best/epoch"] = best.epoch
            summary["best/score"] = best.score
        self._run_log.summary(summary)
        if self.is_main:
            parts = [
                f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in summary.items()
            ]
            say(", ".join(parts), stream=sys.stdout)

    # ------------------------------------------------------------------ checkpoint registry

    def add_checkpoint_items(self, **kwargs: Any) -> None:
        """Add items to the checkpoint dictionary, saved and restored by state_dict.

        Registering is what makes an object survive a resume, so every rank does it; writing the file
        stays rank zero's job. Objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers,
        schedulers, GradScalers) are restored in place, and so is a ``torch.Generator`` (a DataLoader's or
        sampler's own: register it, or a resume shuffles differently); plain values are saved as registered
        and read back from :attr:`checkpoint_items`. The first optimizer registered drives :attr:`step`.

        :param kwargs: The items to add to the checkpoint dictionary.
        :raises RegistryError: When a name is reserved or already registered.
        """
        # a generator has no state_dict(): registered as its state, restored into it in place
        items = {name: GeneratorItem(obj) if isinstance(obj, torch.Generator) else obj for name, obj in kwargs.items()}
        self._registry, _ = core.register_items(self._registry, items)
        for obj in kwargs.values():
            if isinstance(obj, torch.optim.Optimizer) and self._step_hook is None:
                self._step_hook = obj.register_step_post_hook(_step_counter(self))

    @property
    def checkpoint_items(self) -> Mapping[str, Any]:
        """The registered checkpoint items (after a resume, plain values hold the restored ones)."""
        items = self._registry.items
        if not any(isinstance(obj, GeneratorItem) for obj in items.values()):
            return items
        return {name: obj.generator if isinstance(obj, GeneratorItem) else obj for name, obj in items.items()}

    def add_samplers(self, *samplers: Any) -> None:
        """Hand samplers to the trainer, which calls ``set_epoch(epoch)`` on each before every epoch.

        Use it for a ``DistributedSampler`` (or anything with ``set_epoch``), so shuffling differs per
        epoch and a resumed run shuffles exactly as the uninterrupted one.

        :param samplers: Objects with a ``set_epoch(int)`` method.
        :raises UsageError: When one has no ``set_epoch``.
        """
        for sampler in samplers:
            if not callable(getattr(sampler, "set_epoch", None)):
                raise UsageError(f"add_samplers() needs objects with set_epoch(epoch), got {type(sampler).__name__}")
            self._samplers.append(sampler)

    # ------------------------------------------------------------------ checkpoint files

    @property
    def last_ckpt_path(self) -> Path:
        """``out_dir/last.pt``; with ``ckpt.format="sharded"``, the directory ``out_dir/last.ckpt``."""
        if self.cfg.ckpt.format == "sharded":
            return self._shards.last_path
        return self._files.last_path

    @property
    def best_ckpt_path(self) -> Path:
        """``out_dir/best.pt``; with ``ckpt.format="sharded"``, the directory ``out_dir/best.ckpt``."""
        if self.cfg.ckpt.format == "sharded":
            return self._shards.best_path
        return self._files.best_path

    def _claim_out_dir(self) -> None:
        """Lock ``out_dir`` for this run (rank 0, when it writes checkpoints) and check it can be written.

        Done before anything is read, so a second run launched on the same folder is refused at once,
        and a folder that cannot take a checkpoint is found before the first epoch, not after it. Every
        rank learns whether it worked.
        """
        error: BaseException | None = None
        try:
            self._files.claim()
        except OutDirError as exc:
            error = exc
        dist_utils.raise_if_any_rank_failed(
            error,
            lambda: OutDirError(f"rank 0 could not use out_dir {self.out_dir}; see rank 0's error"),
            world_size=self.world_size,
        )

    def _load_resume_checkpoint(self) -> tuple[dict[str, Any] | None, Path | None]:
        """Load the checkpoint ``ckpt.resume`` names; return it and the path it came from (or None, None)."""
        self._refuse_other_format()
        resume = self.cfg.ckpt.resume
        named = resume not in ("auto", "never")
        # a named checkpoint is read in its own format, whatever this run writes: that is how a DDP run's
        # last.pt continues as an FSDP2 run with sharded checkpoints, and the other way round
        if (named and Path(resume).is_dir()) or (not named and self.cfg.ckpt.format == "sharded"):
            ckpt, path = self._shards.load_resume(resume)
        else:
            ckpt, path = self._files.load_resume(self.cfg.ckpt.resume, world_size=self.world_size)
        if ckpt is not None and path is not None:
            self._warn_changed_config(ckpt, path)
        return ckpt, path

    def _refuse_other_format(self) -> None:
        """Refuse to start fresh over a run folder whose checkpoints are in the other ``ckpt.format``."""
        if self.cfg.ckpt.resume != "auto" or not self.cfg.ckpt.enable:
            return
        directories = self._shards.published(self._shards.last_path)
        file = self._files.last_path
        files = [path for path in (file, ckpt_io.previous_path(file)) if path.exists()]
        mine, other = (directories, files) if self.cfg.ckpt.format == "sharded" else (files, directories)
        if other and not mine:
            written = "file" if self.cfg.ckpt.format == "sharded" else "sharded"
            raise CheckpointMismatchError(
                f"{other[0]} was written with ckpt.format={written!r}, and this run has "
                f"ckpt.format={self.cfg.ckpt.format!r}, which would start over beside it; resume it with "
                f"ckpt.format={written!r}, convert it by naming it in another out_dir (ckpt.resume={other[0]}), "
                "or start fresh (ckpt.resume=never)"
            )

    def _check_format(self) -> None:
        """Refuse what ``ckpt.format`` cannot save: a model sharded by :meth:`make_fsdp` in a single file."""
        if not self.cfg.ckpt.enable or self.cfg.ckpt.format != "file":
            return
        for name, obj in self._registry.items.items():
            if isinstance(obj, nn.Module) and sharding.is_sharded(obj):
                raise UsageError(
                    f"checkpoint item {name!r} is sharded by make_fsdp(), and ckpt.format='file' would write only "
                    "rank 0's shards; set ckpt.format='sharded' (or ckpt.enable=false)"
                )

    def _warn_changed_config(self, ckpt: Mapping[str, Any], path: Path) -> None:
        changes = changed_on_resume(strip_secrets(ckpt.get("config") or {}, self.cfg), self._cfg_dict)
        for key, old, new in changes:
            if key == "val.minimize" and ckpt.get("best") is not None:
                raise CheckpointMismatchError(
                    f"{path} tracked its best with val.minimize={old}, this config says {new}; the best score "
                    "cannot be compared across directions"
                )
        if changes:
            details = ", ".join(
                f"{key}: {render_value(key, old, self.cfg)} -> {render_value(key, new, self.cfg)}"
                for key, old, new in changes
            )
            warnings.warn(
                f"resuming {path} with a changed config ({details}); the result may differ from an uninterrupted run",
                RuntimeWarning,
                stacklevel=4,
            )

    def _reconcile(self, ckpt: Mapping[str, Any], path: Path) -> _Resume:
        """Read the engine's records from ``ckpt`` and apply the current config to them (see ``core.reconcile``)."""
        val = self.cfg.val
        resumed = core.reconcile(
            core.LoopState.from_dict(ckpt["loop"]),
            core.BestState.from_dict(ckpt["best"]) if ckpt.get("best") is not None else None,
            core.PatienceState.from_dict(ckpt["patience"]) if ckpt.get("patience") is not None else None,
            epochs=self.cfg.epochs,
            val_patience=val.patience,
            start_patience=val.start_patience,
            min_delta=val.min_delta,
        )
        if resumed.notes:
            warnings.warn(f"resuming {path}: " + "; ".join(resumed.notes), RuntimeWarning, stacklevel=3)
        line = resumed.line
        mid_epoch = ckpt.get("trainkit")
        if resumed.more and mid_epoch is not None:
            position = mid_epoch["position"]
            line += f", inside it: {position['batches']} of {position['batches_per_epoch']} batches done"
        if self.is_main:
            say(f"resuming {path}: {line}")
        results = ckpt.get("results")
        if resumed.more:
            results = None  # a finished run that continues has no final results yet
        return _Resume(path=path, records=resumed, results=dict(results) if results is not None else None)

    def _restore(self, ckpt: dict[str, Any], resume: _Resume) -> None:
        items = self._registry.items
        if resume.path.is_dir():  # a sharded checkpoint: read resharded to this run, into any wrap
            in_dcp = [name for name in items if isinstance(ckpt.get(name), str) and ckpt[name] == sharded.SHARDED]
            sharded.apply_items(items, sharded.load_items(items, resume.path, in_dcp))
        elif any(sharding.is_sharded(obj) for obj in items.values() if isinstance(obj, nn.Module)):
            # a file checkpoint (a DDP or one-process run) into FSDP2 modules: whole states, sharded on load
            converted = sharded.apply_whole_items(items, ckpt)
            ckpt = {**ckpt, **dict.fromkeys(converted, sharded.SHARDED)}
        self._registry, _ = core.apply_payload(self._registry, ckpt, load_into=_load_item)
        modes = ckpt.get("training_modes") or {}
        for name, obj in self._registry.items.items():
            if isinstance(obj, nn.Module) and isinstance(modes.get(name), Mapping):
                restore_training_modes(obj, modes[name])
        records = resume.records
        self._loop = records.loop
        # inside the loop self.epoch is the epoch being run; after it, the last one that ran
        self.epoch = self._loop.epoch - 1 if self._loop.finished else self._loop.epoch
        self.step = self._loop.step
        if records.best is not None:
            self._best_state = records.best
            self.best_metrics = dict(records.best.metrics)
            self._load_best_model(resume.path.parent)
        if records.patience is not None:
            self._patience_state = records.patience
        self._latest_metrics = dict(ckpt.get("latest_metrics") or {})
        self._results = resume.results
        rng = ckpt.get("rng")
        if rng is not None and self.rank < len(rng):  # a rank added by resharding keeps its fresh seed
            restore_rng(rng[self.rank])
        mid_epoch = ckpt.get("trainkit")
        if mid_epoch is not None and rng is not None:
            self._restore_position(mid_epoch, rng[self.rank], resume)

    def _restore_position(self, mid_epoch: Mapping[str, Any], rng_at_save: dict[str, Any], resume: _Resume) -> None:
        """Keep a step checkpoint's position for the resumed epoch's progress(), and put back its unpushed logs."""
        position = core.EpochPosition.from_dict(mid_epoch["position"])
        if self._loop.finished or self._loop.epoch != position.epoch:
            warnings.warn(
                f"{resume.path} was written inside epoch {position.epoch} (after {position.batches} of "
                f"{position.batches_per_epoch} batches), but epochs={self.cfg.epochs} ends the run before it: "
                "the rest of that epoch is not trained",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        mismatch = core.position_mismatch(position, world_size=self.world_size)
        if mismatch is not None:  # load_resume refuses another world size already; kept for a direct caller
            raise CheckpointMismatchError(f"{resume.path} was written inside an epoch: {mismatch}")
        state = mid_epoch["ranks"][self.rank]
        self.first_batch = position.batches
        self._pending_position = (
            position,
            RankPosition(
                rng_at_iter=state["rng_at_iter"],
                generators_at_iter=state["generators_at_iter"],
                rng_at_save=rng_at_save,
            ),
        )
        self._logs.load_state_dict(state["logs"])
        self._grad_norm_mean.load_state_dict(state["grad_norm"])

    def _load_best_model(self, directory: Path) -> None:
        """Reload the best weights from ``best.pt`` beside the resumed checkpoint, so test() uses them.

        When the run resumed from another folder (``ckpt.resume=<path>``), ``best.pt`` is read there
        and written into ``out_dir`` at the next save, so that this run's folder is complete on its own.
        """
        best = self._best_state
        if best is None or best.score is None:
            return
        if self._shards.published(directory / sharded.BEST_DIR):
            model = dist_utils.unwrap(self.model)
            loaded = self._shards.read_best(directory, best, None if model is None else module_state(model))
            if loaded is not None:
                self._best.replace(loaded, private=True)
                if not same_directory(directory, self.out_dir):
                    self._best_dirty = True
            return
        saved = self._files.read_best(directory, best)
        if saved is None:
            return
        model = dist_utils.unwrap(self.model)
        if sharding.is_sharded(model):  # best.pt holds whole weights: each rank keeps its own shards of them
            own = module_state(model)
            self._best.replace(sharding.shard_like(saved["model"], own), private=True)
            self._best_dirty = True  # this run's folder gets a best.ckpt of them at the next save
            return
        # loaded tensors may share memory (tied weights): not private, so the next improvement allocates anew
        self._best.replace(
            {
                key: value.to(self.device) if isinstance(value, torch.Tensor) else value
                for key, value in saved["model"].items()
            }
        )
        if not same_directory(directory, self.out_dir):
            self._best_dirty = True

    def _save_checkpoint(self, batches: TrackedBatches | None = None) -> float | None:
        """Write best.pt (when the best changed) then last.pt on rank 0; every rank learns whether it worked.

        With ``batches`` (a step checkpoint inside an epoch), ``last.pt`` also records where the epoch stands
        and what each rank must put back to continue from there.

        With ``ckpt.async_save`` rank 0 only copies the state into reused host buffers here and a
        background thread writes it (as atomically and durably); a failed write raises at the next save.

        :returns: The seconds the save (best.pt and last.pt) took on rank 0 (None elsewhere, with ckpt disabled,
            or async).
        """
        seconds = None
        if not self.cfg.ckpt.enable:
            self._best_dirty = False
            return seconds
        mine: dict[str, Any] = {"rng": capture_rng()}
        if batches is not None:
            mine["mid_epoch"] = {
                "rng_at_iter": batches.rng_at_iter,
                "generators_at_iter": batches.generators_at_iter,
                "logs": self._logs.state_dict(),
                "grad_norm": self._grad_norm_mean.state_dict(),
            }
        gathered = dist_utils.all_gather_objects(mine)
        rng = [state["rng"] for state in gathered]
        loop, mid_epoch = self._loop, None
        if batches is not None:
            loop = attrs.evolve(loop, step=self.step)
            mid_epoch = mid_epoch_state(
                core.EpochPosition(
                    epoch=self._loop.epoch,
                    batches=batches.consumed,
                    batches_per_epoch=len(batches),
                    batch_size=batches.loader.batch_size,
                    dataset_length=len(batches.loader.dataset),
                    world_size=self.world_size,
                ),
                [state["mid_epoch"] for state in gathered],
            )
        if self.cfg.ckpt.format == "sharded":
            return self._save_sharded(rng, loop, mid_epoch)
        error: BaseException | None = None
        if self.is_main:
            try:
                self._files.wait()  # a failed background write surfaces here, and every rank hears of it
                best = None
                if self._best_dirty:  # best.pt before last.pt: a crash between them is repaired on resume
                    best = best_payload(model=self._best.state, best=self._best_state, config=self._cfg_dict)
                last = self._engine_payload(
                    core.collect_payload(self._registry, state_of=_item_state), rng, loop, mid_epoch
                )
                # the rows on disk before a checkpoint records the offset
                seconds = self._files.save(last, best, before=self._run_log.sync)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                error = exc
        self._best_dirty = False
        dist_utils.raise_if_any_rank_failed(
            error,
            lambda: CheckpointError(f"rank 0 failed to write {self.last_ckpt_path}; see rank 0's traceback"),
            world_size=self.world_size,
        )
        return seconds

    def _engine_payload(
        self, items: dict[str, Any], rng: list[dict[str, Any]], loop: core.LoopState, mid_epoch: dict[str, Any] | None
    ) -> dict[str, Any]:
        return last_payload(
            items=items,
            epoch=self._loop.epoch,
            step=self.step,
            world_size=self.world_size,
            config=self._cfg_dict,
            loop=loop,
            best=self._best_state,
            patience=self._patience_state,
            rng=rng,
            wandb_run_id=self._run_id,
            latest_metrics=self._latest_metrics,
            results=self._results,
            metrics_offset=self._run_log.offset(),
            training_modes={
                name: training_modes(obj) for name, obj in self._registry.items.items() if isinstance(obj, nn.Module)
            },
            mid_epoch=mid_epoch,
        )

    def _save_sharded(
        self, rng: list[dict[str, Any]], loop: core.LoopState, mid_epoch: dict[str, Any] | None
    ) -> float | None:
        """``ckpt.format="sharded"``: every rank writes its shards of ``best.ckpt`` (when the best changed), then of
        ``last.ckpt``; rank 0 adds the engine's payload and publishes each (see :mod:`trainkit.sharded`)."""
        started = time.perf_counter()
        self._shards.wait()  # one save in flight: the previous one is published (or its failure raised) now
        # best.ckpt is written by every rank together: the ranks must agree that it changed
        dirty = self._best_dirty and self._best.state is not None and self._best_state is not None
        if self.world_size > 1:
            votes = dist_utils.all_gather_objects(dirty)
            if any(votes) and not all(votes):
                raise UsageError(
                    f"save_if_best() recorded a new best on ranks {[r for r, v in enumerate(votes) if v]} only; with "
                    "ckpt.format='sharded' every rank writes its shards of best.ckpt, so call save_if_best() on every "
                    "rank with the same score (pool it with reduce_mean() or broadcast())"
                )
        best_engine = last_engine = None
        items = self._registry.items
        if self.is_main:
            if dirty:
                best_engine = best_payload(model={}, best=self._best_state, config=self._cfg_dict)
            in_dcp = {id(obj) for obj in sharded.dcp_items(items).values()}
            states = core.collect_payload(
                self._registry, state_of=lambda obj: sharded.SHARDED if id(obj) in in_dcp else _item_state(obj)
            )
            last_engine = self._engine_payload(states, rng, loop, mid_epoch)
            self._run_log.sync()  # the rows on disk before the checkpoint records the offset
        self._best_dirty = False
        self._shards.save(
            epoch=self._loop.epoch,
            step=self.step,
            last_state=sharded.state_for_save(items),
            last_engine=last_engine,
            best_state={"model": self._best.state} if dirty else None,
            best_engine=best_engine,
        )
        if self.cfg.ckpt.async_save or not self.is_main:
            return None
        return time.perf_counter() - started

    # ------------------------------------------------------------------ best model and early stopping

    def reset_best_tracking(self, minimize: bool | None = None) -> None:
        """Initialize the best-score bookkeeping used by :meth:`save_if_best`.

        :meth:`save_if_best` calls this itself on first use, so a trainer only needs it to pin a direction
        that config does not carry: pass ``minimize`` when the trainer fixes it in code, or call it from
        setup after deciding ``val.minimize`` there. Direction otherwise comes from ``val.minimize``,
        defaulting to maximizing.

        A trainer that never tracks a best never gets these attributes (``best_state``,
        ``patience_state``), so it stays free to use those names itself. Only :attr:`best_model` and
        :attr:`best_metrics` are always defined, since code outside this method reads them.

        :param minimize: The direction; None takes ``val.minimize``.
        """
        direction = self.cfg.val.minimize if minimize is None else bool(minimize)
        self._best_state = core.BestState(minimize=direction, min_delta=self.cfg.val.min_delta)
        self._patience_state = self._fresh_patience()
        self._best.replace(None)
        self.best_metrics = {}

    def _fresh_patience(self) -> core.PatienceState:
        return core.PatienceState(patience=self.cfg.val.patience, start_patience=self.cfg.val.start_patience)

    def save_if_best(self, score: Any, metrics: Mapping[str, Any] | None = None) -> bool:
        """Keep this epoch's weights if its score is the best seen so far.

        On an improvement: records the score and epoch, snapshots the weights of ``self.model``
        (unwrapped from DDP and ``torch.compile``) into :attr:`best_model` (a copy that shares no tensor
        with the model; it never writes into a tensor handed out before), and writes ``best.pt`` at the
        end of the epoch, before ``last.pt``. The two have different readers: :attr:`best_model` is what
        :meth:`test` reloads in this same process, and it survives ``ckpt.enable=false``; ``best.pt`` is
        what a later run loads. Pass ``metrics`` to also record the ``best/val/*`` dict for logging. Feed
        the result to :meth:`step_patience` to early-stop as well; a trainer that only wants best-model
        selection can call this alone.

        Call it on every rank, since every rank's test reloads its own :attr:`best_model`; the ``best.pt``
        write self-gates to rank 0 on its own. A trainer whose score only exists on rank 0 may call it
        under a rank guard, but then owes :meth:`step_patience` a verdict broadcast to the other ranks
        (:meth:`broadcast`).

        :param score: The scalar being tracked, in ``val.minimize`` direction. A non-finite score never
            counts as an improvement.
        :param metrics: The epoch's val metrics, if they should be recorded too.
        :returns: True if the score improved, i.e. the weights were kept.
        :raises UsageError: When ``self.model`` is not set.
        """
        if self._best_state is None:
            self.reset_best_tracking()
        state, improved = core.save_if_best(self._best_state, score, epoch=self.epoch, metrics=metrics)
        if improved:
            model = dist_utils.unwrap(self.model)
            if model is None:
                raise UsageError("save_if_best() snapshots self.model, which is not set; assign it in setup()")
            self._best.take(module_state(model))
            self.best_metrics = dict(state.metrics)
            self._best_dirty = True
        self._best_state = state  # after the snapshot: a failed one leaves the record as it was
        return improved

    def step_patience(self, improved: bool) -> bool:
        """Advance the early-stopping counter with this epoch's outcome.

        An improvement refills the counter; otherwise it ticks down, but only once the epoch reaches
        ``val.start_patience``. Call it at most once per validation, inside :meth:`val_epoch`.

        Every rank has to reach the same verdict, or one leaves the epoch loop while the others block in
        the next collective. That holds on its own when the score is rank-invariant, i.e. a torchmetrics
        ``compute()`` or a :meth:`reduce_mean` result; a rank-0-only score has to be broadcast by the
        caller instead. The loop checks the verdicts agree and raises on every rank if they do not.

        :param improved: What :meth:`save_if_best` returned for this epoch.
        :returns: True once patience is exhausted, i.e. training should stop.
        :raises UsageError: When called outside :meth:`val_epoch`, or twice in one validation.
        """
        if not self._in_validation:
            raise UsageError("step_patience() counts validation outcomes; call it inside val_epoch()")
        if self._patience_stepped:
            raise UsageError(f"step_patience() was already called in epoch {self.epoch}'s validation; call it once")
        if self._patience_state is None:
            self._patience_state = self._fresh_patience()
        self._patience_state, stop = core.step_patience(self._patience_state, improved, epoch=self.epoch)
        self._patience_stepped = True
        return stop

    def get_best_pbar_metrics(self) -> dict[str, float]:
        """Return the best validation metrics formatted for the epoch progress bar.

        :returns: Best validation metrics with the ``best/val/`` prefix stripped, or an empty dict if no
            validation has been run yet.
        """
        prefix = "best/val/"
        return {
            key[len(prefix) :] if key.startswith(prefix) else key: value for key, value in self.best_metrics.items()
        }

    # ------------------------------------------------------------------ distributed helpers

    def make_ddp(self, module: nn.Module, find_unused_parameters: bool = False) -> nn.Module:
        """Wrap a module in DistributedDataParallel if running in distributed mode.

        :param module: The module to wrap (moved to :attr:`device` first).
        :param find_unused_parameters: Passed to DDP. Set to True if some parameters are not used in the
            forward pass. Defaults to False.
        :returns: The DDP-wrapped module, or the original module if not distributed.
        """
        module = module.to(self.device)
        if self.world_size == 1:
            return module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, find_unused_parameters=find_unused_parameters
        )

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

        The sibling of :meth:`make_ddp` for models whose weights and optimizer state should not be copied to
        every rank: ``torch.distributed.fsdp.fully_shard`` on a 1-D device mesh over all ranks (CPU with gloo,
        CUDA with nccl). Build the optimizer after this call, from the returned module's parameters (they
        are DTensors now). The module keeps its class and its parameter names; :meth:`get_param_groups`,
        :meth:`clip_and_log_grad_norm` (the norm over every shard), :meth:`log_param_grad_stats` and
        :meth:`reduce_mean` work as with DDP. On one process it returns the module on :attr:`device`, as
        :meth:`make_ddp` does.

        :param module: The module to shard (moved to :attr:`device` first).
        :param shard: Units sharded on their own before the root, so only one unit's parameters are
            gathered at a time: submodules of ``module``, or a module class (or tuple of classes) whose
            instances are the units (a transformer block, say). None shards the root alone: each forward
            gathers every parameter, while gradients and optimizer state stay sharded.
        :param mp_policy: A ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16 parameters with fp32
            gradient reduction), passed to every ``fully_shard`` call; None trains in full precision.
        :param reshard_after_forward: Free gathered parameters after each unit's forward (less memory, one
            more all-gather in backward), FSDP2's default.
        :param mesh: The ``DeviceMesh`` to shard over; None builds one over every rank on this device type.
        :returns: The sharded module (the same object), or the module itself on one process.
        :raises UsageError: When a ``shard`` unit is not a submodule of ``module``, ``mp_policy`` is not a
            ``MixedPrecisionPolicy``, or this torch has no FSDP2 (before 2.6).
        """
        module = module.to(self.device)
        if self.world_size == 1:
            sharding.units_to_shard(module, shard)  # the same argument checks as on many ranks
            return module
        if mesh is None:
            mesh = sharding.device_mesh(self.device, self.world_size)
        return sharding.shard_module(
            module, mesh=mesh, shard=shard, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )

    def barrier(self) -> None:
        """Synchronize all processes in the distributed group (bounded by ``dist.timeout_s``).

        On gloo this is ``monitored_barrier``, so a rank that does not arrive in time is named in the error.

        :raises RuntimeError: From torch.distributed, when a rank does not arrive within ``dist.timeout_s``.
        """
        if self.world_size > 1:
            dist_utils.barrier(self.cfg.dist.timeout_s)

    def reduce_mean(self, total: Any, count: Any) -> float:
        """Mean over the whole split rather than over this rank's shard of it.

        A distributed sampler hands every rank a different slice, so a locally divided sum leaves the
        ranks disagreeing on the score they select on. Every rank must call this the same number of
        times, in the same order. Sums are taken in float64.

        :param total: This rank's summed quantity.
        :param count: This rank's number of terms in that sum.
        :returns: The pooled mean, NaN if no rank contributed a term.
        :raises UsageError: When ``total`` or ``count`` is a DTensor that already holds the whole value on every
            rank (a partial sum over FSDP2 shards, as a norm's square over sharded parameters, is this rank's
            share and is accepted).
        """
        return dist_utils.reduce_mean(total, count)

    def broadcast(self, value: T, src: int = 0) -> T:
        """Give every rank ``src``'s value, e.g. a verdict computed from a rank-0-only score.

        :param value: The value on ``src`` (ignored on the other ranks).
        :param src: The rank whose value wins.
        :returns: ``src``'s value, on every rank.
        """
        return dist_utils.broadcast_object(value, src=src)

    # ------------------------------------------------------------------ optimizer helpers

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
        contains one of ``cfg.no_weight_decay``. The default list covers biases, norms and every ``*_emb``
        lookup table; a model overrides it only when a name lies about what it is. Every trainable
        parameter lands in exactly one group, once, even when tied or shared; frozen parameters are left
        out. Each group dict carries ``name`` (``"decay"``/``"no_decay"``), ``params`` and ``weight_decay``, and
        nothing else, so ``optimizer.add_param_group()`` accepts any later group.

        :param modules: Modules to take parameters from, ``self.model`` when none are given. Pass more
            when parameters outside the model are trained by the same optimizer, such as an objective with
            its own projection head.
        :returns: The groups, ready for any torch optimizer.
        """
        return optim_utils.make_param_groups(
            self._modules(modules, "get_param_groups"),
            weight_decay=self.cfg.weight_decay,
            no_weight_decay=self.cfg.no_weight_decay,
        )

    def _params(self, modules: tuple[nn.Module, ...], caller: str) -> list[nn.Parameter]:
        return optim_utils.trainable_parameters(self._modules(modules, caller))

    def clip_and_log_grad_norm(self, *modules: nn.Module) -> torch.Tensor:
        """Clip gradients in place and log the pre-clip norm as ``train/grad_norm``.

        The norm is measured even when ``grad_clip`` is unset so the metric does not vanish on unclipped
        runs. Call once per optimizer step, after ``backward()`` (under AMP, after
        ``scaler.unscale_(optimizer)``). Fused foreach kernels, no host sync: the value reaches the host
        when logs are pushed. Under DDP the gradients are already averaged, so every rank sees the same
        norm.

        :param modules: Modules to clip over, ``self.model`` by default. Pass the same ones as
            :meth:`get_param_groups`, so the norm spans every parameter stepped.
        :returns: The pre-clip total L2 norm, a 0-d tensor on the gradients' device.
        """
        params = self._params(modules, "clip_and_log_grad_norm")
        norm = optim_utils.total_grad_norm(params)
        if self.cfg.grad_clip is not None:
            optim_utils.clip_grads_(params, self.cfg.grad_clip, norm)
        norm = sharding.plain(norm.detach())  # over FSDP2 shards a replicated DTensor: its local value is the norm
        self._grad_norm_mean.add(norm)
        self._logs.add({"train/grad_norm": norm})
        return norm

    def log_epoch_grad_norm(self) -> None:
        """Log the epoch-mean grad norm, the counterpart to the epoch-mean train loss.

        Logs ``train/grad_norm_epoch``, the mean of the norms :meth:`clip_and_log_grad_norm` measured
        since the last call, and starts a new epoch's mean. Logs nothing when no norm was measured.
        """
        mean = self._grad_norm_mean.take()
        if mean is not None:
            self._logs.add({"train/grad_norm_epoch": mean})

    def log_param_grad_stats(self, *modules: nn.Module) -> None:
        """Log per-parameter weight norm, grad norm, and grad-to-weight ratio.

        Each gate costs one W&B key per parameter, so both are throttled to every
        ``log_stats_every_n_steps`` steps. Call after ``backward()``, before any clip. ``log_weight_stats``
        gates ``params/<name>/weight_norm``; ``log_grad_stats`` gates ``params/<name>/grad_norm`` and
        ``params/<name>/grad_to_weight``. A few fused ops per call; the values stay on the device until
        the next push.

        :param modules: Modules to measure, ``self.model`` by default.
        """
        cfg = self.cfg
        if not (cfg.log_weight_stats or cfg.log_grad_stats) or self.step % cfg.log_stats_every_n_steps != 0:
            return
        named = optim_utils.named_trainable_parameters(self._modules(modules, "log_param_grad_stats"))
        keys, values = optim_utils.param_stats(named, weights=cfg.log_weight_stats, grads=cfg.log_grad_stats)
        self._logs.add_vector(keys, sharding.plain(values))  # norms over FSDP2 shards: one all-reduce, on the device

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        registered = {name: obj for name, obj in self._registry.items.items() if isinstance(obj, torch.optim.Optimizer)}
        if registered:
            return registered
        return {name: obj for name, obj in vars(self).items() if isinstance(obj, torch.optim.Optimizer)}

    def log_lr(self) -> None:
        """Log the current learning rate for each optimizer parameter group.

        Keys are ``lr/<optimizer>/<group>``: the optimizer's name is the one it was registered under with
        :meth:`add_checkpoint_items` (or, when none is registered, the attribute holding it), and the
        group's is its ``name`` entry (as :meth:`get_param_groups` sets) or its index.
        """
        lrs: dict[str, Any] = {}
        for opt_name, optimizer in self._optimizers().items():
            for index, group in enumerate(optimizer.param_groups):
                lrs[f"lr/{opt_name}/{group.get('name', index)}"] = group["lr"]
        self._logs.add(lrs)

    # ------------------------------------------------------------------ logging

    @property
    def _bars_enabled(self) -> bool:
        return self.cfg.progress.enable and self.is_main

    def _setup_logging(self, ckpt: Mapping[str, Any] | None, resume: _Resume | None) -> None:
        self._run_id = (ckpt or {}).get("wandb_run_id") or new_run_id()
        if not self.is_main:
            return
        journal = None
        elsewhere = resume is not None and not same_directory(resume.path.parent, self.out_dir)
        if self.cfg.ckpt.enable:
            self._files.remove_stale_temp_files()
            offset = (ckpt or {}).get("metrics_offset")
            history = None
            if resume is not None and isinstance(offset, int) and elsewhere:
                history = self._files.read_metrics_prefix(resume.path.parent, offset)
            # a fresh run starts a fresh file; a resumed one drops the rows of the epoch it lost
            journal = JsonlSink(
                self._files.metrics_path, truncate_to=offset if ckpt is not None else 0, history=history
            )
        finished = resume is not None and resume.results is not None
        self._run_log = open_run_log(
            journal,
            # a finished run only returns its results: no new W&B run
            wandb=None if self.cfg.wandb.mode == "disabled" or finished else self.cfg.wandb,
            run_id=self._run_id,
            out_dir=self.out_dir,
            resumed_from=resume.path.parent if resume is not None else None,
            config=self._cfg_dict,
            config_class=self.cfg,
        )

    def log(self, metrics: Mapping[str, Any] | None = None, **named: Any) -> None:
        """Buffer metrics for the next :meth:`push_logs`; nothing leaves the device here.

        Values are floats, ints or 1-element tensors; a key logged twice before a push keeps its last
        value. Use ``train/``, ``val/`` and ``test/`` prefixes.

        :param metrics: Name to value.
        :param named: More metrics as keyword arguments (for names that are identifiers).
        :raises TypeError: When a value is not a number or a 1-element tensor.
        """
        if metrics:
            self._logs.add(metrics)
        if named:
            self._logs.add(named)

    def push_logs(self) -> dict[str, float]:
        """Flush accumulated logs to W&B, including current epoch and step.

        Moves the whole buffer to the host in one transfer, appends it to ``metrics.jsonl`` and logs it
        as one W&B row with ``trainer/epoch`` and ``trainer/step``, then clears the buffer. Runs on every
        rank (so every rank drains its buffer); only rank 0 writes.

        :returns: The pushed metrics, without the epoch and step entries.
        """
        metrics = self._logs.drain()
        if not metrics:
            return metrics
        self._latest_metrics.update(metrics)
        row = {"trainer/step": self.step, "trainer/epoch": self.epoch, **metrics}
        if self.is_main:
            self._run_log.log(row)
        return metrics

    def progress(self, iterable: Iterable[T], desc: str | None = None, total: int | None = None) -> Iterable[T]:
        """Iterate with a per-step progress bar: ``for x, y in self.progress(loader)``.

        The bar shows on rank 0 when ``progress.enable`` is set and stderr is a terminal; otherwise this
        returns ``iterable`` itself, at no cost per step, unless step checkpoints are on. With
        ``ckpt.every_n_steps``, the ``DataLoader`` that :meth:`train_epoch` iterates through here is counted:
        at each step boundary (the first batch fetched after an optimizer step) a due step checkpoint is
        written and a stop signal acted on, and an epoch resumed from a step checkpoint skips the batches
        trained before it at the index level (see :attr:`first_batch`). A loader that cannot be skipped into
        (not a ``DataLoader``, no length, or one that makes its iterator lazily in a generator ``__iter__``) is
        not counted: a ``RuntimeWarning`` says so once, and the run resumes at epoch boundaries. Pass a
        ``DataLoader`` itself: one with
        ``persistent_workers`` has its workers started here in a way that keeps a resumed run's shuffles
        exact (see :func:`~trainkit.rng.start_persistent_workers`), and the first time a loader comes by,
        a ``RuntimeWarning`` says when its shuffle would not survive a resume (its own generator is not
        registered) or would repeat every epoch (a ``DistributedSampler`` not given to :meth:`add_samplers`).

        :param iterable: The batches.
        :param desc: The bar's label; defaults to the current epoch.
        :param total: The number of batches when ``len(iterable)`` does not give it.
        :returns: An iterable over the same batches; the iterable itself when bars and step checkpoints are
            off.
        :raises CheckpointMismatchError: In an epoch resumed from a step checkpoint, when the loader's batch
            size, dataset length or length differ from the checkpoint's, or it cannot be skipped into (for a
            loader that makes its iterator lazily, when the returned batches are first iterated).
        """
        start_persistent_workers(iterable)
        self._check_loader(iterable)
        tracked = self._track(iterable)
        return step_bar(
            iterable if tracked is None else tracked,
            desc=desc or f"epoch {self.epoch}",
            total=total,
            enabled=self._bars_enabled,
            initial=0 if tracked is None else tracked.skip,
        )

    def _track(self, loader: Any) -> TrackedBatches | None:
        """The epoch's batches counted (for step checkpoints) and skipped into (for a mid-epoch resume), or None."""
        stepping = self.cfg.ckpt.enable and self.cfg.ckpt.every_n_steps is not None
        pending = self._pending_position
        if not self._in_train_epoch or not (stepping or pending is not None):
            return None
        if self._epoch_tracked:
            self._warn_untracked(
                "progress() was called a second time in one train_epoch(): only the first loop is counted, so "
                "no step checkpoint is written while this one runs",
                stacklevel=3,  # the line that called progress()
            )
            return None
        reason = unskippable_reason(loader)
        if reason is not None:
            if pending is not None:
                raise CheckpointMismatchError(
                    f"the checkpoint was written inside epoch {pending[0].epoch}, after {pending[0].batches} batches, "
                    f"but train_epoch() now iterates {reason}, which trainkit cannot skip into; "
                    "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
                )
            self._warn_untracked(
                "ckpt.every_n_steps needs progress() to be given a DataLoader over a map-style dataset, with a "
                f"length, got {reason}: this loop writes no step checkpoints and resumes at epoch boundaries",
                stacklevel=3,
            )
            return None
        position: core.EpochPosition | None = None
        resume: RankPosition | None = None
        if pending is not None:
            position, resume = pending
            mismatch = core.position_mismatch(position, world_size=self.world_size, loader=loader_shape(loader))
            generators = len(loader_generators(loader))
            if mismatch is None and generators != len(resume.generators_at_iter):
                mismatch = f"generators of its own: {len(resume.generators_at_iter)} then, {generators} now"
            if mismatch is not None:
                raise CheckpointMismatchError(
                    f"the checkpoint was written inside epoch {position.epoch}, after {position.batches} of "
                    f"{position.batches_per_epoch} batches, and skipping them needs the same data: {mismatch}; "
                    "resume from an epoch-boundary checkpoint, or start fresh (ckpt.resume=never)"
                )
            self._pending_position = None
        self._epoch_tracked = True
        self._mark_step_saved()
        self._voting = stepping and dist_utils.is_distributed()
        return TrackedBatches(
            loader,
            epoch=self.epoch,
            skip=position.batches if position is not None else 0,
            resume=resume,
            step=functools.partial(getattr, self, "step"),
            at_step_boundary=self._at_step_boundary if stepping else None,
            on_close=self._vote.finish,
            on_untracked=functools.partial(self._warn_untracked, stacklevel=3),  # the loop over progress()
        )

    def _warn_untracked(self, message: str, stacklevel: int) -> None:
        """Say once per trainer that a loop runs without step checkpoints (``stacklevel`` as from the caller)."""
        if not self._untracked_warned:
            self._untracked_warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)

    def _check_loader(self, loader: Any) -> None:
        """Warn once per loader whose shuffle would repeat every epoch, or that a resume would not restore."""
        try:
            weakref.ref(loader)
        except TypeError:  # a list or a tuple of batches: no sampler, no generator to check
            return
        key = loader
        sampler = getattr(loader, "sampler", None)
        if key in self._samplers_unchecked or key not in self._loaders_checked:
            # decided at the first epoch after 0: by then a set_epoch() called by hand shows in sampler.epoch
            if self.epoch == 0 and getattr(sampler, "epoch", None) == 0:
                self._samplers_unchecked.add(key)
            else:
                self._samplers_unchecked.discard(key)
                self._warn_if_epoch_never_set(sampler)
        if key in self._loaders_checked:
            return
        self._loaders_checked.add(key)
        if not self.cfg.ckpt.enable:
            return
        registered = [obj.generator for obj in self._registry.items.values() if isinstance(obj, GeneratorItem)]
        if any(all(g is not r for r in registered) for g in loader_generators(loader)):
            warnings.warn(
                "the DataLoader given to progress() shuffles with a torch.Generator of its own, which is not "
                "registered, so a resumed run would shuffle differently from an uninterrupted one; register it "
                "in setup(): self.add_checkpoint_items(loader_generator=generator)",
                RuntimeWarning,
                stacklevel=3,  # the line that called progress()
            )

    def _warn_if_epoch_never_set(self, sampler: Any) -> None:
        if not (callable(getattr(sampler, "set_epoch", None)) and getattr(sampler, "shuffle", False)):
            return
        if any(sampler is known for known in self._samplers) or getattr(sampler, "epoch", None) == self.epoch:
            return  # handed over, or its set_epoch() is called by hand
        warnings.warn(
            f"the DataLoader given to progress() has a {type(sampler).__name__} that shuffles by epoch, but its "
            f"epoch is {getattr(sampler, 'epoch', None)!r} in epoch {self.epoch}: nothing calls its set_epoch(), so "
            "every epoch shuffles the same way; hand it to the trainer in setup(): self.add_samplers(sampler)",
            RuntimeWarning,
            stacklevel=4,  # the line that called progress()
        )

    def close(self) -> None:
        """Finish the W&B run, close ``metrics.jsonl`` and leave the process group if the trainer made it.

        ``train()`` finishes the W&B run and the metrics file itself; call this when the trainer is done
        (``launch``/``spawn`` do) to also tear down the process group. After a successful ``train()`` the
        ranks meet in a barrier first; after a failed one they do not (the others may be gone).
        """
        if self.is_main and not self._failed:
            self._files.wait()
        self._shards.abandon()  # train() finished or abandoned it; only a trainer never trained has one here
        self._shards.release()
        self._close_sinks()
        self._files.release()
        if self._owns_process_group and dist_utils.is_distributed():
            dist_utils.teardown(self.cfg.dist.timeout_s, meet=not self._failed)
            self._owns_process_group = False

    def _close_sinks(self, failed: bool = False) -> None:
        self._run_log.finish(failed=failed)

    def _validate_config(self, cfg: Config | Mapping[str, Any]) -> Config:
        cls = self.config_class
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, Config):
            return cls.from_mapping(cfg.to_dict())
        if isinstance(cfg, Mapping):
            return cls.from_mapping(cfg)
        raise UsageError(f"cfg must be a {cls.__name__} or a mapping, got {type(cfg).__name__}")
