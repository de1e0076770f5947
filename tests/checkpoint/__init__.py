"""Tests of :mod:`trainkit.checkpoint`: saving, loading and verifying checkpoints, kept checkpoints, hostile files."""
