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
    assert dist_utils.wait_until_backend_lets_go(120) is True
    assert 0.15 <= time.monotonic() - start < 60  # at the release, far from the bound, however loaded the host
    assert dist_utils.held_by_backend() == []

    stuck = SlowBackend(None)
    start = time.monotonic()
    assert dist_utils.wait_until_backend_lets_go(0.3) is False
    assert time.monotonic() - start >= 0.3
    stuck.release()
    assert dist_utils.wait_until_backend_lets_go(0.3) is True


def _join_with_restart_count(rank: int, port: int, out_dir: str) -> None:
    """One rank of a 2-agent torchrun job under the agents' shared store, whose agent counted ``rank + 1`` restarts
    (one agent joined later than the other): it writes what joining the process group raised."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", GROUP_WORLD_SIZE="2",
        TORCHELASTIC_RESTART_COUNT=str(rank + 1),
    )  # fmt: skip
    try:
        dist_utils.init_process_group(rank, 2, backend="gloo", timeout_s=2.0, device=torch.device("cpu"))
        raised = None
    except Exception as exc:  # noqa: BLE001 - what it raised is what the test reads
        raised = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"raised": raised}, handle)


def test_agents_that_counted_different_restarts_are_told_to_stop_sharing_the_store(tmp_path):
    """The ranks of two torchrun agents whose restart counts differ do not meet in the shared agent store: each
    fails within dist.timeout_s with an error naming the counts and the setting that gives each attempt its store."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's shared store
    mp.start_processes(_join_with_restart_count, args=(store.port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        raised = json.loads((tmp_path / f"rank{rank}.json").read_text())["raised"]
        assert raised.startswith("DistributedError: ") and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in raised
        assert f"TORCHELASTIC_RESTART_COUNT={rank + 1} here" in raised
