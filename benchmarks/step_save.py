#!/usr/bin/env python
"""A step checkpoint against a hand-written durable ``torch.save`` of the same state, interleaved in one process.

Run from the repository root, as a module (the ``trainkit`` measured is this checkout's)::

    .venv/bin/python -m benchmarks.step_save            # full run (1-1.5 min on 2 cores), gate enforced
    .venv/bin/python -m benchmarks.step_save --quick    # smoke run (~30 s), gate advisory

A small byte-level GPT (about 1.86M parameters: 9 pre-norm transformer layers of width 128, a 256-token
vocabulary) trained with AdamW, so ``last.pt`` holds about 21 MiB of weights and Adam state in some 450 tensors,
the shape of a language model's step checkpoint. The trainer writes a step checkpoint at every optimizer step
(``ckpt.every_n_steps=1``, ``ckpt.async_save=false``) and pushes one row to ``metrics.jsonl`` per step, as a run
that logs every step does, so every checkpoint also makes the journal durable first.

At every step the same state is also written by hand, into a folder of its own on the same disk::

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    flush; os.fsync(tmp); os.replace(tmp, last.pt); os.fsync(the folder)

the durable save every guide gives (no ``.prev`` copy, no journal, no RNG or loop state). A coin decides, per step,
whether the hand-written save runs just before the step boundary or just after it, so neither side always finds
the disk freshly busy. trainkit's time is the wall time of the whole step boundary that wrote the checkpoint: from
the end of the loop body to the start of the next one (building the payload, the journal's ``fsync``, the write,
the ``fsync``\\ s, the ``.prev`` link, the renames; and fetching the next batch, a slice of an in-memory tensor).
The first ``warmup`` saves of each run are left out (the first has no previous file to keep or to free).

The statistic is the median over every step of the paired ratio trainkit / hand-written, with its 95 % bootstrap
interval (:func:`benchmarks.confidence.bootstrap_median`). Gate: ratio <= 1.05, judged on the interval (PASS when
the whole interval is under the limit, FAIL when the whole of it is over, UNDECIDED otherwise). ``os.sync()``
runs before every run, so no run pays for the dirty pages of the one before.

Exit status: 0 when the gate passes (or ``--quick`` without ``--enforce-gates``), 1 when it fails or stays
undecided, 3 when the script itself failed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainkit
from benchmarks.common import RESULTS, load_average, log, machine_was_busy, one_thread, quiet, run_meta, write_json
from benchmarks.confidence import DEFAULT_RESAMPLES, bootstrap_median, judge
from benchmarks.contestants import durable_save
from trainkit import BaseTrainer

GATE_RATIO = 1.05
"""trainkit's step checkpoint / the hand-written durable ``torch.save`` of the same state, median of the pairs."""

SEED = 0


@dataclass(frozen=True)
class Settings:
    mode: str
    runs: int  # fresh trainers (and run folders), one after another
    steps: int  # optimizer steps per run, each with a step checkpoint and a hand-written save
    warmup: int  # saves of each run left out: the first has no previous file to keep or to free


FULL = Settings(mode="full", runs=4, steps=18, warmup=2)
QUICK = Settings(mode="quick", runs=1, steps=6, warmup=2)


class ByteGPT(nn.Module):
    """A byte-level GPT of ~1.86M parameters (the shape of a small language model's checkpoint)."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 9, context: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(n))
        for block in self.blocks:
            h = block(h, src_mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


@attrs.frozen(kw_only=True)
class SaveConfig(trainkit.Config):
    steps: int = 18
    batch_size: int = 4
    context: int = 64


class SaveTrainer(BaseTrainer):
    """Trains :class:`ByteGPT` with a step checkpoint at every step; writes the same state by hand beside it."""

    config_class = SaveConfig
    cfg: SaveConfig

    def setup(self, ckpt: dict[str, Any] | None) -> None:
        cfg = self.cfg
        torch.manual_seed(SEED)
        self.model = ByteGPT(context=cfg.context)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (cfg.steps * cfg.batch_size, cfg.context + 1))
        self.loader = DataLoader(TensorDataset(tokens), batch_size=cfg.batch_size)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.hand_dir = Path(cfg.out_dir) / "by-hand"
        self.hand_dir.mkdir()
        self.boundary_s: list[float] = []  # per step: the step boundary that wrote the step checkpoint
        self.hand_s: list[float] = []  # per step: the hand-written save of the same state
        self.coin = random.Random(SEED)

    def save_by_hand(self) -> None:
        start = time.perf_counter()
        durable_save(
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, self.hand_dir / "last.pt"
        )
        self.hand_s.append(time.perf_counter() - start)

    def train_epoch(self) -> None:
        self.model.train()
        body_ended, after = None, False
        for (x,) in self.progress(self.loader):
            if body_ended is not None:
                self.boundary_s.append(time.perf_counter() - body_ended)
            if after:  # the previous step's state is still the model's: nothing has trained since
                self.save_by_hand()
            logits = self.model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.log(loss=loss)
            self.push_logs()
            after = self.coin.random() < 0.5
            if not after:
                self.save_by_hand()
            body_ended = time.perf_counter()

    def val_epoch(self) -> bool:
        return False


def save_config(s: Settings, out_dir: Path) -> dict[str, Any]:
    return {
        "epochs": 1,
        "seed": SEED,
        "out_dir": str(out_dir),
        "steps": s.steps,
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        "ckpt": {"every_n_steps": 1},
    }


def bench(s: Settings, tmp: Path, resamples: int) -> dict[str, Any]:
    trainkit_s: list[float] = []
    hand_s: list[float] = []
    sizes: dict[str, int] = {}
    for run in range(s.runs):
        run_dir = tmp / f"run-{run}"
        os.sync()  # no dirty pages of the previous run left to flush
        with quiet():
            trainer = SaveTrainer(save_config(s, run_dir))
            trainer.train()
            trainer.close()
        # the boundary after the epoch's last batch is the epoch's end, not a step boundary: its save is not timed
        boundary, hand = trainer.boundary_s, trainer.hand_s[: len(trainer.boundary_s)]
        trainkit_s += boundary[s.warmup :]
        hand_s += hand[s.warmup :]
        sizes = {
            "trainkit": (run_dir / "last.pt").stat().st_size,
            "hand": (trainer.hand_dir / "last.pt").stat().st_size,
        }
        params = sum(p.numel() for p in trainer.model.parameters())
        tensors = len(trainer.model.state_dict()) + sum(
            len(v) for v in trainer.optimizer.state_dict()["state"].values()
        )
        shutil.rmtree(run_dir, ignore_errors=True)
        log(
            f"  run {run + 1}/{s.runs}: trainkit {statistics.median(boundary[s.warmup :]) * 1000:.1f} ms, by hand "
            f"{statistics.median(hand[s.warmup :]) * 1000:.1f} ms per save (medians)"
        )
    ratios = [a / b for a, b in zip(trainkit_s, hand_s, strict=True)]
    median, lo, hi = bootstrap_median(ratios, resamples=resamples)
    return {
        "parameters": params,
        "tensors": tensors,
        "bytes": sizes,
        "pairs": len(ratios),
        "trainkit_s": trainkit_s,
        "hand_s": hand_s,
        "ratios": ratios,
        "median_ms": {"trainkit": statistics.median(trainkit_s) * 1000, "hand": statistics.median(hand_s) * 1000},
        "ratio": {"median": median, "ci_low": lo, "ci_high": hi},
        "verdict": judge(lo, hi, GATE_RATIO, len(ratios)),
    }


def markdown(doc: dict[str, Any]) -> str:
    meta, r = doc["meta"], doc["result"]
    ratio = r["ratio"]
    return "\n".join(
        [
            "# trainkit step checkpoint vs a hand-written durable torch.save",
            "",
            f"{meta['timestamp']}; mode `{doc['settings']['mode']}`; torch {meta['torch']} (1 thread); Python "
            f"{meta['python']}; {meta['cpus']} CPUs; trainkit at {meta['git']}; load average {meta['loadavg_start']} "
            f"/ {meta['loadavg_end']}; {meta['seconds']} s.",
            "",
            f"A byte-level GPT of {r['parameters'] / 1e6:.2f}M parameters with AdamW ({r['tensors']} tensors); "
            f"`last.pt` {r['bytes']['trainkit']:,} bytes, the hand-written file {r['bytes']['hand']:,} bytes. A step "
            "checkpoint at every step (`ckpt.every_n_steps=1`, synchronous) with one `metrics.jsonl` row per step, "
            "against `torch.save` + flush + fsync + `os.replace` + directory fsync of the model's and the "
            f"optimizer's `state_dict()` at the same step, in a random order; {doc['settings']['runs']} run(s), "
            f"{r['pairs']} pairs.",
            "",
            "| contestant | median ms per save |",
            "|---|---|",
            f"| trainkit step boundary with a step checkpoint | {r['median_ms']['trainkit']:.1f} |",
            f"| hand-written durable torch.save | {r['median_ms']['hand']:.1f} |",
            "",
            "| gate | median ratio | 95 % interval | limit | verdict |",
            "|---|---|---|---|---|",
            f"| step_save/trainkit/hand | {ratio['median']:.3f} | [{ratio['ci_low']:.3f}, {ratio['ci_high']:.3f}] "
            f"| {GATE_RATIO} | {r['verdict']} |",
            *(["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]] if doc["notes"] else []),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write ``step_save.json`` and ``step_save.md``.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The exit status (see the module's docstring).
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a machine with a GPU
    parser = argparse.ArgumentParser(description="trainkit step checkpoint vs a hand-written durable torch.save")
    parser.add_argument("--quick", action="store_true", help="smoke mode: few pairs, gate advisory")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--runs", type=int, help="runs (default: 4, quick: 1)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples")
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.runs is not None:
        s = Settings(mode=s.mode, runs=args.runs, steps=s.steps, warmup=s.warmup)
    enforce = args.enforce_gates or not args.quick
    one_thread()
    start = time.perf_counter()
    meta: dict[str, Any] = run_meta()
    tmp = Path(tempfile.mkdtemp(prefix="trainkit-step-save-"))  # $TMPDIR: it must be a real disk (fsync)
    log(f"step_save: {s.runs} run(s) of {s.steps} step checkpoints in {tmp}")
    try:
        result = bench(s, tmp, args.resamples)
    except Exception:
        traceback.print_exc()
        return 3
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = load_average()
    meta["seconds"] = round(time.perf_counter() - start, 1)
    notes = []
    if machine_was_busy(meta):
        notes.append(f"the machine was busy (load average {meta['loadavg_start']} / {meta['loadavg_end']})")
    if s.mode == "quick":
        notes.append("quick mode: too few pairs to decide the gate; it is meant for the full run")
    doc = {"meta": meta, "settings": asdict(s), "gates_enforced": enforce, "limit": GATE_RATIO, "result": result}
    doc["notes"] = notes
    write_json(args.out, "step_save.json", doc)
    md = markdown(doc)
    (args.out / "step_save.md").write_text(md)
    print()
    print(md)
    if result["verdict"] != "PASS":
        log(f"gate step_save/trainkit/hand: {result['verdict']}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    log("gate passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
