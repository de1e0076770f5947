"""A torchrun worker for the elastic-agent tests: it trains and keeps a ledger of the samples of every optimizer step.

Usage: ``python -m tests.distributed.elastic_worker RUN.json`` (under ``torchrun``). The file holds
``{"config": {...}, "ledger": DIR, "step_sleep": {WORLD_SIZE: SECONDS}}``. The trainer holds its global batch on
any world size (``batch_size = global_batch // world_size``, the documented pattern) and appends one JSON line per
optimizer step to ``DIR/<pid>.jsonl``: the attempt (a tag rank 0 draws and broadcasts when the attempt starts), the
world size, the rank, the epoch, the step, the dataset indices of the step's batch, and when the process started.
``step_sleep`` slows every step down on a world size, so that a test can kill a process mid-epoch, or start an agent
while one process trains alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import attrs
import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainkit
from tests.helpers.trainers import make_data
from trainkit import BaseTrainer, Config
from trainkit.distributed.collectives import broadcast_object


@attrs.frozen(kw_only=True)
class LedgerConfig(Config):
    """The global batch (held on every world size) and the data's size."""

    lr: float = 0.05
    global_batch: int = 8
    n_samples: int = 96


class IndexedSamples(Dataset):
    """``(x, y, index)``: the index goes into the ledger."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class LedgerTrainer(BaseTrainer):
    """An MLP regressor under DDP whose every optimizer step is written to the ledger."""

    config_class = LedgerConfig
    cfg: LedgerConfig
    ledger: Path | None = None
    step_sleep: dict[str, float] = {}

    def setup(self, ckpt):
        cfg = self.cfg
        if cfg.global_batch % self.world_size:
            raise ValueError(f"global_batch {cfg.global_batch} is not a multiple of world size {self.world_size}")
        x, y = make_data(cfg.n_samples)
        dataset = IndexedSamples(x, y)
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=cfg.seed)
        self.loader = DataLoader(dataset, batch_size=cfg.global_batch // self.world_size, sampler=sampler)
        self.add_samplers(sampler)
        self.model = self.make_ddp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
        self.optimizer = torch.optim.SGD(self.get_param_groups(), lr=cfg.lr, momentum=0.9)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.attempt = broadcast_object(uuid.uuid4().hex if self.rank == 0 else None)

    def train_epoch(self):
        self.model.train()
        loss = None  # a resume at the epoch's last step boundary enters the epoch with no batch left
        for x, y, index in self.progress(self.loader):
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self._write(index.tolist())
            time.sleep(self.step_sleep.get(str(self.world_size), 0.0))
        if loss is not None:
            self.log({"train/loss": loss.detach()})

    def val_epoch(self):
        return False

    def _write(self, indices: list[int]) -> None:
        if self.ledger is None:
            return
        entry = {
            "attempt": self.attempt, "world": self.world_size, "rank": self.rank, "epoch": self.epoch,
            "step": self.step, "indices": indices, "time": time.time(), "pid": os.getpid(),
            "born": psutil.Process().create_time(),
        }  # fmt: skip
        # one write() per line, whole or absent: a SIGKILL may come at any moment
        with open(self.ledger / f"{os.getpid()}.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")


def main() -> None:
    """Train as the JSON file named on the command line says."""
    run = json.loads(Path(sys.argv[1]).read_text())
    LedgerTrainer.ledger = Path(run["ledger"]) if run.get("ledger") else None
    LedgerTrainer.step_sleep = dict(run.get("step_sleep", {}))
    trainkit.launch(LedgerTrainer, run["config"])


if __name__ == "__main__":
    main()
