"""trainkit overhead benchmarks: trainkit against a hand-written PyTorch loop (and Lightning, when installed).

Run from the repository root, as a module (the ``trainkit`` measured is this checkout's)::

    .venv/bin/python -m benchmarks.overhead            # full run (~16 min on 2 cores), gates enforced
    .venv/bin/python -m benchmarks.overhead --quick    # smoke run (~1 min), gates advisory

The engine section (``--only engine``) runs the loop with the model's work taken out (a null workload) at
three run lengths and fits what each contestant adds to its baseline, in CPU microseconds per optimizer step,
per epoch and per run, with bootstrap 95 % intervals; an engine gate is judged on that cost over the group
baseline's own cost per step in the same run (raw steps), so that a slower host does not fail it. Every gate is
judged on its interval (``confidence.py``): PASS when it lies under the limit, FAIL when it lies over it, UNDECIDED
(exit 0, printed with the pairs that would decide it) when it straddles the limit or rests on fewer than 8 pairs.

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
status is 0 when no gate FAILs (PASS or UNDECIDED), 1 when one does (full mode, or ``--enforce-gates``), 2 when
contestants did different work. See ``benchmarks/README.md`` for what each gate means.

The parts: :mod:`benchmarks.settings` (run modes, gate limits), :mod:`benchmarks.workloads`,
:mod:`benchmarks.contestants` (the hand-written loops and trainkit), :mod:`benchmarks.lightning_contestant`,
:mod:`benchmarks.harness` (interleaved, paired runs), :mod:`benchmarks.verdicts` (:class:`Report`),
:mod:`benchmarks.ratio_sections` (training, import, micro), :mod:`benchmarks.engine` and :mod:`benchmarks.report`.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import trainkit
from benchmarks import confidence
from benchmarks.common import RESULTS, load_average, log, machine_was_busy, one_thread, run_meta
from benchmarks.engine import ENGINE_GROUPS, bench_engine
from benchmarks.harness import isolate_environment, session_tmp
from benchmarks.lightning_contestant import lightning_available
from benchmarks.ratio_sections import bench_import, bench_micro, bench_training
from benchmarks.report import write_outputs
from benchmarks.settings import FULL, QUICK, Settings
from benchmarks.verdicts import Report


def build_parser() -> argparse.ArgumentParser:
    """The command line's options.

    :returns: The parser.
    """
    parser = argparse.ArgumentParser(description="trainkit overhead benchmarks (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small sizes, 3 rounds, gates advisory")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured rounds of every section (default 15, --quick 3 / engine 1)"
    )
    parser.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="clock the gates use: auto = CPU time for in-process work, wall time for disk I/O",
    )
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning contestants")
    parser.add_argument(
        "--only",
        default="engine,training,import,micro",
        help="comma-separated sections: engine, training, import, micro (default: all)",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=confidence.DEFAULT_RESAMPLES,
        help=f"bootstrap resamples of every 95%% interval (default {confidence.DEFAULT_RESAMPLES})",
    )
    parser.add_argument(
        "--engine-groups",
        default=",".join(ENGINE_GROUPS),
        help=f"comma-separated groups of the engine section: {', '.join(ENGINE_GROUPS)} (default: all)",
    )
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    return parser


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings, set[str], tuple[str, ...]]:
    """The command line, checked, and what it asks for.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The arguments, the run mode (``--rounds`` applied), the sections and the engine groups to run.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.rounds is not None:
        s = Settings(**{**s.__dict__, "rounds": args.rounds, "engine_rounds": args.rounds, "engine_group_rounds": ()})
    sections = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = sections - {"engine", "training", "import", "micro"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    engine_groups = tuple(g for g in ENGINE_GROUPS if g in {x.strip() for x in args.engine_groups.split(",")})
    unknown_groups = {x.strip() for x in args.engine_groups.split(",") if x.strip()} - set(ENGINE_GROUPS)
    if unknown_groups or not engine_groups:
        parser.error(
            f"--engine-groups: unknown or no groups in {args.engine_groups!r} (choose from {', '.join(ENGINE_GROUPS)})"
        )
    if args.resamples < 100:
        parser.error("--resamples must be at least 100")
    return args, s, sections, engine_groups


def main(argv: list[str] | None = None) -> int:
    """Run the sections asked for, write ``latest.json`` and ``latest.md``, and judge the gates.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The exit status: 0 when no gate FAILs, 1 when one does (full mode, or ``--enforce-gates``), 2 when
        contestants did different work, 3 when a section raised.
    """
    args, s, sections, engine_groups = parse_args(argv)
    enforce = args.enforce_gates or not args.quick
    isolate_environment()  # before anything imports W&B (Lightning's check included)
    one_thread()
    report = Report(settings=s, enforce=enforce, clock_mode=args.clock, resamples=args.resamples)
    start = time.perf_counter()
    meta: dict[str, Any] = {
        **run_meta(),
        "torch_threads": torch.get_num_threads(),
        "trainkit": trainkit.__version__,
    }
    if s.mode == "full" and s.rounds < 7:
        report.notes.append(f"only {s.rounds} measured rounds (--rounds); the gates are meant for 7 or more")
    use_lightning = pick_lightning(report, meta, bool(sections & {"engine", "training"}), args.no_lightning)
    log(
        f"trainkit overhead benchmark, mode {s.mode}: {s.rounds} measured rounds + 1 warm-up, 1 torch thread, "
        f"clock {args.clock}; load average {meta['loadavg_start']}"
    )
    try:
        run_sections(report, s, meta, sections, engine_groups, use_lightning)
    except Exception:
        traceback.print_exc()
        return 3
    finally:
        shutil.rmtree(session_tmp(), ignore_errors=True)
    meta["loadavg_end"] = load_average()
    meta["seconds"] = round(time.perf_counter() - start, 1)
    if machine_was_busy(meta):
        report.notes.append(
            f"the machine was busy (load average {meta['loadavg_start']} at the start, {meta['loadavg_end']} at the "
            f"end, on {meta['cpus']} CPUs): other processes competed for the CPUs, so single rounds are noisy; "
            "compare a ratio with the `raw (again) / raw` noise floor before trusting a 1-2 % difference"
        )
    json_path, md_path = write_outputs(report, args.out, meta)
    print()
    print(md_path.read_text())
    log(f"wrote {json_path} and {md_path} in {meta['seconds']} s")
    return exit_status(report, enforce)


def pick_lightning(report: Report, meta: dict[str, Any], wanted: bool, refused: bool) -> bool:
    """Whether the Lightning contestants run; why not, noted in ``report`` (and its version in ``meta``).

    :param report: Where a note on a skipped Lightning goes.
    :param meta: The run's facts (``lightning``: its version, when it runs).
    :param wanted: Whether a section that has Lightning contestants runs.
    :param refused: ``--no-lightning``.
    :returns: Whether Lightning runs.
    """
    if wanted and not refused:
        why = lightning_available()
        if why is None:
            import lightning

            meta["lightning"] = lightning.__version__
            return True
        log(f"Lightning skipped ({why}); install it with: pip install -e '.[bench]'")
        report.notes.append(f"Lightning skipped: {why}")
    elif refused:
        report.notes.append("Lightning skipped (--no-lightning)")
    return False


def run_sections(
    report: Report,
    s: Settings,
    meta: dict[str, Any],
    sections: set[str],
    engine_groups: tuple[str, ...],
    use_lightning: bool,
) -> None:
    """Run the sections asked for, in their fixed order, each one's seconds in ``meta["section_seconds"]``.

    :param report: Where their rows and verdicts go.
    :param s: The run mode's sizes.
    :param meta: The run's facts.
    :param sections: The sections to run.
    :param engine_groups: The engine section's groups to run.
    :param use_lightning: Whether the Lightning contestants run.
    """
    runners: dict[str, Callable[[Report, Settings], None]] = {
        "engine": functools.partial(bench_engine, use_lightning=use_lightning, only=engine_groups),
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


def exit_status(report: Report, enforce: bool) -> int:
    """The run's exit status (see :func:`main`), with the lines that say why: every UNDECIDED gate's reason, the
    failed gates, or the count of those that passed.

    :param report: The judged run.
    :param enforce: Whether a FAIL exits 1.
    :returns: The exit status.
    """
    if report.work_mismatch:
        log("FAILED: contestants did different work (see 'Same work')")
        return 2
    undecided = [g for g in report.gates if g["verdict"] == "UNDECIDED"]
    for g in undecided:  # loud, but not a failure: this run cannot tell, more pairs would
        reason = confidence.why_undecided(g["estimate"], g["ci_low"], g["ci_high"], g["limit"], g["pairs"])
        log(f"UNDECIDED: {g['gate']}: {reason}")
    failed = [g["gate"] for g in report.gates if g["verdict"] == "FAIL"]
    if failed:
        log(f"gates failed: {', '.join(failed)}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    passed = sum(g["verdict"] == "PASS" for g in report.gates)
    log(f"no gate failed: {passed} PASS, {len(undecided)} UNDECIDED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
