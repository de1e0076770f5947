"""``overhead.py``'s engine section: what trainkit costs per step, per epoch and per run, with the model's work out.

Every contestant runs the null workload at several run lengths; the paired differences to the baseline are fitted
to ``run + epoch * epochs + step * steps`` (:mod:`benchmarks.confidence`). A gate is judged on that cost as a
fraction of the group baseline's own cost per step in the same run (the raw step), so its verdict means the same
on a host of any speed; the microseconds are reported beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from benchmarks import confidence
from benchmarks.common import log
from benchmarks.contestants import checkpoint_config, raw_run, trainkit_run, wandb_config
from benchmarks.harness import APART, Contestant, GridResult, Shape, Timings, run_grid, wandb_calls_apart
from benchmarks.lightning_contestant import LIGHTNING_NOTES, lightning_run
from benchmarks.settings import ENGINE_FRACTION_GATES, ENGINE_GATES, Settings
from benchmarks.verdicts import Report
from benchmarks.workloads import Workload, null_workload

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


def fitted_fractions(
    res: GridResult, ours: str, base: str, raw: str, shapes: list[Shape], resamples: int
) -> dict[str, dict[str, float]]:
    """:func:`fitted_costs` over ``raw``'s own CPU cost per step in the same runs, with 95 % intervals.

    The resamples draw the same repetitions as :func:`fitted_costs` (the same seed): the interval comes from the
    pairs the microseconds came from.

    :param res: The engine group's samples.
    :param ours: The contestant.
    :param base: Its baseline.
    :param raw: The group's reference loop, whose own step is the unit (the group's baseline).
    :param shapes: The run lengths, in the order of the design.
    :param resamples: Bootstrap resamples.
    :returns: ``{unit: {"fraction", "low", "high"}}`` for ``run``, ``epoch`` and ``step``, in raw steps.
    """
    own = np.array([res.times[(raw, sh)].cpu for sh in shapes])
    est, lo, hi = confidence.bootstrap_cost_fractions(
        _deltas(res, ours, base, shapes, "cpu"), own, confidence.design_matrix(shapes), resamples
    )
    return {unit: {"fraction": est[i], "low": lo[i], "high": hi[i]} for i, unit in enumerate(_UNITS)}


def raw_step(res: GridResult, raw: str, shapes: list[Shape], resamples: int) -> dict[str, Any]:
    """A loop's own fitted CPU cost per step, with its 95 % interval: the unit of the engine gates.

    :param res: The engine group's samples.
    :param raw: The loop (the group's baseline).
    :param shapes: The run lengths, in the order of the design.
    :param resamples: Bootstrap resamples.
    :returns: ``{"contestant", "us", "low", "high"}``.
    """
    own = np.array([res.times[(raw, sh)].cpu for sh in shapes])
    est, lo, hi = confidence.bootstrap_costs(own, confidence.design_matrix(shapes), resamples)
    return {"contestant": raw, "us": est[2] * 1e6, "low": lo[2] * 1e6, "high": hi[2] * 1e6}


def _fmt_cost(c: dict[str, float]) -> str:
    return f"{c['us']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"


def fmt_fraction(c: dict[str, float]) -> str:
    """A cost in raw steps with its interval, as the log and the tables show it.

    :param c: ``{"fraction", "low", "high"}`` (:func:`fitted_fractions`).
    :returns: ``0.04695 [0.03736, 0.05339]``.
    """
    return f"{c['fraction']:.4g} [{c['low']:.4g}, {c['high']:.4g}]"


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
    raw: str | None = None,
) -> dict[str, Any]:
    """Fit, judge and record one engine row: what ``ours`` adds to ``base``.

    A gated cost is judged in raw steps (:func:`judge_engine_gate`), its microseconds recorded as information.

    :param report: Where the row and its verdicts go.
    :param res: The group's samples.
    :param shapes: The run lengths.
    :param feature: The feature (the row's label).
    :param ours: The contestant.
    :param base: Its baseline.
    :param gates: Unit (``step``, ``epoch``, ``run``) to the name of the gate it is judged by.
    :param anchor: A contestant (Lightning) whose per-step cost against ``base`` is shown beside the row.
    :param note: What the row measures, for the table.
    :param raw: The group's reference loop, whose own step a gated cost is a fraction of (default: ``base``).
    :returns: The row.
    """
    raw = raw or base
    costs = fitted_costs(res, ours, base, shapes, report.resamples)
    fractions = fitted_fractions(res, ours, base, raw, shapes, report.resamples) if gates else {}
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
        "raw_step": raw_step(res, raw, shapes, report.resamples) if gates else None,
    }
    parts = []
    for unit in ("step", "epoch", "run"):
        text = f"{unit} {_fmt_cost(costs[unit])}"
        gate = gates.get(unit)
        if gate is not None:
            judged = judge_engine_gate(report, gate, costs[unit], fractions[unit], pairs, row["raw_step"])
            row["gates"][unit] = judged
            text += f" (<= {judged['limit_us']:g} us) = {fmt_fraction(judged)} raw steps {judged['verdict']}"
            text += f" (<= {judged['limit']:g})"
        parts.append(text)
    if anchor is not None and (anchor, shapes[0]) in res.times:
        row["anchor"] = {"contestant": anchor, **fitted_costs(res, anchor, base, shapes, report.resamples)["step"]}
        parts.append(f"{anchor} step {_fmt_cost(row['anchor'])}")
    report.costs.append(row)
    log(f"  engine/{feature:<6} {ours:>20} - {base:<20} us, 95%: " + " | ".join(parts))
    return row


def judge_engine_gate(
    report: Report,
    gate: str,
    cost: dict[str, float],
    fraction: dict[str, float],
    pairs: int,
    own_step: dict[str, Any],
) -> dict[str, Any]:
    """Judge one engine gate in raw steps (:data:`ENGINE_FRACTION_GATES`) and record it in ``report``, its
    microseconds against :data:`ENGINE_GATES` beside it as information.

    :param report: Where the verdict goes.
    :param gate: The gate's name.
    :param cost: The unit's cost in microseconds (:func:`fitted_costs`).
    :param fraction: The same cost in raw steps (:func:`fitted_fractions`).
    :param pairs: The pairs behind both.
    :param own_step: The raw loop's own step (:func:`raw_step`).
    :returns: The row's record of the gate: name, limits, verdict and the fraction with its interval.
    """
    limit, limit_us = ENGINE_FRACTION_GATES[gate], ENGINE_GATES[gate]
    us = {
        "limit": limit_us,
        "estimate": cost["us"],
        "ci_low": cost["low"],
        "ci_high": cost["high"],
        "verdict": confidence.judge(cost["low"], cost["high"], limit_us, pairs),
    }
    information = {"us": us, "raw_step": own_step}
    verdict = report.judge_gate(
        gate, limit, "raw_step", fraction["fraction"], fraction["low"], fraction["high"], pairs, information
    )
    return {"gate": gate, "limit": limit, "limit_us": limit_us, "verdict": verdict, **fraction}


ENGINE_GROUPS = ("off", "tqdm", "wandb", "ckpt", "guard")
"""The engine section's groups, each a baseline and the trainkit variants measured against it."""


def _every_unit(group: str) -> dict[str, str]:
    return {unit: f"engine/{group}/{unit}" for unit in ("step", "epoch", "run")}


@dataclass(frozen=True)
class CostRow:
    """One engine row: what ``ours`` adds to ``base``, judged by ``gates`` (unit to gate name; none: information),
    shown beside Lightning's cost when ``anchored``, each gated cost a fraction of ``raw``'s own step (default:
    ``base``)."""

    feature: str
    ours: str
    base: str
    gates: dict[str, str] = field(default_factory=dict)
    anchored: bool = False
    note: str = ""
    raw: str | None = None


ENGINE_ROWS: dict[str, tuple[CostRow, ...]] = {
    "off": (
        CostRow("off", "raw (again)", "raw", note="noise floor: raw against itself"),
        CostRow(
            "off",
            "trainkit",
            "raw",
            _every_unit("off"),
            True,
            "the epoch loop, config, seeding, run setup; progress and W&B off, no checkpoints",
        ),
        CostRow(
            "steps",
            "trainkit (steps)",
            "raw (ckpt last)",
            {"step": "engine/steps/step"},
            True,
            "ckpt.every_n_steps past the run's end (the tracked loop and the step-boundary check, none due) "
            "against the hand-written loop writing the same last.pt at every epoch end, as ckpt.enable does",
            raw="raw",
        ),
        CostRow(
            "steps",
            "trainkit (steps)",
            "trainkit (ckpt last)",
            {"epoch": "engine/steps/epoch"},
            note="the tracked loop alone: against trainkit writing the same last.pt at every epoch end",
            raw="raw",
        ),
        CostRow(
            "steps",
            "trainkit (steps)",
            "raw",
            note="information: against the loop that writes nothing (its epoch and run columns are the "
            "epoch-end last.pt writes, its step column carries the per-step share below)",
        ),
        CostRow(
            "ckpt last",
            "raw (ckpt last)",
            "raw",
            note="information: the hand-written loop's own epoch-end last.pt; a save after a longer epoch "
            "costs more CPU on this host, which the fit puts in the step column",
        ),
        CostRow(
            "ckpt last",
            "trainkit (ckpt last)",
            "raw (ckpt last)",
            note="information: ckpt.enable against the same last.pt written by hand",
        ),
    ),
    "tqdm": (
        CostRow(
            "tqdm",
            "trainkit",
            "raw_tqdm",
            _every_unit("tqdm"),
            True,
            "trainkit's bars (progress.enable, on a terminal) against a tqdm bar over the batches",
        ),
    ),
    "wandb": (
        CostRow(
            "wandb",
            "trainkit",
            "raw_wandb",
            _every_unit("wandb"),
            True,
            "trainkit's work per row (log + push_logs: buffer, drain, the row, RunLog) against the "
            "raw loop's (.item(), the row); W&B's own Run.log, wandb.init and finish timed apart (below)",
        ),
    ),
    "ckpt": (
        CostRow(
            "ckpt",
            "trainkit",
            "raw_ckpt",
            anchored=True,
            note="durable last.pt and best.pt (save_if_best) against the same files written by hand; "
            "disk-bound, judged on wall time by tiny/ckpt, information here",
        ),
    ),
    "guard": (
        CostRow(
            "guard",
            "trainkit (guard)",
            "trainkit (clip)",
            {"step": "engine/guard/step"},
            note="guard.nonfinite=skip with nothing non-finite (the norm judged before each optimizer step) "
            "against the same loop with the guard off; both call clip_and_log_grad_norm()",
        ),
        CostRow(
            "guard, rollback",
            "trainkit (rollback, steps)",
            "trainkit (clip, steps)",
            {"step": "engine/guard/rollback/step"},
            note="guard.nonfinite=rollback with nothing non-finite against the same loop with the guard off, "
            "both with ckpt.every_n_steps (none due), as a run that rolls back to a step has it: the verdict "
            "and the positions of each step's batches",
            raw="trainkit (clip)",
        ),
        CostRow(
            "guard, rollback, no step checkpoints",
            "trainkit (rollback)",
            "trainkit (clip)",
            note="guard.nonfinite=rollback without ckpt.every_n_steps (it rolls back to the epoch's start; "
            "information): the above plus the counted loop, which this mode runs even so",
        ),
    ),
}
"""Each engine group's rows, in the order the report lists them."""


def engine_contestants() -> dict[str, tuple[str, list[Contestant]]]:
    """Each engine group's baseline and contestants, in :data:`ENGINE_GROUPS` order.

    :returns: ``{group: (baseline's name, contestants)}``.
    """

    def raw(feature: str) -> Callable[[Workload, Path], tuple[nn.Module, Any]]:
        return lambda wl, tmp: raw_run(wl, tmp, feature)

    def ours(feature: str) -> Callable[[Workload, Path], tuple[nn.Module, Any]]:
        return lambda wl, tmp: trainkit_run(wl, tmp, feature)

    def pair(base: str, feature: str) -> tuple[str, list[Contestant]]:
        return base, [Contestant(base, raw(feature), "raw"), Contestant("trainkit", ours(feature), "trainkit")]

    off = [
        Contestant("raw", raw("off"), "raw"),
        Contestant("raw (again)", raw("off"), "raw"),
        Contestant("trainkit", ours("off"), "trainkit"),
        Contestant("trainkit (steps)", ours("steps"), "trainkit"),
        Contestant("trainkit (ckpt last)", ours("ckpt_last"), "trainkit"),
        Contestant("raw (ckpt last)", raw("ckpt_last"), "raw"),
    ]
    guard = [
        Contestant("trainkit (clip)", ours("clip"), "trainkit"),
        Contestant("trainkit (guard)", ours("guard"), "trainkit"),
        Contestant("trainkit (rollback)", ours("rollback"), "trainkit"),
        Contestant("trainkit (clip, steps)", ours("clip_steps"), "trainkit"),
        Contestant("trainkit (rollback, steps)", ours("rollback_steps"), "trainkit"),
    ]
    return {
        "off": ("raw", off),
        "tqdm": pair("raw_tqdm", "tqdm"),
        "wandb": pair("raw_wandb", "wandb"),
        "ckpt": pair("raw_ckpt", "ckpt"),
        "guard": ("trainkit (clip)", guard),
    }


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
    lightning = "lightning" if use_lightning else None
    with wandb_calls_apart():
        for feature, (base, contestants) in engine_contestants().items():
            if feature not in only:
                continue
            if use_lightning and feature in LIGHTNING_NOTES:
                contestants.append(
                    Contestant("lightning", lambda wl, tmp, f=feature: lightning_run(wl, tmp, f), "lightning")
                )
            res = run_engine_group(report, s, feature, base, contestants, workloads)
            for row in ENGINE_ROWS[feature]:
                anchor = lightning if row.anchored else None
                add_cost_row(report, res, shapes, row.feature, row.ours, row.base, row.gates, anchor, row.note, row.raw)
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


def run_engine_group(
    report: Report,
    s: Settings,
    feature: str,
    base: str,
    contestants: list[Contestant],
    workloads: dict[Shape, Workload],
) -> GridResult:
    """Run one engine group's grid and record its samples, its work checks, its warnings and its baseline's own
    fitted cost in ``report``.

    :param report: Where it all goes.
    :param s: The run mode's sizes.
    :param feature: The group.
    :param base: Its baseline.
    :param contestants: Its contestants.
    :param workloads: The null workload at each run length.
    :returns: The group's samples.
    """
    shapes = list(workloads)
    t0 = time.perf_counter()
    reps = s.engine_wandb_reps if feature == "wandb" else s.engine_reps
    rounds = dict(s.engine_group_rounds).get(feature, s.engine_rounds)
    # the tqdm group on a terminal: trainkit draws its step bar only there (elsewhere it costs nothing)
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
    own = confidence.fit_costs(np.array([res.times[(base, sh)].cpu for sh in shapes]), confidence.design_matrix(shapes))
    log(
        f"  engine/{feature:<6} {base} itself: {own[2] * 1e6:.1f} us per step, {own[1] * 1e6:.0f} us per "
        f"epoch, {own[0] * 1e6:.0f} us per run (CPU, fitted)"
    )
    report.own_costs.append(
        {"feature": feature, "contestant": base, **{f"per_{u}_us": own[i] * 1e6 for i, u in enumerate(_UNITS)}}
    )
    return res


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
