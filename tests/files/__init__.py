"""Tests of :mod:`trainkit.files`: the pickle pre-scan under the safe loads."""
