"""``overhead.py``'s ratio sections: real workloads (``training``), fresh interpreters (``import``), ``micro``.

Each section runs its contestants through the harness and adds a row per ratio to the :class:`Report`, judged
against :data:`~benchmarks.settings.GATES` where the row is a gate.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import REPO, log
from benchmarks.contestants import checkpoint_config, durable_save, fsync_dir, raw_run, trainkit_run, wandb_config
from benchmarks.harness import Contestant, Timings, interleave, new_tmp, run_group
from benchmarks.lightning_contestant import lightning_run
from benchmarks.settings import LR, SEED, Settings
from benchmarks.verdicts import Report
from benchmarks.workloads import Workload, medium_workload, tiny_workload
from trainkit.checkpoint import atomic_save
from trainkit.loop import optim
from trainkit.loop.weight_snapshot import WeightSnapshot
from trainkit.state.modules import module_state

# the clock each training gate is judged on with --clock auto: CPU time for what trainkit adds inside the
# process (Python work, tqdm, handing rows to W&B), wall time where the cost is waiting on the disk (fsync)
TINY_CLOCK = {"off": "cpu", "tqdm": "cpu", "wandb": "cpu", "ckpt": "wall", "steps": "cpu"}


def bench_training(report: Report, s: Settings, use_lightning: bool) -> None:
    """The training section: the tiny workload with each feature against its hand-written loop, step checkpoints,
    and the compute-bound medium workload.

    :param report: Where the rows, verdicts and work checks go.
    :param s: The run mode's sizes.
    :param use_lightning: Whether Lightning contestants run.
    """
    tiny = tiny_workload(s)
    log(
        f"tiny: digits MLP 64-128-10, Adam, batch 64, {tiny.epochs} epochs = {tiny.steps} steps per run; "
        f"{s.rounds} rounds x {s.tiny_reps} interleaved runs ({s.wandb_reps} for W&B), paired per repetition"
    )
    wandb_config(tiny)  # built here, not inside a timed run
    checkpoint_config(tiny)
    for feature, raw_name in (("off", "raw"), ("tqdm", "raw_tqdm"), ("wandb", "raw_wandb"), ("ckpt", "raw_ckpt")):
        bench_tiny_feature(report, s, tiny, feature, raw_name, use_lightning)
    bench_tiny_steps(report, s, tiny)
    bench_medium(report, s, use_lightning)


def bench_tiny_feature(
    report: Report, s: Settings, tiny: Workload, feature: str, raw_name: str, use_lightning: bool
) -> None:
    """One feature on the tiny workload: trainkit against the hand-written loop that does the same (gated), with
    the noise floor (``off``), the minimal checkpoint (``ckpt``) and Lightning beside it as information.

    :param report: Where the rows go.
    :param s: The run mode's sizes.
    :param tiny: The tiny workload.
    :param feature: The feature.
    :param raw_name: Its hand-written loop's name.
    :param use_lightning: Whether Lightning runs.
    """
    contestants = [
        Contestant(raw_name, lambda wl, tmp, f=feature: raw_run(wl, tmp, f), "raw"),
        Contestant("trainkit", lambda wl, tmp, f=feature: trainkit_run(wl, tmp, f), "trainkit"),
    ]
    if feature == "off":  # A/A control: the raw loop against itself shows the noise floor
        contestants.append(Contestant("raw (again)", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"))
    if feature == "ckpt":  # what the richer checkpoint costs: the minimal one a quick script writes
        contestants.append(Contestant("raw_ckpt_min", lambda wl, tmp: raw_run(wl, tmp, "ckpt_min"), "raw"))
    if use_lightning:
        contestants.append(Contestant("lightning", lambda wl, tmp, f=feature: lightning_run(wl, tmp, f), "lightning"))
    families = {c.name: c.family for c in contestants}
    reps = s.wandb_reps if feature == "wandb" else s.tiny_reps
    res = run_group(f"tiny/{feature}", tiny, contestants, s.rounds, reps)
    report.check_work(f"tiny/{feature}", res.outcomes, raw_name, families)
    for name, msgs in res.warnings.items():
        report.notes.extend(f"tiny/{feature}: {name} warned: {msg}" for msg in msgs)
    clock = report.pick(TINY_CLOCK[feature])
    t = res.times
    report.add_row("tiny", feature, "trainkit", raw_name, t["trainkit"], t[raw_name], clock, f"tiny/{feature}")
    if feature == "off":
        report.add_row("tiny", "off", "raw (again)", "raw", t["raw (again)"], t["raw"], clock, None)
    if feature == "ckpt":
        report.add_row("tiny", "ckpt", "trainkit", "raw_ckpt_min", t["trainkit"], t["raw_ckpt_min"], clock, None)
    if use_lightning:
        report.add_row("tiny", feature, "trainkit", "lightning", t["trainkit"], t["lightning"], clock, None)


def bench_tiny_steps(report: Report, s: Settings, tiny: Workload) -> None:
    """Step checkpoints (``ckpt.every_n_steps``, none due) with the epoch-end ``last.pt`` writes ``ckpt.enable``
    brings, on the tiny workload: against the raw loop (gated), and as information against trainkit writing the
    same files without step checkpoints (the tracked loop alone) and trainkit (off) (what turning them on costs).

    :param report: Where the rows go.
    :param s: The run mode's sizes.
    :param tiny: The tiny workload.
    """
    contestants = [
        Contestant("raw", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"),
        Contestant("trainkit", lambda wl, tmp: trainkit_run(wl, tmp, "steps"), "trainkit"),
        Contestant("trainkit (off)", lambda wl, tmp: trainkit_run(wl, tmp, "off"), "trainkit"),
        Contestant("trainkit (ckpt last)", lambda wl, tmp: trainkit_run(wl, tmp, "ckpt_last"), "trainkit"),
    ]
    res = run_group("tiny/steps", tiny, contestants, s.rounds, s.tiny_reps)
    report.check_work("tiny/steps", res.outcomes, "raw", {c.name: c.family for c in contestants})
    clock = report.pick(TINY_CLOCK["steps"])
    t = res.times
    report.add_row("tiny", "steps", "trainkit", "raw", t["trainkit"], t["raw"], clock, "tiny/steps")
    report.add_row("tiny", "steps", "trainkit", "trainkit (off)", t["trainkit"], t["trainkit (off)"], clock, None)
    report.add_row(
        "tiny", "steps", "trainkit", "trainkit (ckpt last)", t["trainkit"], t["trainkit (ckpt last)"], clock, None
    )


def bench_medium(report: Report, s: Settings, use_lightning: bool) -> None:
    """The compute-bound medium workload: trainkit against the raw loop (gated) with the noise floor, and step
    checkpoints against trainkit writing the same ``last.pt`` without them (gated; both write it once).

    :param report: Where the rows go.
    :param s: The run mode's sizes.
    :param use_lightning: Whether Lightning runs.
    """
    medium = medium_workload(s)
    log(
        f"medium: MLP 256-4x1024-10, Adam, batch 128, {medium.steps} steps per run; "
        f"{s.rounds} rounds x {s.medium_reps} interleaved runs"
    )
    contestants = [
        Contestant("raw", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"),
        Contestant("trainkit", lambda wl, tmp: trainkit_run(wl, tmp, "off"), "trainkit"),
        Contestant("raw (again)", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"),
        Contestant("trainkit (steps)", lambda wl, tmp: trainkit_run(wl, tmp, "steps"), "trainkit"),
        Contestant("trainkit (ckpt last)", lambda wl, tmp: trainkit_run(wl, tmp, "ckpt_last"), "trainkit"),
    ]
    if use_lightning:
        contestants.append(Contestant("lightning", lambda wl, tmp: lightning_run(wl, tmp, "off"), "lightning"))
    res = run_group("medium/off", medium, contestants, s.rounds, s.medium_reps)
    report.check_work("medium/off", res.outcomes, "raw", {c.name: c.family for c in contestants})
    clock = report.pick("cpu")
    t = res.times
    report.add_row("medium", "off", "trainkit", "raw", t["trainkit"], t["raw"], clock, "medium/off")
    report.add_row("medium", "off", "raw (again)", "raw", t["raw (again)"], t["raw"], clock, None)
    report.add_row("medium", "steps", "trainkit (steps)", "raw", t["trainkit (steps)"], t["raw"], clock, None)
    report.add_row("medium", "steps", "trainkit (steps)", "trainkit", t["trainkit (steps)"], t["trainkit"], clock, None)
    steps, last = t["trainkit (steps)"], t["trainkit (ckpt last)"]
    report.add_row("medium", "steps", "trainkit (steps)", "trainkit (ckpt last)", steps, last, clock, "medium/steps")
    if use_lightning:
        report.add_row("medium", "off", "trainkit", "lightning", t["trainkit"], t["lightning"], clock, None)


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_import(report: Report, s: Settings) -> None:
    """The import section: ``import trainkit`` and ``from trainkit import BaseTrainer`` against ``import torch``,
    each in a fresh interpreter, with bytecode cached.

    :param report: Where the rows and the note on what ``import trainkit`` loads go.
    :param s: The run mode's sizes.
    """
    log(
        f"import: a fresh interpreter per import, {s.import_rounds} rounds (+{s.import_warmups} warm-up), wall and "
        "child CPU time"
    )
    stmts = {
        "import torch": "import torch",
        "import trainkit": "import trainkit",
        "trainkit.BaseTrainer": "from trainkit import BaseTrainer",
    }
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    # bytecode cached, as every user's second import has it: the warm-up round writes trainkit's .pyc files (a host
    # with PYTHONDONTWRITEBYTECODE=1 would compile trainkit's sources in every timed child, ~40 ms that no user pays
    # twice, while torch's were compiled when pip installed it)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times = time_imports(stmts, env, s.import_rounds, s.import_warmups)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, trainkit; print(sorted(m for m in ('torch', 'wandb', 'tqdm', 'numpy') if m in sys.modules))",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    report.notes.append(
        f"`import trainkit` loads {probe.stdout.strip()} of torch/wandb/tqdm/numpy: BaseTrainer "
        "and torch are imported lazily, so the row `trainkit.BaseTrainer` (`from trainkit import "
        "BaseTrainer`) is the import a training script really pays"
    )
    clock = report.pick("cpu")
    for name, gate in (("import trainkit", "import/trainkit"), ("trainkit.BaseTrainer", "import/BaseTrainer")):
        report.add_row("import", "process", name, "import torch", times[name], times["import torch"], clock, gate)


def time_imports(stmts: dict[str, str], env: dict[str, str], rounds: int, warmups: int) -> dict[str, Timings]:
    """Time each statement in a fresh interpreter, the statements in a freshly shuffled order every round.

    :param stmts: Name to the statement run with ``python -c``.
    :param env: The children's environment.
    :param rounds: Measured rounds.
    :param warmups: Rounds run first and discarded.
    :returns: Each statement's wall and child CPU seconds.
    :raises SystemExit: When a statement fails.
    """
    times = {k: Timings() for k in stmts}
    shuffler = random.Random(2000)
    for rnd in range(rounds + warmups):
        order = list(stmts)
        shuffler.shuffle(order)
        for key in order:
            w0, c0 = time.perf_counter(), _child_cpu()
            proc = subprocess.run([sys.executable, "-c", stmts[key]], cwd=REPO, env=env, capture_output=True, text=True)
            w1, c1 = time.perf_counter(), _child_cpu()
            if proc.returncode != 0:
                raise SystemExit(f"`{stmts[key]}` failed:\n{proc.stderr}")
            if rnd >= warmups:
                times[key].wall.append(w1 - w0)
                times[key].cpu.append(c1 - c0)
    return times


def big_model(n_params: int) -> nn.Module:
    """Square linear layers (two tensors each) adding up to about ``n_params`` parameters."""
    width = 1024 if n_params >= 20_000_000 else 512
    layers = max(1, round(n_params / (width * width + width)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.01, 0.01)  # touch every page
    return model


def bench_snapshot(report: Report, s: Settings, model: nn.Module) -> None:
    rounds = max(s.rounds, 9) if s.mode == "full" else s.rounds
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"micro/snapshot: {n_params / 1e6:.1f}M parameters in {len(list(model.parameters()))} tensors "
        f"({n_params * 4 / 2**20:.0f} MiB); {rounds} rounds x {s.micro_reps}"
    )
    # what save_if_best does on an improvement (trainkit.loop.weight_snapshot): read the state dict, copy it into the
    # snapshot's tensors, which nobody else holds here, so they are refilled in place
    snapshot = WeightSnapshot()

    def take() -> None:
        snapshot.take(module_state(model))

    take()  # the first call allocates the snapshot; the timed ones reuse it
    flat_src = torch.empty(n_params).uniform_()
    flat_dst = torch.empty(n_params)
    state = model.state_dict()
    buffers = [torch.empty_like(v) for v in state.values()]
    times = interleave(
        {
            "snapshot": take,
            "memcpy": lambda: flat_dst.copy_(flat_src),
            "foreach": lambda: torch._foreach_copy_(buffers, [v.detach() for v in model.state_dict().values()]),
        },
        rounds,
        s.micro_reps,
        3000,
    )
    assert snapshot.state is not None
    assert all(torch.equal(snapshot.state[k], v) for k, v in state.items()), "the snapshot differs from the weights"
    clock = report.pick("cpu")
    report.add_row(
        "micro",
        "snapshot",
        "WeightSnapshot.take",
        "flat copy_",
        times["snapshot"],
        times["memcpy"],
        clock,
        "micro/snapshot",
    )
    report.add_row("micro", "snapshot", "_foreach_copy_", "flat copy_", times["foreach"], times["memcpy"], clock, None)


def bench_grad_norm(report: Report, s: Settings) -> None:
    rounds = max(s.rounds, 11) if s.mode == "full" else s.rounds
    norm_model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(s.norm_tensors // 2)])
    params = list(norm_model.parameters())
    gen = torch.Generator().manual_seed(SEED)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    log(
        f"micro/grad_norm: {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.1f}M elements, "
        f"{s.norm_calls} calls per sample; {rounds} rounds x {s.micro_reps}"
    )
    ours = optim.total_grad_norm(params)
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    assert torch.equal(ours, theirs), f"the grad norms differ: {ours} vs {theirs}"

    def run_ours() -> None:
        for _ in range(s.norm_calls):
            optim.total_grad_norm(params)

    def run_theirs() -> None:
        for _ in range(s.norm_calls):
            torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)

    times = interleave({"trainkit": run_ours, "torch": run_theirs}, rounds, s.micro_reps, 4000)
    report.add_row(
        "micro",
        "grad_norm",
        "total_grad_norm",
        "get_total_norm",
        times["trainkit"],
        times["torch"],
        report.pick("cpu"),
        "micro/grad_norm",
    )


def bench_ckpt_save(report: Report, s: Settings, model: nn.Module) -> None:
    """The checkpoint-save micro-benchmark: :func:`atomic_save` against the hand-written durable save of the
    same model and Adam state, each save from a synced disk, its file deleted after it.

    :param report: Where the row and notes go.
    :param s: The run mode's sizes.
    :param model: The model (its Adam state is made here).
    """
    payload, n_bytes = adam_payload(model)
    save_dir = new_tmp("save-")
    free = shutil.disk_usage(save_dir).free
    log(
        f"micro/ckpt_save: {n_bytes / 2**20:.0f} MiB payload (model + Adam state), {free / 2**30:.1f} GiB free; "
        f"{s.save_rounds} rounds (+1 warm-up) x {s.save_reps} saves each"
    )
    if free < 3 * n_bytes:
        report.notes.append(f"micro/ckpt_save skipped: {free} bytes free on {save_dir}, it needs {3 * n_bytes}")
        log("  skipped: not enough free disk")
        return
    try:
        times, size = time_saves(payload, save_dir, s.save_rounds, s.save_reps)
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)
    report.notes.append(
        f"micro/ckpt_save: each checkpoint file is {size / 2**20:.0f} MiB; files are deleted after every save"
    )
    report.add_row(
        "micro",
        "ckpt_save",
        "atomic_save",
        "tmp+save+fsync",
        times["trainkit"],
        times["manual"],
        report.pick("wall"),
        "micro/ckpt_save",
    )


def adam_payload(model: nn.Module) -> tuple[dict[str, Any], int]:
    """A checkpoint's payload: the model's state and an Adam optimizer's, its two moments allocated.

    :param model: The model.
    :returns: The payload and its tensors' bytes.
    """
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    optimizer.step()  # allocates Adam's two moment buffers per parameter
    for p in model.parameters():
        p.grad = None
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)
    )
    return payload, n_bytes


def time_saves(payload: dict[str, Any], save_dir: Path, rounds: int, reps: int) -> tuple[dict[str, Timings], int]:
    """Time both saves of ``payload`` into ``save_dir``, interleaved in a shuffled order, after one warm-up round.

    :param payload: What is saved.
    :param save_dir: Where (each file is deleted after its save).
    :param rounds: Measured rounds.
    :param reps: Saves of each kind per round.
    :returns: Each saver's seconds (``trainkit``, ``manual``) and the size of the last file written.
    """
    paths = {"trainkit": save_dir / "atomic.pt", "manual": save_dir / "manual.pt"}
    savers = {"trainkit": atomic_save, "manual": durable_save}
    times = {k: Timings() for k in savers}
    shuffler = random.Random(5000)
    size = 0
    for rnd in range(rounds + 1):
        for _ in range(reps if rnd else 1):
            order = list(savers)
            shuffler.shuffle(order)
            for key in order:
                os.sync()  # start every save with no dirty pages left by the previous one
                gc.collect()
                w0, c0 = time.perf_counter(), time.process_time()
                savers[key](payload, paths[key])
                w1, c1 = time.perf_counter(), time.process_time()
                if rnd > 0:
                    times[key].wall.append(w1 - w0)
                    times[key].cpu.append(c1 - c0)
                size = paths[key].stat().st_size
                paths[key].unlink()
                fsync_dir(save_dir)
    return times, size


def bench_micro(report: Report, s: Settings) -> None:
    model = big_model(s.snapshot_params)
    bench_snapshot(report, s, model)
    bench_grad_norm(report, s)
    if s.save_params != s.snapshot_params:
        model = big_model(s.save_params)
    bench_ckpt_save(report, s, model)
