"""Tests of :mod:`trainkit.cli`: the ``python -m trainkit`` commands (replay, report, certify)."""
