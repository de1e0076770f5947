"""``overhead.py``'s harness: contestants run interleaved and paired, timed on both clocks, their work compared.

:func:`run_group` runs a group on one workload (the ratio sections), :func:`run_grid` on the engine section's
run lengths, :func:`interleave` plain callables (the micro-benchmarks). W&B's own calls can be timed apart from
the runs around them (:func:`wandb_calls_apart`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import quiet, weights_digest
from benchmarks.workloads import Outcome, Workload

_SESSION: list[Path] = []


def session_tmp() -> Path:
    """The folder every run's output folder (and W&B's files) goes into: made on first use, removed at exit.

    :returns: Its path.
    """
    if not _SESSION:
        path = Path(tempfile.mkdtemp(prefix="trainkit-bench-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _SESSION.append(path)
    return _SESSION[0]


def isolate_environment() -> None:
    """Point everything W&B writes into :func:`session_tmp` and hide the GPUs; call it before W&B is imported.

    A CPU benchmark, also on a machine with a GPU: the trainer would move its model there, the raw loop not.
    W&B captures no console (every contestant measures the logging path only) and reads no git state.
    """
    tmp = session_tmp()
    os.environ.update(
        {
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",
            "WANDB_DIR": str(tmp / "wandb"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
            "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_DATA_DIR": str(tmp / "wandb-data"),
            "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    os.environ.pop("WANDB_MODE", None)  # every contestant states its mode explicitly


def new_tmp(prefix: str) -> Path:
    """A fresh output folder for one run, inside :func:`session_tmp`.

    :param prefix: The start of its name (the workload and the contestant).
    :returns: Its path.
    """
    return Path(tempfile.mkdtemp(prefix=prefix, dir=session_tmp()))


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
            for c, shape in grid_order(workloads, contestants, shuffler):
                key = (c.name, shape)
                run = timed_run(c, workloads[shape], terminal, warm_up=rnd == 0)
                if key in outcomes and outcomes[key].key() != run.outcome.key():
                    raise SystemExit(
                        f"{title}: {c.name} at {shape} is not deterministic: {outcomes[key]} vs {run.outcome}"
                    )
                outcomes[key] = run.outcome
                if rnd == 0 and c.family == "trainkit":
                    caught.setdefault(c.name, set()).update(run.warnings)
                if rnd > 0:
                    times[key].wall.append(run.wall - sum(run.wall_apart.values()))
                    times[key].cpu.append(run.cpu - sum(run.cpu_apart.values()))
                    for category in APART:
                        apart[category][key].wall.append(run.wall_apart[category])
                        apart[category][key].cpu.append(run.cpu_apart[category])
        if rnd == 0:
            settle_heap()
    gc.unfreeze()
    return GridResult(times, apart, outcomes, {name: sorted(msgs) for name, msgs in caught.items()})


def grid_order(
    workloads: dict[Shape, Workload], contestants: list[Contestant], shuffler: random.Random
) -> list[tuple[Contestant, Shape]]:
    """One repetition's runs: the lengths in a shuffled order, and at each length the contestants shuffled.

    :param workloads: One workload per run length.
    :param contestants: The contestants.
    :param shuffler: The grid's seeded shuffler (advanced).
    :returns: ``(contestant, run length)`` in the order they run.
    """
    lengths = list(workloads)
    shuffler.shuffle(lengths)
    order = []
    for shape in lengths:
        at_length = list(contestants)
        shuffler.shuffle(at_length)
        order += [(c, shape) for c in at_length]
    return order


@dataclass
class TimedRun:
    """One contestant's run in a grid: its outcome, its seconds (W&B's calls included) and those of W&B's calls
    by category, and the warnings it raised."""

    outcome: Outcome
    wall: float
    cpu: float
    wall_apart: dict[str, float]
    cpu_apart: dict[str, float]
    warnings: set[str]


def timed_run(c: Contestant, wl: Workload, terminal: bool, warm_up: bool) -> TimedRun:
    """Run one contestant once in a fresh folder (removed after), after a full collection, and time it.

    :param c: The contestant.
    :param wl: The workload.
    :param terminal: Run with stdout and stderr on a terminal that drops its output (see :func:`quiet`).
    :param warm_up: Whether this is the warm-up round (its warnings are kept, later ones ignored).
    :returns: The run.
    :raises SystemExit: When the contestant changed torch's thread count.
    """
    tmp = new_tmp(f"{wl.name}-{c.name}-")
    gc.collect()
    _APART.take()
    with warnings.catch_warnings(record=True) as seen, quiet(terminal):
        warnings.simplefilter("always" if warm_up else "ignore")
        w0, c0 = time.perf_counter(), time.process_time()
        model, extra = c.run(wl, tmp)
        w1, c1 = time.perf_counter(), time.process_time()
    cpu_apart, wall_apart = _APART.take()
    out = _outcome(model, extra, tmp)
    del model, extra
    shutil.rmtree(tmp, ignore_errors=True)
    if torch.get_num_threads() != 1:
        raise SystemExit(f"{c.name} changed torch's thread count to {torch.get_num_threads()}")
    caught = {f"{w.category.__name__}: {w.message}" for w in seen}
    return TimedRun(out, w1 - w0, c1 - c0, wall_apart, cpu_apart, caught)
