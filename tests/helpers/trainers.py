"""Small real trainers shared by the trainer tests (importable by spawned processes)."""

from __future__ import annotations

import os

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers.checkpoint_files import flip_bit_in_tensor_data
from trainkit import BaseTrainer, Config


@attrs.frozen(kw_only=True)
class TinyConfig(Config):
    """The engine's keys plus what the tiny regression task needs."""

    lr: float = 0.05
    batch_size: int = 32
    n_samples: int = 320
    scripted_scores: tuple[float, ...] = ()
    local_scores_differ: bool = False
    fail_rank: int | None = None
    fail_epoch: int = 0
    # the hook that raises on fail_rank at fail_epoch; a misspelt one would never raise, so it is refused
    fail_in: str = attrs.field(default="train", validator=attrs.validators.in_(("train", "val")))
    dropout: float = 0.1


def make_data(n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic regression set, the same in every process."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n_samples, 8, generator=gen)
    w = torch.randn(8, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(n_samples, 1, generator=gen)
    return x, y


class TinyTrainer(BaseTrainer):
    """An MLP regressor on synthetic data: SGD with momentum, a shuffling sampler, dropout (uses RNG)."""

    config_class = TinyConfig
    cfg: TinyConfig

    def setup(self, ckpt):
        cfg = self.cfg
        x, y = make_data(cfg.n_samples)
        n_train = int(0.6 * len(x))
        n_val = int(0.2 * len(x))
        self.train_set = TensorDataset(x[:n_train], y[:n_train])  # batches move to the device one by one
        # the model lives on self.device (a GPU when there is one): evaluation data goes there too
        x, y = x.to(self.device), y.to(self.device)
        self.val_x, self.val_y = x[n_train : n_train + n_val], y[n_train : n_train + n_val]
        self.test_x, self.test_y = x[n_train + n_val :], y[n_train + n_val :]
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(cfg.dropout), nn.Linear(32, 1))
        self.model = self.make_ddp(net)
        self.optimizer = self.make_optimizer()
        self.sampler = DistributedSampler(
            self.train_set, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=cfg.seed
        )
        self.loader = DataLoader(self.train_set, batch_size=cfg.batch_size, sampler=self.sampler)
        self.add_samplers(self.sampler)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.epochs_trained: list[int] = []
        self.epochs_validated: list[int] = []

    def make_optimizer(self):
        return torch.optim.SGD(self.get_param_groups(), lr=self.cfg.lr, momentum=0.9)

    def train_epoch(self):
        self._fail_here_if_told("train")
        self.epochs_trained.append(self.epoch)
        self.model.train()
        total = torch.zeros((), device=self.device)
        count = 0
        for x, y in self.progress(self.loader):
            x, y = x.to(self.device), y.to(self.device)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.clip_and_log_grad_norm()
            self.optimizer.step()
            total += loss.detach() * len(x)
            count += len(x)
        self.log({"train/loss": total / count})
        self.log_epoch_grad_norm()
        self.log_lr()

    def _fail_here_if_told(self, hook):
        cfg = self.cfg
        if cfg.fail_in == hook and cfg.fail_rank == self.rank and self.epoch == cfg.fail_epoch:
            raise RuntimeError(f"injected failure on rank {self.rank} at epoch {self.epoch}")

    def _sq_error(self, x, y):
        self.model.eval()
        with torch.no_grad():
            return ((self.model(x) - y) ** 2).sum(), len(x)

    def val_epoch(self):
        self._fail_here_if_told("val")
        shard = slice(self.rank, None, self.world_size)
        total, count = self._sq_error(self.val_x[shard], self.val_y[shard])
        score = self.reduce_mean(total, count)
        if self.cfg.scripted_scores:
            score = self.cfg.scripted_scores[self.epoch]
            if self.cfg.local_scores_differ:
                score = score + (0.0 if self.rank == 0 else -1000.0 * (self.epoch + 1))
        self.epochs_validated.append(self.epoch)
        improved = self.save_if_best(score, {"val/loss": score})
        self.log({"val/loss": score})
        return self.step_patience(improved)

    def test_epoch(self):
        total, count = self._sq_error(self.test_x, self.test_y)
        return {"loss": float(total / count)}


def param_digest(module: nn.Module) -> str:
    """A hash of every parameter's bytes, for bit-identical comparisons."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def pid_marker() -> int:
    """The current process id, for leftover-process checks."""
    return os.getpid()


class SlowToExitTrainer(TinyTrainer):
    """TinyTrainer whose failing rank (``fail_rank``) lingers before it closes, past the collective timeout: the
    other ranks, left waiting in a collective, fail after it but exit before it, as they would behind a rank
    busy writing a crash dump or flushing a slow log.

    Run it with ``fail_in="val"``: the others then time out in ``reduce_mean``. A rank that times out in DDP's
    backward all-reduce may not exit at all while the failed rank lingers. In torch 2.13 the gloo work that
    backward launched holds a Python object (autograd's stashed context), so the worker thread that frees it
    needs the GIL. The main thread, freeing the process group at exit, holds the GIL and waits for that
    worker's lock, and the process deadlocks until spawn terminates it (seen about 1 run in 10 on a loaded
    host; the exit order, not trainkit's report, is what then changes).
    """

    def train(self):
        try:
            return super().train()
        except BaseException:
            self.failed_here = True
            raise

    def close(self):
        if getattr(self, "failed_here", False) and self.rank == self.cfg.fail_rank:
            import time

            # spawn terminates this rank as soon as the other one exits, so a long linger costs the test
            # nothing; the margin keeps the order (the other rank out first) on a loaded 2-core host
            time.sleep(self.cfg.dist.timeout_s + 30)
        super().close()


class KilledTrainer(TinyTrainer):
    """TinyTrainer whose ``fail_rank`` SIGKILLs itself at ``fail_epoch``: it dies without a traceback, and the
    other ranks fail later, at their collective timeout."""

    def train_epoch(self):
        if self.rank == self.cfg.fail_rank and self.epoch == self.cfg.fail_epoch:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        super().train_epoch()


class ReportingTrainer(TinyTrainer):
    """TinyTrainer that writes what each rank saw to ``out_dir/rank<r>.json`` after training."""

    def val_epoch(self):
        verdict = super().val_epoch()
        uneven = [float(v) for v in range(1, 4)] if self.rank == 0 else [float(v) for v in range(10, 15)]
        self.pooled = self.reduce_mean(sum(uneven), len(uneven))
        self.empty = self.reduce_mean(0.0, 0)
        return verdict

    def train(self):
        import json
        from pathlib import Path

        result = super().train()
        report = {
            "rank": self.rank,
            "epochs_trained": self.epochs_trained,
            "pooled": getattr(self, "pooled", None),
            "empty_is_nan": str(getattr(self, "empty", None)),
            "digest": param_digest(self.model),
            "best": self.best_metrics,
        }
        Path(self.cfg.out_dir, f"rank{self.rank}.json").write_text(json.dumps(report))
        return result


class EchoTrainer(TinyTrainer):
    """TinyTrainer whose every rank prints, after training, the value of ``TRAINKIT_TEST_MARK`` it was started with."""

    def train(self):
        import os

        result = super().train()
        print(f"rank {self.rank} saw {os.environ.get('TRAINKIT_TEST_MARK')}", flush=True)
        return result


@attrs.frozen(kw_only=True)
class StepConfig(Config):
    """A run whose epochs are cut by step checkpoints: accumulation, workers, a sampler of choice, augmentation."""

    lr: float = 0.05
    batch_size: int = 4
    n_samples: int = 30  # 30 samples in batches of 4: the last batch of an epoch is short
    accumulate: int = 2
    num_workers: int = 0
    persistent_workers: bool = False
    distributed_sampler: bool = False
    loader_generator: bool = False
    python_sampler: bool = False
    drop_last: bool = False
    push_every: int = 3
    # loaders that carry their own position: "stateful", torchdata's StatefulDataLoader over the samples; "stateful
    # iterable", one over a ShuffledSamples stream (no length); "stream", a ShuffledStream of batches (no length)
    loader: str = attrs.field(
        default="dataloader",
        validator=attrs.validators.in_(("dataloader", "stateful", "stateful iterable", "stream")),
    )


class NoisyDataset(torch.utils.data.Dataset):
    """Samples with per-sample noise drawn from trainkit.sample_generator (exact in workers, across resumes)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y, self.seed = x, y, seed

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        import trainkit

        noise = torch.randn(self.x.shape[1], generator=trainkit.sample_generator(self.seed, index))
        return self.x[index] + 0.1 * noise, self.y[index]


class ShuffledStream:
    """Batches of ``(x, y)`` in an order drawn from torch's global generator when a pass begins, with no length: an
    iterable that carries its own position (``state_dict``/``load_state_dict``), as a stream reader would.

    Its state names its rank, and loading another rank's state raises: each rank must get its own back.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, rank: int) -> None:
        self.x, self.y, self.batch_size, self.rank = x, y, batch_size, rank
        self.order: list[int] = []
        self.position = 0
        self.pending: tuple[list[int], int] | None = None

    def __iter__(self):
        if self.pending is not None:
            (self.order, self.position), self.pending = self.pending, None
        else:
            self.order, self.position = torch.randperm(len(self.x)).tolist(), 0
        while self.position * self.batch_size < len(self.order):
            start = self.position * self.batch_size
            indices = self.order[start : start + self.batch_size]
            self.position += 1
            yield self.x[indices], self.y[indices]

    def state_dict(self) -> dict:
        return {"rank": self.rank, "order": list(self.order), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state['rank']}'s state")
        self.pending = (list(state["order"]), int(state["position"]))


class ShuffledSamples(torch.utils.data.IterableDataset):
    """Samples ``(x, y)`` in an order drawn from torch's global generator when a pass begins; no length, no state of
    its own: a StatefulDataLoader resumes it by reading it again up to its position (in one process)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for index in torch.randperm(len(self.x)).tolist():
            yield self.x[index], self.y[index]


class PythonShuffleSampler(torch.utils.data.Sampler):
    """Shuffles with Python's global ``random``: a resume must put Python's state back to repeat its order."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        import random

        order = list(range(self.length))
        random.shuffle(order)
        return iter(order)


KILL_AT: tuple[str, int, int] | None = None
"""("batch", epoch, batch index) or ("val", epoch, 0): where a StepTrainer SIGKILLs its own process."""
SIGTERM_AT: tuple[str, int, int] | None = None
"""Where a StepTrainer sends itself SIGTERM (rank 0 only: the other ranks learn it from the vote)."""


def _maybe_die(where: tuple[str, int, int], rank: int = 0) -> None:
    import signal

    if where == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if where == SIGTERM_AT and rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)


class StepTrainer(BaseTrainer):
    """Gradient accumulation over a shuffled loader, dropout, per-sample noise, mid-epoch log pushes."""

    config_class = StepConfig
    cfg: StepConfig

    def setup(self, ckpt):
        import trainkit

        cfg = self.cfg
        x, y = make_data(cfg.n_samples + 16)
        self.train_set = NoisyDataset(x[: cfg.n_samples], y[: cfg.n_samples], cfg.seed)
        self.val_x, self.val_y = x[cfg.n_samples :].to(self.device), y[cfg.n_samples :].to(self.device)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.model = self.make_ddp(net)
        self.optimizer = torch.optim.SGD(self.get_param_groups(), lr=cfg.lr, momentum=0.9)
        options = {
            "batch_size": cfg.batch_size,
            "num_workers": cfg.num_workers,
            "persistent_workers": cfg.persistent_workers,
            "drop_last": cfg.drop_last,
        }
        items = {}
        if cfg.loader != "dataloader":
            self.loader = self._loader_with_a_position(x[: cfg.n_samples], y[: cfg.n_samples], options, items)
        elif cfg.distributed_sampler:
            sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank, seed=cfg.seed)
            self.add_samplers(sampler)
            self.loader = DataLoader(self.train_set, sampler=sampler, **options)
        elif cfg.python_sampler:
            self.loader = DataLoader(self.train_set, sampler=PythonShuffleSampler(len(self.train_set)), **options)
        elif cfg.loader_generator:
            generator = torch.Generator().manual_seed(cfg.seed + 7)
            items["loader_generator"] = generator
            self.loader = DataLoader(self.train_set, shuffle=True, generator=generator, **options)
        else:
            self.loader = DataLoader(self.train_set, shuffle=True, **options)
        self.loss_mean = trainkit.RunningMean()
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer, loss_mean=self.loss_mean, **items)

    def _loader_with_a_position(self, x, y, options, items):
        """A loader that carries its own position: a StatefulDataLoader shuffling with a registered generator (or a
        DistributedSampler), or a ShuffledStream."""
        cfg = self.cfg
        if cfg.loader == "stream":
            return ShuffledStream(x, y, cfg.batch_size, rank=self.rank)
        from torchdata.stateful_dataloader import StatefulDataLoader

        if cfg.loader == "stateful iterable":
            return StatefulDataLoader(ShuffledSamples(x, y), **options)
        dataset = TensorDataset(x, y)
        if cfg.distributed_sampler:
            sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, seed=cfg.seed)
            self.add_samplers(sampler)
            return StatefulDataLoader(dataset, sampler=sampler, **options)
        generator = torch.Generator().manual_seed(cfg.seed + 7 + self.rank)
        items["loader_generator"] = generator
        return StatefulDataLoader(dataset, shuffle=True, generator=generator, **options)

    def train_epoch(self):
        cfg = self.cfg
        self.model.train()
        try:
            batches = len(self.loader)
        except TypeError:  # a stream
            batches = None
        index = self.first_batch - 1
        for index, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            x, y = x.to(self.device), y.to(self.device)
            loss = nn.functional.mse_loss(self.model(x), y)
            (loss / cfg.accumulate).backward()
            self.loss_mean.add(loss.detach())
            if (index + 1) % cfg.accumulate == 0 or index + 1 == batches:
                self.clip_and_log_grad_norm()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.log({"train/batch_loss": loss.detach()})
            if (index + 1) % cfg.push_every == 0:
                self.push_logs()
            _maybe_die(("batch", self.epoch, index), self.rank)
        if batches is None and (index + 1) % cfg.accumulate:  # a stream's last, short window
            self.clip_and_log_grad_norm()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.log({"train/loss": self.loss_mean.take()})
        self.log_epoch_grad_norm()

    def val_epoch(self):
        self.model.eval()
        with torch.no_grad():
            total = ((self.model(self.val_x) - self.val_y) ** 2).sum()
        score = self.reduce_mean(total, len(self.val_x))
        improved = self.save_if_best(score, {"val/loss": score})
        self.log({"val/loss": score})
        stop = self.step_patience(improved)
        _maybe_die(("val", self.epoch, 0), self.rank)
        return stop


ATTEMPT = 0
"""Which attempt of a run this process is (set by the scenario driver before it forks): the sample ledger's key."""


@attrs.frozen(kw_only=True)
class ElasticConfig(StepConfig):
    """A StepTrainer run that holds its global batch on any world size: a DistributedSampler on every world size,
    ``global_batch // world_size`` samples per rank (``batch_size`` > 0 overrides it), no dropout (the global RNG of
    a resharded run is seeded anew), and a sample ledger: every index served, per optimizer step, per rank."""

    global_batch: int = 6
    batch_size: int = 0
    n_samples: int = 36
    distributed_sampler: bool = True


class LedgerDataset(NoisyDataset):
    """NoisyDataset whose samples also say their index (for the ledger)."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x, y, int(index)


class ElasticTrainer(StepTrainer):
    """Accumulation, per-sample noise, a RunningMean and mid-epoch pushes, on any world size with one global batch;
    rank r appends ``{"attempt", "epoch", "step", "indices"}`` per batch to ``out_dir/ledger-<r>.jsonl`` and rank 0
    saves the final weights to ``out_dir/final.pt``."""

    config_class = ElasticConfig
    cfg: ElasticConfig

    def setup(self, ckpt):
        import trainkit

        cfg = self.cfg
        x, y = make_data(cfg.n_samples + 16)
        self.train_set = LedgerDataset(x[: cfg.n_samples], y[: cfg.n_samples], cfg.seed)
        self.val_x, self.val_y = x[cfg.n_samples :].to(self.device), y[cfg.n_samples :].to(self.device)
        self.model = self.make_ddp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
        self.optimizer = torch.optim.SGD(self.get_param_groups(), lr=cfg.lr, momentum=0.9)
        batch_size = cfg.batch_size or cfg.global_batch // self.world_size
        if cfg.distributed_sampler:
            sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank, seed=cfg.seed)
            self.add_samplers(sampler)
            self.loader = DataLoader(self.train_set, sampler=sampler, batch_size=batch_size)
        else:
            self.loader = DataLoader(self.train_set, shuffle=True, batch_size=batch_size)
        self.loss_mean = trainkit.RunningMean()
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer, loss_mean=self.loss_mean)
        self.ledger = open(os.path.join(cfg.out_dir, f"ledger-{self.rank}.jsonl"), "a")  # noqa: SIM115 - closed in close()

    def train_epoch(self):
        import json

        cfg = self.cfg
        self.model.train()
        batches = len(self.loader)
        for index, (x, y, indices) in enumerate(self.progress(self.loader), start=self.first_batch):
            record = {"attempt": ATTEMPT, "epoch": self.epoch, "step": self.step, "indices": indices.tolist()}
            self.ledger.write(json.dumps(record) + "\n")
            self.ledger.flush()
            loss = nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
            (loss / cfg.accumulate).backward()
            self.loss_mean.add(loss.detach())
            if (index + 1) % cfg.accumulate == 0 or index + 1 == batches:
                self.clip_and_log_grad_norm()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.log({"train/batch_loss": loss.detach()})
            if (index + 1) % cfg.push_every == 0:
                self.push_logs()
            _maybe_die(("batch", self.epoch, index), self.rank)
        self.log({"train/loss": self.loss_mean.take()})
        self.log_epoch_grad_norm()

    def train(self):
        result = super().train()
        if self.rank == 0:
            torch.save(dist_state(self.model), os.path.join(self.cfg.out_dir, "final.pt"))
        return result

    def close(self):
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.close()
        super().close()


def dist_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A (DDP-wrapped) model's weights, unwrapped, on the CPU."""
    inner = getattr(model, "module", model)
    return {name: value.detach().cpu().clone() for name, value in inner.state_dict().items()}


@attrs.frozen(kw_only=True)
class ShardConfig(Config):
    """A 2-hidden-layer regressor wrapped with DDP or FSDP2 (``wrap``), AdamW, clipping and statistics."""

    wrap: str = "ddp"
    lr: float = 0.01
    batch_size: int = 16
    n_samples: int = 320
    report: bool = True
    fail_rank: int | None = None
    fail_epoch: int = 0
    fail_batch: int = 0
    dump_loaded: bool = False
    kill_in_save: str | None = None  # "before_publish" / "after_publish": rank 0 SIGKILLs itself there
    kill_at_save: int = 2  # ... in the n-th save of last.ckpt
    fail_write: int = 0  # rank 1's n-th DCP write of last.ckpt's shards raises OSError (0: never)
    step_from_epoch: int = 0  # no optimizer step before this epoch (a checkpoint of an optimizer without state)
    best_on_rank0: bool = False  # save_if_best under a rank-0 guard (the API page allows it for file checkpoints)
    slow_write: float = 0.0  # seconds every DCP write of shards sleeps first (training goes on meanwhile)


def _kill_in_publish(where: str, at_save: int) -> None:
    """Make this process SIGKILL itself in the ``at_save``-th publish of last.ckpt: every rank's shards and the
    manifest are written, and the renames into place have not begun (``before_publish``) or are done
    (``after_publish``). Found through ``os.replace``, which the publish renames with."""
    import signal

    real = os.replace
    published = []
    published_names = ("last.ckpt", "last.prev.ckpt")

    def replace(src, dst, *args, **kwargs):
        source, target = os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))
        touches = source in published_names or target in published_names
        if where == "before_publish" and touches and len(published) == at_save - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(src, dst, *args, **kwargs)
        if target == "last.ckpt" and source.startswith(".last.ckpt.tmp-"):
            published.append(dst)
            if where == "after_publish" and len(published) == at_save:
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    os.replace = replace


def _fail_shard_write(at_write: int) -> None:
    """Make this process's ``at_write``-th DCP write of last.ckpt's shards raise, as a full disk would."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data
    writes = []

    def write_data(self, plan, planner):
        if ".last.ckpt.tmp" in str(getattr(self, "path", "")):
            writes.append(plan)
        if len(writes) == at_write and ".last.ckpt.tmp" in str(getattr(self, "path", "")):
            raise OSError(28, "No space left on device (injected)")
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data


def _slow_shard_writes(seconds: float) -> None:
    """Make every DCP write of shards wait first, so a background save is still writing while training changes
    the weights it was handed: what it writes must be what they were when the save started."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data


class ShardTrainer(BaseTrainer):
    """The same model, data and steps under ``make_ddp`` or ``make_fsdp``: what FSDP2 must reproduce."""

    config_class = ShardConfig
    cfg: ShardConfig

    def setup(self, ckpt):
        cfg = self.cfg
        x, y = make_data(cfg.n_samples)
        n_train, n_val = int(0.6 * len(x)), int(0.2 * len(x))
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        val = TensorDataset(x[n_train : n_train + n_val], y[n_train : n_train + n_val])
        test = TensorDataset(x[n_train + n_val :], y[n_train + n_val :])
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and under either wrap
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        if cfg.wrap == "fsdp":
            self.model = self.make_fsdp(net, shard=nn.Linear)
        else:
            self.model = self.make_ddp(net)
        self.optimizer = torch.optim.AdamW(self.get_param_groups(), lr=cfg.lr)
        self.sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank, seed=cfg.seed)
        self.add_samplers(self.sampler)
        self.loader = DataLoader(self.train_set, batch_size=cfg.batch_size, sampler=self.sampler)
        shard = {"num_replicas": self.world_size, "rank": self.rank, "shuffle": False}
        self.val_loader = DataLoader(val, batch_size=32, sampler=DistributedSampler(val, **shard))
        self.test_loader = DataLoader(test, batch_size=32, sampler=DistributedSampler(test, **shard))
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        if cfg.kill_in_save and self.rank == 0:
            _kill_in_publish(cfg.kill_in_save, cfg.kill_at_save)
        if cfg.fail_write and self.rank == 1:
            _fail_shard_write(cfg.fail_write)
        if cfg.slow_write:
            _slow_shard_writes(cfg.slow_write)

    def train(self):
        if self.cfg.dump_loaded:  # what the constructor restored, whole, instead of training
            weights, optimizer = full_weights(self.model), full_optimizer_state(self.model, self.optimizer)
            best = whole_best(self)
            if self.rank == 0:
                torch.save(
                    {"weights": weights, "optimizer": optimizer, "epoch": self.epoch, "step": self.step, "best": best},
                    os.path.join(self.cfg.out_dir, f"loaded{self.world_size}.pt"),
                )
            return None
        return super().train()

    def train_epoch(self):
        self.model.train()
        total, count = torch.zeros(()), 0
        for index, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            if self.rank == self.cfg.fail_rank and self.epoch == self.cfg.fail_epoch and index == self.cfg.fail_batch:
                raise RuntimeError(f"injected failure on rank {self.rank} at epoch {self.epoch}")
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.log_param_grad_stats()
            self.clip_and_log_grad_norm()
            if self.epoch >= self.cfg.step_from_epoch:
                self.optimizer.step()
            total, count = total + loss.detach() * len(x), count + len(x)
        self.log({"train/loss": self.reduce_mean(total, count)})
        self.log_epoch_grad_norm()

    def _mean_loss(self, loader):
        self.model.eval()
        total, count = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for x, y in loader:
                total += nn.functional.mse_loss(self.model(x), y, reduction="sum").double()
                count += len(x)
        return self.reduce_mean(total, count)

    def val_epoch(self):
        score = self._mean_loss(self.val_loader)
        self.log({"val/loss": score})
        if self.cfg.best_on_rank0:
            improved = self.broadcast(self.save_if_best(score) if self.rank == 0 else None)
        else:
            improved = self.save_if_best(score)
        return self.step_patience(improved)

    def test_epoch(self):
        return {"loss": self._mean_loss(self.test_loader)}

    def push_logs(self):
        pushed = super().push_logs()
        self.__dict__.setdefault("pushed", []).append({"step": self.step, "epoch": self.epoch, **pushed})
        return pushed

    def log_training_results(self):
        super().log_training_results()
        if self.cfg.report:
            full, optimizer = full_weights(self.model), full_optimizer_state(self.model, self.optimizer)
            best = whole_best(self)
            if self.rank == 0:
                report = {
                    "weights": full,
                    "pushed": self.__dict__.get("pushed", []),
                    "optimizer": optimizer,
                    "best": best,
                }
                torch.save(report, os.path.join(self.cfg.out_dir, f"report{self.world_size}.pt"))


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of a plain, DDP or FSDP2 module as plain CPU tensors (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainkit.distributed.collectives import unwrap

    model = unwrap(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer's whole state keyed by parameter name (``model.<name>``), as plain CPU tensors (a collective
    under FSDP2); the same keys whatever the wrap, so states of runs on different world sizes compare."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from trainkit.distributed.collectives import unwrap

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(nn.ModuleDict({"model": unwrap(model)}), optimizer, options=options)
    return {
        name: {key: torch.as_tensor(value).clone() for key, value in entry.items()}
        for name, entry in state.get("state", {}).items()
    }  # rank 0 alone holds the whole state


def whole_best(trainer: BaseTrainer) -> dict:
    """The best-model snapshot's whole tensors, without DDP's prefix (gathered from the shards under FSDP2)."""
    best = trainer.best_model or {}
    return {
        name.removeprefix("module."): (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
        for name, value in best.items()
    }


# --------------------------------------------------------------------------------------------- W&B runs


@attrs.frozen(kw_only=True)
class SecretConfig(TinyConfig):
    """TinyConfig with a credential-looking key that must not reach W&B."""

    api_token: str = "not-for-wandb"


class CrashingTrainer(TinyTrainer):
    """TinyTrainer that dies at the start of epoch ``crash_at``, before it logs anything."""

    config_class = SecretConfig
    crash_at: int | None = None

    def train_epoch(self):
        if self.epoch == self.crash_at:
            raise RuntimeError(f"injected crash at epoch {self.epoch}")
        super().train_epoch()


class PerStepTrainer(CrashingTrainer):
    """TinyTrainer that pushes a row after every batch; at ``KILL_AT=epoch,batch`` it dies after that batch's row.

    ``KILL_HOW`` picks how: ``sigkill`` (the process is killed, W&B's service loses what it had not
    written) or ``raise`` (an exception; W&B finishes the run as failed). ``BIAS`` is added to the logged
    batch loss: a resumed run with another bias is a rerun that is not bit-exact.
    """

    def train_epoch(self):
        kill_at = os.environ.get("KILL_AT")
        self.model.train()
        for batch, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.log({"train/batch_loss": loss.detach() + float(os.environ.get("BIAS", "0"))})
            self.push_logs()
            if kill_at == f"{self.epoch},{batch}":
                if os.environ.get("KILL_HOW") == "sigkill":
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected crash")


def train_and_close(trainer: BaseTrainer):
    """Train, then close the trainer (its W&B run finished) even when training raised; return what train() did."""
    try:
        return trainer.train()
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------ a crash in the loop


class Crash(Exception):
    """Stands in for a kill: raised from inside the loop."""


def dying(epoch: int, where: str = "train_epoch"):
    """A TinyTrainer subclass that raises Crash when it reaches ``where`` in ``epoch``."""

    class Dying(TinyTrainer):
        def train_epoch(self):
            if where == "train_epoch" and self.epoch == epoch:
                raise Crash
            super().train_epoch()

        def test_epoch(self):
            if where == "test_epoch":
                raise Crash
            return super().test_epoch()

    return Dying


@attrs.frozen(kw_only=True)
class GuardTestConfig(TinyConfig):
    """TinyTrainer's keys plus a planted divergence: the loss of global batch ``nan_batch`` scaled by inf."""

    nan_batches: tuple[int, ...] = ()
    nan_rank: int | None = None  # None: every rank
    nan_positions: tuple[str, ...] = ()  # "EPOCH:BATCH" positions in the epoch (the counted loop's) planted too
    steps_left_out: tuple[int, ...] = ()  # global batches whose optimizer step this trainer leaves out itself
    optimizer: str = "sgd"  # "sgd", "adam", or either with "_fused"
    guard_on_device: bool = False  # take the guard's device path (found_inf) on the CPU too
    push_every_step: bool = False  # a journal row per step (train/grad_norm, train/loss)
    wrap_ddp: bool = True  # False: every rank trains a model of its own (the ranks' grad norms differ)
    accumulate: int = 1  # batches per optimizer step (gradient accumulation, counted from first_batch)
    nan_step_after_loop: tuple[int, ...] = ()  # epochs that end with an extra non-finite step on a fixed batch
    damage_last_at: str | None = None  # "EPOCH:BATCH": last.pt gets a flipped bit as that batch is trained on


class GuardTrainer(TinyTrainer):
    """TinyTrainer with a divergence planted at chosen batches, or optimizer steps left out by hand (the run a
    guard's skip must equal bitwise); rank ``r`` writes ``out_dir/guard<r>.json``: its digests and skip count."""

    config_class = GuardTestConfig
    cfg: GuardTestConfig

    def setup(self, ckpt):
        super().setup(ckpt)
        self.batches_seen = 0
        if self.cfg.guard_on_device and self.guard is not None:
            self.guard.device_path_on_cpu = True

    def make_ddp(self, module, find_unused_parameters=False):
        return super().make_ddp(module, find_unused_parameters) if self.cfg.wrap_ddp else module.to(self.device)

    def make_optimizer(self):
        kind = self.cfg.optimizer
        fused = {"fused": True} if kind.endswith("_fused") else {}
        if kind.startswith("adam"):
            return torch.optim.AdamW(self.get_param_groups(), lr=0.01, **fused)
        return torch.optim.SGD(self.get_param_groups(), lr=self.cfg.lr, momentum=0.9, **fused)

    def train_epoch(self):
        cfg = self.cfg
        self.model.train()
        batches = self.progress(self.loader)
        for index, (x, y) in enumerate(batches, start=self.first_batch):
            x, y = x.to(self.device), y.to(self.device)
            loss = nn.functional.mse_loss(self.model(x), y)
            # the batch's position in the epoch: a counted loop's (batches left out included), else the index
            position = f"{self.epoch}:{getattr(batches, 'consumed', index + 1) - 1}"
            planted = position in cfg.nan_positions
            if position == cfg.damage_last_at:
                flip_bit_in_tensor_data(self.last_ckpt_path)
            if (self.batches_seen in cfg.nan_batches or planted) and cfg.nan_rank in (None, self.rank):
                loss = loss * float("inf")
            if cfg.accumulate > 1:
                (loss / cfg.accumulate).backward()
                if (index + 1) % cfg.accumulate == 0:
                    self.clip_and_log_grad_norm()
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.batches_seen += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.clip_and_log_grad_norm()
            if self.batches_seen not in cfg.steps_left_out:
                self.optimizer.step()
            self.batches_seen += 1
            if cfg.push_every_step:
                self.log({"train/loss": loss.detach()})
                self.push_logs()
        if self.epoch in cfg.nan_step_after_loop:  # one more step, on no batch the loop yielded
            x, y = self.train_set[:8]
            self.optimizer.zero_grad(set_to_none=True)
            (nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device)) * float("inf")).backward()
            self.clip_and_log_grad_norm()
            self.optimizer.step()
        self.log_lr()

    def train(self):
        import json
        from pathlib import Path

        try:
            return super().train()
        finally:
            guard = self.guard
            report = {
                "digest": param_digest(self.model),
                "optimizer": optimizer_digest(self.optimizer),
                "skipped": None if guard is None else int(guard.count()["guard/skipped_steps"]),  # no .item()
                "on_device": None if guard is None else guard.on_device,
            }
            Path(self.cfg.out_dir, f"guard{self.rank}.json").write_text(json.dumps(report))


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    """A hash of every tensor and number in an optimizer's state (moments, momentum, step counts)."""
    import hashlib

    digest = hashlib.sha256()
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            data = value.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value)
            digest.update(data if isinstance(data, bytes) else data.encode())
    return digest.hexdigest()


@attrs.frozen(kw_only=True)
class TwoOptimizerConfig(GuardTestConfig):
    """GuardTrainer's keys plus the positions where the second optimizer's step diverges."""

    nan_second: tuple[str, ...] = ()  # "EPOCH:BATCH" positions whose second optimizer step is non-finite


class TwoOptimizerTrainer(GuardTrainer):
    """Two optimizers stepping on every batch, as a GAN's discriminator and generator do, each with a grad norm of
    its own: the model's first (the counted one), then a head's; the report's digest covers both modules."""

    config_class = TwoOptimizerConfig
    cfg: TwoOptimizerConfig

    def setup(self, ckpt):
        super().setup(ckpt)
        self.head = nn.Linear(8, 1).to(self.device)
        self.head_optimizer = torch.optim.SGD(self.head.parameters(), lr=0.01, momentum=0.9)
        self.add_checkpoint_items(head=self.head, head_optimizer=self.head_optimizer)

    def train_epoch(self):
        self.model.train()
        batches = self.progress(self.loader)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(self.model(x), y).backward()
            self.clip_and_log_grad_norm(self.model)
            self.optimizer.step()
            loss = nn.functional.mse_loss(self.head(x), y)
            if f"{self.epoch}:{batches.consumed - 1}" in self.cfg.nan_second:
                loss = loss * float("inf")
            self.head_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.clip_and_log_grad_norm(self.head)
            self.head_optimizer.step()
        self.log_lr()

    def train(self):
        try:
            return super().train()
        finally:
            from pathlib import Path

            Path(self.cfg.out_dir, "head.txt").write_text(param_digest(self.head))


class StepValTrainer(TinyTrainer):
    """TinyTrainer whose validations (at step boundaries too) are recorded as ``(epoch, step)``, and the steps it
    trained in eval mode in ``eval_steps``; ``scripted_scores`` are indexed by validation count, not by epoch; every
    rank writes ``rank<r>.json``."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.validations: list[tuple[int, int]] = []
        self.eval_steps: list[int] = []

    def clip_and_log_grad_norm(self, *modules):
        if not self.model.training:
            self.eval_steps.append(self.step)
        return super().clip_and_log_grad_norm(*modules)

    def val_epoch(self):
        self.validations.append((self.epoch, self.step))
        shard = slice(self.rank, None, self.world_size)
        total, count = self._sq_error(self.val_x[shard], self.val_y[shard])
        score = self.reduce_mean(total, count)
        if self.cfg.scripted_scores:
            score = self.cfg.scripted_scores[len(self.validations) - 1]
        improved = self.save_if_best(score, {"val/loss": score})
        self.log({"val/loss": score})
        return self.step_patience(improved)

    def train(self):
        import json
        from pathlib import Path

        result = super().train()
        report = {"validations": self.validations, "step": self.step, "epoch": self.epoch,
                  "digest": param_digest(self.model), "best": self.best_metrics}
        Path(self.cfg.out_dir, f"rank{self.rank}.json").write_text(json.dumps(report))
        return result
