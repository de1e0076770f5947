#!/usr/bin/env python
"""Step checkpoints (``ckpt.every_n_steps``): resume latency, blocked time, and exactness next to Lightning.

Run from the repository root, as a module (the ``trainkit`` measured is this checkout's)::

    .venv/bin/python -m benchmarks.step_resume            # full run (~2.5 min on 2 cores), gates enforced
    .venv/bin/python -m benchmarks.step_resume --quick    # smoke run (~25 s; ~55 s with Lightning), gates advisory
    .venv/bin/python -m benchmarks.step_resume --world-change [--quick]  # resume latency on another world size

Four sections, one run, results side by side in ``--out`` (default ``benchmarks/results/``) as
``step_resume.json`` and ``step_resume.md``:

* **latency**: a dataset whose ``__getitem__`` sleeps (a stand-in for decoding a sample, ~2 ms), one epoch
  of ``batches`` batches. For every position p (batches already trained on) a trainer sends itself SIGTERM
  after batch p, so trainkit writes a step checkpoint at that step boundary and raises
  ``TrainingInterrupted``. Then, from a fresh copy of that run folder, the time from "construct the
  trainer" to "the first batch of the resumed epoch is in the loop's hands" is measured, against an
  iterate-and-discard resume of the same checkpoint (load it, build model and optimizer, create the
  loader's iterator, call ``next()`` p times throwing the batches away, then take the next one: the
  fast-forward Composer does, and HF's Trainer did before accelerate's ``skip_first_batches``). trainkit
  skips at the index level, so its latency should not grow with p; iterate-and-discard loads p batches
  first. Every resumed first batch is checked against batch p of the uninterrupted run, and every
  position is also resumed to the end of training and compared bitwise with the uninterrupted run.
  Gate: trainkit's median latency at the farthest position <= 1.5x its median at the first.
* **blocked**: a model of ~10M parameters (about 126 MB per checkpoint with Adam's state) trained with
  ``every_n_steps``, once with synchronous saves and once with ``ckpt.async_save``. The time the loop is
  blocked by a step checkpoint is the wall time of the checkpointer's ``save`` (``trainer.checkpointer``,
  timed by the subclass around it) at the boundaries that wrote one: with sync saves the whole durable write,
  with async saves the wait for the previous write (if it is still running), the copy into the reused host
  buffers and starting the writer thread. Both runs must end with the same weights. Gate: median blocked time
  async / sync <= 0.15. Reported beside it: how much longer the async run's steps took outside the boundaries
  (the writer thread competing for the CPU and the GIL), per save.
* **iteration** (information): the CPU time per batch of the bare tracked loop (step checkpoints on, none
  due) against the untracked one, for a ``DataLoader(batch_size=64)`` (each batch saying its epoch while it is
  loaded, in both loops) and for a loader indexed once per batch (overhead.py's shape).
* **exactness**: a plain shuffled ``DataLoader`` (``shuffle=True``, no generator), dropout, Adam; each
  framework checkpoints every 5 steps with its own mechanism (trainkit ``ckpt.every_n_steps=5``,
  Lightning ``ModelCheckpoint(every_n_train_steps=5, save_last=True)`` + ``fit(ckpt_path=...)``). A
  subprocess SIGKILLs itself in the middle of the second epoch, a fresh one resumes from the last
  checkpoint, and the final weights are compared with an uninterrupted run's (a fresh process too).
  Lightning is skipped, with the reason, when it is not importable (``pip install -e '.[bench]'``).

Exit status: 0 when every gate passes (or ``--quick`` without ``--enforce-gates``), 1 when a gate is
missed, 2 when trainkit's resume was not exact (a resumed first batch or final weights differ), 3 when
the script itself failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    lightning_missing,
    load_average,
    log,
    machine_was_busy,
    one_thread,
    run_meta,
    write_json,
)
from benchmarks.step_resume_sections import (
    FULL,
    QUICK,
    Settings,
    bench_blocked,
    bench_exactness,
    bench_iteration,
    bench_latency,
    child_main,
)
from benchmarks.step_resume_world import bench_world_change

GATE_LATENCY_FLAT = 1.5  # trainkit: median latency at the farthest position / at the first
GATE_BLOCKED = 0.15  # median blocked time per step checkpoint, async / sync

# ---------------------------------------------------------------------------------------------- output


def markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown page: one part per section, then the gates and notes.

    :param doc: What ``step_resume.json`` holds.
    :returns: The page.
    """
    meta = doc["meta"]
    lines = [
        "# trainkit step checkpoints: resume latency, blocked time, exactness",
        "",
        f"{meta['timestamp']}; mode `{doc['settings']['mode']}`; torch {meta['torch']} (1 thread); Python "
        f"{meta['python']}; {meta['cpus']} CPUs; trainkit at {meta['git']}"
        + (f"; Lightning {meta['lightning']}" if meta.get("lightning") else "")
        + f"; load average {meta['loadavg_start']} / {meta['loadavg_end']}; {meta['seconds']} s.",
        "",
        *latency_part(doc),
        *blocked_part(doc["blocked"]),
        *iteration_part(doc["iteration"]),
        *exactness_part(doc["exactness"]),
    ]
    lines += ["", "## Gates", "", "| gate | value | limit | result |", "|---|---|---|---|"]
    for g in doc["gates"]:
        lines.append(f"| {g['name']} | {g['value']:.3f} | <= {g['limit']} | {'PASS' if g['passed'] else '**FAIL**'} |")
    if doc["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def latency_part(doc: dict[str, Any]) -> list[str]:
    """The page's resume-latency section.

    :param doc: What ``step_resume.json`` holds.
    :returns: The lines, ending with a blank one.
    """
    lat = doc["latency"]
    lines = [
        "## Resume latency vs position in the epoch",
        "",
        f"{lat['batches_per_epoch']} batches of {lat['batch_size']} per epoch, `__getitem__` "
        f"{lat['sample_ms_measured']:.2f} ms (a sleep). Seconds from constructing the trainer on the run "
        "folder to the first batch of the resumed epoch in the loop (median of "
        f"{doc['settings']['latency_reps']}), against iterate-and-discard (load the checkpoint, rebuild, "
        "`next()` p times).",
        "",
        "| position (batches done) | trainkit s | iterate-and-discard s | first batch = uninterrupted | "
        "resumed run exact |",
        "|---|---|---|---|---|",
    ]
    for p in lat["positions"]:
        key = str(p)
        same_batch = "yes" if lat["first_batch_matches_uninterrupted"][key] else "NO"
        lines.append(
            f"| {p} / {lat['batches_per_epoch']} | {lat['median_s']['trainkit'][key]:.4f} "
            f"| {lat['median_s']['discard'][key]:.4f} | {same_batch} "
            f"| {'yes' if lat['resumed_to_end_exact'][key] else 'NO'} |"
        )
    return lines + [
        f"| last / first | {lat['ratio_last_over_first']['trainkit']:.2f}x "
        f"| {lat['ratio_last_over_first']['discard']:.2f}x | | |",
        "",
        f"Iterate-and-discard grows by {lat['discard_seconds_per_skipped_batch'] * 1000:.2f} ms per skipped batch "
        f"(loading one batch costs {lat['expected_loading_seconds_per_batch'] * 1000:.2f} ms here).",
        "",
    ]


def blocked_part(blk: dict[str, Any]) -> list[str]:
    """The page's blocked-time section.

    :param blk: The blocked section's results.
    :returns: The lines, ending with a blank one.
    """
    lines = [
        "## Blocked time of a step checkpoint",
        "",
        f"{blk['parameters'] / 1e6:.1f}M parameters, {blk['checkpoint_mib']:.0f} MiB per `last.pt` (weights + Adam), "
        f"every_n_steps={blk['every_n_steps']}, {blk['saves_per_run']} step checkpoints per run, "
        f"{blk['runs_per_mode']} run(s) per mode; the first save of each run is left out of the medians "
        "(async allocates its staging buffers there) and shown apart.",
        "",
        "| mode | median blocked per step checkpoint, ms | first save, ms "
        "| epoch wall s (median) | epoch minus saving boundaries s (median) |",
        "|---|---|---|---|---|",
    ]
    for m in ("sync", "async"):
        first = statistics.median(blk["first_save_blocked_s"][m])
        lines.append(
            f"| {m} | {blk['median_blocked_s'][m] * 1000:.1f} | {first * 1000:.1f} "
            f"| {statistics.median(blk['epoch_s'][m]):.2f} "
            f"| {statistics.median(blk['epoch_minus_blocked_s'][m]):.2f} |"
        )
    return lines + [
        "",
        f"async / sync blocked: **{blk['blocked_async_over_sync']:.3f}**; same final weights: "
        f"{'yes' if blk['same_weights'] else 'NO'}. Outside the boundaries the async run's steps took "
        f"{blk['lost_per_save_s'] * 1000:.0f} ms per save longer than the sync run's (the writer thread competing "
        f"for the CPU and the GIL; information, not a gate): (blocked + lost) / sync = "
        f"{blk['blocked_plus_lost_async_over_sync']:.3f}.",
        "",
    ]


def iteration_part(iteration: dict[str, Any]) -> list[str]:
    """The page's section on the tracked batch loop's own cost (information).

    :param iteration: The iteration section's results.
    :returns: The lines, ending with a blank one.
    """
    return [
        "## The tracked batch loop (information)",
        "",
        f"CPU time of the bare loop (no model work; an optimizer step without gradients ends every batch's step), "
        f"{iteration['epochs']} epochs of 23 batches of 64 in-memory samples, step checkpoints on (none due) "
        "against off; median of the paired ratios.",
        "",
        "| loader | plain us per batch | extra us per batch when tracked | ratio |",
        "|---|---|---|---|",
        *[
            f"| {shape} | {iteration[shape]['plain_us_per_batch']:.1f} "
            f"| {iteration[shape]['extra_us_per_batch']:+.1f} | {iteration[shape]['ratio_median']:.3f} |"
            for shape in ("per-sample", "per-batch")
        ],
        "",
    ]


def exactness_part(ex: dict[str, Any]) -> list[str]:
    """The page's section on exactness after a SIGKILL mid-epoch, one row per framework that ran.

    :param ex: The exactness section's results.
    :returns: The lines.
    """
    lines = [
        "## Exactness after a SIGKILL mid-epoch",
        "",
        f"{ex['setup']['loader']}; {ex['setup']['model']}; {ex['setup']['epochs']} epochs of "
        f"{ex['setup']['samples'] // ex['setup']['batch_size']} steps; a checkpoint every "
        f"{ex['setup']['checkpoint_every_n_steps']} steps; killed after step {ex['setup']['kill_after_step']}.",
        "",
        "| framework | mid-epoch checkpoint | exact | max abs diff | relative L2 diff | steps (reference / resumed) |",
        "|---|---|---|---|---|---|",
    ]
    how = {
        "trainkit": "`ckpt.every_n_steps=5`",
        "lightning": "`ModelCheckpoint(every_n_train_steps=5, save_last=True)`, `fit(ckpt_path=last.ckpt)`",
    }
    for fw in ("trainkit", "lightning"):
        e = ex.get(fw)
        if e is None:
            continue
        if "skipped" in e:
            lines.append(f"| {fw} | {how[fw]} | not run: {e['skipped']} | | | |")
        elif "error" in e:
            lines.append(f"| {fw} | {how[fw]} | FAILED (see JSON) | | | |")
        else:
            lines.append(
                f"| {fw} | {how[fw]} | {'yes' if e['exact'] else 'no'} | {e['max_abs_diff']:.3g} "
                f"| {e['relative_l2_diff']:.3g} | {e['steps']['reference']} / {e['steps']['resumed']} |"
            )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The arguments.
    """
    parser = argparse.ArgumentParser(description="trainkit step-checkpoint benchmarks (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small sizes, gates advisory")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning exactness run")
    parser.add_argument("--enforce-gates", action="store_true", help="exit 1 on a missed gate in --quick mode too")
    parser.add_argument(
        "--world-change", action="store_true", help="only the latency of a resume on another world size (1 -> 2)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the four sections (or, with ``--child``, one attempt of the exactness section), write the results.

    :param argv: The command line's arguments (default: ``sys.argv[1:]``).
    :returns: The exit status (see the module's docstring).
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a machine with a GPU
    os.environ.setdefault("WANDB_SILENT", "true")
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    s = QUICK if args.quick else FULL
    enforce = args.enforce_gates or not args.quick
    one_thread()
    if args.world_change:
        return world_change_main(s, args.out, enforce)
    start = time.perf_counter()
    meta: dict[str, Any] = run_meta()
    lightning_why = "--no-lightning" if args.no_lightning else lightning_missing()
    if lightning_why is None:
        import lightning

        meta["lightning"] = lightning.__version__
    else:
        log(f"Lightning skipped ({lightning_why})")
    tmp = Path(tempfile.mkdtemp(prefix="trainkit-step-bench-"))  # $TMPDIR: it must be a real disk (fsync)
    try:
        sections = {
            "latency": bench_latency(s, tmp),
            "blocked": bench_blocked(s, tmp),
            "iteration": bench_iteration(s, tmp),
            "exactness": bench_exactness(tmp, lightning_why is None, lightning_why),
        }
    except Exception:
        traceback.print_exc()
        return 3
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = load_average()
    meta["seconds"] = round(time.perf_counter() - start, 1)
    doc = results_doc(meta, s, enforce, sections)
    write_json(args.out, "step_resume.json", doc)
    md = markdown(doc)
    (args.out / "step_resume.md").write_text(md)
    print()
    print(md)
    log(f"wrote {args.out / 'step_resume.json'} and {args.out / 'step_resume.md'} in {meta['seconds']} s")
    return exit_status(doc, enforce)


def results_doc(meta: dict[str, Any], s: Settings, enforce: bool, sections: dict[str, Any]) -> dict[str, Any]:
    """What ``step_resume.json`` holds: the run's facts, the gates judged, whether trainkit resumed exactly
    everywhere, and every section's results (the exactness runs' weights left out).

    :param meta: The run's facts.
    :param s: The run mode.
    :param enforce: Whether a missed gate fails the run.
    :param sections: ``latency``, ``blocked``, ``iteration`` and ``exactness``: each section's results.
    :returns: The document.
    """
    latency, blocked, exactness = sections["latency"], sections["blocked"], sections["exactness"]
    gates = [
        {
            "name": "latency/trainkit last/first",
            "value": latency["ratio_last_over_first"]["trainkit"],
            "limit": GATE_LATENCY_FLAT,
        },
        {"name": "blocked/async/sync", "value": blocked["blocked_async_over_sync"], "limit": GATE_BLOCKED},
    ]
    for g in gates:
        g["passed"] = g["value"] <= g["limit"]
    trainkit_exact = (
        all(latency["first_batch_matches_uninterrupted"].values())
        and all(latency["resumed_to_end_exact"].values())
        and blocked["same_weights"]
        and exactness["trainkit"].get("exact") is True
    )
    notes = []
    if machine_was_busy(meta):
        notes.append(f"the machine was busy (load average {meta['loadavg_start']} / {meta['loadavg_end']})")
    if s.mode == "quick":
        notes.append("quick mode: small sizes; the gates are meant for the full run")
    return {
        "meta": meta,
        "settings": asdict(s),
        "gates_enforced": enforce,
        "gates": gates,
        "all_gates_passed": all(g["passed"] for g in gates),
        "trainkit_exact": trainkit_exact,
        "latency": latency,
        "blocked": blocked,
        "iteration": sections["iteration"],
        "exactness": {
            k: ({kk: vv for kk, vv in v.items() if kk != "weights"} if isinstance(v, dict) else v)
            for k, v in exactness.items()
        },
        "notes": notes,
    }


def exit_status(doc: dict[str, Any], enforce: bool) -> int:
    """The run's exit status (see the module's docstring), with the line that says why.

    :param doc: What ``step_resume.json`` holds.
    :param enforce: Whether a missed gate exits 1.
    :returns: 2 when trainkit's resume was not exact, 1 on an enforced missed gate, else 0.
    """
    if not doc["trainkit_exact"]:
        log("FAILED: trainkit's resume was not exact")
        return 2
    failed = [g["name"] for g in doc["gates"] if not g["passed"]]
    if failed:
        log(f"gates missed: {', '.join(failed)}" + ("" if enforce else " (advisory in --quick mode)"))
        return 1 if enforce else 0
    log("all gates passed")
    return 0


def world_change_main(s: Settings, out: Path, enforce: bool) -> int:
    """``--world-change``: the latency section on another world size (:mod:`benchmarks.step_resume_world`), its gate
    (flat in the position, as the same-world one), ``step_resume_world.json``.

    :param s: The settings.
    :param out: The output folder.
    :param enforce: Whether a missed gate fails the run.
    :returns: The exit status (see the module's docstring).
    """
    meta: dict[str, Any] = run_meta()
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="trainkit-world-bench-"))
    try:
        world = bench_world_change(s, tmp)
    except Exception:
        traceback.print_exc()
        return 3
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"], meta["seconds"] = load_average(), round(time.perf_counter() - start, 1)
    gate = {"name": "world-change latency last/first", "value": world["ratio_last_over_first"]}
    gate.update(limit=GATE_LATENCY_FLAT, passed=gate["value"] <= GATE_LATENCY_FLAT)
    write_json(out, "step_resume_world.json", {"meta": meta, "settings": asdict(s), "latency": world, "gate": gate})
    log(f"wrote {out / 'step_resume_world.json'} in {meta['seconds']} s")
    if not all(world["first_batch_matches_uninterrupted"].values()):
        log("FAILED: a resumed first batch did not hold the uninterrupted run's samples")
        return 2
    if not gate["passed"]:
        log(f"gate missed: {gate['name']} {gate['value']:.2f} > {GATE_LATENCY_FLAT}")
        return 1 if enforce else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
