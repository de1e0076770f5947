"""Train a TinyTrainer from a JSON file with trainkit.launch; the fault tests run this as a real process.

Usage: ``python -m tests.faults.train RUN.json`` (also under torchrun). The file holds
``{"config": {...}, "fault": {...}}``: ``config`` goes to the trainer unchanged; ``fault`` steers
the injected behaviour, and stays out of the config so it never changes what a checkpoint records:

- ``batch_sleep``: seconds to sleep after every batch, so signals land at every point of an epoch;
- ``ballast_numel``: register a float32 tensor of that many elements as a checkpoint item, so saves
  take long enough to be killed mid-write;
- ``exit_rank``/``exit_epoch``: that rank calls ``os._exit(1)`` at the start of that epoch, on the
  first torchrun attempt only (``TORCHELASTIC_RESTART_COUNT`` is ``"0"``).

Each epoch start prints ``epoch <n> rank <r> pid <pid>`` to stdout, so a test knows training is under way.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import trainkit
from tests.helpers.trainers import TinyTrainer


class FaultTrainer(TinyTrainer):
    """TinyTrainer with the injected behaviour of the ``fault`` section."""

    fault: dict = {}

    def setup(self, ckpt):
        super().setup(ckpt)
        numel = int(self.fault.get("ballast_numel", 0))
        if numel:
            self.add_checkpoint_items(ballast=torch.zeros(numel))
        sleep = float(self.fault.get("batch_sleep", 0.0))
        if sleep:
            self.optimizer.register_step_post_hook(lambda *_: time.sleep(sleep))

    def train_epoch(self):
        # one write() per line: the ranks of a torchrun job share this file, and print() writes twice
        os.write(sys.stdout.fileno(), f"epoch {self.epoch} rank {self.rank} pid {os.getpid()}\n".encode())
        if (
            self.fault.get("exit_rank") == self.rank
            and self.fault.get("exit_epoch") == self.epoch
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ):
            os._exit(1)
        super().train_epoch()


def main() -> None:
    """Run the training described by the JSON file named on the command line."""
    run = json.loads(Path(sys.argv[1]).read_text())
    FaultTrainer.fault = run.get("fault", {})
    trainkit.launch(FaultTrainer, run["config"])


if __name__ == "__main__":
    main()
