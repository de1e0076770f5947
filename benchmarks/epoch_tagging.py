"""What telling a dataset the epoch costs per batch: ``iter(loader)`` against the loop ``self.progress()`` hands a
``train_epoch()`` without step checkpoints (:func:`trainkit.loop.tracked_batches.epoch_tagged`) and the counted one
(step checkpoints on, none due: the index stream of :class:`trainkit.loop.tracked_batches.TrackedBatches`),
``num_workers=0``.

Run from the repository root, as a module (about a minute on 2 cores)::

    .venv/bin/python -m benchmarks.epoch_tagging [--rounds 40]

Two datasets: ``ints`` (``__getitem__`` returns the index, the batch collated by ``list``: what is left is the
loader's own per-batch work, so the tagging's share shows in full) and ``rows`` (two tensors indexed per sample,
the default collate: a small real dataset). Each round runs every variant once over the same loader, in a shuffled
order, each the best of 3 passes over 50 batches; a row is the median over rounds of the paired difference
variant - plain in CPU microseconds per batch, with its quartiles. Information only: no gate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import one_thread
from trainkit.loop.tracked_batches import TrackedBatches, epoch_tagged

BATCHES = 50


class _Ints(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class _Rows(Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def _counted(loader: DataLoader) -> Any:
    return TrackedBatches(
        loader,
        epoch=1,
        skip=0,
        resume=None,
        step=lambda: 0,
        at_step_boundary=lambda batches: None,
        on_close=lambda: None,
        on_untracked=lambda reason: None,
    )


VARIANTS: dict[str, Callable[[DataLoader], Any]] = {
    "plain": lambda loader: loader,
    "untracked, tagged": lambda loader: epoch_tagged(loader, 1),
    "counted": _counted,
}


def _per_batch_us(make: Callable[[DataLoader], Any], loader: DataLoader) -> float:
    best = float("inf")
    for _ in range(3):
        batches = make(loader)
        start = time.process_time()
        for _ in batches:
            pass
        best = min(best, time.process_time() - start)
    return best / BATCHES * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    one_thread()
    for name, dataset, collate in (("ints", _Ints, list), ("rows", _Rows, None)):
        for batch_size in (32, 256):
            loader = DataLoader(dataset(batch_size * BATCHES), batch_size=batch_size, shuffle=True, collate_fn=collate)
            times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for _ in range(args.rounds + 1):  # the first round warms up, and is dropped
                for variant in random.sample(list(VARIANTS), len(VARIANTS)):
                    times[variant].append(_per_batch_us(VARIANTS[variant], loader))
            plain = times["plain"][1:]
            print(f"{name}, batch_size={batch_size}: plain {statistics.median(plain):.1f} us/batch")
            for variant in list(VARIANTS)[1:]:
                diffs = sorted(a - b for a, b in zip(times[variant][1:], plain, strict=True))
                quartiles = statistics.quantiles(diffs, n=4)
                print(
                    f"  {variant}: {statistics.median(diffs):+.2f} us/batch [{quartiles[0]:+.2f}, {quartiles[2]:+.2f}]"
                )


if __name__ == "__main__":
    main()
