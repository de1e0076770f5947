"""The suite's long run, switched on in one place: ``TRAINKIT_SLOW=1``.

The default run keeps at least one case of every kind (each fault, each format, each store, each loader setting);
the long run adds the repeats of a kind (more kill points, fuzz rounds, world-size sequences, pairings) and
hypothesis's full count of examples (tests/conftest.py).
"""

from __future__ import annotations

import os

SLOW = os.environ.get("TRAINKIT_SLOW") == "1"
"""The long run: every case marked ``slow``, every repeat of a kind and hypothesis's full count of examples."""
