"""GPU check: no host syncs on trainkit's per-step path, overhead vs a raw loop, snapshots, memory, exact resume.

Run on a CUDA machine (a few minutes), from the repository root, as a module::

    python -m benchmarks.gpu_check [--out benchmarks/results] [--rounds 7]

Sections (each runs even when an earlier one failed; a failure is reported, and the exit status is 1):

- ``syncs``: the tiny workload through a BaseTrainer subclass calling every per-step helper
  (``progress``, ``log``, ``clip_and_log_grad_norm``, ``log_param_grad_stats`` on every step, ``log_lr``,
  ``optimizer.step`` with trainkit's step hook) each under ``torch.cuda.set_sync_debug_mode("error")``,
  so a host sync raises and is recorded with the call that made it. A control (``float(loss)`` under the
  same probe) must be caught, or the check proves nothing.
- ``timing``: trainkit / raw wall time on the GPU for the tiny (MLP on scikit-learn digits, batch 64) and
  medium (4x1024 MLP, synthetic) workloads, interleaved rounds, median of per-round ratios; two
  variants: ``off`` (the same loop, nothing else) and ``helpers`` (grad clipping with the norm logged
  and the loss logged every step, pushed once per epoch; raw does the same by hand). Final losses must
  be bitwise equal.
- ``memory``: peak ``max_memory_allocated``: ``off`` trainkit / raw <= 1.001; with best-model selection
  (on-device snapshot) trainkit minus exactly one snapshot buffer, over raw, <= 1.001.
- ``snapshot``: the best-model snapshot of a ~50M-parameter model (trainkit keeps it on the device: one
  ``_foreach_copy_``) against a flat device copy of the same bytes (gate 1.3); and the GPU-to-pinned
  staging used by ``ckpt.async_save`` against a flat copy into pinned memory (reported, same gate).
- ``resume``: a tiny run on the GPU with the batch order drawn from the CUDA generator, crashed after
  epoch 3 and resumed from ``last.pt``, ends bitwise equal to the uninterrupted run (CUDA RNG states and
  CUDA tensors through a checkpoint).

- ``sharded``: ``ckpt.format=sharded`` on one process (an 800 MB model and AdamW state on the GPU): blocked
  seconds of a sync and of an async save (goal: async <= 0.1x sync), and every published ``last.ckpt`` read
  back equal to the weights at its save, although they change on the device right after the save returns.

``--cpu-smoke`` runs the same code paths on the CPU at tiny sizes (no sync probe, no gates), so the test
suite keeps this script from rotting on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if "--cpu-smoke" in sys.argv:  # the trainer picks a GPU when it sees one: the smoke run must stay on the CPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from torch import nn  # noqa: E402

import trainkit  # noqa: E402
from benchmarks.common import RESULTS, keep_weights, save_inputs, write_json  # noqa: E402
from trainkit.checkpoint.formats.async_save import StagingBuffers
from trainkit.loop.weight_snapshot import WeightSnapshot
from trainkit.state.modules import module_state

GATE_SNAPSHOT = 1.3
GATE_PEAK = 1.001


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
        spec = {"width": 128, "depth": 1, "n_in": 64, "n_out": 10, "batch": 64, "epochs": 2 if smoke else 20}
    else:
        n = 1024 if smoke else 32768
        x = torch.randn(n, 1024, generator=gen)
        y = torch.randint(0, 10, (n,), generator=gen)
        spec = {
            "width": 256 if smoke else 1024,
            "depth": 4,
            "n_in": 1024,
            "n_out": 10,
            "batch": 512,
            "epochs": 1 if smoke else 2,
        }
    n_val = len(x) // 8
    return {
        **spec,
        "name": name,
        "x": x[n_val:].to(device),
        "y": y[n_val:].to(device),
        "x_val": x[:n_val].to(device),
        "y_val": y[:n_val].to(device),
    }


def batches(data: dict, order: torch.Tensor | None = None):
    x, y, size = data["x"], data["y"], data["batch"]
    if order is not None:
        x, y = x[order], y[order]
    for start in range(0, len(x) - size + 1, size):
        yield x[start : start + size], y[start : start + size]


def val_loss(model: nn.Module, data: dict) -> torch.Tensor:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(data["x_val"]), data["y_val"])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- raw loops


def raw_run(data: dict, device: torch.device, variant: str) -> dict:
    """The hand-written loop. ``helpers``: clip with the norm kept, loss and norm averaged per epoch by hand."""
    torch.manual_seed(0)
    model = mlp(data["width"], data["depth"], data["n_in"], data["n_out"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = []
    best, best_state = float("inf"), None
    for _ in range(data["epochs"]):
        loss_sum = norm_sum = None
        for x, y in batches(data):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if variant in ("helpers", "best"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                loss_sum = loss.detach().clone() if loss_sum is None else loss_sum.add_(loss.detach())
                norm_sum = norm.clone() if norm_sum is None else norm_sum.add_(norm)
            optimizer.step()
        if variant in ("helpers", "best"):
            history.append(torch.stack([loss_sum, norm_sum]).tolist())  # one transfer per epoch
        if variant == "best":
            score = float(val_loss(model, data))
            if score < best:
                best = score
                best_state = keep_weights(best_state, model)
    return {"loss": float(loss), "history": history}


# ---------------------------------------------------------------------------------------------- trainkit


class SyncProbe:
    """Runs blocks under ``set_sync_debug_mode("error")`` and records which labelled call synced first."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.violations: dict[str, str] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def check(self, label: str):
        if not self.enabled:
            yield
            return
        self.calls[label] = self.calls.get(label, 0) + 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        except RuntimeError as exc:
            if "synchroniz" not in str(exc).lower():
                raise
            self.violations.setdefault(label, str(exc).splitlines()[0])
        finally:
            torch.cuda.set_sync_debug_mode(0)


class CheckTrainer(trainkit.BaseTrainer):
    """The raw loop through BaseTrainer; ``variant`` picks which per-step helpers it calls."""

    data: dict = {}
    variant = "off"
    probe = SyncProbe(False)
    crash_after_epoch: int | None = None
    shuffle_on_device = False

    def setup(self, ckpt):
        torch.manual_seed(0)
        d = self.data
        self.model = self.make_ddp(mlp(d["width"], d["depth"], d["n_in"], d["n_out"]))
        # the syncs variant also goes through get_param_groups; the timed ones match raw's AdamW exactly
        params = self.get_param_groups() if self.variant == "syncs" else self.model.parameters()
        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.history: list[list[float]] = []
        self.last_loss = torch.zeros(())

    def train_epoch(self):
        probe, variant = self.probe, self.variant
        self.last_loss = None  # holding last epoch's loss through this one would cost raw-loop-foreign memory
        order = None
        if self.shuffle_on_device:  # drawn from the CUDA generator: resume must restore its state
            order = torch.randperm(len(self.data["x"]), device=self.device)
        steps = iter(self.progress(batches(self.data, order)))
        loss = torch.zeros(())
        while True:
            with probe.check("progress"):
                batch = next(steps, None)
            if batch is None:
                break
            x, y = batch
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if variant == "syncs":
                with probe.check("log_param_grad_stats"):
                    self.log_param_grad_stats()
            if variant != "off":
                with probe.check("clip_and_log_grad_norm"):
                    self.clip_and_log_grad_norm()
            with probe.check("optimizer.step (with trainkit's step hook)"):
                self.optimizer.step()
            if variant != "off":
                with probe.check("log"):
                    self.log({"train/loss": loss.detach()})
            if variant == "syncs":
                with probe.check("log_lr"):
                    self.log_lr()
        self.last_loss = loss.detach()
        if variant in ("helpers", "best", "syncs"):
            self.log_epoch_grad_norm()
        if self.crash_after_epoch is not None and self.epoch == self.crash_after_epoch:
            raise KeyboardInterrupt("simulated crash")

    def val_epoch(self):
        if self.variant == "best":
            self.save_if_best(float(val_loss(self.model, self.data)))
        return False


def trainkit_config(data: dict, out_dir: str, variant: str, ckpt: bool = False) -> dict[str, Any]:
    return {
        "epochs": data["epochs"],
        "out_dir": out_dir,
        "grad_clip": 1.0,
        "wandb": {"mode": "disabled"},
        "progress": {"enable": variant == "syncs"},
        "ckpt": {"enable": ckpt, "resume": "auto" if ckpt else "never"},
        "log_weight_stats": variant == "syncs",
        "log_grad_stats": variant == "syncs",
        "log_stats_every_n_steps": 1,
    }


def trainkit_run(data: dict, out_dir: str, variant: str, probe: SyncProbe | None = None) -> dict:
    CheckTrainer.data, CheckTrainer.variant = data, variant
    CheckTrainer.probe = probe or SyncProbe(False)
    trainer = CheckTrainer(trainkit_config(data, out_dir, variant))
    trainer.train()
    trainer.close()
    return {"loss": float(trainer.last_loss), "trainer": trainer}


# ---------------------------------------------------------------------------------------------- sections


def check_syncs(device: torch.device, smoke: bool) -> dict:
    data = workload("tiny", device, smoke)
    data["epochs"] = 2
    probe = SyncProbe(enabled=device.type == "cuda")
    with tempfile.TemporaryDirectory() as out:
        trainkit_run(data, out, "syncs", probe)
    control = SyncProbe(enabled=probe.enabled)
    head = nn.Linear(64, 10).to(device)
    with control.check("control: float(loss)"):
        float(val_loss(head, data))
    result = {
        "probed_calls": probe.calls,
        "violations": probe.violations,
        "control_caught": bool(control.violations) if probe.enabled else None,
    }
    failures = [f"host sync in {label}: {msg}" for label, msg in probe.violations.items()]
    if probe.enabled and not control.violations:
        failures.append("the sync probe did not catch float(loss): the check proves nothing on this torch")
    return {**result, "failures": failures}


def timed(fn, device: torch.device) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return time.perf_counter() - start, value


def check_timing(device: torch.device, smoke: bool, rounds: int) -> dict:
    result: dict[str, Any] = {}
    failures = []
    with tempfile.TemporaryDirectory() as out:
        for name in ("tiny", "medium"):
            data = workload(name, device, smoke)
            for variant in ("off", "helpers"):
                contestants = {
                    "raw": lambda d=data, v=variant: raw_run(d, device, v),
                    "trainkit": lambda d=data, v=variant: trainkit_run(d, out, v),
                }
                times: dict[str, list[float]] = {k: [] for k in contestants}
                losses: dict[str, set[float]] = {k: set() for k in contestants}
                for round_index in range(rounds + 1):  # round 0 warms up and is discarded
                    order = list(contestants) if round_index % 2 else list(reversed(contestants))
                    for key in order:
                        seconds, value = timed(contestants[key], device)
                        losses[key].add(value["loss"])
                        if round_index:
                            times[key].append(seconds)
                ratios = [t / r for t, r in zip(times["trainkit"], times["raw"])]
                same = len(losses["raw"]) == 1 and losses["raw"] == losses["trainkit"]
                result[f"{name}/{variant}"] = {
                    "steps": data["epochs"] * (len(data["x"]) // data["batch"]),
                    "raw_s": statistics.median(times["raw"]),
                    "trainkit_s": statistics.median(times["trainkit"]),
                    "trainkit_over_raw": statistics.median(ratios),
                    "min_max": [min(ratios), max(ratios)],
                    "same_final_loss": same,
                }
                if not same:
                    failures.append(f"{name}/{variant}: different final losses {losses}")
    return {**result, "failures": failures}


def peak_memory(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        fn()
        return None
    synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated() - base


def check_memory(device: torch.device, smoke: bool) -> dict:
    """Peak device memory of trainkit against the hand-written loop, beyond the best-model snapshot, per workload
    and variant. A CPU has no peak to read: the smoke run goes through the code paths on the tiny workload only
    (the medium one would repeat them).

    :param device: The device.
    :param smoke: The CPU smoke run.
    :returns: Each workload and variant's peaks, and the failures.
    """
    result: dict[str, Any] = {}
    failures = []
    with tempfile.TemporaryDirectory() as out:
        for name in ("tiny",) if smoke else ("tiny", "medium"):
            data = workload(name, device, smoke)
            raw_run(data, device, "best")
            trainkit_run(data, out, "best")  # warm-up: cuBLAS workspaces and the like are in neither peak
            for variant in ("off", "best"):
                holder: dict[str, Any] = {}
                raw_peak = peak_memory(lambda d=data, v=variant: raw_run(d, device, v), device)
                tk_peak = peak_memory(lambda d=data, v=variant, h=holder: h.update(trainkit_run(d, out, v)), device)
                trainer = holder["trainer"]
                snapshot = sum(
                    t.numel() * t.element_size()
                    for t in (trainer.best_model or {}).values()
                    if isinstance(t, torch.Tensor)
                )
                entry = {"raw_peak_bytes": raw_peak, "trainkit_peak_bytes": tk_peak, "snapshot_bytes": snapshot}
                if raw_peak:
                    # raw's "best" loop keeps a snapshot of its own; "off" has none on either side (0 bytes)
                    ratio = (tk_peak - snapshot) / (raw_peak - snapshot)
                    entry["trainkit_minus_snapshot_over_raw_minus_snapshot"] = ratio
                    entry["extra_bytes_beyond_snapshot"] = tk_peak - raw_peak
                    if ratio > GATE_PEAK:
                        failures.append(f"{name}/{variant}: peak memory ratio {ratio:.5f} > {GATE_PEAK}")
                result[f"{name}/{variant}"] = entry
                holder.clear()  # the trainer, and its snapshot, go before the next measurement
                del trainer
    return {**result, "failures": failures}


def device_timer(device: torch.device):
    if device.type != "cuda":

        def run(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return run

    def run_cuda(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    return run_cuda


def check_snapshot(device: torch.device, smoke: bool, rounds: int) -> dict:
    width = 256 if smoke else 4096
    depth = 2 if smoke else 3  # 3 x (4096^2 + 4096) ~ 50M parameters
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)

    timer = device_timer(device)
    # what save_if_best does on an improvement: read the state dict, copy it into the snapshot's tensors
    snapshot = WeightSnapshot()

    def take() -> None:
        snapshot.take(module_state(model))

    take()  # allocates the snapshot once; the timed takes refill it in place (nobody else holds it)
    nbytes = sum(t.numel() * t.element_size() for t in snapshot.state.values())
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    flat_dst = torch.empty_like(flat_src)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = StagingBuffers()
    state = model.state_dict()
    staging.stage(state)  # allocates the pinned buffers once
    targets = list(snapshot.state.values())
    sources = [v.detach() for v in state.values()]
    fns = {
        "snapshot_on_device": take,
        "flat_device_copy": lambda: flat_dst.copy_(flat_src),
        # what the snapshot is made of, for when it misses its gate
        "one_foreach_copy": lambda: torch._foreach_copy_(targets, sources),
        "copy_each": lambda: [t.copy_(v) for t, v in zip(targets, sources)],
        "state_dict_only": model.state_dict,
        "staging_to_pinned": lambda: staging.stage(state),
        "flat_copy_to_pinned": lambda: pinned.copy_(flat_src, non_blocking=True),
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for round_index in range(3 * rounds + 1):
        for key, fn in fns.items():
            seconds = timer(fn)
            if round_index:
                samples[key].append(seconds)
    exact = all(torch.equal(snapshot.state[k], v) for k, v in state.items())
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": nbytes,
        "median_s": med,
        "device_copy_GBps": 2 * nbytes / med["flat_device_copy"] / 1e9,
        "pinned_copy_GBps": nbytes / med["flat_copy_to_pinned"] / 1e9,
        "snapshot_over_device_copy": med["snapshot_on_device"] / med["flat_device_copy"],
        "staging_over_pinned_copy": med["staging_to_pinned"] / med["flat_copy_to_pinned"],
        "snapshot_equals_weights": exact,
        "gate": GATE_SNAPSHOT,
    }
    failures = []
    if device.type == "cuda":
        for key in ("snapshot_over_device_copy", "staging_over_pinned_copy"):
            if result[key] > GATE_SNAPSHOT:
                failures.append(f"{key} = {result[key]:.3f} > {GATE_SNAPSHOT}")
    if not exact:
        failures.append("the snapshot differs from the weights")
    return {**result, "failures": failures}


def check_resume(device: torch.device, smoke: bool) -> dict:
    data = workload("tiny", device, smoke)
    data["epochs"] = 3 if smoke else 6
    crash = 1 if smoke else 3

    def run(out: str, crash_after: int | None) -> CheckTrainer:
        CheckTrainer.data, CheckTrainer.variant, CheckTrainer.probe = data, "best", SyncProbe(False)
        CheckTrainer.crash_after_epoch, CheckTrainer.shuffle_on_device = crash_after, True
        try:
            trainer = CheckTrainer(trainkit_config(data, out, "best", ckpt=True))
            trainer.train()
            trainer.close()
            return trainer
        finally:
            CheckTrainer.crash_after_epoch, CheckTrainer.shuffle_on_device = None, False

    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as split:
        reference = run(whole, None)
        try:
            run(split, crash)
        except KeyboardInterrupt:
            pass
        else:
            return {"failures": ["the simulated crash did not happen"]}
        ckpt = torch.load(Path(split) / "last.pt", weights_only=True, map_location="cpu")
        resumed = run(split, None)
        ref_state, res_state = reference.model.state_dict(), resumed.model.state_dict()
        same_weights = all(torch.equal(ref_state[k], res_state[k]) for k in ref_state)
        same_best = reference.best_state == resumed.best_state
        same_history = reference.best_metrics == resumed.best_metrics
    result = {
        "device": str(next(resumed.model.parameters()).device),
        "crashed_after_epoch": crash,
        "checkpoint_epoch": ckpt["epoch"],
        "cuda_rng_in_checkpoint": "cuda" in ckpt["rng"][0],
        "bitwise_equal_weights": same_weights,
        "same_best_state": same_best,
        "same_best_metrics": same_history,
    }
    failures = [] if same_weights and same_best and same_history else ["resumed run differs from the uninterrupted run"]
    if device.type == "cuda" and not result["cuda_rng_in_checkpoint"]:
        failures.append("last.pt holds no CUDA RNG state")
    return {**result, "failures": failures}


def sharded_state(device: torch.device, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Square Linear layers with AdamW's moments on the device (the checkpoint has its full size)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


def check_sharded(device: torch.device, smoke: bool, rounds: int) -> dict:
    """``ckpt.format=sharded`` on one process, sync and async (staged into reused host buffers, pinned and
    filled by non-blocking copies on a GPU): the seconds the loop is blocked per save, and whether each
    published ``last.ckpt`` holds the weights of its save's moment although they change on the device right
    after the save returns (a staging copy not finished by then would publish the changed ones).

    The saves go through the checkpointer part itself (``trainkit.checkpoint.checkpointer.Checkpointer``, what the
    trainer's loop calls at an epoch's end), built from plain values as the trainer builds it."""
    from trainkit.checkpoint.checkpointer import Checkpointer
    from trainkit.checkpoint.formats import dcp_directory
    from trainkit.config import Config, public_config

    width, layers = (64, 4) if smoke else (2048, 16)
    model, optimizer = sharded_state(device, width, layers)
    record, registry = save_inputs({"model": model, "optimizer": optimizer})
    result: dict[str, Any] = {}
    failures = []
    for variant in ("sync", "async"):
        with tempfile.TemporaryDirectory() as out:
            cfg = Config.from_mapping(
                {"epochs": 1, "out_dir": out, "ckpt": {"format": "sharded", "async_save": variant == "async"}}
            )
            checkpointer = Checkpointer(
                Path(out), cfg.ckpt, rank=0, world_size=1, timeout_s=60.0, device=device, config=public_config(cfg)
            )
            checkpointer.claim()
            try:
                checkpointer.save(record, registry, best_weights=None, before=lambda: None)  # warm-up: the host copy
                checkpointer.wait()
                blocked, exact = [], True
                for _ in range(max(rounds, 3)):
                    expected = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
                    synchronize(device)
                    begun = time.perf_counter()
                    checkpointer.save(record, registry, best_weights=None, before=lambda: None)
                    blocked.append(time.perf_counter() - begun)
                    with torch.no_grad():  # the next steps change the weights while the shards are written
                        for parameter in model.parameters():
                            parameter.add_(1.0)
                    checkpointer.wait()
                    published = dcp_directory.read_whole(checkpointer.last_path, "model")
                    exact = exact and all(torch.equal(published[key], value) for key, value in expected.items())
                checkpointer.finish()
            finally:
                checkpointer.close(failed=False, before_release=lambda: None)
        result[f"{variant} blocked_s"] = round(statistics.median(blocked), 4)
        result[f"{variant} published the save's weights"] = exact
        if not exact:
            failures.append(f"{variant}: a published last.ckpt differs from the weights at its save")
    result["checkpoint MiB"] = round(3 * layers * width**2 * 4 / 2**20, 1)
    result["async / sync"] = round(result["async blocked_s"] / result["sync blocked_s"], 3)
    if not smoke and result["async / sync"] > 0.1:
        failures.append(f"async blocked {result['async / sync']} of a sync save (goal <= 0.1)")
    return {**result, "failures": failures}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run the code paths on the CPU, tiny sizes, no gates")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("gpu_check needs CUDA; use --cpu-smoke to exercise the script on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    rounds = 1 if smoke else args.rounds
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    sections = {
        "syncs": lambda: check_syncs(device, smoke),
        "timing": lambda: check_timing(device, smoke, rounds),
        "memory": lambda: check_memory(device, smoke),
        "snapshot": lambda: check_snapshot(device, smoke, rounds),
        "resume": lambda: check_resume(device, smoke),
        "sharded": lambda: check_sharded(device, smoke, rounds),
    }
    failures: list[str] = []
    for name, section in sections.items():
        start = time.perf_counter()
        try:
            report[name] = section()
        except Exception:  # noqa: BLE001 - report it and go on: one device run must tell as much as it can
            report[name] = {"error": traceback.format_exc(), "failures": [f"{name} raised"]}
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        failures += [f"{name}: {f}" for f in report[name]["failures"]]
        print(f"[{name}] done in {report[name]['seconds']} s; failures: {report[name]['failures']}", flush=True)
    report["failures"] = failures
    write_json(args.out, "gpu_check_smoke.json" if smoke else "gpu_check.json", report)
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
