"""Tests of :mod:`trainkit.config`: the config records, overrides and secrets."""
