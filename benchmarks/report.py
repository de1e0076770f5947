"""``overhead.py``'s outputs: ``latest.json`` (every sample, row and verdict) and ``latest.md`` (the tables)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import confidence
from benchmarks.engine import fmt_fraction
from benchmarks.lightning_contestant import LIGHTNING_NOTES
from benchmarks.verdicts import Report


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
            verdict = _verdict_text(judged["verdict"], record["pairs_to_decide"])
            text += f" (<= {judged['limit_us']:g}) = {fmt_fraction(judged)} raw steps <= {judged['limit']:g}: {verdict}"
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
    lines = [
        "| gate | limit | estimate | 95% interval | pairs | result | microseconds (information) |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in report.gates:
        digits = ".4f" if g["unit"] == "ratio" else ".4g"
        unit = "" if g["unit"] == "ratio" else " raw steps"
        us, step = g.get("us"), g.get("raw_step")
        info = "-"
        if us is not None and step is not None:
            info = f"{us['estimate']:+.2f} [{us['ci_low']:+.2f}, {us['ci_high']:+.2f}] us <= {us['limit']:g}"
            info += f"; {step['contestant']} step {step['us']:.1f} us"
        lines.append(
            f"| {g['gate']} | <= {g['limit']:g}{unit} | {g['estimate']:{digits}} "
            f"| [{g['ci_low']:{digits}}, {g['ci_high']:{digits}}] | {g['pairs']} "
            f"| {_verdict_text(g['verdict'], g['pairs_to_decide'])} | {info} |"
        )
    return lines


def write_outputs(report: Report, out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``latest.json`` and ``latest.md``.

    :param report: The report.
    :param out_dir: The folder (``--out``); made when missing.
    :param meta: The run's metadata (:func:`benchmarks.common.run_meta` and what ``main`` adds).
    :returns: The paths of the JSON and the Markdown file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "latest.json"
    json_path.write_text(json.dumps(report_doc(report, meta), indent=2) + "\n")
    lines = [
        *page_header(report, meta),
        *gate_summary(report),
        "",
        *engine_part(report),
        *ratios_part(report),
        *same_work_part(report),
    ]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    if meta.get("lightning"):
        lines += ["", "## Lightning settings", ""] + [f"- {k}: {v}" for k, v in LIGHTNING_NOTES.items()]
    md_path = out_dir / "latest.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def report_doc(report: Report, meta: dict[str, Any]) -> dict[str, Any]:
    """What ``latest.json`` holds: the run's facts, every gate, row, engine row and sample, the work checks.

    :param report: The report.
    :param meta: The run's metadata.
    :returns: The document.
    """
    verdicts = [g["verdict"] for g in report.gates]
    return {
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


def page_header(report: Report, meta: dict[str, Any]) -> list[str]:
    """``latest.md``'s title, the run's facts and how gates are judged.

    :param report: The report.
    :param meta: The run's metadata.
    :returns: The lines, ending with a blank one.
    """
    s = report.settings
    return [
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
        f"than {confidence.MIN_PAIRS} pairs, with about the pairs that would decide it. An engine gate is judged "
        "in raw steps: the cost a contestant adds, over its group baseline's own CPU cost per step in the same run "
        "(the same on a host of any speed); its microseconds and their limit are information.",
        "",
    ]


def engine_part(report: Report) -> list[str]:
    """``latest.md``'s engine section (none when the engine section did not run).

    :param report: The report.
    :returns: The lines, ending with a blank one.
    """
    if not report.costs:
        return []
    shapes = ", ".join(f"{e}x{b}" for e, b in report.settings.engine_shapes)
    return [
        "## Engine cost (null workload)",
        "",
        f"Added CPU microseconds, contestant minus baseline, fitted over the run lengths {shapes} (epochs x steps "
        "per epoch) to `run + epoch * epochs + step * steps`; median of the paired differences at each length, 95% "
        "bootstrap interval over repetitions in brackets. `raw (again) - raw` is the noise floor. A gated "
        "cost shows its microsecond limit, then the same cost in raw steps (over the group baseline's own "
        "cost per step, listed below), whose limit decides.",
        "",
        *engine_table(report),
        "",
    ]


def ratios_part(report: Report) -> list[str]:
    """``latest.md``'s ratio section.

    :param report: The report.
    :returns: The lines, ending with a blank one.
    """
    return [
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
    ]


def same_work_part(report: Report) -> list[str]:
    """``latest.md``'s proof that the contestants of each group did the same work.

    :param report: The report.
    :returns: The lines.
    """
    lines = [
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
    return lines
