"""Gate for ``ckpt.async_save``: how long a save blocks the loop, and how much training the writer costs.

    python -m benchmarks.async_save [--mb 600] [--rounds 3] [--device cpu|cuda] [--out benchmarks/results]

A ~600 MB state (a model's weights plus Adam's two moments) is saved three ways, interleaved:
- sync: :func:`trainkit.checkpoint.atomic_save` (temp file, fsync, replace, directory fsync);
- async: the time the loop is blocked (staging the state into reused host buffers and starting the
  writer), and the training time lost while the writer runs (a fixed amount of matmul work timed with and
  without the writer running, measured side by side).
Gates (ratios to the synchronous save): blocked <= 0.15, blocked + lost <= 0.5. Exits 1 when one is missed.
With ``--device cuda`` the state lives on the GPU, staging copies it into pinned host buffers, and the
training stand-in is GPU matmul work launched from the loop's thread (``async_save_cuda.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, write_json
from trainkit.checkpoint import atomic_save
from trainkit.checkpoint.formats.async_save import AsyncCheckpointWriter, StagingBuffers

GATE_BLOCKED = 0.15
GATE_BLOCKED_PLUS_LOST = 0.5


def make_state(total_mb: int, device: torch.device) -> dict:
    """Weights plus two Adam moments of the same size, in 64 tensors, about ``total_mb`` MB in all."""
    per_copy = total_mb * 2**20 // 3 // 4  # float32 elements per copy
    shapes = [(per_copy // 64,)] * 64
    weights = {f"layer{i}.weight": torch.randn(shape, device=device) for i, shape in enumerate(shapes)}
    adam = {
        i: {
            "exp_avg": torch.randn(shape, device=device),
            "exp_avg_sq": torch.rand(shape, device=device),
            "step": torch.tensor(10.0),
        }  # Adam keeps step on the CPU unless capturable
        for i, shape in enumerate(shapes)
    }
    return {"model": weights, "optimizer": {"state": adam, "param_groups": [{"lr": 1e-3, "params": list(range(64))}]}}


def train_work(steps: int, device: torch.device) -> float:
    """A fixed amount of compute standing in for training steps; returns its wall time."""
    size = 384 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        a = torch.tanh(a @ a) * 0.5
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600, help="state size in MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    state = make_state(args.mb, device)
    staging = StagingBuffers()
    writer = AsyncCheckpointWriter()
    steps = 40 if device.type == "cpu" else 200
    train_work(5, device)
    rows = {"sync_s": [], "blocked_s": [], "lost_s": [], "writer_s": []}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
        path = Path(folder) / "last.pt"
        atomic_save(state, path)  # warm-up: page cache, first-time allocations
        staging.stage(state)
        for _ in range(args.rounds):
            rows["sync_s"].append(atomic_save(state, path, keep_previous=True))
            alone = train_work(steps, device)
            start = time.perf_counter()
            staged = staging.stage(state)
            writer.submit([(staged, path)])
            rows["blocked_s"].append(time.perf_counter() - start)
            busy_start = time.perf_counter()
            with_writer = 0.0
            while writer.busy:  # train while the writer writes, as the loop would
                with_writer += train_work(steps, device)
                if time.perf_counter() - busy_start > 120:
                    break
            writer.wait()
            rows["writer_s"].append(writer.last_seconds or 0.0)
            # the same compute alone takes (with_writer / one batch) batches' time: the excess is what was lost
            batches = max(1, round(with_writer / alone)) if with_writer else 0
            rows["lost_s"].append(max(0.0, with_writer - batches * alone) if batches else 0.0)
    med = {key: statistics.median(values) for key, values in rows.items()}
    blocked = med["blocked_s"] / med["sync_s"]
    blocked_plus_lost = (med["blocked_s"] + med["lost_s"]) / med["sync_s"]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "state_mb": args.mb,
        "rounds": args.rounds,
        "median_s": med,
        "blocked_over_sync": blocked,
        "blocked_plus_lost_over_sync": blocked_plus_lost,
        "gates": {"blocked_over_sync": GATE_BLOCKED, "blocked_plus_lost_over_sync": GATE_BLOCKED_PLUS_LOST},
    }
    failures = []
    if blocked > GATE_BLOCKED:
        failures.append(f"blocked / sync = {blocked:.3f} > {GATE_BLOCKED}")
    if blocked_plus_lost > GATE_BLOCKED_PLUS_LOST:
        failures.append(f"(blocked + lost) / sync = {blocked_plus_lost:.3f} > {GATE_BLOCKED_PLUS_LOST}")
    report["failures"] = failures
    write_json(args.out, "async_save.json" if device.type == "cpu" else "async_save_cuda.json", report)
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
