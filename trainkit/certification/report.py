"""certify's report: the verdict, what was compared and interrupted, the first difference and its likely causes.

:class:`CertifyReport` is what :func:`trainkit.cli.certify.certify` returns; ``python -m trainkit certify`` prints
its :meth:`~CertifyReport.lines` and ``--json`` writes its :meth:`~CertifyReport.to_dict`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from trainkit.certification.causes import Cause
from trainkit.certification.plan import Interruption

if TYPE_CHECKING:
    from trainkit.checkpoint.compare import Difference

__all__ = ["CertifyReport"]


@attrs.frozen(kw_only=True)
class CertifyReport:
    """What :func:`~trainkit.cli.certify.certify` found.

    :ivar passed: Whether the interrupted run ended bit for bit where the straight one did.
    :ivar trainer: The trainer, as ``MODULE:Class``.
    :ivar budget: The budget both runs had (``max_steps=12``, ``epochs=2``).
    :ivar world_size: Processes per run.
    :ivar total_steps: The optimizer steps the straight run took.
    :ivar interruptions: The interruptions planned, in step order.
    :ivar resumes: For each interruption: the step it fired at and the step the next attempt resumed from.
    :ivar straight_dir: The straight run's folder (kept).
    :ivar interrupted_dir: The interrupted run's folder (kept).
    :ivar checkpoints_compared: The step checkpoints compared (plus ``last`` and ``best``).
    :ivar rows_compared: The ``metrics.jsonl`` rows compared.
    :ivar divergence: The first difference (its file and step set), or None.
    :ivar causes: Its likely causes (empty on PASS).
    :ivar notes: What the attempts found that a PASS did not need (an unregistered object that did not matter), what
        a loader's state covers, and what certify left out (the remote tier, a boundary no interruption crossed).
    :ivar crossed: For each interruption: what the run crossed between its start (or last resume) and the signal
        (step checkpoints, validations, epoch ends).
    :ivar seconds: The wall-clock time certify took.
    :ivar timeout_s: Its bound.
    """

    passed: bool
    trainer: str
    budget: str
    world_size: int
    total_steps: int
    interruptions: tuple[Interruption, ...]
    resumes: tuple[tuple[int, int], ...]
    straight_dir: str
    interrupted_dir: str
    checkpoints_compared: int
    rows_compared: int
    divergence: Difference | None
    causes: tuple[Cause, ...]
    notes: tuple[str, ...]
    seconds: float
    timeout_s: float
    crossed: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (what ``--json`` writes).

        :returns: A JSON-serialisable dict (causes with their ``what`` and ``fix``).
        """
        data = attrs.asdict(self, recurse=True)
        data["verdict"] = "PASS" if self.passed else "DIVERGED"
        data["causes"] = [{"key": c.key, "found": list(c.found), "what": c.what, "fix": c.fix} for c in self.causes]
        return data

    def lines(self) -> list[str]:
        """The report as printed.

        :returns: The lines.
        """
        verdict = "PASS" if self.passed else "DIVERGED"
        stops = ", ".join(
            f"{i.signal} at step {fired} (resumed from step {resumed})"
            for i, (fired, resumed) in zip(self.interruptions, self.resumes)
        )
        lines = [
            f"certify {self.trainer}: {verdict}",
            f"  budget:      {self.budget}: {self.total_steps} optimizer steps, {self.world_size} process(es)",
            f"  interrupted: {stops}",
        ]
        lines += [f"  crossed:     {line}" for line in self.crossed]
        found = self.divergence
        if found is None or found.where == "metrics.jsonl":
            lines.append(
                f"  compared:    {self.checkpoints_compared} step checkpoints, last and best, {self.rows_compared} "
                "metrics.jsonl rows (wall-clock keys left out: perf/*, time, timestamp)"
            )
        else:
            lines.append(f"  compared:    {self.checkpoints_compared} step checkpoints, up to the first that differs")
        if found is not None:
            at = f" (step {found.step})" if found.step is not None else ""
            lines.append(f"  first diverging checkpoint: {found.where}{at}")
            lines.append(f"  first difference: {found.describe()}")
            for cause in self.causes:
                named = f" [{', '.join(cause.found)}]" if cause.found else ""
                lines += [f"  likely cause: {cause.what}{named}", f"    fix: {cause.fix}"]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [
            f"  runs kept:   straight {self.straight_dir}",
            f"               interrupted {self.interrupted_dir}",
            f"  time:        {self.seconds:.1f} s (bound: --timeout-s {self.timeout_s:g})",
        ]
        return lines
