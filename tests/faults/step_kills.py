"""SIGKILL a StepTrainer at chosen points, resume it, and report what every finished run ended with.

Usage: ``python -m tests.faults.step_kills SCENARIO.json REPORT.json``. The scenario holds
``{"config": {...}, "world_size": 1 or 2, "runs": [[kill point, ...], ...]}``. A kill point is one of:

- ``["batch", epoch, batch index]``: SIGKILL right after that batch (its step included when it ends a window);
- ``["val", epoch, 0]``: SIGKILL right after that epoch's validation;
- ``["sigterm", epoch, batch index]``: rank 0 sends itself SIGTERM there; the stop is reported in
  ``run<n>.json.stopped<rank>``.

Each run starts fresh in its own folder, is killed at its first point, resumed and killed at the next, ...,
then resumed to the end; ``[]`` is the uninterrupted reference. The report gives, per run, the exit codes of
its attempts and digests of the final weights, optimizer state and ``metrics.jsonl``.

Every attempt is a process forked from this one (torch imported once; no thread runs before a fork), so the
kills are real SIGKILLs of real training processes, on real files, at a few hundred milliseconds each.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - what a first optimizer imports (2-3 s): once here, not in every forked attempt
import torch.distributed  # noqa: F401
import torch.nn.parallel  # noqa: F401

import trainkit
from tests.helpers import trainers
from trainkit.distributed.collectives import free_port

TIMEOUT_S = float(os.environ.get("STEP_KILLS_TIMEOUT_S", "180"))


def _digest(state: Any) -> str:
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        else:
            digest.update(repr(value).encode())

    walk(state)
    return digest.hexdigest()


def _attempt(config: dict[str, Any], rank: int, world_size: int, kill: list | None, report: Path) -> None:
    trainers.KILL_AT = tuple(kill) if kill and kill[0] != "sigterm" else None
    trainers.SIGTERM_AT = ("batch", *kill[1:]) if kill and kill[0] == "sigterm" else None
    trainer = trainers.StepTrainer(config, rank, world_size)
    try:
        try:
            trainer.train()
        except trainkit.TrainingInterrupted as stopped:
            Path(f"{report}.stopped{rank}").write_text(json.dumps({"step": trainer.step, "message": str(stopped)}))
            raise
        if rank == 0:
            metrics = Path(config["out_dir"], "metrics.jsonl").read_bytes()
            summary = {
                "model": trainers.param_digest(trainer.model),
                "optimizer": _digest(trainer.optimizer.state_dict()),
                "metrics": hashlib.sha256(metrics).hexdigest(),
                "metrics_text": metrics.decode(),
                "step": trainer.step,
            }
            report.write_text(json.dumps(summary))
    finally:
        trainer.close()


def _fork_attempt(config: dict[str, Any], world_size: int, kill: list | None, report: Path) -> list[int]:
    """Run one attempt (every rank a forked child); return each rank's exit code (-9 when killed)."""
    port = free_port()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the child: train, then leave without running the parent's cleanup
            code = 0
            try:
                # an attempt that hangs says where, on stderr, before the parent kills it
                faulthandler.dump_traceback_later(TIMEOUT_S - 10, exit=False)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                _attempt(config, rank, world_size, kill, report)
            except trainkit.TrainingInterrupted as stopped:
                code = stopped.exit_code
            except BaseException:  # noqa: BLE001 - reported on stderr, then a non-zero exit
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = []
    deadline = time.monotonic() + TIMEOUT_S
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                for other in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes.append(-999)
                print(f"attempt {kill} timed out after {TIMEOUT_S} s", file=sys.stderr, flush=True)
                break
            time.sleep(0.002)
    return codes


def main() -> None:
    """Run the scenario named on the command line and write the report."""
    scenario = json.loads(Path(sys.argv[1]).read_text())
    report_path = Path(sys.argv[2])
    base = Path(scenario["config"]["out_dir"])
    world_size = int(scenario.get("world_size", 1))
    results = []
    for number, kills in enumerate(scenario["runs"]):
        out = base / f"run{number}"
        config = {**scenario["config"], "out_dir": str(out)}
        summary_path = base / f"run{number}.json"
        codes = []
        for kill in [*kills, None]:
            codes.append(_fork_attempt(config, world_size, kill, summary_path))
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        results.append({"kills": kills, "exit_codes": codes, "summary": summary})
    report_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
