"""``step_resume.py --world-change``: resume latency of a mid-epoch step checkpoint on another number of processes.

A step checkpoint is written on 1 process (a ``DistributedSampler`` with one replica, the whole global batch per
rank), SIGTERMed after batch p, and resumed on 2 gloo ranks (``trainkit.spawn``, half the batch each). Each rank
times "construct the trainer" to "the first batch of the resumed epoch is in the loop's hands" (the rendezvous is
inside, alike at every position); the slower rank's time counts. trainkit skips at the index level on the new
world size too, so the latency should not grow with p. Every resumed first batch is checked: the two ranks together
hold exactly the samples of the uninterrupted run's batch p, and no rank loaded any other sample before it.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import trainkit
from benchmarks.common import log, quiet
from benchmarks.step_resume_sections import SEED, ResumeConfig, Settings, SlowDataset, make_data, small_net
from trainkit import BaseTrainer


class IndexedSlowDataset(SlowDataset):
    """SlowDataset whose samples also say their index (to check the resumed batch), counting the samples loaded."""

    loaded = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.loaded += 1
        x, y = super().__getitem__(index)
        return x, y, int(index)


@attrs.frozen(kw_only=True)
class WorldConfig(ResumeConfig):
    global_batch: int = 4
    sigterm_after: int = -1  # SIGTERM this process after that batch (-1: never)
    stop_at_first_batch: bool = False  # record the first batch's time and indices, then end the epoch


class WorldTrainer(BaseTrainer):
    """One epoch over a slow dataset dealt by a DistributedSampler, ``global_batch // world_size`` per rank."""

    config_class = WorldConfig
    cfg: WorldConfig

    def __init__(self, cfg: Any, rank: int = 0, world_size: int = 1) -> None:
        self.constructed_at = time.perf_counter()
        super().__init__(cfg, rank, world_size)

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        cfg = self.cfg
        x, y = make_data(cfg.batches * cfg.global_batch, cfg.d_in)
        self.dataset = dataset = IndexedSlowDataset(x, y, cfg.sample_ms / 1000)
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, seed=SEED)
        self.add_samplers(sampler)
        self.loader = DataLoader(dataset, sampler=sampler, batch_size=cfg.global_batch // self.world_size)
        self.model = self.make_ddp(small_net(cfg.d_in))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.batches: list[list[int]] = []

    def train_epoch(self) -> None:
        import os
        import signal

        self.model.train()
        for index, (x, y, indices) in enumerate(self.progress(self.loader), start=self.first_batch):
            if self.cfg.stop_at_first_batch:
                seconds = time.perf_counter() - self.constructed_at
                record = {
                    "seconds": seconds,
                    "index": index,
                    "indices": indices.tolist(),
                    "loaded": self.dataset.loaded,
                }
                Path(self.cfg.out_dir, f"first-batch-{self.rank}.json").write_text(json.dumps(record))
                return  # the epoch ends here: the timing is done
            self.batches.append(indices.tolist())
            loss = F.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if index == self.cfg.sigterm_after:
                os.kill(os.getpid(), signal.SIGTERM)  # trainkit stops at the next step boundary

    def val_epoch(self) -> bool:
        return False


def world_config(s: Settings, out_dir: Path, **changes: Any) -> dict[str, Any]:
    return {
        "epochs": 1,
        "seed": SEED,
        "out_dir": str(out_dir),
        "batches": s.batches,
        "global_batch": 2 * s.batch_size,
        "sample_ms": s.sample_ms,
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        "dist": {"backend": "gloo", "timeout_s": 60},
        "ckpt": {"every_n_steps": 10**9},  # the only step checkpoint is the one the signal forces
        **changes,
    }


def bench_world_change(s: Settings, tmp: Path) -> dict[str, Any]:
    """Write a step checkpoint at each position on 1 process, resume it on 2, time the first batch.

    :param s: The settings (positions, repetitions, sizes).
    :param tmp: A scratch folder.
    :returns: The section's results: medians per position, the ratio last / first, whether every first batch held
        the uninterrupted run's samples.
    """
    log(f"world change 1 -> 2 ranks: {s.batches} batches of {2 * s.batch_size} per epoch; positions {s.positions}")
    with quiet():
        reference = WorldTrainer(world_config(s, tmp / "reference"))
        reference.train()
        reference.close()
    runs: dict[int, Path] = {}
    for p in s.positions:
        run_dir = tmp / f"world-at{p}"
        trainer = WorldTrainer(world_config(s, run_dir, sigterm_after=p - 1))
        try:
            with quiet():
                trainer.train()
        except trainkit.TrainingInterrupted:
            pass
        finally:
            trainer.close()
        runs[p] = run_dir
    seconds: dict[int, list[float]] = {p: [] for p in s.positions}
    same_samples: dict[int, bool] = {}
    for round_ in range(s.latency_reps + 1):
        for p in s.positions:
            run_dir = tmp / f"world-resume-{p}-{round_}"
            shutil.copytree(runs[p], run_dir)
            with quiet():
                trainkit.spawn(WorldTrainer, world_config(s, run_dir, stop_at_first_batch=True), 2)
            firsts = [json.loads(Path(run_dir, f"first-batch-{rank}.json").read_text()) for rank in range(2)]
            served = sorted(i for first in firsts for i in first["indices"])
            exact = all(first["index"] == p for first in firsts) and served == sorted(reference.batches[p])
            exact = exact and all(first["loaded"] == len(first["indices"]) for first in firsts)  # nothing skipped loads
            same_samples[p] = same_samples.get(p, True) and exact
            if round_ > 0:
                seconds[p].append(max(first["seconds"] for first in firsts))
            shutil.rmtree(run_dir, ignore_errors=True)
    median = {p: statistics.median(values) for p, values in seconds.items()}
    first, last = s.positions[0], s.positions[-1]
    for p in s.positions:
        log(f"  position {p:>4}: {median[p] * 1000:8.1f} ms on 2 ranks; first batch = uninterrupted: {same_samples[p]}")
    log(f"  last / first: {median[last] / median[first]:.2f}x")
    return {
        "from_world_size": 1,
        "to_world_size": 2,
        "global_batch": 2 * s.batch_size,
        "positions": list(s.positions),
        "seconds": {str(p): v for p, v in seconds.items()},
        "median_s": {str(p): v for p, v in median.items()},
        "ratio_last_over_first": median[last] / median[first],
        "first_batch_matches_uninterrupted": {str(p): v for p, v in same_samples.items()},
    }
