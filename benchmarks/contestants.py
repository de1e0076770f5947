"""``overhead.py``'s contestants: the hand-written loops, and the same training through trainkit.

Each takes a :class:`~benchmarks.workloads.Workload`, a fresh output folder and a feature (``off``, ``tqdm``,
``wandb``, ``ckpt``, ``steps``, the guard's variants) and returns the trained model with what it computed, for
the harness to check that every contestant of a group did the same work. The raw loops write by hand what
trainkit writes (the same checkpoint content, durably); the trainkit contestants use only trainkit's public API.
"""

from __future__ import annotations

import array
import os
import random
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import keep_weights
from benchmarks.settings import SEED
from benchmarks.workloads import Workload
from trainkit import BaseTrainer


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_save(payload: Any, path: Path, keep_previous: bool = False) -> None:
    """The hand-written durable save: temp file in the same dir, flush, fsync, replace, fsync the dir.

    ``keep_previous`` first hard-links the file being replaced to ``<stem>.prev.pt`` (under a temp name,
    renamed into place), the fallback trainkit keeps for a corrupted newest file.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if keep_previous:
        link = path.with_name(f".{path.stem}.prev.tmp")
        try:
            os.link(path, link)
            os.replace(link, path.with_name(f"{path.stem}.prev{path.suffix}"))
        except FileNotFoundError:
            pass  # the first save: nothing to keep yet
    os.replace(tmp, path)
    fsync_dir(path.parent)


def best_record(score: float, epoch: int | None) -> dict[str, Any]:
    """The best-score record trainkit stores (minimizing, no min_delta), as a hand-written loop keeps it."""
    return {"minimize": True, "min_delta": 0.0, "score": score, "epoch": epoch, "metrics": {}}


def rng_states() -> dict[str, Any]:
    """Every generator a training script may draw from, as plain bytes (what exact resume needs)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, array.array("q", internal).tobytes(), gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": [name, keys.tobytes(), int(pos), int(has_gauss), float(cached)],
    }


def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` of wall time on the CPU (a planted cost: the tests check the engine section finds it).

    :param seconds: How long to spin.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def raw_run(wl: Workload, tmp: Path, feature: str, spin_s: float = 0.0) -> tuple[nn.Module, Any]:
    """The hand-written loop; ``feature`` adds exactly what the matching trainkit variant does per step/epoch.

    ``spin_s`` busy-waits that long after every optimizer step: a known cost planted into a contestant, which
    the tests use to check that the engine section measures a per-step cost it is given (0: nothing planted).

    ``ckpt`` writes the checkpoints trainkit writes, by hand: the same content in ``last.pt`` (weights,
    optimizer, counters, config, loop/best/patience records, every generator's state) and ``best.pt``,
    each with its ``.prev`` fallback link. ``ckpt_min`` writes what a quick script would: weights,
    optimizer, counters and torch's generator state, no fallback; it is information, not a gate. ``ckpt_last``
    writes only ``last.pt`` as ``ckpt.enable`` alone does (no best-model tracking): the baseline of the ``steps``
    gate, whose trainkit contestant writes that file at every epoch end too.
    Every variant ends with the report trainkit gives at the end of training: one printed summary line
    and, with W&B, the same entries in the run summary.
    """
    torch.manual_seed(SEED)
    model = wl.build_model()
    optimizer = wl.make_optimizer(model)
    loader = wl.train_loader()
    run = start_wandb(wl, tmp) if feature == "wandb" else None
    batches = tqdm_batches(loader) if feature == "tqdm" else lambda epoch: loader
    saves = HandCheckpoints(feature, tmp, checkpoint_config(wl) if feature in ("ckpt", "ckpt_last") else None)
    step = rows = 0
    val = float("nan")
    loss = torch.zeros(())
    loss_of, backward = wl.loss_fn, wl.backward
    for epoch in range(wl.epochs):
        model.train()
        for x, y in batches(epoch):
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if backward:
                loss.backward()
            optimizer.step()
            step += 1
            if spin_s:
                spin(spin_s)
            if run is not None:
                # W&B's step given as trainkit gives it (each row's 0-based number, committed at once): W&B's own
                # work per row, timed apart, is then the same call on both sides
                row = {"trainer/step": step, "trainer/epoch": epoch, "train/loss": loss.item()}
                run.log(row, step=rows, commit=True)
                rows += 1
        val = wl.val_loss(model)
        if feature in ("ckpt", "ckpt_min", "ckpt_last"):
            saves.epoch_end(model, optimizer, epoch, step, val)
    end_report(run, wl.epochs, saves.best_epoch, saves.best)
    return model, (loss, val, saves.improvements if feature in ("ckpt", "ckpt_min") else None)


def start_wandb(wl: Workload, tmp: Path) -> Any:
    """An offline W&B run set up as trainkit's WandbSink sets it up (config panel included), so both log the same
    way.

    :param wl: The workload (its config goes to the run).
    :param tmp: The run's folder.
    :returns: The W&B run.
    """
    import wandb

    run = wandb.init(
        mode="offline",
        dir=str(tmp),
        id=uuid.uuid4().hex[:8],
        resume="allow",
        project="trainkit-bench",
        config=wandb_config(wl),
        reinit="create_new",
        settings=wandb.Settings(init_timeout=60, silent=True),
    )
    run.define_metric("trainer/step")
    run.define_metric("*", step_metric="trainer/step")
    return run


def tqdm_batches(loader: Any) -> Any:
    """A function of the epoch that wraps ``loader`` in the step bar with trainkit's settings.

    trainkit.loop.progress redraws at most every 0.5 s on a terminal, every 30 s elsewhere; the training section
    runs into /dev/null, the engine section's tqdm group on a terminal.

    :param loader: The training batches.
    :returns: ``epoch -> iterable of batches``.
    """
    from tqdm.auto import tqdm

    interval = 0.5 if sys.stderr.isatty() else 30.0

    def batches(epoch: int) -> Any:
        return tqdm(loader, desc=f"epoch {epoch}", leave=False, mininterval=interval, dynamic_ncols=True)

    return batches


class HandCheckpoints:
    """The checkpoints a hand-written loop writes at each epoch's end for the ``ckpt`` variants (see
    :func:`raw_run`), and the best score it tracks for them."""

    def __init__(self, feature: str, tmp: Path, config: dict[str, Any] | None) -> None:
        self.feature, self.tmp, self.config = feature, tmp, config
        self.same_as_trainkit = feature != "ckpt_min"
        self.best = float("inf")
        self.best_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.improvements = 0

    def epoch_end(self, model: nn.Module, optimizer: Any, epoch: int, step: int, val: float) -> None:
        """Write ``best.pt`` when ``val`` improved (not for ``ckpt_last``), then ``last.pt``.

        :param model: The model.
        :param optimizer: Its optimizer.
        :param epoch: The epoch that ended (0-based).
        :param step: Optimizer steps so far.
        :param val: The epoch's validation loss.
        """
        if self.feature != "ckpt_last" and val < self.best:
            self.save_best(model, epoch, val)
        last: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch + 1,
            "step": step,
        }
        if self.same_as_trainkit:
            tracks_best = self.feature == "ckpt"
            last.update(
                config=self.config,
                loop={"epoch": epoch + 1, "step": step, "stop_reason": None},
                best=best_record(self.best, self.best_epoch) if tracks_best else None,
                patience={"patience": None, "start_patience": 0, "remaining": None} if tracks_best else None,
                rng=[rng_states()],
            )
        else:
            last.update(best=self.best, rng=torch.get_rng_state())
        durable_save(last, self.tmp / "last.pt", keep_previous=self.same_as_trainkit)

    def save_best(self, model: nn.Module, epoch: int, val: float) -> None:
        """Record a new best score and write ``best.pt``.

        :param model: The model.
        :param epoch: The epoch that improved.
        :param val: Its validation loss.
        """
        self.best = val
        self.best_epoch = epoch
        self.improvements += 1
        self.best_state = keep_weights(self.best_state, model)
        best_payload: dict[str, Any] = {"model": self.best_state, "epoch": epoch}
        if self.same_as_trainkit:
            best_payload.update(best=best_record(self.best, epoch), config=self.config)
        else:
            best_payload["best"] = self.best
        durable_save(best_payload, self.tmp / "best.pt", keep_previous=self.same_as_trainkit)


def end_report(run: Any, epochs: int, best_epoch: int | None, best: float) -> None:
    """The end-of-run report trainkit gives (log_training_results): the W&B summary and one printed line; the
    W&B run finished.

    :param run: The W&B run, or None.
    :param epochs: Epochs run.
    :param best_epoch: The best epoch, or None when none was tracked.
    :param best: Its score.
    """
    summary: dict[str, Any] = {"epochs_run": epochs, "stop_reason": "max_epochs"}
    if best_epoch is not None:
        summary.update({"best/epoch": best_epoch, "best/score": best})
    if run is not None:
        run.summary.update(summary)
    print("raw: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    if run is not None:
        run.finish()


class BenchTrainer(BaseTrainer):
    """The same model, data and loop through trainkit. Set ``workload``/``feature`` before constructing.

    Feature ``steps`` turns step checkpoints on (``ckpt.every_n_steps``, a period longer than the run, so none
    comes due): every step goes through the counted batch iteration and the step-boundary check. Step
    checkpoints need ``ckpt.enable``, which also writes ``last.pt`` at every epoch end; ``ckpt_last`` is
    ``ckpt.enable`` alone (the same writes, no step checkpoints, no best-model tracking), the baseline that
    leaves the tracked loop's own cost. Only trainkit's public API is used: nothing of the engine is stubbed.
    """

    workload: Workload
    feature: str = "off"

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        wl = self.workload
        self.model = self.make_ddp(wl.build_model())
        self.optimizer = wl.make_optimizer(self.model)
        self.loader = wl.train_loader()
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        # the loader's generator stays unregistered, as in the hand-written loops (their checkpoints hold
        # the same items): no run here resumes, so trainkit's warning about it is beside the point
        warnings.filterwarnings("ignore", "the DataLoader given to progress", RuntimeWarning)
        self.log_steps = self.feature == "wandb"
        self.track_best = self.feature == "ckpt"
        self.improvements = 0
        self.last_loss = torch.zeros(())
        self.last_val = float("nan")
        self.tracked: int | None = None

    def train_epoch(self) -> None:
        model, optimizer = self.model, self.optimizer
        model.train()
        loss = self.last_loss
        loss_of, backward = self.workload.loss_fn, self.workload.backward
        batches = self.progress(self.loader)
        for x, y in batches:
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if backward:
                loss.backward()
            optimizer.step()
            if self.log_steps:
                self.log({"train/loss": loss})
                self.push_logs()
        self.last_loss = loss
        # the batches trainkit counted (step checkpoints on): proof that `steps` measured the tracked loop
        self.tracked = getattr(batches, "consumed", None)

    def val_epoch(self) -> bool:
        self.last_val = self.workload.val_loss(self.model)
        if self.track_best and self.save_if_best(self.last_val):
            self.improvements += 1
        return False


_WANDB_CONFIGS: dict[str, dict[str, Any]] = {}


def wandb_config(wl: Workload) -> dict[str, Any]:
    """The config dict trainkit hands to W&B's config panel, built once (outside any timed run)."""
    if wl.name not in _WANDB_CONFIGS:
        cfg = BenchTrainer.config_class.from_mapping(trainkit_config(wl, Path("runs/bench"), "wandb"))
        _WANDB_CONFIGS[wl.name] = cfg.to_dict()
    return _WANDB_CONFIGS[wl.name]


_CHECKPOINT_CONFIGS: dict[str, dict[str, Any]] = {}


def checkpoint_config(wl: Workload) -> dict[str, Any]:
    """The config tree trainkit stores in every checkpoint, for the hand-written loop to store as well.

    Built once, outside any timed run (as a script would hold its config).
    """
    if wl.name not in _CHECKPOINT_CONFIGS:
        cfg = BenchTrainer.config_class.from_mapping(trainkit_config(wl, Path("runs/bench"), "ckpt"))
        _CHECKPOINT_CONFIGS[wl.name] = cfg.to_dict()
    return _CHECKPOINT_CONFIGS[wl.name]


class ClippingBenchTrainer(BenchTrainer):
    """:class:`BenchTrainer` calling ``clip_and_log_grad_norm()`` before each optimizer step (features ``clip`` and
    ``guard``): what the divergence guard judges, so ``guard`` (``guard.nonfinite=skip``, nothing non-finite)
    against ``clip`` (the guard off) is the guard's own cost per step."""

    def train_epoch(self) -> None:
        model, optimizer, loss_of = self.model, self.optimizer, self.workload.loss_fn
        model.train()
        loss = self.last_loss
        batches = self.progress(self.loader)
        for x, y in batches:
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            self.clip_and_log_grad_norm()
            optimizer.step()
        self.last_loss = loss
        self.tracked = getattr(batches, "consumed", None)


STEPPING = ("steps", "clip_steps", "rollback_steps")
"""The variants with ``ckpt.every_n_steps`` past the run's end: the tracked loop, no step checkpoint due."""
GUARDED = {"guard": "skip", "rollback": "rollback", "rollback_steps": "rollback"}
"""The variants with the divergence guard on, and its ``guard.nonfinite``."""


def trainkit_config(wl: Workload, tmp: Path, feature: str) -> dict[str, Any]:
    ckpt: dict[str, Any] = {"enable": feature in ("ckpt", "ckpt_last", *STEPPING)}
    if feature in STEPPING:
        # every step runs the tracked iteration and the boundary check; the period is past the run's last
        # step, so no step checkpoint is written (trainkit_run checks the files)
        ckpt["every_n_steps"] = wl.steps + 1
    return {
        "epochs": wl.epochs,
        "seed": SEED,
        "out_dir": str(tmp),
        "val": {"minimize": True},
        "ckpt": ckpt,
        "wandb": {"mode": "offline" if feature == "wandb" else "disabled", "project": "trainkit-bench"},
        "progress": {"enable": feature == "tqdm"},
        "guard": {"nonfinite": GUARDED.get(feature, "off")},
    }


def trainkit_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    cls = ClippingBenchTrainer if feature in ("clip", "clip_steps", *GUARDED) else BenchTrainer
    cls.workload = wl
    cls.feature = feature
    trainer = cls(trainkit_config(wl, tmp, feature))
    result = trainer.train() or {}
    trainer.close()
    if (feature in GUARDED) != ("guard/skipped_steps" in result):
        raise SystemExit(f"the `{feature}` variant's divergence guard is not as asked: the run returned {result}")
    if feature in STEPPING and (trainer.tracked != len(trainer.loader) or trainer.step != wl.steps):
        raise SystemExit(
            f"the `{feature}` variant did not run the tracked loop: {trainer.tracked} batches counted in the last "
            f"epoch (expected {len(trainer.loader)}), {trainer.step} steps counted (expected {wl.steps})"
        )
    written = {p.name for p in tmp.glob("*.pt")}
    if feature in STEPPING and not ("last.pt" in written and written <= {"last.pt", "last.prev.pt"}):
        # the epoch-end last.pt (and its .prev) only: a step checkpoint would be a mistake in the setup
        raise SystemExit(f"the `{feature}` variant wrote other files: {sorted(p.name for p in tmp.glob('*.pt'))}")
    return trainer.model, (trainer.last_loss, trainer.last_val, trainer.improvements if feature == "ckpt" else None)
