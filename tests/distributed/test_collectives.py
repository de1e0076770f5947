"""trainkit's own collectives in 2 real gloo processes: object broadcast and gather, and a clean teardown."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainkit.distributed import collectives as dist_utils

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(120)]


def _collectives(rank: int, out_dir: str) -> None:
    """One rank: each of trainkit's collectives, then teardown; writes what it saw to rank<r>.json."""
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    report: dict = {}
    report["from_0"] = dist_utils.broadcast_object({"epoch": 3, "rank": rank, "text": "é" * 5}, src=0)
    report["from_1"] = dist_utils.broadcast_object(["x" * (1000 * (rank + 1))], src=1)[0][:3]
    # uneven sizes: rank 1's object is 100x longer, so rank 0's bytes are padded and cut back
    gathered = dist_utils.all_gather_objects({"rank": rank, "blob": "y" * (10 + 1000 * rank)})
    report["gathered"] = [(item["rank"], len(item["blob"])) for item in gathered]
    report["mean"] = dist_utils.reduce_mean(torch.tensor(float(rank + 1)), 1)
    report["any_all"] = dist_utils.any_all([rank == 0, True])
    held = [weakref.ref(ref()) for ref in dist_utils.held_by_backend() if ref() is not None]
    dist_utils.teardown(30)
    report["held_after_teardown"] = sum(ref() is not None for ref in held)
    report["still_distributed"] = dist_utils.is_distributed()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)


def test_object_collectives_agree_and_teardown_leaves_nothing_to_the_backend(tmp_path, monkeypatch):
    """broadcast_object/all_gather_objects round-trip objects of uneven sizes; teardown waits for the backend."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(dist_utils.free_port()))
    mp.start_processes(_collectives, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["from_0"] == {"epoch": 3, "rank": 0, "text": "é" * 5}
        assert report["from_1"] == "xxx"
        assert report["gathered"] == [[0, 10], [1, 1010]]
        assert report["mean"] == 1.5
        assert report["any_all"] == [[True, True], [False, True]]
        assert report["held_after_teardown"] == 0, f"rank {rank}: the backend still held trainkit's tensors"
        assert report["still_distributed"] is False


class SlowBackend:
    """Stands in for a backend thread: holds a tensor, lets go of it after ``delay_s`` (never when None)."""

    def __init__(self, delay_s: float | None) -> None:
        self.tensor: torch.Tensor | None = torch.zeros(4)
        dist_utils.handed_to_backend(self.tensor)
        if delay_s is not None:
            threading.Timer(delay_s, self.release).start()

    def release(self) -> None:
        self.tensor = None


def test_wait_for_the_backend_returns_once_it_lets_go_and_gives_up_at_the_bound():
    """The teardown wait ends when the last handed-over tensor is freed, and returns False at its bound."""
    dist_utils.held_by_backend().clear()
    SlowBackend(0.2)
    start = time.monotonic()
    assert dist_utils.wait_until_backend_lets_go(10) is True
    assert 0.15 <= time.monotonic() - start < 5
    assert dist_utils.held_by_backend() == []

    stuck = SlowBackend(None)
    start = time.monotonic()
    assert dist_utils.wait_until_backend_lets_go(0.3) is False
    assert time.monotonic() - start >= 0.3
    stuck.release()
    assert dist_utils.wait_until_backend_lets_go(0.3) is True
