"""Tests of :mod:`trainkit.run`: the run folder, its lock and journal, and the W&B run."""
