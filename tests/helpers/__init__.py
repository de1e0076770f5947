"""What the tests share, and no test of its own: trainers, config builders, file surgery, counters and readers.

- :mod:`tests.helpers.trainers`: small real trainers (importable by spawned and forked processes);
- :mod:`tests.helpers.certify_trainers`: a trainer whose resume is exact and one per defect ``certify`` names;
- :mod:`tests.helpers.configs`: :func:`~tests.helpers.configs.make_cfg`, the quiet config every test starts from;
- :mod:`tests.helpers.checkpoint_files`: real checkpoint files, rewritten or damaged on purpose;
- :mod:`tests.helpers.host_syncs`: counting the tensor methods that wait for the device;
- :mod:`tests.helpers.wandb_files`: W&B's offline ``.wandb`` files, read back and written by hand.

The fixtures built on them are in ``tests/conftest.py``; the real processes of the fault tests are in
``tests/faults/``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: where the tests start subprocesses and find README.md, docs/ and examples/."""
