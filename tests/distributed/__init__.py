"""Tests of :mod:`trainkit.distributed`: trainkit's own collectives on real gloo processes."""
