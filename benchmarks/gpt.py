#!/usr/bin/env python
"""The GPT example's trainer against a hand-written loop of the same training: tokens/s, interleaved in one run.

Run from the repository root, as a module (the ``trainkit`` measured is this checkout's)::

    .venv/bin/python -m benchmarks.gpt            # about 1-2 minutes on 2 cores, the gate enforced
    .venv/bin/python -m benchmarks.gpt --quick    # smoke run (a small model, a few steps), the gate advisory

Both contestants train ``examples/gpt.py``'s model (its YAML's sizes unless ``--quick``) on the same windows of the
standard library's sources in the same order (a ``DistributedSampler`` over one rank, seeded with 0), with AdamW
over the same two parameter groups, the same warmup+cosine ``LambdaLR`` stepped once per optimizer step, gradient
accumulation, clipping at 1.0 with a non-finite step skipped, validation every ``--val-every`` steps and at the
last, and the train loss read every ``--log-every`` steps:

* **trainkit**: ``examples.gpt.GPTTrainer`` itself with ``max_steps``, ``val.every_n_steps``,
  ``log_every_n_steps``, ``log_throughput`` (its ``count_tokens()``) and ``guard.nonfinite=skip``; W&B disabled,
  no progress bar, ``ckpt.enable=false`` (what a checkpoint costs is ``step_resume.py``'s and ``overhead.py``'s
  business).
* **raw**: the same training in a plain loop, written as one would by hand.

A run is timed from building it (config, model, optimizer, data) to its last validation. The standard library is
read once, before any run, and handed to both (a cached ``stdlib_sources``). One warm-up round, then ``--rounds``
rounds, each contestant once per round in a freshly shuffled order (:func:`benchmarks.harness.interleave`), on one
torch thread. Both make the same number of tokens, so the ratio of their seconds is the inverse ratio of their
tokens/s. The statistic is trainkit / raw per pair of runs (a ratio above 1: trainkit is slower), its median
and its 95 % bootstrap interval; gate ``gpt/tokens_per_s`` ("no slower"): <= :data:`GATE`, judged on CPU time by
default (``--clock``), by the interval (:func:`benchmarks.confidence.judge`: PASS when the whole interval is under
the limit, FAIL when it is over, UNDECIDED when it straddles it or rests on fewer than 8 pairs).

Same work, asserted: the final train loss, the final validation loss and the weights' digest of every run must
agree bitwise between the contestants.

Results: ``gpt.json`` and ``gpt.md`` in ``--out`` (default ``benchmarks/results/``; ``--quick`` writes
``gpt_quick.*``). Exit status: 0 when the gate PASSes or is UNDECIDED (or ``--quick`` without
``--enforce-gates``), 1 when it FAILs, 2 when the contestants did different work, 3 when the script itself failed.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import confidence
from benchmarks.common import (
    REPO,
    RESULTS,
    load_average,
    log,
    machine_was_busy,
    one_thread,
    quiet,
    run_meta,
    weights_digest,
    write_json,
)
from benchmarks.harness import CLOCKS, interleave, isolate_environment, new_tmp

HOST_NOISE = 0.018
"""How far a "no slower" ratio of this host reads from 1 with nothing added: the upper end of the 95 % interval of
trainkit / raw seconds in the recorded full run (``benchmarks/results/gpt.json``, 650 pairs: 1.0178)."""

GATE = 1.02
"""trainkit / raw seconds for the same tokens ("no slower"): 1 plus a margin of 2 %, just above the host's measured
noise (:data:`HOST_NOISE`), so that a true ratio of 1 can PASS. At 1.01, under the noise, no number of pairs could
decide it."""


@dataclass(frozen=True)
class Sizes:
    """One run mode: the model, the batches, the run's length and the number of rounds."""

    mode: str
    steps: int
    val_every: int
    log_every: int
    rounds: int
    model: dict[str, int]


FULL = Sizes("full", steps=10, val_every=5, log_every=5, rounds=10, model={})  # the YAML's model and batches
QUICK = Sizes(
    "quick",
    steps=4,
    val_every=2,
    log_every=2,
    rounds=3,
    model={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16, "batch_size": 4, "val_windows": 8},
)


def example_config(sizes: Sizes, out_dir: Path) -> Any:
    """The example's config, read as its command line reads it: its YAML, then the benchmark's sizes, and W&B,
    bars and checkpoints off.

    :param sizes: The run mode.
    :param out_dir: The run's folder.
    :returns: A ``GPTConfig``.
    """
    from examples.gpt import DEFAULTS, GPTConfig
    from trainkit.cli import config_from_argv

    words = [f"{key}={value}" for key, value in sizes.model.items()] + [
        f"max_steps={sizes.steps}",
        f"val.every_n_steps={sizes.val_every}",
        f"log_every_n_steps={sizes.log_every}",
        f"out_dir={out_dir}",
        "ckpt.enable=false",
        "ckpt.resume=never",
        "wandb.mode=disabled",
        "progress.enable=false",
    ]
    return config_from_argv(GPTConfig, [str(REPO / "examples" / "gpt.yaml"), *words], defaults=DEFAULTS)


def trainkit_run(sizes: Sizes) -> tuple[float, float, str]:
    """Train through ``examples.gpt.GPTTrainer``.

    :param sizes: The run mode.
    :returns: The final train loss, the final validation loss and the weights' digest.
    """
    from examples.gpt import GPTTrainer

    trainer = GPTTrainer(example_config(sizes, new_tmp("gpt-trainkit-")))
    try:
        result = trainer.train() or {}
    finally:
        trainer.close()
    return float(result["train/loss"]), float(result["val/loss"]), weights_digest(trainer.model)


def raw_run(sizes: Sizes) -> tuple[float, float, str]:
    """Train the same model on the same data with the same optimizer and schedule in a hand-written loop.

    :param sizes: The run mode.
    :returns: The final train loss, the final validation loss and the weights' digest.
    """
    import torch

    from examples.gpt import GPT, next_byte_loss

    cfg = example_config(sizes, Path("unused"))
    torch.manual_seed(cfg.seed)
    loader, val_x, val_y = raw_data(cfg)
    model = GPT(cfg)
    optimizer, scheduler = raw_optimizer(model, cfg, sizes.steps)
    rows, step, val_loss, window_loss = [], 0, math.nan, torch.zeros(())
    model.train()
    for index, (x, y) in enumerate(loader):
        loss = next_byte_loss(model, x, y)
        (loss / cfg.accum_steps).backward()
        window_loss += loss.detach() / cfg.accum_steps
        if (index + 1) % cfg.accum_steps:
            continue
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=True)
        if torch.isfinite(norm):  # a non-finite step is skipped; the schedule still advances
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_loss, window_loss = float(window_loss), torch.zeros(())
        if step % sizes.log_every == 0:
            rows.append({"step": step, "train/loss": train_loss, "lr": scheduler.get_last_lr()[0]})
        if step % sizes.val_every == 0 or step == sizes.steps:
            val_loss = raw_validate(model, val_x, val_y, cfg.batch_size)
        if step == sizes.steps:
            break
    return train_loss, val_loss, weights_digest(model)


def raw_data(cfg: Any) -> tuple[Any, Any, Any]:
    """The hand-written loop's data: the training windows in a one-rank ``DistributedSampler``'s order, and the
    validation windows the example picks, stacked.

    :param cfg: The example's config.
    :returns: The training ``DataLoader``, the validation inputs and their targets.
    """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from examples.gpt import Windows, stdlib_sources

    texts = stdlib_sources(cfg.val_every_nth_file)
    train_set = Windows(texts["train"], cfg.block_size)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    sampler.set_epoch(0)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    val_set = Windows(texts["val"], cfg.block_size)
    picked = torch.linspace(0, len(val_set) - 1, cfg.val_windows).long()
    val_x, val_y = (torch.stack(t) for t in zip(*(val_set[int(i)] for i in picked)))
    return loader, val_x, val_y


def raw_optimizer(model: Any, cfg: Any, steps: int) -> tuple[Any, Any]:
    """The example's AdamW over two parameter groups (1-D and ``*_emb`` parameters not decayed) and its
    warmup+cosine schedule.

    :param model: The model.
    :param cfg: The example's config.
    :param steps: The run's optimizer steps (the schedule's length).
    :returns: The optimizer and its ``LambdaLR``.
    """
    import torch

    from examples.gpt import warmup_cosine

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim <= 1 or "_emb" in name else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, cfg.warmup_steps, steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def raw_validate(model: Any, val_x: Any, val_y: Any, batch_size: int) -> float:
    """The mean next-byte loss over the validation windows, in batches, as the example computes it.

    :param model: The model (back in training mode on return).
    :param val_x: The validation inputs.
    :param val_y: Their targets.
    :param batch_size: Windows per batch.
    :returns: The loss.
    """
    import torch

    from examples.gpt import next_byte_loss

    model.eval()
    with torch.no_grad():
        total = sum(
            next_byte_loss(model, val_x[i : i + batch_size], val_y[i : i + batch_size], "sum").double()
            for i in range(0, len(val_x), batch_size)
        )
    model.train()
    return float(total / val_y.numel())


def markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown page.

    :param doc: What ``gpt.json`` holds.
    :returns: The page.
    """
    meta, s, r = doc["meta"], doc["settings"], doc["result"]
    lines = [
        "# examples/gpt.py: trainkit's trainer against a hand-written loop",
        "",
        f"{meta['timestamp']}; mode `{s['mode']}`; torch {meta['torch']} (1 thread); Python {meta['python']}; "
        f"{meta['cpus']} CPUs; trainkit at {meta['git']}; load average {meta['loadavg_start']} / "
        f"{meta['loadavg_end']}; {meta['seconds']} s.",
        "",
        f"{doc['parameters'] / 1e6:.2f}M parameters; {s['steps']} optimizer steps of {doc['tokens_per_step']} tokens "
        f"per run, validation every {s['val_every']} steps; {r['pairs']} pairs after a warm-up round.",
        "",
        "| contestant | median s per run (wall) | tokens/s (median, wall) | median s per run (CPU) |",
        "|---|---|---|---|",
    ]
    for name in ("raw", "trainkit"):
        c = r["contestants"][name]
        lines.append(
            f"| {name} | {c['wall_median_s']:.3f} | {c['tokens_per_s_median']:.0f} | {c['cpu_median_s']:.3f} |"
        )
    g = doc["gate"]
    lines += [
        "",
        f"trainkit / raw seconds ({g['clock']}): **{g['estimate']:.4f}** [95% {g['ci_low']:.4f}, {g['ci_high']:.4f}]; "
        f"{r['other_clock']}: {r['other_ratio_median']:.4f}. Gate `{g['gate']}` <= {g['limit']} (a margin of "
        f"{g['limit'] - 1:.0%} over the host's noise of {HOST_NOISE:.1%}): **{g['verdict']}**"
        + (f" (about {g['pairs_to_decide']} pairs would decide it)" if g["verdict"] == "UNDECIDED" else "")
        + ".",
        "",
        f"Same work: {'bitwise (losses and weights)' if doc['same_work'] else '**NO**'}: {doc['outcomes']}.",
    ]
    if doc["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def measure(sizes: Sizes, clock: str, resamples: int) -> dict[str, Any]:
    """Run the interleaved rounds and judge the gate.

    :param sizes: The run mode.
    :param clock: ``cpu`` or ``wall``: the clock the gate is judged on.
    :param resamples: Bootstrap resamples behind the interval.
    :returns: The measurements, the gate's record and each contestant's outcome.
    """
    outcomes: dict[str, set[tuple[float, float, str]]] = {"raw": set(), "trainkit": set()}

    def contestant(name: str, fn: Any) -> Any:
        def run() -> None:
            with quiet():
                outcomes[name].add(fn(sizes))

        return run

    times = interleave(
        {"raw": contestant("raw", raw_run), "trainkit": contestant("trainkit", trainkit_run)},
        rounds=sizes.rounds,
        reps=1,
        seed=44,
    )
    ratios = {c: [a / b for a, b in zip(times["trainkit"].on(c), times["raw"].on(c))] for c in CLOCKS}
    estimate, lo, hi = confidence.bootstrap_median(ratios[clock], resamples)
    pairs = len(ratios[clock])
    other = "wall" if clock == "cpu" else "cpu"
    gate = {
        "gate": "gpt/tokens_per_s",
        "limit": GATE,
        "clock": clock,
        "estimate": estimate,
        "ci_low": lo,
        "ci_high": hi,
        "pairs": pairs,
        "verdict": confidence.judge(lo, hi, GATE, pairs),
        "pairs_to_decide": confidence.pairs_to_decide(estimate, lo, hi, GATE, pairs),
    }
    return {"times": times, "ratios": ratios, "other": other, "gate": gate, "outcomes": outcomes}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Sizes]:
    """The command line, and the run mode it asks for.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The arguments and the run mode (``--rounds`` applied).
    """
    parser = argparse.ArgumentParser(description="examples/gpt.py's trainer against a hand-written loop")
    parser.add_argument("--quick", action="store_true", help="smoke mode: a small model, a few steps, gate advisory")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--rounds", type=int, help="measured rounds (default: 10; 3 with --quick)")
    parser.add_argument("--clock", choices=CLOCKS, default="cpu", help="the clock the gate is judged on")
    parser.add_argument("--resamples", type=int, default=confidence.DEFAULT_RESAMPLES)
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.rounds is not None:
        sizes = Sizes(**{**asdict(sizes), "rounds": args.rounds})
    return args, sizes


def main(argv: list[str] | None = None) -> int:
    """Measure, write ``gpt.json`` and ``gpt.md``, and return the exit status (see the module's docstring).

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The exit status.
    """
    args, sizes = parse_args(argv)
    enforce = args.enforce_gates or not args.quick
    isolate_environment()
    os.environ.pop("OMP_NUM_THREADS", None)
    one_thread()
    start = time.perf_counter()
    meta: dict[str, Any] = run_meta()
    try:
        import examples.gpt as example

        # read once, before any timed run, and shared: both contestants' runs then start from the same page cache
        example.stdlib_sources = functools.cache(example.stdlib_sources)
        cfg = example_config(sizes, Path("unused"))
        example.stdlib_sources(cfg.val_every_nth_file)
        parameters = sum(p.numel() for p in example.GPT(cfg).parameters())
        measured = measure(sizes, args.clock, args.resamples)
    except Exception:
        traceback.print_exc()
        return 3
    meta["loadavg_end"] = load_average()
    meta["seconds"] = round(time.perf_counter() - start, 1)
    tokens = sizes.steps * cfg.accum_steps * cfg.batch_size * cfg.block_size
    doc = results_doc(meta, sizes, measured, tokens, parameters, enforce)
    suffix = "_quick" if args.quick else ""
    write_json(args.out, f"gpt{suffix}.json", doc)
    md = markdown(doc)
    (args.out / f"gpt{suffix}.md").write_text(md)
    print()
    print(md)
    log(f"wrote {args.out / f'gpt{suffix}.json'} and {args.out / f'gpt{suffix}.md'} in {meta['seconds']} s")
    return exit_status(doc, enforce)


def results_doc(
    meta: dict[str, Any], sizes: Sizes, measured: dict[str, Any], tokens: int, parameters: int, enforce: bool
) -> dict[str, Any]:
    """What ``gpt.json`` holds: the run's facts, the gate, whether both did the same work, and every sample.

    :param meta: :func:`benchmarks.common.run_meta`, with the end's load average and the run's seconds.
    :param sizes: The run mode.
    :param measured: What :func:`measure` returned.
    :param tokens: Tokens per run.
    :param parameters: The model's parameter count.
    :param enforce: Whether the gate is enforced (a FAIL exits 1).
    :returns: The document.
    """
    times, gate = measured["times"], measured["gate"]
    outcomes = {name: sorted(found) for name, found in measured["outcomes"].items()}
    notes = []
    if machine_was_busy(meta):
        notes.append(f"the machine was busy (load average {meta['loadavg_start']} / {meta['loadavg_end']})")
    if sizes.mode == "quick":
        notes.append("quick mode: a small model and few rounds; the gate is meant for the full run")
    return {
        "meta": meta,
        "settings": asdict(sizes),
        "parameters": parameters,
        "tokens_per_step": tokens // sizes.steps,
        "tokens_per_run": tokens,
        "gate": gate,
        "gate_enforced": enforce,
        "same_work": len(outcomes["raw"]) == 1 and outcomes["raw"] == outcomes["trainkit"],
        "outcomes": {name: [list(o) for o in found] for name, found in outcomes.items()},
        "result": {
            "pairs": gate["pairs"],
            "contestants": {
                name: {
                    "wall_s": t.wall,
                    "cpu_s": t.cpu,
                    "wall_median_s": statistics.median(t.wall),
                    "cpu_median_s": statistics.median(t.cpu),
                    "tokens_per_s_median": statistics.median(tokens / s for s in t.wall),
                }
                for name, t in times.items()
            },
            "ratios": measured["ratios"],
            "other_clock": measured["other"],
            "other_ratio_median": statistics.median(measured["ratios"][measured["other"]]),
        },
        "notes": notes,
    }


def exit_status(doc: dict[str, Any], enforce: bool) -> int:
    """The exit status of a run (see the module's docstring), with the line that says why.

    :param doc: What ``gpt.json`` holds.
    :param enforce: Whether a FAIL exits 1.
    :returns: 2 on different work, 1 on an enforced FAIL, else 0.
    """
    gate = doc["gate"]
    if not doc["same_work"]:
        log(f"WORK MISMATCH: {doc['outcomes']}")
        return 2
    if gate["verdict"] == "FAIL":
        log(f"gate missed: {gate['gate']}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    if gate["verdict"] == "UNDECIDED":
        log(
            f"UNDECIDED: {gate['gate']}: "
            + confidence.why_undecided(gate["estimate"], gate["ci_low"], gate["ci_high"], GATE, gate["pairs"])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
