"""GPU check: no host syncs on trainkit's per-step path, overhead vs a raw loop, snapshot speed, peak memory.

Run on a CUDA machine (under 5 minutes)::

    python benchmarks/gpu_check.py [--out benchmarks/results]

It runs the tiny (MLP on scikit-learn digits, batch 64) and medium (4x1024 MLP, synthetic) workloads as a
raw PyTorch loop and as a BaseTrainer subclass doing the same work, with
``torch.cuda.set_sync_debug_mode("error")`` around every trainkit call made per step (a host sync there
raises). It prints and writes (``gpu_check.json``): trainkit / raw wall time per workload, the best-model
snapshot of a ~50M-parameter model (trainkit keeps ``best_model`` on the device: an on-device
``_foreach_copy_``) against a flat device copy of the same bytes and against a copy to pinned host memory,
and peak memory: trainkit / raw, and the difference against exactly one snapshot buffer.

``--cpu-smoke`` runs the same code paths on the CPU at a tiny size (no sync checks, no gates), so the test
suite keeps this script from rotting on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainkit  # noqa: E402


def mlp(width: int, depth: int, n_in: int, n_out: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(n_in if i == 0 else width, width), nn.ReLU()]
    layers.append(nn.Linear(width, n_out))
    return nn.Sequential(*layers)


def workload(name: str, device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    if name == "tiny":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target)
        spec = {"width": 64, "depth": 2, "n_in": 64, "n_out": 10, "batch": 64, "epochs": 2 if smoke else 10}
    else:
        n = 512 if smoke else 16384
        x = torch.randn(n, 1024, generator=gen)
        y = torch.randint(0, 10, (n,), generator=gen)
        spec = {"width": 256 if smoke else 1024, "depth": 4, "n_in": 1024, "n_out": 10, "batch": 256,
                "epochs": 1 if smoke else 3}
    return {**spec, "x": x.to(device), "y": y.to(device)}


def batches(data: dict):
    x, y, size = data["x"], data["y"], data["batch"]
    for start in range(0, len(x) - size + 1, size):
        yield x[start : start + size], y[start : start + size]


def raw_run(data: dict, device: torch.device) -> float:
    torch.manual_seed(0)
    model = mlp(data["width"], data["depth"], data["n_in"], data["n_out"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(data["epochs"]):
        for x, y in batches(data):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
    return float(loss)


@contextmanager
def sync_errors(enabled: bool):
    """Make any host sync raise while the block runs (CUDA only)."""
    if enabled:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if enabled:
            torch.cuda.set_sync_debug_mode(0)


class CheckTrainer(trainkit.BaseTrainer):
    """The raw loop through BaseTrainer, with trainkit's per-step calls under sync_errors."""

    data: dict = {}
    check_syncs = False

    def setup(self, ckpt):
        torch.manual_seed(0)
        d = self.data
        self.model = mlp(d["width"], d["depth"], d["n_in"], d["n_out"]).to(self.device)
        self.optimizer = torch.optim.AdamW(self.get_param_groups(), lr=1e-3)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)

    def train_epoch(self):
        for x, y in self.progress(batches(self.data)):
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with sync_errors(self.check_syncs):
                self.log_param_grad_stats()
                self.clip_and_log_grad_norm()
            self.optimizer.step()
            with sync_errors(self.check_syncs):
                self.log({"train/loss": loss.detach()})
        self.last_loss = loss.detach()

    def val_epoch(self):
        return False


def trainkit_run(data: dict, device: torch.device, out_dir: str, check_syncs: bool) -> float:
    CheckTrainer.data = data
    CheckTrainer.check_syncs = check_syncs
    cfg = {"epochs": data["epochs"], "out_dir": out_dir, "grad_clip": 1.0, "wandb": {"mode": "disabled"},
           "progress": {"enable": False}, "ckpt": {"enable": False, "resume": "never"},
           "log_weight_stats": True, "log_grad_stats": True, "log_stats_every_n_steps": 50}
    trainer = CheckTrainer(cfg)
    trainer.train()
    return float(trainer.last_loss)


def timed(fn, device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, value


def peak_memory(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated()


def snapshot_check(device: torch.device, smoke: bool, rounds: int) -> dict:
    width = 256 if smoke else 4096
    depth = 2 if smoke else 3  # 3 x 4096^2 ~ 50M parameters
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)

    class Snap(trainkit.BaseTrainer):
        def setup(self, ckpt):
            self.model = model

        def train_epoch(self):
            pass

        def val_epoch(self):
            return False

    with tempfile.TemporaryDirectory() as out:
        trainer = Snap({"epochs": 1, "out_dir": out, "wandb": {"mode": "disabled"}, "progress": {"enable": False},
                        "ckpt": {"enable": False, "resume": "never"}})
        trainer._snapshot_best()  # allocates the buffers once
        nbytes = sum(t.numel() * t.element_size() for t in trainer.best_model.values())
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        results: dict[str, list[float]] = {"snapshot": [], "device_memcpy": [], "to_pinned_host": []}
        for _ in range(rounds + 1):
            for key, fn in (("snapshot", trainer._snapshot_best), ("device_memcpy", lambda: flat_dst.copy_(flat_src)),
                            ("to_pinned_host", lambda: pinned.copy_(flat_src, non_blocking=True))):
                seconds, _ = timed(fn, device)
                results[key].append(seconds)
    medians = {k: statistics.median(v[1:]) for k, v in results.items()}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": nbytes,
        "median_s": medians,
        "snapshot_over_memcpy": medians["snapshot"] / medians["device_memcpy"],
        "gate_snapshot_over_memcpy": 1.3,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run the code paths on the CPU, tiny sizes, no gates")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("gpu_check needs CUDA; use --cpu-smoke to exercise the script on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    rounds = 1 if smoke else args.rounds
    report: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)", "torch": torch.__version__}
    failures = []
    with tempfile.TemporaryDirectory() as out:
        for name in ("tiny", "medium"):
            data = workload(name, device, smoke)
            trainkit_run(data, device, out, check_syncs=not smoke)  # warm-up, and the sync check
            raw_times, tk_times = [], []
            for _ in range(rounds):
                seconds, raw_loss = timed(lambda d=data: raw_run(d, device), device)
                raw_times.append(seconds)
                seconds, tk_loss = timed(lambda d=data: trainkit_run(d, device, out, check_syncs=False), device)
                tk_times.append(seconds)
            raw_peak = peak_memory(lambda d=data: raw_run(d, device), device)
            tk_peak = peak_memory(lambda d=data: trainkit_run(d, device, out, check_syncs=False), device)
            ratio = statistics.median(tk_times) / statistics.median(raw_times)
            report[name] = {
                "raw_s": statistics.median(raw_times),
                "trainkit_s": statistics.median(tk_times),
                "trainkit_over_raw": ratio,
                "same_loss": raw_loss == tk_loss,
                "raw_peak_bytes": raw_peak,
                "trainkit_peak_bytes": tk_peak,
                "peak_ratio": (tk_peak / raw_peak) if raw_peak else None,
                "host_syncs_in_trainkit_calls": (
                    "none (sync debug mode 'error' raised nothing)" if not smoke else "not checked"
                ),
            }
        report["snapshot"] = snapshot_check(device, smoke, rounds)
    if not smoke:
        if report["snapshot"]["snapshot_over_memcpy"] > 1.3:
            failures.append("snapshot / memcpy > 1.3")
        for name in ("tiny", "medium"):
            if report[name]["peak_ratio"] is not None and report[name]["peak_ratio"] > 1.001:
                failures.append(f"{name}: peak memory trainkit / raw > 1.001 (snapshot not used in this run)")
    report["failures"] = failures
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / ("gpu_check_smoke.json" if smoke else "gpu_check.json")).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
