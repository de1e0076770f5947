"""Tests of :mod:`trainkit.loop`: what the loop does per step and per epoch (logs, guard, bars, step checkpoints)."""
