"""Train a StepTrainer from a JSON file with ``trainkit.launch``: what a user's script under ``python -m`` or torchrun
does; the refusal tests run it as a real process.

Usage: ``python -m tests.distributed.refusing_worker RUN.json``. The file holds ``{"config": {...}, "bug": bool}``:
``config`` goes to the trainer unchanged; ``bug`` makes ``setup()`` fail as a bug in the user's code does (a plain
``RuntimeError``, not a refusal).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trainkit
from tests.helpers.trainers import StepTrainer


class BuggyTrainer(StepTrainer):
    """A StepTrainer whose ``setup()`` has a bug."""

    def setup(self, ckpt):
        raise RuntimeError("a bug in setup()")


def main() -> None:
    """Run the training described by the JSON file named on the command line."""
    run = json.loads(Path(sys.argv[1]).read_text())
    trainkit.launch(BuggyTrainer if run.get("bug") else StepTrainer, run["config"])


if __name__ == "__main__":
    main()
