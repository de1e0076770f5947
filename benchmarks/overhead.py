"""trainkit overhead benchmarks: trainkit against a hand-written PyTorch loop (and Lightning, when installed).

Run from the repository root, as a module (the ``trainkit`` measured is this checkout's)::

    .venv/bin/python -m benchmarks.overhead            # full run (~16 min on 2 cores), gates enforced
    .venv/bin/python -m benchmarks.overhead --quick    # smoke run (~1 min), gates advisory

The engine section (``--only engine``) runs the loop with the model's work taken out (a null workload) at
three run lengths and fits what each contestant adds to its baseline, in CPU microseconds per optimizer step,
per epoch and per run, with bootstrap 95 % intervals. Every gate, ratio or microseconds, is judged on its
interval (``confidence.py``): PASS when it lies under the limit, FAIL when it lies over it, UNDECIDED (exit 0,
printed with the pairs that would decide it) when it straddles the limit or rests on fewer than 8 pairs.

Everything runs in one process (the import gate aside, which needs fresh interpreters), single-threaded
(``torch.set_num_threads(1)``). Contestants of a group run interleaved, in a shuffled order, for one
discarded warm-up round and then ``--rounds`` measured rounds of ``reps`` repetitions; every ratio is
the median over all repetitions of the paired ratio trainkit / baseline (two runs of the same repetition
ran back to back), with the quartiles beside it. Every contestant of a group gets the
same initial weights, the same data and the same batch order, and the script asserts they did the same
work: the final training loss, the final validation loss and a hash of the final weights must be
bitwise identical (a contestant that cannot match bitwise is compared to a tight tolerance, with the
reason printed).

Results go to ``--out`` (default ``benchmarks/results/``) as ``latest.json`` and ``latest.md``. The exit
status is 0 when no gate FAILs (PASS or UNDECIDED), 1 when one does (full mode, or ``--enforce-gates``), 2 when
contestants did different work. See ``benchmarks/README.md`` for what each gate means.
"""

from __future__ import annotations

import argparse
import array
import atexit
import contextlib
import functools
import gc
import json
import logging
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Everything W&B writes goes to a throwaway folder; set before wandb is imported (by anything).
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="trainkit-bench-"))
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)  # also when imported, not run
for _key, _value in {
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",  # no stdout/stderr capture: both contestants measure the logging path only
    "WANDB_DIR": str(_SESSION_TMP / "wandb"),
    "WANDB_CACHE_DIR": str(_SESSION_TMP / "wandb-cache"),
    "WANDB_CONFIG_DIR": str(_SESSION_TMP / "wandb-config"),
    "WANDB_DATA_DIR": str(_SESSION_TMP / "wandb-data"),
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
}.items():
    os.environ[_key] = _value
os.environ.pop("WANDB_MODE", None)  # every contestant states its mode explicitly
# a CPU benchmark, also on a machine with a GPU (the trainer would move its model there, the raw loop not)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler  # noqa: E402

import trainkit  # noqa: E402
from benchmarks import confidence  # noqa: E402
from benchmarks.common import (  # noqa: E402
    REPO,
    RESULTS,
    keep_weights,
    lightning_missing,
    load_average,
    log,
    machine_was_busy,
    one_thread,
    quiet,
    run_meta,
    weights_digest,
)
from trainkit import BaseTrainer  # noqa: E402
from trainkit import checkpoint as tk_checkpoint  # noqa: E402
from trainkit.loop import optim as tk_optim  # noqa: E402
from trainkit.loop.snapshot import WeightSnapshot  # noqa: E402
from trainkit.state.modules import module_state  # noqa: E402

SEED = 0
LR = 1e-3

# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts of one run mode."""

    mode: str
    rounds: int  # measured rounds (after one discarded warm-up round)
    tiny_epochs: int
    tiny_reps: int  # runs per contestant per round, interleaved; each repetition pairs up
    wandb_reps: int  # the same for the W&B variant, whose runs vary the most
    medium_samples: int
    medium_epochs: int
    medium_reps: int
    import_rounds: int
    import_warmups: int  # fresh interpreters per import run first and discarded (the page cache warmed)
    snapshot_params: int
    micro_reps: int
    norm_tensors: int
    norm_calls: int  # calls per timed grad-norm sample
    save_params: int  # model parameters of the checkpoint-save micro-benchmark (Adam state doubles it)
    save_rounds: int
    save_reps: int
    engine_shapes: tuple[tuple[int, int], ...]  # the null workload's run lengths: (epochs, batches per epoch)
    engine_rounds: int  # measured rounds of the engine section
    engine_group_rounds: tuple[tuple[str, int], ...]  # groups measured over more rounds: cheap ones whose gates sit
    # within a microsecond of their limit (more pairs narrow the interval; each round of these takes ~0.4 s)
    engine_reps: int  # runs per contestant and run length per round
    engine_wandb_reps: int  # the same for the W&B group, whose every run starts a W&B run (~0.15 s)


FULL = Settings(
    mode="full",
    rounds=15,
    tiny_epochs=16,
    tiny_reps=5,
    wandb_reps=6,
    medium_samples=1024,
    medium_epochs=1,
    medium_reps=5,
    import_rounds=9,
    import_warmups=1,
    snapshot_params=50_000_000,
    micro_reps=3,
    norm_tensors=200,
    norm_calls=20,
    save_params=50_000_000,
    save_rounds=7,
    save_reps=2,
    # short runs: this host's speed wanders in phases of tens of milliseconds or more, so two runs of 10 ms
    # back to back differ by ~7 %, two of 50 ms or more by 11-18 %: many short pairs resolve a step finer
    engine_shapes=((1, 10), (1, 200), (10, 10)),
    engine_rounds=15,
    engine_group_rounds=(("off", 40), ("guard", 60)),
    engine_reps=6,
    engine_wandb_reps=4,
)
QUICK = Settings(
    mode="quick",
    rounds=3,
    tiny_epochs=2,
    tiny_reps=1,
    wandb_reps=1,
    medium_samples=256,
    medium_epochs=1,
    medium_reps=1,
    import_rounds=1,  # a fresh interpreter per import: the smoke run checks the section runs
    import_warmups=1,  # (writes trainkit's .pyc files, so the timed import reads them as a user's does)
    snapshot_params=5_000_000,
    micro_reps=1,
    norm_tensors=200,
    norm_calls=5,
    save_params=5_000_000,
    save_rounds=3,
    save_reps=1,
    engine_shapes=((1, 5), (1, 50), (5, 5)),
    engine_rounds=1,
    engine_group_rounds=(),
    engine_reps=1,
    engine_wandb_reps=1,
)

# ratio gates, judged on the 95 % bootstrap interval of the median paired ratio (confidence.judge). tiny/wandb
# and tiny/steps are information now: what trainkit adds per W&B row and per tracked step is gated in the
# engine section (ENGINE_GATES), where W&B's start and the model's work do not drown it
GATES = {
    "tiny/off": 1.02,
    "medium/off": 1.01,
    "tiny/tqdm": 1.02,
    "tiny/ckpt": 1.03,
    "medium/steps": 1.01,
    "import/trainkit": 1.10,
    "import/BaseTrainer": 1.10,
    "micro/snapshot": 1.30,
    "micro/grad_norm": 1.05,
    "micro/ckpt_save": 1.10,
}

# the engine section's gates: added CPU microseconds per optimizer step / epoch / run (construction to the end
# of train()), judged on the fit's 95 % bootstrap interval. W&B's per-run gate leaves out wandb.init and
# Run.finish (timed apart); steps' per-epoch gate is against trainkit with the same epoch-end writes
ENGINE_GATES = {
    "engine/off/step": 2.0,
    "engine/off/epoch": 150.0,
    "engine/off/run": 5000.0,
    "engine/steps/step": 3.0,
    "engine/steps/epoch": 150.0,
    "engine/tqdm/step": 5.0,
    "engine/tqdm/epoch": 150.0,
    "engine/tqdm/run": 5000.0,
    "engine/wandb/step": 10.0,
    "engine/wandb/epoch": 150.0,
    "engine/wandb/run": 5000.0,
    "engine/guard/step": 2.0,
    "engine/guard/rollback/step": 2.0,
}

# ---------------------------------------------------------------------------------------------- helpers


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_save(payload: Any, path: Path, keep_previous: bool = False) -> None:
    """The hand-written durable save: temp file in the same dir, flush, fsync, replace, fsync the dir.

    ``keep_previous`` first hard-links the file being replaced to ``<stem>.prev.pt`` (under a temp name,
    renamed into place), the fallback trainkit keeps for a corrupted newest file.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if keep_previous:
        link = path.with_name(f".{path.stem}.prev.tmp")
        try:
            os.link(path, link)
            os.replace(link, path.with_name(f"{path.stem}.prev{path.suffix}"))
        except FileNotFoundError:
            pass  # the first save: nothing to keep yet
    os.replace(tmp, path)
    fsync_dir(path.parent)


def best_record(score: float, epoch: int | None) -> dict[str, Any]:
    """The best-score record trainkit stores (minimizing, no min_delta), as a hand-written loop keeps it."""
    return {"minimize": True, "min_delta": 0.0, "score": score, "epoch": epoch, "metrics": {}}


def rng_states() -> dict[str, Any]:
    """Every generator a training script may draw from, as plain bytes (what exact resume needs)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, array.array("q", internal).tobytes(), gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": [name, keys.tobytes(), int(pos), int(has_gauss), float(cached)],
    }


def ratio_stats(num: list[float], den: list[float]) -> dict[str, Any]:
    """Statistics of the paired ratios ``num[i] / den[i]`` (runs i of two contestants ran back to back)."""
    ratios = [a / b for a, b in zip(num, den)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0], None, ratios[0])
    return {
        "median": statistics.median(ratios),
        "q1": q1,
        "q3": q3,
        "min": min(ratios),
        "max": max(ratios),
        "ratios": ratios,
    }


def new_tmp(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_SESSION_TMP))


# ---------------------------------------------------------------------------------------------- workloads


class _Batches(Dataset):
    """Indexed by a whole batch of indices at once (with ``batch_size=None``): one gather per batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


@dataclass
class Workload:
    """Data, initial weights and the loop's shape; identical for every contestant."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    batch_size: int
    epochs: int
    make_net: Callable[[], nn.Module]
    init_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # the loss of a batch from the model's output; every contestant's loop calls it (bound to a local first)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    make_dataset: Callable[[torch.Tensor, torch.Tensor], Dataset] = _Batches
    samples_per_epoch: int | None = None  # the sampler's num_samples; None: every training sample once
    backward: bool = True  # False: the loss needs no backward (the null workload), every loop skips it

    def __post_init__(self) -> None:
        torch.manual_seed(SEED)
        self.init_state = {k: v.clone() for k, v in self.make_net().state_dict().items()}

    def build_model(self) -> nn.Module:
        net = self.make_net()
        net.load_state_dict(self.init_state)
        return net

    @staticmethod
    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(module.parameters(), lr=LR)

    def train_loader(self) -> DataLoader:
        """A real DataLoader with its own seeded generator: the same batch order for every contestant."""
        generator = torch.Generator().manual_seed(SEED)
        indices = RandomSampler(range(len(self.x_train)), num_samples=self.samples_per_epoch, generator=generator)
        sampler = BatchSampler(indices, self.batch_size, False)
        return DataLoader(self.make_dataset(self.x_train, self.y_train), batch_size=None, sampler=sampler)

    def val_loss(self, model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            value = self.loss_fn(model(self.x_val), self.y_val).item()
        model.train()
        return value

    @property
    def steps(self) -> int:
        return self.epochs * -(-(self.samples_per_epoch or len(self.x_train)) // self.batch_size)


def tiny_workload(s: Settings) -> Workload:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    x, y = x[perm], y[perm]
    n_train = 1437
    return Workload(
        name="tiny",
        x_train=x[:n_train].contiguous(),
        y_train=y[:n_train].contiguous(),
        x_val=x[n_train:].contiguous(),
        y_val=y[n_train:].contiguous(),
        batch_size=64,
        epochs=s.tiny_epochs,
        make_net=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
    )


def medium_workload(s: Settings) -> Workload:
    gen = torch.Generator().manual_seed(SEED)
    n, n_val, d_in, width, classes = s.medium_samples, 512, 256, 1024, 10
    x = torch.randn(n + n_val, d_in, generator=gen)
    teacher = torch.randn(d_in, classes, generator=gen)
    y = (x @ teacher).argmax(dim=1)

    def make_net() -> nn.Module:
        layers: list[nn.Module] = []
        dim = d_in
        for _ in range(4):
            layers += [nn.Linear(dim, width), nn.ReLU()]
            dim = width
        layers.append(nn.Linear(width, classes))
        return nn.Sequential(*layers)

    return Workload(
        name="medium",
        x_train=x[:n].contiguous(),
        y_train=y[:n].contiguous(),
        x_val=x[n:].contiguous(),
        y_val=y[n:].contiguous(),
        batch_size=128,
        epochs=s.medium_epochs,
        make_net=make_net,
    )


class _NoWork(nn.Module):
    """The null workload's model: one parameter (for the optimizer to hold), and a forward that returns its input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _output_is_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The null workload's loss: the model's (0-dim) output itself, so no loss function runs."""
    return out


class _OneSample(Dataset):
    """Batches of one sample each, kept as 0-dim tensors in lists: a batch costs a list lookup, no gather."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = list(x.unbind()), list(y.unbind())

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        (i,) = index
        return self.x[i], self.y[i]


@dataclass
class NullWorkload(Workload):
    """The training loop with the model's work taken out: a batch of one, no forward, no backward.

    What is left per step is what every loop pays around the model: the ``DataLoader``'s next batch, the
    model's call (it returns its input, the "loss"), ``zero_grad`` and an ``optimizer.step()`` of SGD over one
    parameter without a gradient (the call, its hooks and trainkit's step counter, no arithmetic): about
    30 us on this 2-core host, a few tens of microseconds anywhere. This host's speed wanders by 10-20 % from
    one run to the next, so the noise on a per-step estimate is a share of the raw step's own cost: the
    smaller that cost, the finer the engine's cost can be resolved.
    """

    @staticmethod
    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=LR)


def null_workload(epochs: int, batches: int) -> NullWorkload:
    """The null workload at one run length.

    Each epoch draws ``batches`` of ``batches + 1`` training samples (``RandomSampler(num_samples=...)``): the
    sampler then draws its one permutation at the epoch's first batch and nothing after its last. With every
    sample once and batches of one, ``RandomSampler`` draws a second, unused permutation when it is asked for a
    batch past the last one, which a hand-written loop does and Lightning does only every other epoch: the
    batch orders would part ways from the second epoch on.

    :param epochs: Epochs per run.
    :param batches: Batches (optimizer steps) per epoch.
    :returns: The workload; its name carries the shape (the config caches are keyed by name).
    """
    gen = torch.Generator().manual_seed(SEED)
    x = torch.rand(batches + 2, generator=gen)
    y = torch.zeros(batches + 2, dtype=torch.int64)
    return NullWorkload(
        name=f"null-{epochs}x{batches}",
        x_train=x[: batches + 1].contiguous(),
        y_train=y[: batches + 1].contiguous(),
        x_val=x[batches + 1],
        y_val=y[batches + 1],
        batch_size=1,
        epochs=epochs,
        make_net=_NoWork,
        loss_fn=_output_is_loss,
        make_dataset=_OneSample,
        samples_per_epoch=batches,
        backward=False,
    )


@dataclass
class Outcome:
    """What a contestant computed: compared across contestants to prove they did the same work."""

    train_loss: float
    val_loss: float
    digest: str
    improvements: int | None = None
    files: tuple[str, ...] = ()

    def key(self) -> tuple[Any, ...]:
        return (self.train_loss, self.val_loss, self.digest)


# ---------------------------------------------------------------------------------------------- raw loops


def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` of wall time on the CPU (a planted cost: the tests check the engine section finds it).

    :param seconds: How long to spin.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def raw_run(wl: Workload, tmp: Path, feature: str, spin_s: float = 0.0) -> tuple[nn.Module, Any]:
    """The hand-written loop; ``feature`` adds exactly what the matching trainkit variant does per step/epoch.

    ``spin_s`` busy-waits that long after every optimizer step: a known cost planted into a contestant, which
    the tests use to check that the engine section measures a per-step cost it is given (0: nothing planted).

    ``ckpt`` writes the checkpoints trainkit writes, by hand: the same content in ``last.pt`` (weights,
    optimizer, counters, config, loop/best/patience records, every generator's state) and ``best.pt``,
    each with its ``.prev`` fallback link. ``ckpt_min`` writes what a quick script would: weights,
    optimizer, counters and torch's generator state, no fallback; it is information, not a gate. ``ckpt_last``
    writes only ``last.pt`` as ``ckpt.enable`` alone does (no best-model tracking): the baseline of the ``steps``
    gate, whose trainkit contestant writes that file at every epoch end too.
    Every variant ends with the report trainkit gives at the end of training: one printed summary line
    and, with W&B, the same entries in the run summary.
    """
    torch.manual_seed(SEED)
    model = wl.build_model()
    optimizer = wl.make_optimizer(model)
    loader = wl.train_loader()
    run = None
    if feature == "wandb":
        import wandb

        run = wandb.init(
            mode="offline",
            dir=str(tmp),
            id=uuid.uuid4().hex[:8],
            resume="allow",
            project="trainkit-bench",
            config=wandb_config(wl),
            reinit="create_new",
            settings=wandb.Settings(init_timeout=60, silent=True),
        )
        # the same W&B setup trainkit's WandbSink does (config panel included), so both log the same way
        run.define_metric("trainer/step")
        run.define_metric("*", step_metric="trainer/step")
    if feature == "tqdm":
        from tqdm.auto import tqdm

        # the step bar with trainkit's settings (trainkit.loop.progress: redraw at most every 0.5 s on a terminal, every
        # 30 s elsewhere; the training section runs into /dev/null, the engine section's tqdm group on a terminal)
        interval = 0.5 if sys.stderr.isatty() else 30.0

        def batches(epoch: int) -> Any:
            return tqdm(loader, desc=f"epoch {epoch}", leave=False, mininterval=interval, dynamic_ncols=True)
    else:

        def batches(epoch: int) -> Any:
            return loader

    config = checkpoint_config(wl) if feature in ("ckpt", "ckpt_last") else None
    best = float("inf")
    best_epoch = None
    best_state: dict[str, torch.Tensor] | None = None
    improvements = 0
    step = rows = 0
    val = float("nan")
    loss = torch.zeros(())
    loss_of, backward = wl.loss_fn, wl.backward
    for epoch in range(wl.epochs):
        model.train()
        for x, y in batches(epoch):
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if backward:
                loss.backward()
            optimizer.step()
            step += 1
            if spin_s:
                spin(spin_s)
            if run is not None:
                # W&B's step given as trainkit gives it (each row's 0-based number, committed at once): W&B's own
                # work per row, timed apart, is then the same call on both sides
                row = {"trainer/step": step, "trainer/epoch": epoch, "train/loss": loss.item()}
                run.log(row, step=rows, commit=True)
                rows += 1
        val = wl.val_loss(model)
        if feature in ("ckpt", "ckpt_min", "ckpt_last"):
            same_as_trainkit = feature != "ckpt_min"
            if feature != "ckpt_last" and val < best:
                best = val
                best_epoch = epoch
                improvements += 1
                best_state = keep_weights(best_state, model)
                best_payload: dict[str, Any] = {"model": best_state, "epoch": epoch}
                if same_as_trainkit:
                    best_payload.update(best=best_record(best, epoch), config=config)
                else:
                    best_payload["best"] = best
                durable_save(best_payload, tmp / "best.pt", keep_previous=same_as_trainkit)
            last: dict[str, Any] = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "step": step,
            }
            if same_as_trainkit:
                tracks_best = feature == "ckpt"
                last.update(
                    config=config,
                    loop={"epoch": epoch + 1, "step": step, "stop_reason": None},
                    best=best_record(best, best_epoch) if tracks_best else None,
                    patience={"patience": None, "start_patience": 0, "remaining": None} if tracks_best else None,
                    rng=[rng_states()],
                )
            else:
                last.update(best=best, rng=torch.get_rng_state())
            durable_save(last, tmp / "last.pt", keep_previous=same_as_trainkit)
    # the end-of-run report trainkit gives (log_training_results): the W&B summary and one printed line
    summary: dict[str, Any] = {"epochs_run": wl.epochs, "stop_reason": "max_epochs"}
    if best_epoch is not None:
        summary.update({"best/epoch": best_epoch, "best/score": best})
    if run is not None:
        run.summary.update(summary)
    print("raw: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    if run is not None:
        run.finish()
    return model, (loss, val, improvements if feature in ("ckpt", "ckpt_min") else None)


# ---------------------------------------------------------------------------------------------- trainkit


class BenchTrainer(BaseTrainer):
    """The same model, data and loop through trainkit. Set ``workload``/``feature`` before constructing.

    Feature ``steps`` turns step checkpoints on (``ckpt.every_n_steps``, a period longer than the run, so none
    comes due): every step goes through the counted batch iteration and the step-boundary check. Step
    checkpoints need ``ckpt.enable``, which also writes ``last.pt`` at every epoch end; ``ckpt_last`` is
    ``ckpt.enable`` alone (the same writes, no step checkpoints, no best-model tracking), the baseline that
    leaves the tracked loop's own cost. Only trainkit's public API is used: nothing of the engine is stubbed.
    """

    workload: Workload
    feature: str = "off"

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        wl = self.workload
        self.model = self.make_ddp(wl.build_model())
        self.optimizer = wl.make_optimizer(self.model)
        self.loader = wl.train_loader()
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        # the loader's generator stays unregistered, as in the hand-written loops (their checkpoints hold
        # the same items): no run here resumes, so trainkit's warning about it is beside the point
        warnings.filterwarnings("ignore", "the DataLoader given to progress", RuntimeWarning)
        self.log_steps = self.feature == "wandb"
        self.track_best = self.feature == "ckpt"
        self.improvements = 0
        self.last_loss = torch.zeros(())
        self.last_val = float("nan")
        self.tracked: int | None = None

    def train_epoch(self) -> None:
        model, optimizer = self.model, self.optimizer
        model.train()
        loss = self.last_loss
        loss_of, backward = self.workload.loss_fn, self.workload.backward
        batches = self.progress(self.loader)
        for x, y in batches:
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if backward:
                loss.backward()
            optimizer.step()
            if self.log_steps:
                self.log({"train/loss": loss})
                self.push_logs()
        self.last_loss = loss
        # the batches trainkit counted (step checkpoints on): proof that `steps` measured the tracked loop
        self.tracked = getattr(batches, "consumed", None)

    def val_epoch(self) -> bool:
        self.last_val = self.workload.val_loss(self.model)
        if self.track_best and self.save_if_best(self.last_val):
            self.improvements += 1
        return False


_WANDB_CONFIGS: dict[str, dict[str, Any]] = {}


def wandb_config(wl: Workload) -> dict[str, Any]:
    """The config dict trainkit hands to W&B's config panel, built once (outside any timed run)."""
    if wl.name not in _WANDB_CONFIGS:
        cfg = BenchTrainer.config_class.from_mapping(trainkit_config(wl, Path("runs/bench"), "wandb"))
        _WANDB_CONFIGS[wl.name] = cfg.to_dict()
    return _WANDB_CONFIGS[wl.name]


_CHECKPOINT_CONFIGS: dict[str, dict[str, Any]] = {}


def checkpoint_config(wl: Workload) -> dict[str, Any]:
    """The config tree trainkit stores in every checkpoint, for the hand-written loop to store as well.

    Built once, outside any timed run (as a script would hold its config).
    """
    if wl.name not in _CHECKPOINT_CONFIGS:
        cfg = BenchTrainer.config_class.from_mapping(trainkit_config(wl, Path("runs/bench"), "ckpt"))
        _CHECKPOINT_CONFIGS[wl.name] = cfg.to_dict()
    return _CHECKPOINT_CONFIGS[wl.name]


class ClippingBenchTrainer(BenchTrainer):
    """:class:`BenchTrainer` calling ``clip_and_log_grad_norm()`` before each optimizer step (features ``clip`` and
    ``guard``): what the divergence guard judges, so ``guard`` (``guard.nonfinite=skip``, nothing non-finite)
    against ``clip`` (the guard off) is the guard's own cost per step."""

    def train_epoch(self) -> None:
        model, optimizer, loss_of = self.model, self.optimizer, self.workload.loss_fn
        model.train()
        loss = self.last_loss
        batches = self.progress(self.loader)
        for x, y in batches:
            loss = loss_of(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            self.clip_and_log_grad_norm()
            optimizer.step()
        self.last_loss = loss
        self.tracked = getattr(batches, "consumed", None)


STEPPING = ("steps", "clip_steps", "rollback_steps")
"""The variants with ``ckpt.every_n_steps`` past the run's end: the tracked loop, no step checkpoint due."""
GUARDED = {"guard": "skip", "rollback": "rollback", "rollback_steps": "rollback"}
"""The variants with the divergence guard on, and its ``guard.nonfinite``."""


def trainkit_config(wl: Workload, tmp: Path, feature: str) -> dict[str, Any]:
    ckpt: dict[str, Any] = {"enable": feature in ("ckpt", "ckpt_last", *STEPPING)}
    if feature in STEPPING:
        # every step runs the tracked iteration and the boundary check; the period is past the run's last
        # step, so no step checkpoint is written (trainkit_run checks the files)
        ckpt["every_n_steps"] = wl.steps + 1
    return {
        "epochs": wl.epochs,
        "seed": SEED,
        "out_dir": str(tmp),
        "val": {"minimize": True},
        "ckpt": ckpt,
        "wandb": {"mode": "offline" if feature == "wandb" else "disabled", "project": "trainkit-bench"},
        "progress": {"enable": feature == "tqdm"},
        "guard": {"nonfinite": GUARDED.get(feature, "off")},
    }


def trainkit_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    cls = ClippingBenchTrainer if feature in ("clip", "clip_steps", *GUARDED) else BenchTrainer
    cls.workload = wl
    cls.feature = feature
    trainer = cls(trainkit_config(wl, tmp, feature))
    result = trainer.train() or {}
    trainer.close()
    if (feature in GUARDED) != ("guard/skipped_steps" in result):
        raise SystemExit(f"the `{feature}` variant's divergence guard is not as asked: the run returned {result}")
    if feature in STEPPING and (trainer.tracked != len(trainer.loader) or trainer.step != wl.steps):
        raise SystemExit(
            f"the `{feature}` variant did not run the tracked loop: {trainer.tracked} batches counted in the last "
            f"epoch (expected {len(trainer.loader)}), {trainer.step} steps counted (expected {wl.steps})"
        )
    written = {p.name for p in tmp.glob("*.pt")}
    if feature in STEPPING and not ("last.pt" in written and written <= {"last.pt", "last.prev.pt"}):
        # the epoch-end last.pt (and its .prev) only: a step checkpoint would be a mistake in the setup
        raise SystemExit(f"the `{feature}` variant wrote other files: {sorted(p.name for p in tmp.glob('*.pt'))}")
    return trainer.model, (trainer.last_loss, trainer.last_val, trainer.improvements if feature == "ckpt" else None)


# ---------------------------------------------------------------------------------------------- Lightning

_LIGHTNING: dict[str, Any] = {}
LIGHTNING_NOTES = {
    "off": "enable_progress_bar/logger/enable_checkpointing/enable_model_summary off, num_sanity_val_steps=0",
    "tqdm": "enable_progress_bar=True with Lightning's default TQDMProgressBar(refresh_rate=1): redraws every step",
    "wandb": "WandbLogger(offline=True), self.log('train/loss') every step (log_every_n_steps=1), wandb.finish()",
    "ckpt": "ModelCheckpoint(monitor='val/loss', save_top_k=1, save_last=True): best file + last file per epoch; "
    "Lightning writes without fsync and keeps no in-memory best snapshot",
}


def lightning_available() -> str | None:
    """Import Lightning; returns None when usable, else the reason it is skipped."""
    if _LIGHTNING:
        return None
    why = lightning_missing()
    if why is not None:
        return why
    import lightning.pytorch as pl

    if torch.__version__ != _TORCH_VERSION_AT_START:
        return f"lightning changed torch ({_TORCH_VERSION_AT_START} -> {torch.__version__})"
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class LitModule(pl.LightningModule):
        def __init__(self, wl: Workload, feature: str) -> None:
            super().__init__()
            self.wl = wl
            self.feature = feature
            self.net = wl.build_model()
            self.last_loss = torch.zeros(())
            self.last_val = float("nan")
            # a loss without backward (the null workload) cannot go through Lightning's automatic optimization,
            # which calls backward itself: the step goes through Lightning's optimizer wrapper by hand instead
            self.automatic_optimization = wl.backward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.wl.loss_fn(self.net(x), y)
            if not self.automatic_optimization:
                optimizer = self.optimizers()
                optimizer.zero_grad(set_to_none=True)
                optimizer.step()
            if self.feature == "wandb":
                self.log("train/loss", loss, on_step=True, on_epoch=False)
            self.last_loss = loss
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = self.wl.loss_fn(self.net(x), y)
            self.last_val = loss.item()
            if self.feature == "ckpt":
                self.log("val/loss", loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.wl.make_optimizer(self.net)

    _LIGHTNING.update(pl=pl, LitModule=LitModule)
    return None


class _OneBatch:
    """The whole validation set as one batch (a list would be read as several dataloaders)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch = (x, y)

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([self.batch])


def lightning_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    pl = _LIGHTNING["pl"]
    module = _LIGHTNING["LitModule"](wl, feature)
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=wl.epochs,
        default_root_dir=str(tmp),
        enable_progress_bar=feature == "tqdm",
        enable_model_summary=False,
        enable_checkpointing=feature == "ckpt",
        logger=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        check_val_every_n_epoch=1,
    )
    logger = None
    if feature == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # mode="offline" reaches wandb.init itself: Lightning's offline=True only sets WANDB_MODE, which W&B reads
        # once per process, so after another contestant's run W&B would start this one online (and ask to log in)
        logger = WandbLogger(offline=True, mode="offline", save_dir=str(tmp), project="trainkit-bench")
        kwargs.update(logger=logger, log_every_n_steps=1)
    if feature == "ckpt":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kwargs["callbacks"] = [
            ModelCheckpoint(
                dirpath=str(tmp),
                filename="best",
                monitor="val/loss",
                mode="min",
                save_top_k=1,
                save_last=True,
                enable_version_counter=False,
            )
        ]
    trainer = pl.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=wl.train_loader(), val_dataloaders=_OneBatch(wl.x_val, wl.y_val))
    if logger is not None:
        logger.experiment.finish()
        os.environ.pop("WANDB_MODE", None)  # set by offline=True; the other contestants state their mode themselves
    return module.net, (module.last_loss, module.last_val, None)


# ---------------------------------------------------------------------------------------------- harness

CLOCKS = ("cpu", "wall")


@dataclass
class Contestant:
    name: str
    run: Callable[[Workload, Path], tuple[nn.Module, Any]]
    family: str  # raw / trainkit / lightning


@dataclass
class Timings:
    """Every measured repetition, in run order, on both clocks (repetition i of two contestants is a pair)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def on(self, clock: str) -> list[float]:
        return self.cpu if clock == "cpu" else self.wall


@dataclass
class GroupResult:
    times: dict[str, Timings]
    outcomes: dict[str, Outcome]
    warnings: dict[str, list[str]]


def _outcome(model: nn.Module, extra: Any, tmp: Path) -> Outcome:
    loss, val, improvements = extra
    files = tuple(sorted(p.name for p in tmp.iterdir() if p.suffix in (".pt", ".ckpt")))
    return Outcome(float(loss.detach()), float(val), weights_digest(model), improvements, files)


def settle_heap() -> None:
    """Collect, then freeze every object alive after the warm-up out of the collector's reach.

    torch, wandb and Lightning leave ~500k long-lived objects: without this each ``gc.collect()`` between
    runs costs ~0.2 s, and a full collection that happens to fall inside a timed run charges it to
    whichever contestant triggered it. Frozen objects are never scanned; new ones are, as usual.
    """
    gc.collect()
    gc.freeze()


def run_group(title: str, wl: Workload, contestants: list[Contestant], rounds: int, reps: int) -> GroupResult:
    """One warm-up round (discarded; it also collects outcomes and warnings), then ``rounds`` measured rounds.

    Inside a round every repetition runs each contestant once, in a fresh shuffled order, so the runs of
    one repetition see the same state of the machine and pair up for the ratios.
    """
    times = {c.name: Timings() for c in contestants}
    outcomes: dict[str, Outcome] = {}
    caught: dict[str, list[str]] = {}
    shuffler = random.Random(1000)
    for rnd in range(rounds + 1):
        walls: dict[str, list[float]] = {c.name: [] for c in contestants}
        cpus: dict[str, list[float]] = {c.name: [] for c in contestants}
        for _ in range(reps if rnd else 1):
            order = list(contestants)
            shuffler.shuffle(order)
            for c in order:
                tmp = new_tmp(f"{wl.name}-{c.name}-")
                gc.collect()
                with warnings.catch_warnings(record=True) as seen, quiet():
                    warnings.simplefilter("always" if rnd == 0 else "ignore")  # warm-up: collect them
                    w0, c0 = time.perf_counter(), time.process_time()
                    model, extra = c.run(wl, tmp)
                    w1, c1 = time.perf_counter(), time.process_time()
                walls[c.name].append(w1 - w0)
                cpus[c.name].append(c1 - c0)
                out = _outcome(model, extra, tmp)
                if c.name in outcomes and outcomes[c.name].key() != out.key():
                    raise SystemExit(f"{title}: {c.name} is not deterministic across runs: {outcomes[c.name]} vs {out}")
                outcomes[c.name] = out
                if rnd == 0 and c.family == "trainkit":
                    caught[c.name] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
                del model, extra
                shutil.rmtree(tmp, ignore_errors=True)
                if torch.get_num_threads() != 1:
                    raise SystemExit(f"{c.name} changed torch's thread count to {torch.get_num_threads()}")
        if rnd > 0:
            for name in times:
                times[name].wall.extend(walls[name])
                times[name].cpu.extend(cpus[name])
        else:
            settle_heap()
    gc.unfreeze()
    return GroupResult(times, outcomes, caught)


def interleave(fns: dict[str, Callable[[], Any]], rounds: int, reps: int, seed: int) -> dict[str, Timings]:
    """``run_group`` for plain callables: a warm-up round, then ``rounds`` rounds of ``reps`` paired calls."""
    times = {k: Timings() for k in fns}
    shuffler = random.Random(seed)
    for rnd in range(rounds + 1):
        walls: dict[str, list[float]] = {k: [] for k in fns}
        cpus: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps if rnd else 1):
            order = list(fns)
            shuffler.shuffle(order)
            for key in order:
                gc.collect()
                w0, c0 = time.perf_counter(), time.process_time()
                fns[key]()
                w1, c1 = time.perf_counter(), time.process_time()
                walls[key].append(w1 - w0)
                cpus[key].append(c1 - c0)
        if rnd > 0:
            for key in fns:
                times[key].wall.extend(walls[key])
                times[key].cpu.extend(cpus[key])
        else:
            settle_heap()
    gc.unfreeze()
    return times


APART = ("start", "log")
"""What the engine section times apart from the runs: W&B's ``wandb.init`` + ``Run.finish``, and its ``Run.log``."""


@dataclass
class _Apart:
    """CPU and wall seconds spent inside W&B's own calls since the last :meth:`take`, by :data:`APART` category."""

    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(APART, 0.0))
    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(APART, 0.0))
    depth: int = 0  # a call inside a timed call (W&B logging from inside finish, say) is not counted twice

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """Return ``(cpu, wall)`` by category so far and start again from zero."""
        taken = (self.cpu, self.wall)
        self.cpu, self.wall = dict.fromkeys(APART, 0.0), dict.fromkeys(APART, 0.0)
        return taken


_APART = _Apart()


def _timed_apart(fn: Callable[..., Any], category: str) -> Callable[..., Any]:
    """Wrap ``fn`` so the time spent in it goes to ``_APART[category]`` (the caller subtracts it from the run)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _APART.depth += 1
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _APART.depth -= 1
            if _APART.depth == 0:
                _APART.cpu[category] += time.process_time() - c0
                _APART.wall[category] += time.perf_counter() - w0

    return wrapper


@contextlib.contextmanager
def wandb_calls_apart() -> Iterator[None]:
    """Time W&B's own calls apart from the run around them, for every contestant alike.

    ``wandb.init`` and ``Run.finish`` (category ``start``): W&B's start reads every installed package's
    metadata and talks to its service, tens of milliseconds that swing by more than everything trainkit does
    in a run. ``Run.log`` (category ``log``): W&B's own work per row, about 0.5 ms on this host, the same call
    in the raw loop, trainkit and Lightning; its run-to-run wander (10-20 % here, like everything's) would bury
    the few microseconds trainkit adds around it. Inside this context those calls are timed on their own, so
    the engine section fits trainkit's per-row cost without them and reports W&B's beside it. Every contestant
    looks them up at call time (``wandb.init``, ``run.log``, ``run.finish``), so patching W&B's module and
    ``Run`` class reaches them all without touching trainkit.
    """
    import wandb

    init, log_row, finish = wandb.init, wandb.Run.log, wandb.Run.finish
    wandb.init = _timed_apart(init, "start")
    wandb.Run.log = _timed_apart(log_row, "log")
    wandb.Run.finish = _timed_apart(finish, "start")
    try:
        yield
    finally:
        wandb.init, wandb.Run.log, wandb.Run.finish = init, log_row, finish


Shape = tuple[int, int]
"""A run length of the engine section: ``(epochs, batches per epoch)``."""


@dataclass
class GridResult:
    """The engine section's samples: one series per contestant and run length, repetition i of each a pair."""

    times: dict[tuple[str, Shape], Timings]  # the run, less the time in W&B's own calls (APART)
    apart: dict[str, dict[tuple[str, Shape], Timings]]  # the time in W&B's calls by category (zero without W&B)
    outcomes: dict[tuple[str, Shape], Outcome]
    warnings: dict[str, list[str]]


def run_grid(
    title: str,
    workloads: dict[Shape, Workload],
    contestants: list[Contestant],
    rounds: int,
    reps: int,
    terminal: bool = False,
) -> GridResult:
    """``run_group`` over several run lengths at once: every repetition runs each contestant at each length.

    In a repetition the lengths come in a freshly shuffled order and, at each length, the contestants run back
    to back in a freshly shuffled order: the runs that are compared (two contestants at one length) are as
    close in time as they can be, drift hits every contestant alike, and repetition i of any two series pairs up.
    The time spent inside W&B's own calls (when :func:`wandb_calls_apart` is active) is taken out of each run
    and kept beside it.

    :param title: The group's name, for messages.
    :param workloads: One workload per run length.
    :param contestants: The contestants.
    :param rounds: Measured rounds, after one discarded warm-up round.
    :param reps: Repetitions per measured round.
    :param terminal: Run with stdout and stderr on a terminal that drops its output (see :func:`quiet`).
    :returns: The samples, the outcomes (checked deterministic per contestant and length) and the warnings
        trainkit contestants raised in the warm-up round.
    """
    keys = [(c, shape) for shape in workloads for c in contestants]
    times = {(c.name, shape): Timings() for c, shape in keys}
    apart = {category: {(c.name, shape): Timings() for c, shape in keys} for category in APART}
    outcomes: dict[tuple[str, Shape], Outcome] = {}
    caught: dict[str, set[str]] = {}
    shuffler = random.Random(6000)
    # these runs take milliseconds: a full collection before each one must not scan the ~500k objects torch,
    # W&B and Lightning left (0.1 s each), so they are frozen now, and what the warm-up leaves after it
    settle_heap()
    for rnd in range(rounds + 1):
        for _ in range(reps if rnd else 1):
            lengths = list(workloads)
            shuffler.shuffle(lengths)
            order = []
            for shape in lengths:
                at_length = list(contestants)
                shuffler.shuffle(at_length)
                order += [(c, shape) for c in at_length]
            for c, shape in order:
                wl = workloads[shape]
                tmp = new_tmp(f"{wl.name}-{c.name}-")
                gc.collect()
                _APART.take()
                with warnings.catch_warnings(record=True) as seen, quiet(terminal):
                    warnings.simplefilter("always" if rnd == 0 else "ignore")
                    w0, c0 = time.perf_counter(), time.process_time()
                    model, extra = c.run(wl, tmp)
                    w1, c1 = time.perf_counter(), time.process_time()
                cpu_apart, wall_apart = _APART.take()
                out = _outcome(model, extra, tmp)
                key = (c.name, shape)
                if key in outcomes and outcomes[key].key() != out.key():
                    raise SystemExit(f"{title}: {c.name} at {shape} is not deterministic: {outcomes[key]} vs {out}")
                outcomes[key] = out
                if rnd == 0 and c.family == "trainkit":
                    caught.setdefault(c.name, set()).update(f"{w.category.__name__}: {w.message}" for w in seen)
                del model, extra
                shutil.rmtree(tmp, ignore_errors=True)
                if torch.get_num_threads() != 1:
                    raise SystemExit(f"{c.name} changed torch's thread count to {torch.get_num_threads()}")
                if rnd > 0:
                    times[key].wall.append(w1 - w0 - sum(wall_apart.values()))
                    times[key].cpu.append(c1 - c0 - sum(cpu_apart.values()))
                    for category in APART:
                        apart[category][key].wall.append(wall_apart[category])
                        apart[category][key].cpu.append(cpu_apart[category])
        if rnd == 0:
            settle_heap()
    gc.unfreeze()
    return GridResult(times, apart, outcomes, {name: sorted(msgs) for name, msgs in caught.items()})


@dataclass
class Report:
    settings: Settings
    enforce: bool
    clock_mode: str
    resamples: int = confidence.DEFAULT_RESAMPLES
    rows: list[dict[str, Any]] = field(default_factory=list)
    costs: list[dict[str, Any]] = field(default_factory=list)  # the engine section's rows
    own_costs: list[dict[str, Any]] = field(default_factory=list)  # each engine baseline's own fitted cost
    engine_samples: dict[str, Any] = field(default_factory=dict)  # group -> contestant -> shape -> cpu/wall/apart
    wandb_apart: dict[str, Any] = field(default_factory=dict)  # wandb.init + finish per run, timed apart
    gates: list[dict[str, Any]] = field(default_factory=list)  # every gate judged, ratio and engine alike
    checks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    work_mismatch: bool = False

    def pick(self, natural: str) -> str:
        """The clock a gate uses: its natural one (``auto``), or the one forced with ``--clock``."""
        return natural if self.clock_mode == "auto" else self.clock_mode

    def judge_gate(self, gate: str, limit: float, unit: str, estimate: float, lo: float, hi: float, pairs: int) -> str:
        """Judge one gate on its interval (:func:`confidence.judge`) and record it.

        :param gate: The gate's name.
        :param limit: Its limit, in ``unit``.
        :param unit: ``"ratio"`` or ``"us"``.
        :param estimate: The point estimate (median ratio, fitted cost).
        :param lo: The 95 % interval's lower end.
        :param hi: Its upper end.
        :param pairs: The pairs behind the interval.
        :returns: ``"PASS"``, ``"FAIL"`` or ``"UNDECIDED"``.
        """
        verdict = confidence.judge(lo, hi, limit, pairs)
        self.gates.append(
            {
                "gate": gate,
                "limit": limit,
                "unit": unit,
                "estimate": estimate,
                "ci_low": lo,
                "ci_high": hi,
                "pairs": pairs,
                "verdict": verdict,
                "pairs_to_decide": confidence.pairs_to_decide(estimate, lo, hi, limit, pairs),
            }
        )
        return verdict

    def add_row(
        self,
        bench: str,
        variant: str,
        ours: str,
        base: str,
        ours_t: Timings,
        base_t: Timings,
        clock: str,
        gate: str | None,
    ) -> dict[str, Any]:
        stats = {c: ratio_stats(ours_t.on(c), base_t.on(c)) for c in CLOCKS}
        main = stats[clock]
        median, lo, hi = confidence.bootstrap_median(main["ratios"], self.resamples)
        limit = GATES.get(gate) if gate else None
        other = "wall" if clock == "cpu" else "cpu"
        pairs = len(ours_t.wall)
        verdict = (
            None if gate is None or limit is None else self.judge_gate(gate, limit, "ratio", median, lo, hi, pairs)
        )
        row = {
            "benchmark": bench,
            "variant": variant,
            "contestant": ours,
            "baseline": base,
            "clock": clock,
            "contestant_median_s": statistics.median(ours_t.on(clock)),
            "baseline_median_s": statistics.median(base_t.on(clock)),
            "ratio_median": main["median"],
            "ratio_ci_low": lo,
            "ratio_ci_high": hi,
            "ratio_q1": main["q1"],
            "ratio_q3": main["q3"],
            "ratio_min": main["min"],
            "ratio_max": main["max"],
            "ratios": main["ratios"],
            "other_clock": other,
            "other_ratio_median": stats[other]["median"],
            "other_ratios": stats[other]["ratios"],
            "pairs": pairs,
            "gate": gate if limit is not None else None,
            "gate_limit": limit,
            "verdict": verdict,
            "passed": None if verdict is None else verdict != "FAIL",
        }
        self.rows.append(row)
        shown = "" if verdict is None else f"{verdict} (gate <= {limit:.2f})"
        if verdict == "UNDECIDED":
            shown += f", ~{self.gates[-1]['pairs_to_decide'] or 'no number of'} pairs would decide it"
        log(
            f"  {bench + '/' + variant:<16} {ours:>15} / {base:<15} {clock:<4} {median:.4f} "
            f"[95% {lo:.4f}-{hi:.4f}; q1-q3 {main['q1']:.4f}-{main['q3']:.4f}]  ({other} "
            f"{stats[other]['median']:.4f})  {shown}"
        )
        return row

    def check_work(self, title: str, outcomes: dict[str, Outcome], reference: str, families: dict[str, str]) -> None:
        ref = outcomes[reference]
        for name in families:
            out = outcomes[name]
            entry: dict[str, Any] = {
                "group": title,
                "contestant": name,
                "reference": reference,
                "train_loss": out.train_loss,
                "val_loss": out.val_loss,
                "digest": out.digest,
                "files": list(out.files),
                "improvements": out.improvements,
            }
            if out.key() == ref.key():
                entry["match"] = "bitwise"
            elif families[name] == "lightning" and _close(out, ref):
                entry["match"] = "tolerance"
                self.notes.append(
                    f"{title}: {name} matches {reference} to a relative 1e-6 on the losses but not bitwise; Lightning "
                    "runs the same ops, though not necessarily in bit-for-bit the same sequence"
                )
            else:
                entry["match"] = "MISMATCH"
                self.work_mismatch = True
            if ref.improvements is not None and out.improvements is not None and out.improvements != ref.improvements:
                entry["match"] = "MISMATCH (best-model improvements)"
                self.work_mismatch = True
            self.checks.append(entry)
            if entry["match"] not in ("bitwise", "tolerance"):
                log(f"  WORK MISMATCH {title}: {name} {out} vs {reference} {ref}")


def _close(a: Outcome, b: Outcome) -> bool:
    def near(x: float, y: float) -> bool:
        return abs(x - y) <= 1e-6 * max(abs(x), abs(y), 1e-12)

    return near(a.train_loss, b.train_loss) and near(a.val_loss, b.val_loss)


# ---------------------------------------------------------------------------------------------- sections

# the clock each training gate is judged on with --clock auto: CPU time for what trainkit adds inside the
# process (Python work, tqdm, handing rows to W&B), wall time where the cost is waiting on the disk (fsync)
TINY_CLOCK = {"off": "cpu", "tqdm": "cpu", "wandb": "cpu", "ckpt": "wall", "steps": "cpu"}


def bench_training(report: Report, s: Settings, use_lightning: bool) -> None:
    tiny = tiny_workload(s)
    log(
        f"tiny: digits MLP 64-128-10, Adam, batch 64, {tiny.epochs} epochs = {tiny.steps} steps per run; "
        f"{s.rounds} rounds x {s.tiny_reps} interleaved runs ({s.wandb_reps} for W&B), paired per repetition"
    )
    wandb_config(tiny)  # built here, not inside a timed run
    checkpoint_config(tiny)
    for feature, raw_name in (("off", "raw"), ("tqdm", "raw_tqdm"), ("wandb", "raw_wandb"), ("ckpt", "raw_ckpt")):
        contestants = [
            Contestant(raw_name, lambda wl, tmp, f=feature: raw_run(wl, tmp, f), "raw"),
            Contestant("trainkit", lambda wl, tmp, f=feature: trainkit_run(wl, tmp, f), "trainkit"),
        ]
        if feature == "off":  # A/A control: the raw loop against itself shows the noise floor
            contestants.append(Contestant("raw (again)", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"))
        if feature == "ckpt":  # what the richer checkpoint costs: the minimal one a quick script writes
            contestants.append(Contestant("raw_ckpt_min", lambda wl, tmp: raw_run(wl, tmp, "ckpt_min"), "raw"))
        if use_lightning:
            contestants.append(
                Contestant("lightning", lambda wl, tmp, f=feature: lightning_run(wl, tmp, f), "lightning")
            )
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

    # step checkpoints (ckpt.every_n_steps, none due) with the epoch-end last.pt writes ckpt.enable brings:
    # against trainkit writing the same files without step checkpoints (ckpt last), the tracked loop alone;
    # against the raw loop and trainkit (off), what turning them on costs in all (information)
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
    # the gate: step checkpoints against trainkit writing the same last.pt without them (both write it once)
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
    times = {k: Timings() for k in stmts}
    shuffler = random.Random(2000)
    for rnd in range(s.import_rounds + s.import_warmups):
        order = list(stmts)
        shuffler.shuffle(order)
        for key in order:
            w0, c0 = time.perf_counter(), _child_cpu()
            proc = subprocess.run([sys.executable, "-c", stmts[key]], cwd=REPO, env=env, capture_output=True, text=True)
            w1, c1 = time.perf_counter(), _child_cpu()
            if proc.returncode != 0:
                raise SystemExit(f"`{stmts[key]}` failed:\n{proc.stderr}")
            if rnd >= s.import_warmups:
                times[key].wall.append(w1 - w0)
                times[key].cpu.append(c1 - c0)
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
    report.add_row(
        "import",
        "process",
        "import trainkit",
        "import torch",
        times["import trainkit"],
        times["import torch"],
        clock,
        "import/trainkit",
    )
    report.add_row(
        "import",
        "process",
        "trainkit.BaseTrainer",
        "import torch",
        times["trainkit.BaseTrainer"],
        times["import torch"],
        clock,
        "import/BaseTrainer",
    )


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
    # what save_if_best does on an improvement (trainkit.loop.snapshot): read the state dict, copy it into the
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
    ours = tk_optim.total_grad_norm(params)
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    assert torch.equal(ours, theirs), f"the grad norms differ: {ours} vs {theirs}"

    def run_ours() -> None:
        for _ in range(s.norm_calls):
            tk_optim.total_grad_norm(params)

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
    paths = {"trainkit": save_dir / "atomic.pt", "manual": save_dir / "manual.pt"}
    savers = {"trainkit": tk_checkpoint.atomic_save, "manual": durable_save}
    times = {k: Timings() for k in savers}
    shuffler = random.Random(5000)
    size = 0
    try:
        for rnd in range(s.save_rounds + 1):
            walls: dict[str, list[float]] = {k: [] for k in savers}
            cpus: dict[str, list[float]] = {k: [] for k in savers}
            for _ in range(s.save_reps if rnd else 1):
                order = list(savers)
                shuffler.shuffle(order)
                for key in order:
                    os.sync()  # start every save with no dirty pages left by the previous one
                    gc.collect()
                    w0, c0 = time.perf_counter(), time.process_time()
                    savers[key](payload, paths[key])
                    w1, c1 = time.perf_counter(), time.process_time()
                    walls[key].append(w1 - w0)
                    cpus[key].append(c1 - c0)
                    size = paths[key].stat().st_size
                    paths[key].unlink()
                    fsync_dir(save_dir)
            if rnd > 0:
                for key in savers:
                    times[key].wall.extend(walls[key])
                    times[key].cpu.extend(cpus[key])
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


def bench_micro(report: Report, s: Settings) -> None:
    model = big_model(s.snapshot_params)
    bench_snapshot(report, s, model)
    bench_grad_norm(report, s)
    if s.save_params != s.snapshot_params:
        model = big_model(s.save_params)
    bench_ckpt_save(report, s, model)


# ---------------------------------------------------------------------------------------------- engine

_UNITS = ("run", "epoch", "step")  # the order of confidence.design_matrix's columns


def _deltas(res: GridResult, ours: str, base: str, shapes: list[Shape], clock: str) -> np.ndarray:
    """``(shapes, pairs)``: ours minus base, seconds, repetition by repetition."""
    return np.array([np.subtract(res.times[(ours, sh)].on(clock), res.times[(base, sh)].on(clock)) for sh in shapes])


def fitted_costs(
    res: GridResult, ours: str, base: str, shapes: list[Shape], resamples: int
) -> dict[str, dict[str, float]]:
    """What ``ours`` adds to ``base`` per run, per epoch and per step, in CPU microseconds, with 95 % intervals.

    :param res: The engine group's samples.
    :param ours: The contestant.
    :param base: Its baseline.
    :param shapes: The run lengths, in the order of the design.
    :param resamples: Bootstrap resamples.
    :returns: ``{unit: {"us", "low", "high", "wall_us"}}`` for ``run``, ``epoch`` and ``step``.
    """
    design = confidence.design_matrix(shapes)
    est, lo, hi = confidence.bootstrap_costs(_deltas(res, ours, base, shapes, "cpu"), design, resamples)
    wall = confidence.fit_costs(_deltas(res, ours, base, shapes, "wall"), design)
    return {
        unit: {"us": est[i] * 1e6, "low": lo[i] * 1e6, "high": hi[i] * 1e6, "wall_us": wall[i] * 1e6}
        for i, unit in enumerate(_UNITS)
    }


def _fmt_cost(c: dict[str, float]) -> str:
    return f"{c['us']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"


def add_cost_row(
    report: Report,
    res: GridResult,
    shapes: list[Shape],
    feature: str,
    ours: str,
    base: str,
    gates: dict[str, str],
    anchor: str | None = None,
    note: str = "",
) -> dict[str, Any]:
    """Fit, judge and record one engine row: what ``ours`` adds to ``base``.

    :param report: Where the row and its verdicts go.
    :param res: The group's samples.
    :param shapes: The run lengths.
    :param feature: The feature (the row's label).
    :param ours: The contestant.
    :param base: Its baseline.
    :param gates: Unit (``step``, ``epoch``, ``run``) to the name of the gate in :data:`ENGINE_GATES` it is judged by.
    :param anchor: A contestant (Lightning) whose per-step cost against the same baseline is shown beside the row.
    :param note: What the row measures, for the table.
    :returns: The row.
    """
    costs = fitted_costs(res, ours, base, shapes, report.resamples)
    pairs = len(res.times[(ours, shapes[0])].cpu)
    row: dict[str, Any] = {
        "feature": feature,
        "contestant": ours,
        "baseline": base,
        "clock": "cpu",
        "pairs": pairs,
        "note": note,
        **{f"per_{unit}": costs[unit] for unit in _UNITS},
        "gates": {},
        "anchor": None,
    }
    parts = []
    for unit in ("step", "epoch", "run"):
        text = f"{unit} {_fmt_cost(costs[unit])}"
        gate = gates.get(unit)
        if gate is not None:
            limit = ENGINE_GATES[gate]
            c = costs[unit]
            verdict = report.judge_gate(gate, limit, "us", c["us"], c["low"], c["high"], pairs)
            row["gates"][unit] = {"gate": gate, "limit": limit, "verdict": verdict}
            text += f" {verdict} (<= {limit:g})"
        parts.append(text)
    if anchor is not None and (anchor, shapes[0]) in res.times:
        row["anchor"] = {"contestant": anchor, **fitted_costs(res, anchor, base, shapes, report.resamples)["step"]}
        parts.append(f"{anchor} step {_fmt_cost(row['anchor'])}")
    report.costs.append(row)
    log(f"  engine/{feature:<6} {ours:>20} - {base:<20} us, 95%: " + " | ".join(parts))
    return row


ENGINE_GROUPS = ("off", "tqdm", "wandb", "ckpt", "guard")
"""The engine section's groups, each a baseline and the trainkit variants measured against it."""


def bench_engine(report: Report, s: Settings, use_lightning: bool, only: tuple[str, ...] = ENGINE_GROUPS) -> None:
    """The engine's own cost: the null workload at several run lengths, contestants side by side.

    Every contestant runs at every run length in every repetition; the paired differences to the baseline
    at each length are fitted to ``run + epoch * epochs + step * steps`` (least squares over the per-length
    medians) with a bootstrap over repetitions for the intervals. All on CPU time; W&B's own calls
    (``wandb.init``, ``Run.finish``, ``Run.log``) are timed apart and reported beside the rows.

    :param report: Where the rows, verdicts and samples go.
    :param s: The run mode's sizes.
    :param use_lightning: Whether Lightning contestants run (the per-step anchor beside each row).
    :param only: The groups to run (``--engine-groups``), in :data:`ENGINE_GROUPS` order.
    """
    shapes = [tuple(sh) for sh in s.engine_shapes]
    workloads = {sh: null_workload(*sh) for sh in shapes}
    for wl in workloads.values():  # built here, not inside a timed run
        wandb_config(wl)
        checkpoint_config(wl)
    lengths = ", ".join(f"{e} epochs x {b} steps" for e, b in shapes)
    log(
        f"engine: the null workload (a batch of one, no forward, no backward) at {lengths}; "
        f"{s.engine_rounds} rounds x {s.engine_reps} interleaved runs per contestant and length ({s.engine_wandb_reps} "
        "for W&B), CPU time" + "".join(f"; {group}: {rounds} rounds" for group, rounds in s.engine_group_rounds)
    )

    def raw(feature: str) -> Callable[[Workload, Path], tuple[nn.Module, Any]]:
        return lambda wl, tmp: raw_run(wl, tmp, feature)

    def ours(feature: str) -> Callable[[Workload, Path], tuple[nn.Module, Any]]:
        return lambda wl, tmp: trainkit_run(wl, tmp, feature)

    groups: dict[str, tuple[str, list[Contestant]]] = {
        "off": (
            "raw",
            [
                Contestant("raw", raw("off"), "raw"),
                Contestant("raw (again)", raw("off"), "raw"),
                Contestant("trainkit", ours("off"), "trainkit"),
                Contestant("trainkit (steps)", ours("steps"), "trainkit"),
                Contestant("trainkit (ckpt last)", ours("ckpt_last"), "trainkit"),
                Contestant("raw (ckpt last)", raw("ckpt_last"), "raw"),
            ],
        ),
        "tqdm": (
            "raw_tqdm",
            [Contestant("raw_tqdm", raw("tqdm"), "raw"), Contestant("trainkit", ours("tqdm"), "trainkit")],
        ),
        "wandb": (
            "raw_wandb",
            [Contestant("raw_wandb", raw("wandb"), "raw"), Contestant("trainkit", ours("wandb"), "trainkit")],
        ),
        "ckpt": (
            "raw_ckpt",
            [Contestant("raw_ckpt", raw("ckpt"), "raw"), Contestant("trainkit", ours("ckpt"), "trainkit")],
        ),
        "guard": (
            "trainkit (clip)",
            [
                Contestant("trainkit (clip)", ours("clip"), "trainkit"),
                Contestant("trainkit (guard)", ours("guard"), "trainkit"),
                Contestant("trainkit (rollback)", ours("rollback"), "trainkit"),
                Contestant("trainkit (clip, steps)", ours("clip_steps"), "trainkit"),
                Contestant("trainkit (rollback, steps)", ours("rollback_steps"), "trainkit"),
            ],
        ),
    }
    groups = {feature: group for feature, group in groups.items() if feature in only}
    lightning = "lightning" if use_lightning else None
    with wandb_calls_apart():
        for feature, (base, contestants) in groups.items():
            if use_lightning and feature in LIGHTNING_NOTES:
                contestants.append(
                    Contestant("lightning", lambda wl, tmp, f=feature: lightning_run(wl, tmp, f), "lightning")
                )
            # the tqdm group on a terminal: trainkit draws its step bar only there (elsewhere it costs nothing)
            t0 = time.perf_counter()
            reps = s.engine_wandb_reps if feature == "wandb" else s.engine_reps
            rounds = dict(s.engine_group_rounds).get(feature, s.engine_rounds)
            res = run_grid(f"engine/{feature}", workloads, contestants, rounds, reps, terminal=feature == "tqdm")
            report.engine_samples[feature] = {
                c.name: {
                    f"{e}x{b}": {
                        "cpu": res.times[(c.name, (e, b))].cpu,
                        "wall": res.times[(c.name, (e, b))].wall,
                        **{f"{cat}_cpu": res.apart[cat][(c.name, (e, b))].cpu for cat in APART},
                    }
                    for e, b in shapes
                }
                for c in contestants
            }
            log(f"  engine/{feature}: {len(contestants)} contestants in {time.perf_counter() - t0:.1f} s")
            families = {c.name: c.family for c in contestants}
            for sh in shapes:
                outcomes = {c.name: res.outcomes[(c.name, sh)] for c in contestants}
                report.check_work(f"engine/{feature} {sh[0]}x{sh[1]}", outcomes, base, families)
            for name, msgs in res.warnings.items():
                report.notes.extend(f"engine/{feature}: {name} warned: {msg}" for msg in msgs)
            own = confidence.fit_costs(
                np.array([res.times[(base, sh)].cpu for sh in shapes]), confidence.design_matrix(shapes)
            )
            log(
                f"  engine/{feature:<6} {base} itself: {own[2] * 1e6:.1f} us per step, {own[1] * 1e6:.0f} us per "
                f"epoch, {own[0] * 1e6:.0f} us per run (CPU, fitted)"
            )
            report.own_costs.append(
                {"feature": feature, "contestant": base, **{f"per_{u}_us": own[i] * 1e6 for i, u in enumerate(_UNITS)}}
            )
            if feature == "off":
                add_cost_row(
                    report, res, shapes, "off", "raw (again)", "raw", {}, note="noise floor: raw against itself"
                )
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "off",
                    "trainkit",
                    "raw",
                    {u: f"engine/off/{u}" for u in ("step", "epoch", "run")},
                    lightning,
                    "the epoch loop, config, seeding, run setup; progress and W&B off, no checkpoints",
                )
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "steps",
                    "trainkit (steps)",
                    "raw (ckpt last)",
                    {"step": "engine/steps/step"},
                    lightning,
                    "ckpt.every_n_steps past the run's end (the tracked loop and the step-boundary check, none due) "
                    "against the hand-written loop writing the same last.pt at every epoch end, as ckpt.enable does",
                )
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "steps",
                    "trainkit (steps)",
                    "trainkit (ckpt last)",
                    {"epoch": "engine/steps/epoch"},
                    note="the tracked loop alone: against trainkit writing the same last.pt at every epoch end",
                )
                for row_feature, ours_name, base_name, note in (
                    (
                        "steps",
                        "trainkit (steps)",
                        "raw",
                        "information: against the loop that writes nothing (its epoch and run columns are the "
                        "epoch-end last.pt writes, its step column carries the per-step share below)",
                    ),
                    (
                        "ckpt last",
                        "raw (ckpt last)",
                        "raw",
                        "information: the hand-written loop's own epoch-end last.pt; a save after a longer epoch "
                        "costs more CPU on this host, which the fit puts in the step column",
                    ),
                    (
                        "ckpt last",
                        "trainkit (ckpt last)",
                        "raw (ckpt last)",
                        "information: ckpt.enable against the same last.pt written by hand",
                    ),
                ):
                    add_cost_row(report, res, shapes, row_feature, ours_name, base_name, {}, note=note)
            elif feature != "guard":
                trainkit_gates = {
                    "tqdm": {u: f"engine/tqdm/{u}" for u in ("step", "epoch", "run")},
                    "wandb": {u: f"engine/wandb/{u}" for u in ("step", "epoch", "run")},
                    "ckpt": {},
                }[feature]
                notes = {
                    "tqdm": "trainkit's bars (progress.enable, on a terminal) against a tqdm bar over the batches",
                    "wandb": "trainkit's work per row (log + push_logs: buffer, drain, the row, RunLog) against the "
                    "raw loop's (.item(), the row); W&B's own Run.log, wandb.init and finish timed apart (below)",
                    "ckpt": "durable last.pt and best.pt (save_if_best) against the same files written by hand; "
                    "disk-bound, judged on wall time by tiny/ckpt, information here",
                }
                add_cost_row(report, res, shapes, feature, "trainkit", base, trainkit_gates, lightning, notes[feature])
            elif feature == "guard":
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "guard",
                    "trainkit (guard)",
                    "trainkit (clip)",
                    {"step": "engine/guard/step"},
                    note="guard.nonfinite=skip with nothing non-finite (the norm judged before each optimizer step) "
                    "against the same loop with the guard off; both call clip_and_log_grad_norm()",
                )
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "guard, rollback",
                    "trainkit (rollback, steps)",
                    "trainkit (clip, steps)",
                    {"step": "engine/guard/rollback/step"},
                    note="guard.nonfinite=rollback with nothing non-finite against the same loop with the guard off, "
                    "both with ckpt.every_n_steps (none due), as a run that rolls back to a step has it: the verdict "
                    "and the positions of each step's batches",
                )
                add_cost_row(
                    report,
                    res,
                    shapes,
                    "guard, rollback, no step checkpoints",
                    "trainkit (rollback)",
                    "trainkit (clip)",
                    {},
                    note="guard.nonfinite=rollback without ckpt.every_n_steps (it rolls back to the epoch's start; "
                    "information): the above plus the counted loop, which this mode runs even so",
                )
            if feature == "wandb":
                add_cost_row(
                    report,
                    with_apart(res, "log"),
                    shapes,
                    "wandb, Run.log in",
                    "trainkit",
                    base,
                    {},
                    lightning,
                    "the same rows with W&B's own Run.log put back in (wandb.init and finish still apart): "
                    "information, W&B's wander buries microseconds here",
                )
                wandb_apart(report, res, shapes, [c.name for c in contestants], base)


def with_apart(res: GridResult, category: str) -> GridResult:
    """``res`` with the time its runs spent in one category of W&B's calls put back into them.

    :param res: The samples.
    :param category: One of :data:`APART`.
    :returns: A copy whose ``times`` include that category.
    """
    added = res.apart[category]
    times = {
        key: Timings(
            wall=[a + b for a, b in zip(t.wall, added[key].wall)], cpu=[a + b for a, b in zip(t.cpu, added[key].cpu)]
        )
        for key, t in res.times.items()
    }
    return GridResult(times, res.apart, res.outcomes, res.warnings)


def wandb_apart(report: Report, res: GridResult, shapes: list[Shape], names: list[str], base: str) -> None:
    """Report W&B's own calls, timed apart: ``wandb.init`` + ``Run.finish`` per run, ``Run.log`` per row.

    :param report: Where the rows go.
    :param res: The W&B group's samples.
    :param shapes: The run lengths (pooled for the start: it does not depend on the run's length).
    :param names: The contestants.
    :param base: The raw W&B loop.
    """
    design = confidence.design_matrix(shapes)
    entry: dict[str, Any] = {"start_per_run": {}, "log_per_row": {}}
    for name in names:
        start = res.apart["start"]
        cpu = [v * 1e3 for sh in shapes for v in start[(name, sh)].cpu]
        wall = [v * 1e3 for sh in shapes for v in start[(name, sh)].wall]
        med, lo, hi = confidence.bootstrap_median(cpu, report.resamples)
        entry["start_per_run"][name] = {"cpu_ms": med, "low": lo, "high": hi, "wall_ms": statistics.median(wall)}
        rows = np.array([res.apart["log"][(name, sh)].cpu for sh in shapes])
        est, lo_r, hi_r = confidence.bootstrap_costs(rows, design, report.resamples)
        entry["log_per_row"][name] = {"us": est[2] * 1e6, "low": lo_r[2] * 1e6, "high": hi_r[2] * 1e6}
        log(
            f"  engine/wandb  {name:>20} W&B's own calls: wandb.init + finish CPU {med:.1f} ms per run [95% {lo:.1f}, "
            f"{hi:.1f}] (wall {statistics.median(wall):.0f} ms); Run.log CPU {est[2] * 1e6:.0f} us per row "
            f"[{lo_r[2] * 1e6:.0f}, {hi_r[2] * 1e6:.0f}]"
        )
    if "trainkit" in names:
        start = res.apart["start"]
        diffs = [(a - b) * 1e3 for sh in shapes for a, b in zip(start[("trainkit", sh)].cpu, start[(base, sh)].cpu)]
        med, lo, hi = confidence.bootstrap_median(diffs, report.resamples)
        entry["start_trainkit_minus_raw"] = {"cpu_ms": med, "low": lo, "high": hi}
        logs = res.apart["log"]
        deltas = np.array([np.subtract(logs[("trainkit", sh)].cpu, logs[(base, sh)].cpu) for sh in shapes])
        est, lo_r, hi_r = confidence.bootstrap_costs(deltas, design, report.resamples)
        entry["log_trainkit_minus_raw"] = {"us": est[2] * 1e6, "low": lo_r[2] * 1e6, "high": hi_r[2] * 1e6}
        log(
            f"  engine/wandb  trainkit - {base} in W&B's own calls: start {med:+.2f} ms per run [95% {lo:+.2f}, "
            f"{hi:+.2f}]; Run.log {est[2] * 1e6:+.1f} us per row [{lo_r[2] * 1e6:+.1f}, {hi_r[2] * 1e6:+.1f}]"
        )
    report.wandb_apart = entry


# ---------------------------------------------------------------------------------------------- output


def _verdict_text(verdict: str | None, pairs_to_decide: int | None = None) -> str:
    if verdict is None:
        return "info"
    if verdict == "FAIL":
        return "**FAIL**"
    if verdict == "UNDECIDED":
        return f"**UNDECIDED** (~{pairs_to_decide} pairs)" if pairs_to_decide else "**UNDECIDED**"
    return verdict


def markdown_table(rows: list[dict[str, Any]], gates: dict[str, dict[str, Any]]) -> list[str]:
    """The ratio rows as a Markdown table.

    :param rows: :attr:`Report.rows`.
    :param gates: Gate name to its record in :attr:`Report.gates`.
    :returns: The table's lines.
    """
    lines = [
        "| benchmark | contestant / baseline | clock | contestant s | baseline s | ratio (median) | 95% interval "
        "| q1-q3 | other clock | pairs | gate | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gate = f"<= {r['gate_limit']:.2f}" if r["gate_limit"] is not None else "-"
        record = gates.get(r["gate"]) if r["gate"] else None
        result = _verdict_text(r["verdict"], record["pairs_to_decide"] if record else None)
        lines.append(
            f"| {r['benchmark']}/{r['variant']} | {r['contestant']} / {r['baseline']} | {r['clock']} "
            f"| {r['contestant_median_s']:.4f} | {r['baseline_median_s']:.4f} | {r['ratio_median']:.4f} "
            f"| {r['ratio_ci_low']:.4f}-{r['ratio_ci_high']:.4f} "
            f"| {r['ratio_q1']:.4f}-{r['ratio_q3']:.4f} | {r['other_clock']} {r['other_ratio_median']:.4f} "
            f"| {r['pairs']} | {gate} | {result} |"
        )
    return lines


def engine_table(report: Report) -> list[str]:
    """The engine section's rows as a Markdown table: added CPU us per step, epoch and run, with intervals.

    :param report: The report.
    :returns: The table's lines (none when the section did not run).
    """
    if not report.costs:
        return []
    gates = {g["gate"]: g for g in report.gates}

    def cell(row: dict[str, Any], unit: str) -> str:
        c = row[f"per_{unit}"]
        text = (
            f"{c['us']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
            if unit != "run"
            else (f"{c['us']:+.0f} [{c['low']:+.0f}, {c['high']:+.0f}]")
        )
        judged = row["gates"].get(unit)
        if judged is not None:
            record = gates[judged["gate"]]
            text += f" <= {judged['limit']:g}: {_verdict_text(judged['verdict'], record['pairs_to_decide'])}"
        return text

    lines = [
        "| feature | contestant - baseline | pairs | per step (us) | per epoch (us) | per run (us) "
        "| Lightning - same baseline, per step (us) | what it measures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report.costs:
        anchor = r["anchor"]
        anchor_text = f"{anchor['us']:+.1f} [{anchor['low']:+.1f}, {anchor['high']:+.1f}]" if anchor else "-"
        lines.append(
            f"| {r['feature']} | {r['contestant']} - {r['baseline']} | {r['pairs']} | {cell(r, 'step')} "
            f"| {cell(r, 'epoch')} | {cell(r, 'run')} | {anchor_text} | {r['note']} |"
        )
    if report.own_costs:
        lines += ["", "The baselines' own cost (CPU, fitted the same way):", ""]
        lines += [
            f"- {o['contestant']}: {o['per_step_us']:.1f} us per step, {o['per_epoch_us']:.0f} us per epoch, "
            f"{o['per_run_us']:.0f} us per run"
            for o in report.own_costs
        ]
    if report.wandb_apart:
        apart = report.wandb_apart
        lines += ["", "W&B's own calls, timed apart from the rows above (CPU; median or fit, 95% interval):", ""]
        for name, c in apart["start_per_run"].items():
            row = apart["log_per_row"][name]
            lines.append(
                f"- {name}: `wandb.init` + `Run.finish` {c['cpu_ms']:.1f} ms per run [{c['low']:.1f}, "
                f"{c['high']:.1f}] (wall {c['wall_ms']:.0f} ms); `Run.log` {row['us']:.0f} us per row "
                f"[{row['low']:.0f}, {row['high']:.0f}]"
            )
        if "start_trainkit_minus_raw" in apart:
            d, r = apart["start_trainkit_minus_raw"], apart["log_trainkit_minus_raw"]
            lines.append(
                f"- trainkit - raw_wandb: start {d['cpu_ms']:+.2f} ms per run [{d['low']:+.2f}, {d['high']:+.2f}]; "
                f"`Run.log` {r['us']:+.1f} us per row [{r['low']:+.1f}, {r['high']:+.1f}]"
            )
    return lines


def gate_summary(report: Report) -> list[str]:
    """Every gate with its verdict, as a Markdown table.

    :param report: The report.
    :returns: The table's lines.
    """
    lines = ["| gate | limit | estimate | 95% interval | pairs | result |", "|---|---|---|---|---|---|"]
    for g in report.gates:
        digits = ".4f" if g["unit"] == "ratio" else ".2f"
        unit = "" if g["unit"] == "ratio" else " us"
        lines.append(
            f"| {g['gate']} | <= {g['limit']:g}{unit} | {g['estimate']:{digits}} "
            f"| [{g['ci_low']:{digits}}, {g['ci_high']:{digits}}] | {g['pairs']} "
            f"| {_verdict_text(g['verdict'], g['pairs_to_decide'])} |"
        )
    return lines


def write_outputs(report: Report, out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    verdicts = [g["verdict"] for g in report.gates]
    doc = {
        "meta": meta,
        "settings": report.settings.__dict__,
        "clock_mode": report.clock_mode,
        "confidence_level": confidence.LEVEL,
        "bootstrap_resamples": report.resamples,
        "gates_enforced": report.enforce,
        "all_gates_passed": all(v == "PASS" for v in verdicts),
        "no_gate_failed": "FAIL" not in verdicts,
        "work_identical": not report.work_mismatch,
        "gates": report.gates,
        "rows": report.rows,
        "engine": {
            "rows": report.costs,
            "baselines": report.own_costs,
            "wandb_apart": report.wandb_apart,
            "samples_s": report.engine_samples,
        },
        "work_checks": report.checks,
        "notes": report.notes,
    }
    json_path = out_dir / "latest.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")

    s = report.settings
    lines = [
        "# trainkit overhead benchmark",
        "",
        f"{meta['timestamp']}; mode `{s.mode}`; {s.rounds} measured rounds (+1 warm-up); torch {meta['torch']} "
        f"({meta['torch_threads']} thread); Python {meta['python']}; {meta['cpus']} CPUs; trainkit "
        f"{meta['trainkit']} at {meta['git']}"
        + (f"; Lightning {meta['lightning']}" if meta.get("lightning") else "")
        + f"; {meta['seconds']} s.",
        "",
        f"Load average at start / end: {meta['loadavg_start']} / {meta['loadavg_end']}.",
        "",
        "Gates are judged on 95% bootstrap intervals: PASS when the interval's upper end is under the limit, "
        "FAIL when its lower end is over it, UNDECIDED (exit 0) when it straddles the limit or rests on fewer "
        f"than {confidence.MIN_PAIRS} pairs, with about the pairs that would decide it.",
        "",
        *gate_summary(report),
        "",
        *(
            [
                "## Engine cost (null workload)",
                "",
                "Added CPU microseconds, contestant minus baseline, fitted over the run lengths "
                f"{', '.join(f'{e}x{b}' for e, b in s.engine_shapes)} (epochs x steps per epoch) to "
                "`run + epoch * epochs + step * steps`; median of the paired differences at each length, 95% "
                "bootstrap interval over repetitions in brackets. `raw (again) - raw` is the noise floor.",
                "",
                *engine_table(report),
                "",
            ]
            if report.costs
            else []
        ),
        "## Ratios",
        "",
        "Ratio = contestant / baseline, paired per repetition (in every repetition each contestant runs once, "
        "back to back, in a shuffled order); the table shows the median of the paired ratios over all "
        "repetitions of all measured rounds, its 95% bootstrap interval and the quartiles, on the "
        f"clock the gate uses (`--clock {report.clock_mode}`), with the other clock's median beside it. Rows "
        "`raw (again) / raw` run the raw loop against itself: their spread is the measurement noise floor.",
        "",
        *markdown_table(report.rows, {g["gate"]: g for g in report.gates}),
        "",
        "## Same work",
        "",
        "Every contestant of a group started from the same weights and saw the same batches in the same order.",
        "",
        "| group | contestant | final train loss | final val loss | weights (sha256) | checkpoint files | match |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report.checks:
        lines.append(
            f"| {c['group']} | {c['contestant']} | {c['train_loss']!r} | {c['val_loss']!r} | {c['digest']} "
            f"| {' '.join(c['files']) or '-'} | {c['match']} |"
        )
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    if meta.get("lightning"):
        lines += ["", "## Lightning settings", ""] + [f"- {k}: {v}" for k, v in LIGHTNING_NOTES.items()]
    md_path = out_dir / "latest.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


_TORCH_VERSION_AT_START = torch.__version__


def main(argv: list[str] | None = None) -> int:
    """Run the sections asked for, write ``latest.json`` and ``latest.md``, and judge the gates.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The exit status: 0 when no gate FAILs, 1 when one does (full mode, or ``--enforce-gates``), 2 when
        contestants did different work, 3 when a section raised.
    """
    parser = argparse.ArgumentParser(description="trainkit overhead benchmarks (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small sizes, 3 rounds, gates advisory")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured rounds of every section (default 15, --quick 3 / engine 1)"
    )
    parser.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="clock the gates use: auto = CPU time for in-process work, wall time for disk I/O",
    )
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning contestants")
    parser.add_argument(
        "--only",
        default="engine,training,import,micro",
        help="comma-separated sections: engine, training, import, micro (default: all)",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=confidence.DEFAULT_RESAMPLES,
        help=f"bootstrap resamples of every 95%% interval (default {confidence.DEFAULT_RESAMPLES})",
    )
    parser.add_argument(
        "--engine-groups",
        default=",".join(ENGINE_GROUPS),
        help=f"comma-separated groups of the engine section: {', '.join(ENGINE_GROUPS)} (default: all)",
    )
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    args = parser.parse_args(argv)

    s = QUICK if args.quick else FULL
    if args.rounds is not None:
        s = Settings(**{**s.__dict__, "rounds": args.rounds, "engine_rounds": args.rounds, "engine_group_rounds": ()})
    sections = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = sections - {"engine", "training", "import", "micro"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    engine_groups = tuple(g for g in ENGINE_GROUPS if g in {x.strip() for x in args.engine_groups.split(",")})
    unknown_groups = {x.strip() for x in args.engine_groups.split(",") if x.strip()} - set(ENGINE_GROUPS)
    if unknown_groups or not engine_groups:
        parser.error(
            f"--engine-groups: unknown or no groups in {args.engine_groups!r} (choose from {', '.join(ENGINE_GROUPS)})"
        )
    enforce = args.enforce_gates or not args.quick
    one_thread()
    if args.resamples < 100:
        parser.error("--resamples must be at least 100")
    report = Report(settings=s, enforce=enforce, clock_mode=args.clock, resamples=args.resamples)
    start = time.perf_counter()
    meta: dict[str, Any] = {
        **run_meta(),
        "torch_threads": torch.get_num_threads(),
        "trainkit": trainkit.__version__,
    }
    if s.mode == "full" and s.rounds < 7:
        report.notes.append(f"only {s.rounds} measured rounds (--rounds); the gates are meant for 7 or more")

    use_lightning = False
    if sections & {"engine", "training"} and not args.no_lightning:
        why = lightning_available()
        if why is None:
            use_lightning = True
            import lightning

            meta["lightning"] = lightning.__version__
        else:
            log(f"Lightning skipped ({why}); install it with: pip install -e '.[bench]'")
            report.notes.append(f"Lightning skipped: {why}")
    elif args.no_lightning:
        report.notes.append("Lightning skipped (--no-lightning)")
    log(
        f"trainkit overhead benchmark, mode {s.mode}: {s.rounds} measured rounds + 1 warm-up, 1 torch thread, "
        f"clock {args.clock}; load average {meta['loadavg_start']}"
    )
    try:
        runners: dict[str, Callable[[Report, Settings], None]] = {
            "engine": functools.partial(bench_engine, use_lightning=use_lightning, only=engine_groups),
            "training": functools.partial(bench_training, use_lightning=use_lightning),
            "import": bench_import,
            "micro": bench_micro,
        }
        for name, section in runners.items():
            if name in sections:
                t0 = time.perf_counter()
                section(report, s)
                meta.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
                log(f"  ({name}: {meta['section_seconds'][name]} s)")
    except Exception:
        traceback.print_exc()
        return 3
    finally:
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
    meta["loadavg_end"] = load_average()
    meta["seconds"] = round(time.perf_counter() - start, 1)
    if machine_was_busy(meta):
        report.notes.append(
            f"the machine was busy (load average {meta['loadavg_start']} at the start, {meta['loadavg_end']} at the "
            f"end, on {meta['cpus']} CPUs): other processes competed for the CPUs, so single rounds are noisy; "
            "compare a ratio with the `raw (again) / raw` noise floor before trusting a 1-2 % difference"
        )
    json_path, md_path = write_outputs(report, args.out, meta)
    print()
    print(md_path.read_text())
    log(f"wrote {json_path} and {md_path} in {meta['seconds']} s")
    if report.work_mismatch:
        log("FAILED: contestants did different work (see 'Same work')")
        return 2
    undecided = [g for g in report.gates if g["verdict"] == "UNDECIDED"]
    for g in undecided:  # loud, but not a failure: this run cannot tell, more pairs would
        reason = confidence.why_undecided(g["estimate"], g["ci_low"], g["ci_high"], g["limit"], g["pairs"])
        log(f"UNDECIDED: {g['gate']}: {reason}")
    failed = [g["gate"] for g in report.gates if g["verdict"] == "FAIL"]
    if failed:
        log(f"gates failed: {', '.join(failed)}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    passed = sum(g["verdict"] == "PASS" for g in report.gates)
    log(f"no gate failed: {passed} PASS, {len(undecided)} UNDECIDED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
