"""``step_resume.py``'s sections: resume latency, the tracked batch loop, blocked time, exactness after a SIGKILL.

Each ``bench_*`` function runs one section and returns its results as plain data; ``step_resume.py`` judges the
gates and writes the report. :func:`child_main` is one attempt of the exactness section, in a fresh process
(``python -m benchmarks.step_resume --child SPEC``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import trainkit
from benchmarks.common import REPO, digest, log, quiet, weights_digest
from trainkit import BaseTrainer

SEED = 0

# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    mode: str
    # latency
    batches: int  # batches per epoch
    batch_size: int
    sample_ms: float  # what one __getitem__ costs (a sleep)
    positions: tuple[int, ...]  # batches trained on before the step checkpoint
    latency_reps: int  # measured repetitions per (position, method), after one discarded warm-up round
    # blocked
    width: int
    layers: int  # square linear layers of the blocked-time model
    block_batch: int
    every_n_steps: int
    saves: int  # step checkpoints per run
    block_runs: int  # runs per mode (sync, async), interleaved
    # iteration
    iter_epochs: int
    iter_reps: int


FULL = Settings(
    mode="full",
    batches=200,
    batch_size=4,
    sample_ms=2.0,
    positions=(1, 50, 100, 150, 199),
    latency_reps=5,
    width=1024,
    layers=10,
    block_batch=32,
    every_n_steps=8,
    saves=5,
    block_runs=3,
    iter_epochs=20,
    iter_reps=9,
)
QUICK = Settings(
    mode="quick",
    batches=40,
    batch_size=2,
    sample_ms=2.0,
    positions=(1, 20, 39),
    latency_reps=2,
    width=512,
    layers=6,
    block_batch=16,
    every_n_steps=4,
    saves=3,
    block_runs=1,
    iter_epochs=4,
    iter_reps=2,
)

# ---------------------------------------------------------------------------------------------- helpers


def make_data(n: int, d_in: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    y = torch.tanh(x @ torch.randn(d_in, 1, generator=gen))
    return x, y


class SlowDataset(Dataset):
    """A map-style dataset whose ``__getitem__`` costs ``seconds`` (a sleep: decoding, reading, augmenting)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seconds: float) -> None:
        self.x, self.y, self.seconds = x, y, seconds

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seconds:
            time.sleep(self.seconds)
        return self.x[index], self.y[index]


def small_net(d_in: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 64), nn.Tanh(), nn.Dropout(0.2), nn.Linear(64, 1))


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


# ---------------------------------------------------------------------------------------------- latency


@attrs.frozen(kw_only=True)
class ResumeConfig(trainkit.Config):
    batches: int = 40
    batch_size: int = 2
    sample_ms: float = 2.0
    d_in: int = 16


class ResumeTrainer(BaseTrainer):
    """One epoch over a slow dataset, a shuffled DataLoader, dropout, SGD with momentum.

    Class attributes steer a run: ``sigterm_after`` (send SIGTERM to this process after that batch),
    ``stop_at_first_batch`` (record the time the first batch arrives, then abort), ``record_batches``
    (keep a digest of every batch, for the uninterrupted reference).
    """

    config_class = ResumeConfig
    cfg: ResumeConfig
    sigterm_after: int | None = None
    stop_at_first_batch = False
    record_batches = False

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        cfg = self.cfg
        x, y = make_data(cfg.batches * cfg.batch_size, cfg.d_in)
        self.loader = DataLoader(SlowDataset(x, y, cfg.sample_ms / 1000), batch_size=cfg.batch_size, shuffle=True)
        self.model = small_net(cfg.d_in)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.first_batch_at: float | None = None
        self.first_batch_index: int | None = None
        self.first_batch_digest: str | None = None
        self.batch_digests: list[str] = []

    def train_epoch(self) -> None:
        self.model.train()
        for index, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            if self.first_batch_at is None:
                self.first_batch_at = time.perf_counter()
                self.first_batch_index = index
                self.first_batch_digest = digest([x, y])
                if self.stop_at_first_batch:
                    raise _FirstBatch
            if self.record_batches:
                self.batch_digests.append(digest([x, y]))
            loss = F.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if index == self.sigterm_after:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded; trainkit stops at the next step boundary

    def val_epoch(self) -> bool:
        return False


class _FirstBatch(Exception):
    """Raised by ResumeTrainer in stop_at_first_batch mode: the first batch arrived, the timing is done."""


def resume_config(s: Settings, out_dir: Path) -> dict[str, Any]:
    return {
        "epochs": 1,
        "seed": SEED,
        "out_dir": str(out_dir),
        "batches": s.batches,
        "batch_size": s.batch_size,
        "sample_ms": s.sample_ms,
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        # step checkpoints on (so the loop is tracked and SIGTERM stops at a step boundary); the period is past
        # the epoch's end: the only step checkpoint is the one the signal forces
        "ckpt": {"every_n_steps": 10**9},
    }


def run_resume_trainer(config: dict[str, Any], **attributes: Any) -> ResumeTrainer:
    for key, value in {"sigterm_after": None, "stop_at_first_batch": False, "record_batches": False}.items():
        setattr(ResumeTrainer, key, attributes.get(key, value))
    trainer = ResumeTrainer(config)
    try:
        trainer.train()
    except (trainkit.TrainingInterrupted, _FirstBatch):
        pass
    finally:
        trainer.close()
    return trainer


def discard_resume(s: Settings, run_dir: Path, position: int) -> tuple[float, str]:
    """Iterate-and-discard: load the checkpoint, rebuild, then load and throw away ``position`` batches.

    Returns the seconds to the first batch to train on and that batch's digest. What a hand-written (or
    Composer-style) resume does: the sampler's permutation is drawn from the RNG state restored at the save
    point, so the batch is not the one the uninterrupted run saw; only its latency is compared.
    """
    start = time.perf_counter()
    ckpt = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=False)
    x, y = make_data(s.batches * s.batch_size, 16)
    loader = DataLoader(SlowDataset(x, y, s.sample_ms / 1000), batch_size=s.batch_size, shuffle=True)
    model = small_net(16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(_torch_rng(ckpt))
    batches = iter(loader)
    for _ in range(position):
        next(batches)
    first = next(batches)
    elapsed = time.perf_counter() - start
    return elapsed, digest(first)


def _torch_rng(ckpt: dict[str, Any]) -> torch.Tensor:
    state = ckpt["rng"][0]["torch"]  # bytes (trainkit.state.rng.capture_rng)
    return state if isinstance(state, torch.Tensor) else torch.frombuffer(bytearray(state), dtype=torch.uint8)


def bench_latency(s: Settings, tmp: Path) -> dict[str, Any]:
    """The latency section: seconds to the first batch of a resumed epoch against the position in it, trainkit's
    resume against iterate-and-discard, interleaved; every resume's first batch and final weights checked.

    :param s: The run mode.
    :param tmp: A scratch folder on a real disk.
    :returns: The section's results.
    """
    log(
        f"latency: {s.batches} batches of {s.batch_size} per epoch, {s.sample_ms} ms per sample "
        f"({s.batches * s.batch_size * s.sample_ms / 1000:.2f} s of loading per epoch); positions {list(s.positions)}; "
        f"{s.latency_reps} measured rounds (+1 warm-up)"
    )
    # the uninterrupted run: every batch's digest and the final weights
    with quiet():
        reference = run_resume_trainer(resume_config(s, tmp / "reference"), record_batches=True)
    ref_weights = weights_digest(reference.model)
    sample_s = measured_sample_s(s)
    runs = {p: checkpoint_at(s, tmp / f"at{p}", p) for p in s.positions}
    times: dict[str, dict[int, list[float]]] = {"trainkit": {p: [] for p in s.positions}}
    times["discard"] = {p: [] for p in s.positions}
    first_batch_ok: dict[int, bool] = {}
    shuffler = random.Random(3000)
    for rnd in range(s.latency_reps + 1):
        order = [(p, m) for p in s.positions for m in ("trainkit", "discard")]
        shuffler.shuffle(order)
        for p, method in order:
            if method == "trainkit":
                seconds, index, batch = time_trainkit_resume(s, fresh_copy(runs[p], tmp, f"{p}-tk"), p)
                first_batch_ok[p] = first_batch_ok.get(p, True) and index == p and batch == reference.batch_digests[p]
            else:
                seconds = discard_resume(s, runs[p], p)[0]
            if rnd > 0:
                times[method][p].append(seconds)
    # every position resumed to the end: the final weights must be the uninterrupted run's
    resumed_exact: dict[int, bool] = {}
    for p in s.positions:
        run_dir = fresh_copy(runs[p], tmp, f"{p}-full")
        with quiet():
            trainer = run_resume_trainer(resume_config(s, run_dir))
        resumed_exact[p] = weights_digest(trainer.model) == ref_weights and trainer.step == s.batches
        shutil.rmtree(run_dir, ignore_errors=True)
    checks = {"first_batch_matches_uninterrupted": first_batch_ok, "resumed_to_end_exact": resumed_exact}
    return latency_result(s, times, sample_s, checks, ref_weights)


def measured_sample_s(s: Settings) -> float:
    """The measured cost of one ``__getitem__`` of the slow dataset (``time.sleep`` overshoots a little).

    :param s: The run mode (its nominal milliseconds per sample).
    :returns: Seconds per sample, the mean of 50.
    """
    probe = SlowDataset(torch.zeros(50, 1), torch.zeros(50, 1), s.sample_ms / 1000)
    t0 = time.perf_counter()
    for i in range(50):
        probe[i]
    return (time.perf_counter() - t0) / 50


def checkpoint_at(s: Settings, run_dir: Path, p: int) -> Path:
    """A run stopped by SIGTERM after batch ``p - 1`` (``p`` batches trained), its step checkpoint saved at that
    boundary.

    :param s: The run mode.
    :param run_dir: The run's folder.
    :param p: The position.
    :returns: ``run_dir``.
    :raises SystemExit: When the checkpoint does not record ``p`` batches.
    """
    with quiet():
        trainer = run_resume_trainer(resume_config(s, run_dir), sigterm_after=p - 1)
    ckpt = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=False)
    consumed = ckpt["trainkit"]["position"]["batches"]
    if consumed != p or trainer.step != p:
        raise SystemExit(f"the step checkpoint for position {p} recorded {consumed} batches (step {trainer.step})")
    return run_dir


def fresh_copy(run_dir: Path, tmp: Path, tag: str) -> Path:
    """A copy of a run folder to resume from, so that every resume starts from the same checkpoint.

    :param run_dir: The run folder.
    :param tmp: Where the copy goes.
    :param tag: Part of the copy's name.
    :returns: The copy.
    """
    target = tmp / f"resume-{tag}-{time.perf_counter_ns()}"
    shutil.copytree(run_dir, target)
    return target


def time_trainkit_resume(s: Settings, run_dir: Path, p: int) -> tuple[float, int | None, str | None]:
    """Resume in ``run_dir`` (removed after) up to the first batch of the resumed epoch, timed from the trainer's
    construction.

    :param s: The run mode.
    :param run_dir: A fresh copy of the run stopped at position ``p``.
    :param p: The position.
    :returns: The seconds, the first batch's index in the epoch and its digest.
    :raises SystemExit: When the resumed run never reached a batch.
    """
    config = resume_config(s, run_dir)
    with quiet():
        start = time.perf_counter()
        trainer = run_resume_trainer(config, stop_at_first_batch=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    if trainer.first_batch_at is None:
        raise SystemExit(f"the resumed run at position {p} never reached a batch")
    return trainer.first_batch_at - start, trainer.first_batch_index, trainer.first_batch_digest


def latency_result(
    s: Settings,
    times: dict[str, dict[int, list[float]]],
    sample_s: float,
    checks: dict[str, dict[int, bool]],
    ref_weights: str,
) -> dict[str, Any]:
    """The latency section's results from its samples, each position's line logged.

    :param s: The run mode.
    :param times: ``trainkit`` and ``discard``: each position's seconds.
    :param sample_s: The measured seconds per sample.
    :param checks: ``first_batch_matches_uninterrupted`` and ``resumed_to_end_exact``, by position.
    :param ref_weights: The uninterrupted run's weights' digest.
    :returns: The results.
    """
    median = {m: {p: statistics.median(v) for p, v in per.items()} for m, per in times.items()}
    first, last = s.positions[0], s.positions[-1]
    ratio = {m: median[m][last] / median[m][first] for m in median}
    # iterate-and-discard should cost about the loading of the skipped batches on top of its fixed part
    slope = (median["discard"][last] - median["discard"][first]) / (last - first)
    first_batch_ok, resumed_exact = checks["first_batch_matches_uninterrupted"], checks["resumed_to_end_exact"]
    for p in s.positions:
        log(
            f"  position {p:>4}: trainkit {median['trainkit'][p] * 1000:8.1f} ms   iterate-and-discard "
            f"{median['discard'][p] * 1000:8.1f} ms   first batch = uninterrupted batch {p}: {first_batch_ok[p]}; "
            f"resumed to the end exact: {resumed_exact[p]}"
        )
    log(f"  last / first: trainkit {ratio['trainkit']:.2f}x, iterate-and-discard {ratio['discard']:.2f}x")
    return {
        "batches_per_epoch": s.batches,
        "batch_size": s.batch_size,
        "sample_ms_nominal": s.sample_ms,
        "sample_ms_measured": sample_s * 1000,
        "positions": list(s.positions),
        "seconds": {m: {str(p): v for p, v in per.items()} for m, per in times.items()},
        "median_s": {m: {str(p): v for p, v in per.items()} for m, per in median.items()},
        "ratio_last_over_first": ratio,
        "discard_seconds_per_skipped_batch": slope,
        "expected_loading_seconds_per_batch": sample_s * s.batch_size,
        "first_batch_matches_uninterrupted": {str(p): v for p, v in first_batch_ok.items()},
        "resumed_to_end_exact": {str(p): v for p, v in resumed_exact.items()},
        "reference_weights": ref_weights,
    }


# ---------------------------------------------------------------------------------------------- iteration


class _Rows(Dataset):
    """In-memory rows, one ``__getitem__`` per sample (the common map-style dataset) or per batch of indices."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class IterTrainer(BaseTrainer):
    """Times the bare batch loop: no forward/backward, an optimizer step without gradients (it only fires
    trainkit's step counter, so every batch ends a step), the loop's CPU time per epoch recorded."""

    shape = "per-sample"

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        x, y = make_data(1437, 64)
        if self.shape == "per-sample":  # DataLoader(batch_size=64): 64 __getitem__ calls and a collate per batch
            self.loader = DataLoader(_Rows(x, y), batch_size=64, shuffle=True)
        else:  # overhead.py's shape: a BatchSampler as the sampler, one __getitem__ per batch of indices
            sampler = BatchSampler(RandomSampler(range(len(x))), 64, False)
            self.loader = DataLoader(_Rows(x, y), batch_size=None, sampler=sampler)
        self.model = nn.Linear(64, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.loop_cpu_s = 0.0

    def train_epoch(self) -> None:
        optimizer = self.optimizer
        start = time.process_time()
        for _batch in self.progress(self.loader):
            optimizer.step()
        self.loop_cpu_s += time.process_time() - start

    def val_epoch(self) -> bool:
        return False


def bench_iteration(s: Settings, tmp: Path) -> dict[str, Any]:
    """The CPU cost per batch of the tracked loop (step checkpoints on, none due) over the untracked one."""
    log(
        f"iteration: 1437 in-memory samples, batches of 64 (23 per epoch), {s.iter_epochs} epochs per run; "
        f"{s.iter_reps} measured rounds (+1 warm-up); loop CPU time only"
    )
    variants = {"plain": None, "tracked": 10**9}
    result: dict[str, Any] = {"epochs": s.iter_epochs, "batches_per_epoch": 23, "batch_size": 64}
    shuffler = random.Random(5000)
    for shape in ("per-sample", "per-batch"):
        IterTrainer.shape = shape
        times: dict[str, list[float]] = {v: [] for v in variants}
        for rnd in range(s.iter_reps + 1):
            order = list(variants)
            shuffler.shuffle(order)
            for variant in order:
                config = {
                    "epochs": s.iter_epochs,
                    "seed": SEED,
                    "out_dir": str(tmp / f"iter-{shape}-{variant}-{time.perf_counter_ns()}"),
                    "wandb": {"mode": "disabled"},
                    "progress": {"enable": False},
                    "ckpt": {"every_n_steps": variants[variant]},
                }
                with quiet():
                    trainer = IterTrainer(config)
                    trainer.train()
                    trainer.close()
                if rnd > 0:
                    times[variant].append(trainer.loop_cpu_s)
                shutil.rmtree(config["out_dir"], ignore_errors=True)
        batches = s.iter_epochs * 23
        ratios = [t / p for t, p in zip(times["tracked"], times["plain"])]
        plain, tracked = statistics.median(times["plain"]), statistics.median(times["tracked"])
        result[shape] = {
            "plain_cpu_s": times["plain"],
            "tracked_cpu_s": times["tracked"],
            "ratio_median": statistics.median(ratios),
            "plain_us_per_batch": plain / batches * 1e6,
            "extra_us_per_batch": (tracked - plain) / batches * 1e6,
        }
        log(
            f"  {shape}: plain {plain / batches * 1e6:.1f} us per batch, tracked "
            f"{tracked / batches * 1e6:.1f} us ({result[shape]['extra_us_per_batch']:+.1f} us, "
            f"ratio {result[shape]['ratio_median']:.3f})"
        )
    return result


# ---------------------------------------------------------------------------------------------- blocked time


@attrs.frozen(kw_only=True)
class BlockConfig(trainkit.Config):
    width: int = 512
    layers: int = 4
    batch_size: int = 16
    batches: int = 20


class BlockTrainer(BaseTrainer):
    """A wide MLP (a few tens of MB of weights, twice that of Adam state) over in-memory data; times the boundary."""

    config_class = BlockConfig
    cfg: BlockConfig

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        cfg = self.cfg
        torch.manual_seed(SEED)
        self.model = nn.Sequential(*[nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        x, y = make_data(cfg.batches * cfg.batch_size, cfg.width)
        self.loader = DataLoader(SlowDataset(x, x, 0.0), batch_size=cfg.batch_size, shuffle=True)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.saving: list[float] = []  # seconds of each step checkpoint's save: the loop is blocked for it
        self.epoch_s = 0.0
        save = self.checkpointer.save

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                if self.epoch_s == 0.0:  # inside the epoch's loop: a step checkpoint (the epoch's end is not timed)
                    self.saving.append(time.perf_counter() - start)

        self.checkpointer.save = timed_save  # type: ignore[method-assign]

    def train_epoch(self) -> None:
        self.model.train()
        start = time.perf_counter()
        for x, y in self.progress(self.loader):
            loss = F.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.epoch_s = time.perf_counter() - start

    def val_epoch(self) -> bool:
        return False


def block_config(s: Settings, out_dir: Path, async_save: bool) -> dict[str, Any]:
    return {
        "epochs": 1,
        "seed": SEED,
        "out_dir": str(out_dir),
        "width": s.width,
        "layers": s.layers,
        "batch_size": s.block_batch,
        # the last step checkpoint lands half a period before the epoch's end
        "batches": s.every_n_steps * s.saves + s.every_n_steps // 2,
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        "ckpt": {"every_n_steps": s.every_n_steps, "async_save": async_save},
    }


def blocked_run(s: Settings, run_dir: Path, mode: str, async_save: bool) -> BlockTrainer:
    """One run of the blocked section in ``run_dir`` (removed after), from a synced disk.

    :param s: The run mode.
    :param run_dir: The run's folder.
    :param mode: ``sync`` or ``async``, for messages.
    :param async_save: Whether step checkpoints save asynchronously.
    :returns: The closed trainer, with its blocked seconds per save and its epoch's seconds.
    :raises SystemExit: When the run did not write the step checkpoints it should have.
    """
    os.sync()  # no dirty pages of the previous run left to flush
    with quiet():
        trainer = BlockTrainer(block_config(s, run_dir, async_save))
        trainer.train()
        trainer.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(trainer.saving) != s.saves:
        raise SystemExit(f"{mode}: {len(trainer.saving)} step checkpoints written, expected {s.saves}")
    return trainer


def bench_blocked(s: Settings, tmp: Path) -> dict[str, Any]:
    """The blocked section: the loop's time per step checkpoint, sync against async, in interleaved runs; the
    time the async run lost outside the boundaries beside it.

    :param s: The run mode.
    :param tmp: A scratch folder on a real disk.
    :returns: The section's results.
    :raises SystemExit: When the disk has too little room.
    """
    params = s.layers * (s.width * s.width + s.width)
    ckpt_mb = params * 4 * 3 / 2**20
    log(
        f"blocked: {params / 1e6:.1f}M parameters, ~{ckpt_mb:.0f} MiB per last.pt (weights + Adam); "
        f"every_n_steps={s.every_n_steps}, {s.saves} step checkpoints per run; {s.block_runs} runs per mode"
    )
    free = shutil.disk_usage(tmp).free
    if free < 8 * ckpt_mb * 2**20:
        raise SystemExit(f"not enough free disk in {tmp}: {free} bytes")
    modes = {"sync": False, "async": True}
    # blocked_s leaves each run's first save out (the first async save also allocates the staging buffers);
    # epoch_minus_blocked_s is the epoch's time minus every saving boundary
    names = ("blocked_s", "first_save_blocked_s", "epoch_s", "epoch_minus_blocked_s")
    samples: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in names}
    digests: set[str] = set()
    shuffler = random.Random(4000)
    for _ in range(s.block_runs):
        order = list(modes)
        shuffler.shuffle(order)
        for mode in order:
            trainer = blocked_run(s, tmp / f"block-{mode}-{time.perf_counter_ns()}", mode, modes[mode])
            samples["first_save_blocked_s"][mode].append(trainer.saving[0])
            samples["blocked_s"][mode].extend(trainer.saving[1:])
            samples["epoch_s"][mode].append(trainer.epoch_s)
            samples["epoch_minus_blocked_s"][mode].append(trainer.epoch_s - sum(trainer.saving))
            digests.add(weights_digest(trainer.model))
    return blocked_result(s, samples, len(digests) == 1)


def blocked_result(s: Settings, samples: dict[str, dict[str, list[float]]], same_weights: bool) -> dict[str, Any]:
    """The blocked section's results from its samples, its line logged.

    :param s: The run mode.
    :param samples: ``blocked_s`` (every save but the first), ``first_save_blocked_s``, ``epoch_s`` and
        ``epoch_minus_blocked_s``, each by mode.
    :param same_weights: Whether every run ended with the same weights.
    :returns: The results.
    """
    params = s.layers * (s.width * s.width + s.width)
    saving, first_saves, outside = (
        samples["blocked_s"],
        samples["first_save_blocked_s"],
        samples["epoch_minus_blocked_s"],
    )
    median = {m: statistics.median(saving[m]) for m in ("sync", "async")}
    ratio = median["async"] / median["sync"]
    # training time the async run lost outside the boundaries (the writer thread competing for the CPU and the
    # GIL): the same steps took that much longer than in the sync run, where nothing runs beside them
    lost = (statistics.median(outside["async"]) - statistics.median(outside["sync"])) / s.saves
    result = {
        "parameters": params,
        "checkpoint_mib": params * 4 * 3 / 2**20,
        "every_n_steps": s.every_n_steps,
        "saves_per_run": s.saves,
        "runs_per_mode": s.block_runs,
        "blocked_s": saving,
        "first_save_blocked_s": first_saves,
        "median_blocked_s": median,
        "blocked_async_over_sync": ratio,
        "epoch_s": samples["epoch_s"],
        "epoch_minus_blocked_s": outside,
        "lost_per_save_s": lost,
        "blocked_plus_lost_async_over_sync": (median["async"] + lost) / median["sync"],
        "same_weights": same_weights,
    }
    log(
        f"  median blocked per step checkpoint: sync {median['sync'] * 1000:.1f} ms, async "
        f"{median['async'] * 1000:.1f} ms -> {ratio:.3f}x; first async save (allocates the buffers) "
        f"{statistics.median(first_saves['async']) * 1000:.1f} ms; same weights: {result['same_weights']}"
    )
    return result


# ---------------------------------------------------------------------------------------------- exactness

EXACT_SAMPLES, EXACT_BATCH, EXACT_EPOCHS, EXACT_EVERY = 512, 16, 3, 5
EXACT_KILL = (1, 20)  # epoch, batch index: after step 32 + 21 = 53, the last checkpoint is step 50's


class ExactTrainer(BaseTrainer):
    """Plain shuffled DataLoader (no generator), dropout, Adam; SIGKILLs its own process after batch ``kill_at``.

    ``kill_at`` (epoch, batch index) is a class attribute, not config: the resumed run has the same config.
    """

    kill_at: tuple[int, int] | None = None

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        x, y = make_data(EXACT_SAMPLES, 16)
        self.loader = DataLoader(SlowDataset(x, y, 0.0), batch_size=EXACT_BATCH, shuffle=True)
        self.model = small_net(16)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)

    def train_epoch(self) -> None:
        self.model.train()
        for index, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            loss = F.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if (self.epoch, index) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def val_epoch(self) -> bool:
        return False


def child_trainkit(out_dir: Path, kill: list[int] | None) -> tuple[nn.Module, int]:
    config = {
        "epochs": EXACT_EPOCHS,
        "seed": SEED,
        "out_dir": str(out_dir),
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        "ckpt": {"every_n_steps": EXACT_EVERY},
    }
    ExactTrainer.kill_at = (kill[0], kill[1]) if kill else None
    trainer = ExactTrainer(config)
    trainer.train()
    trainer.close()
    return trainer.model, trainer.step


def child_lightning(out_dir: Path, kill: list[int] | None) -> tuple[nn.Module, int]:
    import logging

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    pl.seed_everything(SEED, verbose=False)  # what a Lightning script does first, in every process

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_net(16)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.net.parameters(), lr=1e-2)

    class Killer(pl.Callback):
        """Runs before ModelCheckpoint's hook (Lightning runs checkpoint callbacks last)."""

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if kill and (trainer.current_epoch, batch_idx) == tuple(kill):
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = make_data(EXACT_SAMPLES, 16)
    loader = DataLoader(SlowDataset(x, y, 0.0), batch_size=EXACT_BATCH, shuffle=True)
    module = Module()
    checkpoint = ModelCheckpoint(dirpath=str(out_dir), every_n_train_steps=EXACT_EVERY, save_last=True, save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EXACT_EPOCHS,
        default_root_dir=str(out_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Killer(), checkpoint],
    )
    last = out_dir / "last.ckpt"
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(last) if last.exists() else None)
    return module.net, trainer.global_step


def child_main(spec_path: str) -> int:
    """One attempt in a fresh process: train (resuming when the folder holds a checkpoint), save the weights."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = child_trainkit if spec["framework"] == "trainkit" else child_lightning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, step = runner(out_dir, spec["kill"])
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, spec["weights"])
    Path(spec["report"]).write_text(
        json.dumps({"step": step, "warnings": sorted({str(w.message).splitlines()[0] for w in seen})})
    )
    return 0


def run_child(framework: str, out_dir: Path, kill: tuple[int, int] | None, tag: str, tmp: Path) -> dict[str, Any]:
    spec = {
        "framework": framework,
        "out_dir": str(out_dir),
        "kill": list(kill) if kill else None,
        "weights": str(tmp / f"{tag}.weights.pt"),
        "report": str(tmp / f"{tag}.json"),
    }
    spec_path = tmp / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    # a fresh interpreter, started as the benchmark itself was (a module, from the repository root): it imports
    # this checkout's trainkit and benchmarks without any path set by hand
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_resume", "--child", str(spec_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    result: dict[str, Any] = {"exit_code": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    if proc.returncode == 0:
        result.update(json.loads(Path(spec["report"]).read_text()))
        result["weights"] = torch.load(spec["weights"], weights_only=True)
    return result


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(a[k].pow(2).sum()) for k in a) ** 0.5
    return {"exact": exact, "max_abs_diff": diff, "relative_l2_diff": num / den if den else 0.0}


def bench_exactness(tmp: Path, use_lightning: bool, lightning_why: str | None) -> dict[str, Any]:
    steps_per_epoch = EXACT_SAMPLES // EXACT_BATCH
    kill_step = EXACT_KILL[0] * steps_per_epoch + EXACT_KILL[1] + 1
    log(
        f"exactness: {EXACT_SAMPLES} samples, batch {EXACT_BATCH} ({steps_per_epoch} steps per epoch), "
        f"{EXACT_EPOCHS} epochs, a checkpoint every {EXACT_EVERY} steps; SIGKILL after step {kill_step} "
        f"(epoch {EXACT_KILL[0]}, batch {EXACT_KILL[1]}); each attempt a fresh process"
    )
    frameworks = ["trainkit"] + (["lightning"] if use_lightning else [])
    out: dict[str, Any] = {
        "setup": {
            "samples": EXACT_SAMPLES,
            "batch_size": EXACT_BATCH,
            "epochs": EXACT_EPOCHS,
            "checkpoint_every_n_steps": EXACT_EVERY,
            "kill_after_step": kill_step,
            "kill_at": {"epoch": EXACT_KILL[0], "batch": EXACT_KILL[1]},
            "loader": "DataLoader(shuffle=True), no generator",
            "model": "Linear(16,64)-Tanh-Dropout(0.2)-Linear(64,1), Adam(lr=1e-2)",
        }
    }
    if not use_lightning:
        out["lightning"] = {"skipped": lightning_why or "--no-lightning"}
    for fw in frameworks:
        t0 = time.perf_counter()
        reference = run_child(fw, tmp / f"{fw}-reference", None, f"{fw}-reference", tmp)
        killed = run_child(fw, tmp / f"{fw}-killed", EXACT_KILL, f"{fw}-killed", tmp)
        resumed = run_child(fw, tmp / f"{fw}-killed", None, f"{fw}-resumed", tmp)
        entry: dict[str, Any] = {
            "exit_codes": {"reference": reference["exit_code"], "killed": killed["exit_code"]},
            "resumed_exit_code": resumed["exit_code"],
        }
        failed = [r for r in (reference, resumed) if r["exit_code"] != 0]
        if failed or killed["exit_code"] != -signal.SIGKILL:
            entry["error"] = (failed[0] if failed else killed)["stderr_tail"]
            entry["exact"] = False
        else:
            entry.update(compare(reference["weights"], resumed["weights"]))
            entry["steps"] = {"reference": reference["step"], "resumed": resumed["step"]}
            entry["resume_warnings"] = resumed["warnings"]
            if fw == "lightning":  # a second uninterrupted run: Lightning alone is deterministic here
                again = run_child(fw, tmp / f"{fw}-again", None, f"{fw}-again", tmp)
                if again["exit_code"] == 0:
                    entry["uninterrupted_runs_identical"] = compare(reference["weights"], again["weights"])["exact"]
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        out[fw] = entry
        if "error" in entry:
            log(f"  {fw}: FAILED\n{entry['error']}")
        else:
            log(
                f"  {fw}: exact {'yes' if entry['exact'] else 'no'} (max |diff| {entry['max_abs_diff']:.3g}, relative "
                f"L2 {entry['relative_l2_diff']:.3g}); steps {entry['steps']}; {entry['seconds']} s"
            )
    return out
