"""Spawn 2 ranks of a trainer whose first epoch never ends, each printing its pid; the test SIGKILLs this process.

Usage: ``python -m tests.faults.orphans OUT_DIR``. Each rank prints ``rank <r> pid <pid>`` once its process group
is up, then sleeps in its epoch until something kills it.
"""

from __future__ import annotations

import os
import sys
import time

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer


class EndlessTrainer(TinyTrainer):
    """TinyTrainer whose first epoch waits forever (its ranks only end by a signal)."""

    def train_epoch(self):
        os.write(sys.stdout.fileno(), f"rank {self.rank} pid {os.getpid()}\n".encode())
        while True:
            time.sleep(0.05)


def main() -> None:
    """Spawn the ranks; never returns unless they fail."""
    trainkit.spawn(EndlessTrainer, make_cfg(sys.argv[1], epochs=2), 2)


if __name__ == "__main__":
    main()
