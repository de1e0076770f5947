"""Train a small byte-level GPT on the Python standard library's own sources with trainkit: a language-model run.

A run is measured in optimizer steps, not epochs: ``max_steps`` ends it (mid-epoch: one epoch here is every
window of the training text, far more than a run takes), validation runs every ``val.every_n_steps`` steps, and
the learning-rate schedule is sized from the run's planned steps. The same script runs under torchrun::

    python examples/gpt.py examples/gpt.yaml
    python examples/gpt.py examples/gpt.yaml max_steps=400 accum_steps=4 out_dir=runs/gpt-long
    torchrun --nproc_per_node=2 examples/gpt.py examples/gpt.yaml out_dir=runs/gpt-ddp

The text is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages left out), so it is
real and needs no download; the tokens are its bytes (a vocabulary of 256). Ctrl-C stops at the next optimizer
step, saves, and exits; the same command then resumes from that step, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainkit
from trainkit.cli import config_from_argv


def at_least(minimum: int):
    """A field's rule: the value must be >= ``minimum``; a bad one is a ``ConfigError`` naming the key, as the
    engine's own keys are checked (one line and exit status 2 on the command line)."""

    def check(instance, attribute, value):
        if value < minimum:
            raise trainkit.ConfigError(attribute.name, f"must be >= {minimum}", value)

    return check


@attrs.frozen(kw_only=True)
class GPTConfig(trainkit.Config):
    """The engine's keys plus this task's."""

    lr: float = 3e-3
    warmup_steps: int = attrs.field(default=20, validator=at_least(0))
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    batch_size: int = attrs.field(default=8, validator=at_least(1))
    accum_steps: int = attrs.field(default=2, validator=at_least(1))  # micro-batches per optimizer step
    block_size: int = attrs.field(default=64, validator=at_least(2))
    n_layer: int = attrs.field(default=4, validator=at_least(1))
    n_head: int = attrs.field(default=4, validator=at_least(1))
    n_embd: int = attrs.field(default=128, validator=at_least(1))
    dropout: float = 0.0
    tie_embeddings: bool = True
    val_windows: int = attrs.field(default=64, validator=at_least(1))  # windows every validation reads
    val_every_nth_file: int = attrs.field(default=20, validator=at_least(2))  # 1 file in n is validation


DEFAULTS = {
    "max_steps": 150,
    "out_dir": "runs/gpt",
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "val": {"every_n_steps": 50, "minimize": True},
}


# ------------------------------------------------------------------------------------------------- data


def stdlib_sources(every_nth_file: int) -> dict[str, bytes]:
    """The standard library's ``*.py`` files, split into ``train`` and ``val`` text, the same in every process.

    A file goes to validation when the CRC-32 of its path relative to the library is a multiple of
    ``every_nth_file``: a split by file (no file's text on both sides) that does not move when a file is added.

    :param every_nth_file: About one file in this many is held out.
    :returns: ``{"train": bytes, "val": bytes}``, each the concatenation of its files in sorted path order.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [Path(folder, name) for name in files if name.endswith(".py")]
    texts: dict[str, list[bytes]] = {"train": [], "val": []}
    for path in sorted(paths):
        held_out = zlib.crc32(path.relative_to(root).as_posix().encode()) % every_nth_file == 0
        texts["val" if held_out else "train"].append(path.read_bytes())
    return {split: b"".join(parts) for split, parts in texts.items()}


class Windows(Dataset):
    """Every ``block_size + 1`` bytes of a text, at fixed offsets: input bytes and the bytes that follow them.

    Window ``i`` is always the same bytes, whichever epoch, rank or worker asks for it, so the sampler's shuffle
    is the only randomness in the data and a step-checkpoint resume is exact.
    """

    def __init__(self, text: bytes, block_size: int) -> None:
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(index) * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, floor: float) -> float:
    """The learning rate's factor at ``step``: linear from 0 over ``warmup_steps``, then a cosine down to ``floor``
    at ``total_steps``, then ``floor``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    done = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


# ------------------------------------------------------------------------------------------------ model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a byte sees only the bytes before it."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd must be a multiple of n_head, got n_embd={n_embd}, n_head={n_head}")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x MLP, each added to the residual stream."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A byte-level GPT: byte and position embeddings, ``n_layer`` blocks, logits over the 256 byte values."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(256, cfg.n_embd)  # *_emb: exempt from weight decay (cfg.no_weight_decay)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*(Block(cfg.n_embd, cfg.n_head, cfg.dropout) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, 256, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok_emb(idx) + self.pos_emb(positions))))


def next_byte_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the model's next-byte predictions, in nats per byte."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


# ---------------------------------------------------------------------------------------------- trainer


class GPTTrainer(trainkit.BaseTrainer):
    """Predict the next byte; validate every ``val.every_n_steps`` steps; keep the weights of the best val loss."""

    config_class = GPTConfig
    cfg: GPTConfig

    def setup(self, ckpt):
        cfg = self.cfg
        texts = stdlib_sources(cfg.val_every_nth_file)
        train_set = Windows(texts["train"], cfg.block_size)
        self.sampler = DistributedSampler(
            train_set, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        self.add_samplers(self.sampler)
        self.loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=self.sampler, drop_last=True)
        # the same val_windows windows, spread over the held-out text, at every validation; each rank reads its slice
        val_set = Windows(texts["val"], cfg.block_size)
        picked = torch.linspace(0, len(val_set) - 1, cfg.val_windows).long()[self.rank :: self.world_size]
        self.val_x, self.val_y = (torch.stack(t).to(self.device) for t in zip(*(val_set[int(i)] for i in picked)))

        self.model = self.make_ddp(GPT(cfg))
        self.optimizer = torch.optim.AdamW(self.get_param_groups(), lr=cfg.lr, betas=(0.9, 0.95))
        # Sized from the run's planned optimizer steps (max_steps, or epochs times the steps of an epoch): the
        # cosine reaches its floor exactly at the run's last step. Raising max_steps to extend a finished run
        # therefore changes the schedule from the step it resumes at, and the extended run is not the longer run
        # bit for bit; give the schedule a key of its own (as examples/digits.py does) when that must hold.
        steps_per_epoch = math.ceil(len(self.loader) / cfg.accum_steps)
        total = self.planned_steps(steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_cosine(step, cfg.warmup_steps, total, cfg.min_lr_ratio)
        )
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    def train_epoch(self):
        cfg = self.cfg
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batches = len(self.loader)
        window_loss = torch.zeros((), device=self.device)  # a step checkpoint falls between windows: never lost
        for index, (x, y) in enumerate(self.progress(self.loader), start=self.first_batch):
            x, y = x.to(self.device), y.to(self.device)
            window_start = index - index % cfg.accum_steps
            window = min(cfg.accum_steps, batches - window_start)  # the epoch's last window may be shorter
            last_of_window = index + 1 == window_start + window
            # DDP all-reduces the gradients in every backward(); inside no_sync() it only accumulates them, so the
            # window costs one all-reduce, in its last backward, instead of one per micro-batch
            sync = contextlib.nullcontext() if last_of_window or self.world_size == 1 else self.model.no_sync()
            with sync:
                loss = next_byte_loss(self.model, x, y)
                (loss / window).backward()
            window_loss += loss.detach() / window
            self.count_tokens(y.numel())
            if last_of_window:
                self.clip_and_log_grad_norm()  # once per optimizer step, on the window's summed gradients
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.log({"train/loss": window_loss})  # log_every_n_steps pushes a row every n steps
                self.log_lr()
                window_loss = torch.zeros((), device=self.device)

    def _mean_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()  # the loop puts train mode back when a validation inside the epoch returns
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for start in range(0, len(x), self.cfg.batch_size):
                rows = slice(start, start + self.cfg.batch_size)
                total += next_byte_loss(self.model, x[rows], y[rows], reduction="sum").double()
        return self.reduce_mean(total, y.numel())  # nats per byte over every rank's windows

    def val_epoch(self):
        loss = self._mean_loss(self.val_x, self.val_y)
        metrics = {"val/loss": loss, "val/bits_per_byte": loss / math.log(2)}
        self.log(metrics)
        improved = self.save_if_best(loss, metrics)  # val.minimize: true; the same on every rank (reduce_mean)
        return self.step_patience(improved)


def main(argv: list[str] | None = None) -> dict | None:
    """Train, print the best validation loss, and return the final metrics.

    :param argv: Config words (YAML files, ``dotted.key=value``); None reads the command line, where a bad
        word is reported in one line and exits with status 2.
    """
    # One intra-op thread unless OMP_NUM_THREADS says otherwise: the matrices are small (128 wide), and on a shared
    # 2-core host a second thread made a micro-batch up to 10x slower, waiting for a core another process held.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = config_from_argv(GPTConfig, argv, defaults=DEFAULTS)
    start = time.perf_counter()
    result = trainkit.launch(GPTTrainer, cfg)
    elapsed = time.perf_counter() - start
    if result is not None and "best/val/loss" in result and os.environ.get("RANK", "0") == "0":
        print(
            f"best val loss: {result['best/val/loss']:.4f} nats/byte ({result['best/val/bits_per_byte']:.3f} "
            f"bits/byte), {elapsed:.1f} s, run folder {cfg.out_dir}",
            flush=True,
        )
    return result


if __name__ == "__main__":
    main()
