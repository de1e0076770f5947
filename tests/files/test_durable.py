"""atomic_save's work beside the write: done before the file is published; a failure of either leaves it as it was."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from trainkit.checkpoint import atomic_save, previous_path


def _names(folder):
    return sorted(os.listdir(folder))


def test_the_file_is_published_only_after_the_work_beside_it_is_done(tmp_path):
    """The work runs in another thread while the payload is written; until it returns, path holds the old file."""
    path = tmp_path / "last.pt"
    atomic_save({"v": torch.zeros(4)}, path, keep_previous=True)
    seen = {}

    def beside():
        seen["thread"] = threading.current_thread()
        time.sleep(0.3)  # long past the write of 16 bytes: a save that did not wait would have published by now
        seen["value"] = torch.load(path, weights_only=True)["v"][0].item()

    atomic_save({"v": torch.ones(4)}, path, keep_previous=True, alongside=beside)
    assert seen["thread"] is not threading.main_thread()
    assert seen["value"] == 0.0  # still the old file at the end of the work
    assert torch.load(path, weights_only=True)["v"][0].item() == 1.0
    assert torch.load(previous_path(path), weights_only=True)["v"][0].item() == 0.0


def test_a_failure_beside_the_write_leaves_the_files_as_they_were(tmp_path):
    """The work's own error is raised; path and its .prev are unchanged and no temp file is left."""
    path = tmp_path / "last.pt"
    atomic_save({"v": torch.zeros(4)}, path, keep_previous=True)
    atomic_save({"v": torch.ones(4)}, path, keep_previous=True)
    before = {name: (tmp_path / name).read_bytes() for name in _names(tmp_path)}

    def beside():
        raise OSError(5, "injected: the journal's fsync failed")

    with pytest.raises(OSError, match="injected: the journal's fsync failed"):
        atomic_save({"v": torch.full((4,), 2.0)}, path, keep_previous=True, alongside=beside)
    assert {name: (tmp_path / name).read_bytes() for name in _names(tmp_path)} == before


def test_a_failed_write_still_waits_for_the_work_beside_it(tmp_path):
    """A payload that cannot be written raises its own error, after the work beside it has finished."""
    path = tmp_path / "last.pt"
    done = threading.Event()

    def beside():
        time.sleep(0.2)
        done.set()
        raise OSError(5, "a second failure, not the one raised")

    with pytest.raises(Exception, match="pickle|lambda") as raised:
        atomic_save({"f": lambda: 0}, path, alongside=beside)
    assert done.is_set() and "second failure" not in str(raised.value)
    assert _names(tmp_path) == []
