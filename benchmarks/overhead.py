#!/usr/bin/env python
"""trainkit overhead benchmarks: trainkit against a hand-written PyTorch loop (and Lightning, when installed).

Run from the repository root::

    .venv/bin/python benchmarks/overhead.py            # full run (~10 min on 2 cores), gates enforced
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run (< 1 min), gates advisory

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
status is 0 when every gate passes, 1 when a gate is missed (full mode, or ``--enforce-gates``), 2 when
contestants did different work. See ``benchmarks/README.md`` for what each gate means.
"""

from __future__ import annotations

import argparse
import array
import atexit
import contextlib
import datetime
import functools
import gc
import hashlib
import json
import logging
import os
import platform
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout: measure this working tree's trainkit
    sys.path.insert(0, str(REPO))

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
from trainkit import BaseTrainer  # noqa: E402
from trainkit import checkpoint as tk_checkpoint  # noqa: E402
from trainkit import optim as tk_optim  # noqa: E402
from trainkit.modules import module_state  # noqa: E402
from trainkit.snapshot import WeightSnapshot  # noqa: E402

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
    snapshot_params: int
    micro_reps: int
    norm_tensors: int
    norm_calls: int  # calls per timed grad-norm sample
    save_params: int  # model parameters of the checkpoint-save micro-benchmark (Adam state doubles it)
    save_rounds: int
    save_reps: int


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
    snapshot_params=50_000_000,
    micro_reps=3,
    norm_tensors=200,
    norm_calls=20,
    save_params=50_000_000,
    save_rounds=7,
    save_reps=2,
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
    import_rounds=3,
    snapshot_params=5_000_000,
    micro_reps=1,
    norm_tensors=200,
    norm_calls=5,
    save_params=5_000_000,
    save_rounds=3,
    save_reps=1,
)

GATES = {
    "tiny/off": 1.02,
    "medium/off": 1.01,
    "tiny/tqdm": 1.02,
    "tiny/wandb": 1.02,
    "tiny/ckpt": 1.03,
    "tiny/steps": 1.02,
    "medium/steps": 1.01,
    "import/trainkit": 1.10,
    "import/BaseTrainer": 1.10,
    "micro/snapshot": 1.30,
    "micro/grad_norm": 1.05,
    "micro/ckpt_save": 1.10,
}

# ---------------------------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Send stdout and stderr (tqdm bars, trainkit's summary line, Lightning chatter) to /dev/null."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in registration order (names differ across wrappers)."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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
        sampler = BatchSampler(RandomSampler(range(len(self.x_train)), generator=generator), self.batch_size, False)
        return DataLoader(_Batches(self.x_train, self.y_train), batch_size=None, sampler=sampler)

    def val_loss(self, model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            value = F.cross_entropy(model(self.x_val), self.y_val).item()
        model.train()
        return value

    @property
    def steps(self) -> int:
        return self.epochs * -(-len(self.x_train) // self.batch_size)


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


def raw_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    """The hand-written loop; ``feature`` adds exactly what the matching trainkit variant does per step/epoch.

    ``ckpt`` writes the checkpoints trainkit writes, by hand: the same content in ``last.pt`` (weights,
    optimizer, counters, config, loop/best/patience records, every generator's state) and ``best.pt``,
    each with its ``.prev`` fallback link. ``ckpt_min`` writes what a quick script would: weights,
    optimizer, counters and torch's generator state, no fallback; it is information, not a gate.
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

        # the step bar with trainkit's settings (not a TTY here: redraw at most every 30 s, like trainkit)
        def batches(epoch: int) -> Any:
            return tqdm(loader, desc=f"epoch {epoch}", leave=False, mininterval=30.0, dynamic_ncols=True)
    else:

        def batches(epoch: int) -> Any:
            return loader

    config = checkpoint_config(wl) if feature == "ckpt" else None
    best = float("inf")
    best_epoch = None
    best_state: dict[str, torch.Tensor] | None = None
    improvements = 0
    step = 0
    val = float("nan")
    loss = torch.zeros(())
    for epoch in range(wl.epochs):
        model.train()
        for x, y in batches(epoch):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if run is not None:
                run.log({"trainer/step": step, "trainer/epoch": epoch, "train/loss": loss.item()})
        val = wl.val_loss(model)
        if feature in ("ckpt", "ckpt_min"):
            same_as_trainkit = feature == "ckpt"
            if val < best:
                best = val
                best_epoch = epoch
                improvements += 1
                state = model.state_dict()
                if best_state is None:
                    best_state = {k: v.detach().clone() for k, v in state.items()}
                else:
                    with torch.no_grad():
                        torch._foreach_copy_(list(best_state.values()), [v.detach() for v in state.values()])
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
                last.update(
                    config=config,
                    loop={"epoch": epoch + 1, "step": step, "stop_reason": None},
                    best=best_record(best, best_epoch),
                    patience={"patience": None, "start_patience": 0, "remaining": None},
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

    Feature ``steps`` turns step checkpoints on (``ckpt.every_n_steps``, a period longer than the run) and
    leaves out the checkpoint writes at epoch ends (see :meth:`_save_checkpoint`), so what it adds to
    ``off`` is the per-step work of step checkpoints alone: the counted batch iteration and the step-boundary
    check (stop-signal vote, due check) after every optimizer step.
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
        batches = self.progress(self.loader)
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if self.log_steps:
                self.log({"train/loss": loss})
                self.push_logs()
        self.last_loss = loss
        # the batches trainkit counted (step checkpoints on): proof that `steps` measured the tracked loop
        self.tracked = getattr(batches, "consumed", None)

    def _save_checkpoint(self, batches: Any = None) -> float | None:
        """Feature ``steps``: write nothing. Step checkpoints need ``ckpt.enable``, which also writes ``last.pt``
        at every epoch end and at the end of the run; those writes are the ``ckpt`` feature (gated by
        ``tiny/ckpt`` against the same files written by hand), not the per-step cost measured here. No step
        checkpoint may come due (the period is longer than the run): one would be a mistake in the setup."""
        if self.feature != "steps":
            return super()._save_checkpoint(batches)
        if batches is not None:
            raise AssertionError("a step checkpoint came due in the `steps` variant: every_n_steps is too small")
        return None

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


def trainkit_config(wl: Workload, tmp: Path, feature: str) -> dict[str, Any]:
    ckpt: dict[str, Any] = {"enable": feature in ("ckpt", "steps")}
    if feature == "steps":
        # every step runs the tracked iteration and the boundary check; the period is past the run's last
        # step, so none is written (the variant's _save_checkpoint asserts it)
        ckpt["every_n_steps"] = wl.steps + 1
    return {
        "epochs": wl.epochs,
        "seed": SEED,
        "out_dir": str(tmp),
        "val": {"minimize": True},
        "ckpt": ckpt,
        "wandb": {"mode": "offline" if feature == "wandb" else "disabled", "project": "trainkit-bench"},
        "progress": {"enable": feature == "tqdm"},
    }


def trainkit_run(wl: Workload, tmp: Path, feature: str) -> tuple[nn.Module, Any]:
    BenchTrainer.workload = wl
    BenchTrainer.feature = feature
    trainer = BenchTrainer(trainkit_config(wl, tmp, feature))
    trainer.train()
    trainer.close()
    if feature == "steps" and (trainer.tracked != len(trainer.loader) or trainer.step != wl.steps):
        raise SystemExit(
            f"the `steps` variant did not run the tracked loop: {trainer.tracked} batches counted in the last epoch "
            f"(expected {len(trainer.loader)}), {trainer.step} steps counted (expected {wl.steps})"
        )
    if feature == "steps" and any(tmp.glob("*.pt")):  # BaseTrainer._save_checkpoint renamed: the stub is bypassed
        raise SystemExit(f"the `steps` variant wrote checkpoint files: {sorted(p.name for p in tmp.glob('*.pt'))}")
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
    try:
        with quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import lightning.pytorch as pl
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip"
        return f"{type(exc).__name__}: {exc}"
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

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if self.feature == "wandb":
                self.log("train/loss", loss, on_step=True, on_epoch=False)
            self.last_loss = loss
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
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

        logger = WandbLogger(offline=True, save_dir=str(tmp), project="trainkit-bench")
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


@dataclass
class Report:
    settings: Settings
    enforce: bool
    clock_mode: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    work_mismatch: bool = False

    def pick(self, natural: str) -> str:
        """The clock a gate uses: its natural one (``auto``), or the one forced with ``--clock``."""
        return natural if self.clock_mode == "auto" else self.clock_mode

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
        limit = GATES.get(gate) if gate else None
        other = "wall" if clock == "cpu" else "cpu"
        row = {
            "benchmark": bench,
            "variant": variant,
            "contestant": ours,
            "baseline": base,
            "clock": clock,
            "contestant_median_s": statistics.median(ours_t.on(clock)),
            "baseline_median_s": statistics.median(base_t.on(clock)),
            "ratio_median": main["median"],
            "ratio_q1": main["q1"],
            "ratio_q3": main["q3"],
            "ratio_min": main["min"],
            "ratio_max": main["max"],
            "ratios": main["ratios"],
            "other_clock": other,
            "other_ratio_median": stats[other]["median"],
            "other_ratios": stats[other]["ratios"],
            "pairs": len(ours_t.wall),
            "gate": gate,
            "gate_limit": limit,
            "passed": None if limit is None else main["median"] <= limit,
        }
        self.rows.append(row)
        verdict = "" if limit is None else ("PASS" if row["passed"] else "FAIL") + f" (gate <= {limit:.2f})"
        log(
            f"  {bench + '/' + variant:<16} {ours:>15} / {base:<15} {clock:<4} {main['median']:.4f} "
            f"[q1-q3 {main['q1']:.4f}-{main['q3']:.4f}]  ({other} {stats[other]['median']:.4f})  {verdict}"
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

    # step checkpoints' per-step work (ckpt.every_n_steps, none written): against the raw loop, as tiny/off;
    # trainkit (off) beside it shows what the steps variant adds to trainkit alone
    contestants = [
        Contestant("raw", lambda wl, tmp: raw_run(wl, tmp, "off"), "raw"),
        Contestant("trainkit", lambda wl, tmp: trainkit_run(wl, tmp, "steps"), "trainkit"),
        Contestant("trainkit (off)", lambda wl, tmp: trainkit_run(wl, tmp, "off"), "trainkit"),
    ]
    res = run_group("tiny/steps", tiny, contestants, s.rounds, s.tiny_reps)
    report.check_work("tiny/steps", res.outcomes, "raw", {c.name: c.family for c in contestants})
    clock = report.pick(TINY_CLOCK["steps"])
    t = res.times
    report.add_row("tiny", "steps", "trainkit", "raw", t["trainkit"], t["raw"], clock, "tiny/steps")
    report.add_row("tiny", "steps", "trainkit", "trainkit (off)", t["trainkit"], t["trainkit (off)"], clock, None)

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
    ]
    if use_lightning:
        contestants.append(Contestant("lightning", lambda wl, tmp: lightning_run(wl, tmp, "off"), "lightning"))
    res = run_group("medium/off", medium, contestants, s.rounds, s.medium_reps)
    report.check_work("medium/off", res.outcomes, "raw", {c.name: c.family for c in contestants})
    clock = report.pick("cpu")
    t = res.times
    report.add_row("medium", "off", "trainkit", "raw", t["trainkit"], t["raw"], clock, "medium/off")
    report.add_row("medium", "off", "raw (again)", "raw", t["raw (again)"], t["raw"], clock, None)
    report.add_row("medium", "steps", "trainkit (steps)", "raw", t["trainkit (steps)"], t["raw"], clock, "medium/steps")
    report.add_row("medium", "steps", "trainkit (steps)", "trainkit", t["trainkit (steps)"], t["trainkit"], clock, None)
    if use_lightning:
        report.add_row("medium", "off", "trainkit", "lightning", t["trainkit"], t["lightning"], clock, None)


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_import(report: Report, s: Settings) -> None:
    log(f"import: a fresh interpreter per import, {s.import_rounds} rounds (+1 warm-up), wall and child CPU time")
    stmts = {
        "import torch": "import torch",
        "import trainkit": "import trainkit",
        "trainkit.BaseTrainer": "from trainkit import BaseTrainer",
    }
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    times = {k: Timings() for k in stmts}
    shuffler = random.Random(2000)
    for rnd in range(s.import_rounds + 1):
        order = list(stmts)
        shuffler.shuffle(order)
        for key in order:
            w0, c0 = time.perf_counter(), _child_cpu()
            proc = subprocess.run([sys.executable, "-c", stmts[key]], cwd=REPO, env=env, capture_output=True, text=True)
            w1, c1 = time.perf_counter(), _child_cpu()
            if proc.returncode != 0:
                raise SystemExit(f"`{stmts[key]}` failed:\n{proc.stderr}")
            if rnd > 0:
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
    # what save_if_best does on an improvement (trainkit.snapshot): read the state dict, copy it into the
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


# ---------------------------------------------------------------------------------------------- output


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - metadata only
        return ""


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| benchmark | contestant / baseline | clock | contestant s | baseline s | ratio (median) | q1-q3 "
        "| other clock | gate | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gate = f"<= {r['gate_limit']:.2f}" if r["gate_limit"] is not None else "-"
        result = "info" if r["passed"] is None else ("PASS" if r["passed"] else "**FAIL**")
        lines.append(
            f"| {r['benchmark']}/{r['variant']} | {r['contestant']} / {r['baseline']} | {r['clock']} "
            f"| {r['contestant_median_s']:.4f} | {r['baseline_median_s']:.4f} | {r['ratio_median']:.4f} "
            f"| {r['ratio_q1']:.4f}-{r['ratio_q3']:.4f} | {r['other_clock']} {r['other_ratio_median']:.4f} "
            f"| {gate} | {result} |"
        )
    return lines


def write_outputs(report: Report, out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    gates = [r for r in report.rows if r["gate"]]
    doc = {
        "meta": meta,
        "settings": report.settings.__dict__,
        "clock_mode": report.clock_mode,
        "gates_enforced": report.enforce,
        "all_gates_passed": all(r["passed"] for r in gates),
        "work_identical": not report.work_mismatch,
        "rows": report.rows,
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
        "Ratio = contestant / baseline, paired per repetition (in every repetition each contestant runs once, "
        "back to back, in a shuffled order); the table shows the median of the paired ratios over all "
        "repetitions of all measured rounds and their quartiles, on the "
        f"clock the gate uses (`--clock {report.clock_mode}`), with the other clock's median beside it. Rows "
        "`raw (again) / raw` run the raw loop against itself: their spread is the measurement noise floor.",
        "",
        *markdown_table(report.rows),
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
    parser = argparse.ArgumentParser(description="trainkit overhead benchmarks (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small sizes, 3 rounds, gates advisory")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="output folder")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 9, --quick 3); >= 7")
    parser.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="clock the gates use: auto = CPU time for in-process work, wall time for disk I/O",
    )
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning contestants")
    parser.add_argument(
        "--only",
        default="training,import,micro",
        help="comma-separated sections: training, import, micro (default: all)",
    )
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    args = parser.parse_args(argv)

    s = QUICK if args.quick else FULL
    if args.rounds is not None:
        s = Settings(**{**s.__dict__, "rounds": args.rounds})
    sections = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = sections - {"training", "import", "micro"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    enforce = args.enforce_gates or not args.quick
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    report = Report(settings=s, enforce=enforce, clock_mode=args.clock)
    start = time.perf_counter()
    meta: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "trainkit": trainkit.__version__,
        "git": (_git("rev-parse", "--short", "HEAD") or "?")
        + (" + uncommitted trainkit changes" if _git("status", "--porcelain", "--", "trainkit") else ""),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if s.mode == "full" and s.rounds < 7:
        report.notes.append(f"only {s.rounds} measured rounds (--rounds); the gates are meant for 7 or more")

    use_lightning = False
    if "training" in sections and not args.no_lightning:
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
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["seconds"] = round(time.perf_counter() - start, 1)
    if float(meta["loadavg_start"].split()[0]) > 1.5 or float(meta["loadavg_end"].split()[0]) > 1.5:
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
    failed = [r["gate"] for r in report.rows if r["gate"] and not r["passed"]]
    if failed:
        log(f"gates missed: {', '.join(failed)}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    log("all gates passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
