"""Why the runs diverged, or what a PASS did not need: the evidence certify gathers for
:func:`~trainkit.certification.causes.likely_causes`.

The attempts' findings (objects not registered, loaders iterated outside ``progress()``, what a loader's state
covers), a value seen to differ right after a resume (:func:`lost_value`, from the attempts' step logs), a second
straight run when nothing else explains a divergence (a non-deterministic op), the batches a resumed attempt first
trained on, and whether the resume before the divergence was inside an epoch (:func:`diagnose`).

Side effects: reads the work folder's logs and checkpoints; :func:`diagnose` may run the trainer straight once more.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainkit.certification.attempts import Attempts, kept_checkpoints, read_json, run_to_the_end, step_rows
from trainkit.certification.causes import Cause, likely_causes
from trainkit.certification.comparison import compare_runs

if TYPE_CHECKING:
    from trainkit.checkpoint.compare import Difference

__all__ = ["diagnose", "lost_value"]


def lost_value(straight: Path, attempts: Sequence[Path]) -> tuple[str, str, str] | None:
    """The first value (a counter, a generator's state) that a resumed attempt of the interrupted run held at a step and
    the straight run did not. Values that already differ in the first attempt, before any resume, vary from run to
    run (a time, an id) and are left out.

    Side effects: reads the step logs.

    :param straight: The straight run's step log (``.steps.jsonl``).
    :param attempts: The interrupted run's step logs, attempt by attempt.
    :returns: The value's cause key (:data:`~trainkit.certification.causes.CAUSES`), what was seen and the value's
        path; None when every value matched.
    """
    base = {row["step"]: row.get("values", {}) for row in step_rows(straight) if "step" in row}

    def differing(step: int, values: dict[str, str]) -> list[str]:
        there = base.get(step)
        return [] if there is None else [key for key in {**there, **values} if there.get(key) != values.get(key)]

    rows = [[row for row in step_rows(path) if "step" in row] for path in attempts]
    noise = {key for row in (rows[0] if rows else []) for key in differing(row["step"], row.get("values", {}))}
    for attempt in rows[1:]:
        for row in attempt:
            keys = [key for key in differing(row["step"], row.get("values", {})) if key not in noise]
            if keys:
                key = keys[0]
                path, _, loader = key.partition("@")
                step, resumed = row["step"], attempt[0]["step"] - 1
                seen = (
                    f"{path}: {base[step].get(key, 'absent')} in the straight run, {row['values'].get(key, 'absent')} "
                    f"after the resume from step {resumed} (at step {step})"
                )
                if loader:
                    return "loader_state_incomplete", f"{seen}; reached from {loader}", path
                kind = str(base[step].get(key, row["values"].get(key))).split(" state ")
                if len(kind) == 2:  # a generator of its own, which no scan reached
                    return ("unregistered" if kind[0] == "torch.Generator" else "uncaptured_rng"), seen, path
                return "unregistered_value", seen, path
    return None


def _findings(folder: Path) -> tuple[list[tuple[str, str]], list[str], list[tuple[str, str, str]]]:
    """What the attempts found, merged in attempt order without repeats: from the attempts that got to the end of
    their training loop where any did (they know the loaders ``train_epoch()`` handed to ``progress()``)."""
    unregistered: dict[tuple[str, str], None] = {}
    loaders: dict[str, None] = {}
    covered: dict[tuple[str, str, str], None] = {}
    found_all = [read_json(path) or {} for path in sorted((folder / "logs").glob("*.findings.json"))]
    final = [found for found in found_all if "loaders_outside_progress" in found]
    for found in final or found_all:
        unregistered.update((tuple(pair), None) for pair in found.get("unregistered", []))
        loaders.update((name, None) for name in found.get("loaders_outside_progress", []))
        covered.update((tuple(entry), None) for entry in found.get("covered", []))
    return list(unregistered), list(loaders), list(covered)  # type: ignore[arg-type]


def diagnose(
    runs: Attempts,
    folder: Path,
    divergence: Difference | None,
    resumes: Sequence[tuple[int, int]],
    lost: tuple[str, str, str] | None = None,
) -> tuple[tuple[Cause, ...], tuple[str, ...]]:
    """Name the likely causes of a divergence, and the notes of the report.

    Side effects: reads the work folder; when the attempts found nothing to blame, runs the trainer straight once
    more (``straight-again``) to tell a non-deterministic op.

    :param runs: The attempts' starter.
    :param folder: certify's work folder.
    :param divergence: The first difference between the runs; None: a PASS (only the notes are made).
    :param resumes: For each interruption: the step it fired at and the step the next attempt resumed from.
    :param lost: :func:`lost_value`'s result.
    :returns: The causes (none on a PASS) and the notes (what did not matter, what a loader's state covers).
    :raises CertifyError: When the second straight run fails.
    """
    unregistered, loaders, covered = _findings(folder)
    if lost is not None and any(lost[2] == name or lost[2].startswith(f"{name}.") for name, _ in unregistered):
        lost = None  # what the scan found and names (first) itself
    lost_path = None if lost is None else lost[2]
    notes = [
        f"left to the state of {loader}, which every checkpoint saves, step and epoch-end (not to be registered): "
        f"{name} ({kind})"
        for name, kind, loader in covered
        if name != lost_path
    ]
    if divergence is None:
        notes += [f"not registered, but it did not matter here: {name} ({kind})" for name, kind in unregistered]
        notes += [f"iterated outside progress(), but it did not matter here: {name}" for name in loaders]
        return (), tuple(notes)
    agree = None
    if not unregistered and not loaders and lost is None:  # a second straight run tells a non-deterministic op
        again = folder / "straight-again"
        run_to_the_end(runs, again, "straight-again", ())
        agree = compare_runs(folder / "straight", again)[0] is None
    before = [resumed for _, resumed in resumes if divergence.step is None or resumed < divergence.step]
    mid_epoch = bool(before) and _mid_epoch(folder / "interrupted", before[-1])
    causes = likely_causes(
        unregistered, loaders, straight_runs_agree=agree, resumed_mid_epoch=mid_epoch,
        batches_after_resume=_batches_after_resume(folder / "logs"), lost=None if lost is None else lost[:2],
    )  # fmt: skip
    return causes, tuple(notes)


def _batches_after_resume(logs: Path) -> str | None:
    """How the first training batch of a resumed attempt differs from the straight run's batch at the same epoch and
    index, for the first resumed attempt where it does; None when every resume saw the straight run's batches."""
    straight: dict[tuple[int, int], str] = {}
    for path in logs.glob("*-straight.batches.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            straight[row["epoch"], row["index"]] = row["digest"]
    for path in sorted(logs.glob("*-interrupted.batches.jsonl"))[1:]:  # the first attempt resumed nothing
        lines = path.read_text().splitlines()
        first = json.loads(lines[0]) if lines else None
        if first is not None and straight.get((first["epoch"], first["index"])) != first["digest"]:
            return (
                f"the first batch after a resume (epoch {first['epoch']}, batch {first['index']}) differs from the "
                "straight run's"
            )
    return None


def _mid_epoch(out_dir: Path, step: int) -> bool:
    """Whether the kept checkpoint at ``step`` stands inside an epoch."""
    from trainkit.checkpoint.compare import read_comparable

    path = kept_checkpoints(out_dir).get(step)
    return path is not None and read_comparable(path).get("position") is not None
