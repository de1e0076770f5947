"""certify's attempts: each a real process per rank, run until it finishes or is interrupted, and what they leave.

:class:`Attempts` starts one attempt's processes (``torch.multiprocessing.start_processes`` from a fork server that
imported torch once, :func:`trainkit.certification.child.run_rank` in each) and waits for them within the deadline;
:func:`run_to_the_end` resumes a run attempt after attempt until it finishes. The rest reads what an attempt left in
its run folder and its logs: the kept checkpoints, ``last``/``best``, the step log.

Side effects: starts processes, reads their run folders and logs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainkit.certification.plan import Interruption
from trainkit.errors import TrainkitError

__all__ = [
    "EXIT_SIGTERM",
    "Attempts",
    "CertifyError",
    "final_checkpoint",
    "kept_checkpoints",
    "read_json",
    "run_to_the_end",
    "step_boundaries",
    "step_rows",
    "steps_taken",
]


_ENGINE = "trainkit.pt"
"""The engine's own file inside a sharded checkpoint directory (``ENGINE_FILE`` of
:mod:`trainkit.checkpoint.formats.dcp_directory`)."""


EXIT_SIGTERM = 143
"""What an attempt stopped by ``SIGTERM`` exits with (``128 + 15``, as :func:`trainkit.launch` does)."""


class CertifyError(TrainkitError, RuntimeError):
    """certify could not run the trainer to a verdict: a run failed, or ran past ``--timeout-s``."""


class Attempts:
    """Starts each attempt's processes and waits for them within the deadline.

    :ivar base: What every attempt's :func:`~trainkit.certification.child.run_rank` gets (the trainer and config
        class, the config, ``world_size``, the environment, the threads).
    :ivar folder: certify's work folder (the logs go in its ``logs/``).
    :ivar deadline: The ``time.monotonic()`` past which the attempt running is killed.
    :ivar timeout_s: The bound that deadline came from, for the error.
    :ivar attempts: The attempts started so far.
    :ivar stems: Each attempt's log path without its suffix, in order.
    """

    def __init__(self, base: dict[str, Any], folder: Path, deadline: float, timeout_s: float) -> None:
        self.base, self.folder, self.deadline, self.timeout_s = base, folder, deadline, timeout_s
        self.attempts = 0
        self.stems: list[Path] = []

    def attempt(self, out_dir: Path, label: str, interruption: Interruption | None) -> tuple[str, dict | None]:
        """Run one attempt.

        Side effects: starts ``world_size`` processes training in ``out_dir``; writes the attempt's logs.

        :param out_dir: The run folder.
        :param label: The run's name in the logs (``straight``, ``interrupted``).
        :param interruption: Where the attempt is interrupted; None: it runs to the end.
        :returns: How it ended (``done``, ``term``, ``kill``), and what fired (``{"step": ..., "epoch": ...}``).
        :raises CertifyError: When the attempt failed, or ran past the deadline.
        """
        import torch.multiprocessing as mp

        from trainkit.certification.child import run_rank
        from trainkit.distributed.collectives import free_port

        self.attempts += 1
        stem = self.folder / "logs" / f"{self.attempts:02d}-{label}"
        paths = {name: f"{stem}.{name}.json" for name in ("findings", "fired", "done")}
        paths["batches"] = f"{stem}.batches.jsonl"
        paths["steps"] = f"{stem}.steps.jsonl"
        self.stems.append(stem)
        env = {**self.base["env"], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        config = {**self.base["config"], "out_dir": str(out_dir)}
        interrupt = None if interruption is None else {"how": interruption.how, "step": interruption.step}
        spec = {**self.base, **paths, "config": config, "env": env, "log": f"{stem}.rank{{rank}}.log",
                "interrupt": interrupt}  # fmt: skip
        context = mp.start_processes(
            run_rank, args=(spec,), nprocs=self.base["world_size"], join=False, start_method="forkserver"
        )
        failure = self._wait(context, stem)
        codes = [process.exitcode for process in context.processes]
        fired = read_json(paths["fired"])
        if failure is None and Path(paths["done"]).is_file():
            return "done", fired
        if interruption is not None and fired is not None:
            expected = -9 if interruption.how == "kill" else EXIT_SIGTERM
            if expected in codes and all(code in (0, expected, EXIT_SIGTERM, -9, -15) for code in codes):
                return interruption.how, fired
        raise CertifyError(
            f"the {label} run's attempt {self.attempts} ended with exit status(es) {codes} "
            f"{'after' if fired else 'before'} its interruption: see {stem}.rank0.log\n{_tail(f'{stem}.rank0.log')}"
            f"{failure or ''}"
        )

    def _wait(self, context: Any, stem: Path) -> str | None:
        import torch.multiprocessing as mp

        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()  # a process this call started, by its own handle
                    process.join()
                raise CertifyError(
                    f"certify ran past --timeout-s {self.timeout_s:g}: the attempt running then was killed (its log: "
                    f"{stem}.rank0.log); raise --timeout-s or lower --max-steps/--epochs"
                )
            try:
                if context.join(timeout=min(left, 0.5), grace_period=10):
                    return None
            except mp.ProcessRaisedException as exc:
                return str(exc)
            except mp.ProcessExitedException:
                return None  # a signal's exit status: judged by the caller


def read_json(path: str | Path) -> Any:
    """Read a small JSON file an attempt wrote.

    :param path: The file.
    :returns: Its value, or None when it is missing or cut short (a SIGKILL).
    """
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _tail(path: str | Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_to_the_end(runs: Attempts, out_dir: Path, label: str, plan: Sequence[Interruption]) -> list[tuple[int, int]]:
    """Run attempts in ``out_dir`` until one finishes, the i-th interrupted by ``plan[i]``.

    Side effects: those of :meth:`Attempts.attempt`.

    :param runs: The attempts' starter.
    :param out_dir: The run folder.
    :param label: The run's name in the logs.
    :param plan: The interruptions, in step order.
    :returns: For each interruption, the step it fired at and the step the next attempt resumed from.
    :raises CertifyError: When an attempt failed, or finished before its interruption.
    """
    resumes = []
    for index in range(len(plan) + 1):
        interruption = plan[index] if index < len(plan) else None
        how, fired = runs.attempt(out_dir, label, interruption)
        if how == "done":
            if interruption is not None:
                raise CertifyError(f"the {label} run finished before its {interruption.signal} at step "
                                   f"{interruption.step}")  # fmt: skip
            return resumes
        resumes.append((fired["step"], _last_step(out_dir) or 0))
    raise CertifyError(f"the {label} run did not finish after {len(plan) + 1} attempts")  # pragma: no cover


def kept_checkpoints(out_dir: Path) -> dict[int, Path]:
    """A run folder's kept step checkpoints.

    :param out_dir: The run folder.
    :returns: Step to path (``checkpoints/step-<step>.pt`` or ``.ckpt``).
    """
    from trainkit.checkpoint.kept import kept_step

    folder = out_dir / "checkpoints"
    found = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        step = kept_step(entry.name)
        if step is not None:
            found[step] = entry
    return found


def final_checkpoint(out_dir: Path, stem: str) -> Path | None:
    """A run folder's ``last`` or ``best`` checkpoint, in whichever format it was written.

    :param out_dir: The run folder.
    :param stem: ``"last"`` or ``"best"``.
    :returns: ``<stem>.pt`` or ``<stem>.ckpt``, or None when neither exists.
    """
    for name in (f"{stem}.pt", f"{stem}.ckpt"):
        if (out_dir / name).exists():
            return out_dir / name
    return None


def steps_taken(out_dir: Path) -> int:
    """The optimizer steps a finished run took, from its ``last`` checkpoint.

    :param out_dir: The run folder.
    :returns: The step.
    :raises CertifyError: When the run wrote no ``last`` checkpoint.
    """
    step = _last_step(out_dir)
    if step is None:
        raise CertifyError(f"the run in {out_dir} finished without writing last.pt")
    return step


def _last_step(out_dir: Path) -> int | None:
    """The step of a run folder's ``last`` checkpoint; None when it has none."""
    from trainkit.checkpoint import load_checkpoint

    last = final_checkpoint(out_dir, "last")
    return None if last is None else int(load_checkpoint(last if last.is_file() else last / _ENGINE)["step"])


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The rows an attempt's step log holds (a row per step, one per validation; a line cut by a SIGKILL left out).

    :param path: The attempt's ``.steps.jsonl``.
    :returns: The rows; none when the file is absent.
    """
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a SIGKILL
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def step_boundaries(path: Path, total: int) -> tuple[list[int], list[int]]:
    """The steps (before ``total``) after which a run's attempt ended an epoch, and those after which it validated.

    :param path: The attempt's ``.steps.jsonl``.
    :param total: The run's optimizer steps.
    :returns: The epoch ends and the validations, each in step order.
    """
    steps = [(row["step"], row["epoch"]) for row in step_rows(path) if "step" in row]
    ends = [a for (a, epoch_a), (_, epoch_b) in zip(steps, steps[1:]) if epoch_b != epoch_a and a < total]
    validations = sorted({row["val"] for row in step_rows(path) if 1 <= row.get("val", 0) < total})
    return ends, validations
