"""``overhead.py``'s verdicts: every gate judged on its 95 % interval, every row and work check recorded.

:class:`Report` collects what a run measured: the ratio rows (:meth:`Report.add_row`), the engine section's
rows (filled by :mod:`benchmarks.engine`), each gate with its verdict (:meth:`Report.judge_gate`) and the proof
that the contestants of a group did the same work (:meth:`Report.check_work`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks import confidence
from benchmarks.common import log
from benchmarks.harness import CLOCKS, Timings
from benchmarks.settings import GATES, Settings
from benchmarks.workloads import Outcome


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

    def judge_gate(
        self,
        gate: str,
        limit: float,
        unit: str,
        estimate: float,
        lo: float,
        hi: float,
        pairs: int,
        information: dict[str, Any] | None = None,
    ) -> str:
        """Judge one gate on its interval (:func:`confidence.judge`) and record it.

        :param gate: The gate's name.
        :param limit: Its limit, in ``unit``.
        :param unit: ``"ratio"``, or ``"raw_step"`` for an engine gate (its cost over the raw loop's own step).
        :param estimate: The point estimate (median ratio, fitted cost).
        :param lo: The 95 % interval's lower end.
        :param hi: Its upper end.
        :param pairs: The pairs behind the interval.
        :param information: More of the record (an engine gate's microseconds and the raw step), not judged.
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
                **(information or {}),
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
