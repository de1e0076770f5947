"""SIGKILL a StepTrainer at chosen points, resume it, and report what every finished run ended with.

Usage: ``python -m tests.faults.step_kills SCENARIO.json REPORT.json``. The scenario holds
``{"config": {...}, "world_size": 1 or 2, "runs": [[kill point, ...], ...]}``. A kill point is one of:

- ``["batch", epoch, batch index]``: SIGKILL right after that batch (its step included when it ends a window);
- ``["val", epoch, 0]``: SIGKILL right after that epoch's validation;
- ``["sigterm", epoch, batch index]``: rank 0 sends itself SIGTERM there; the stop is reported in
  ``run<n>.json.stopped<rank>``;
- ``["op", fraction, "before" | "after"]``: rank 0 SIGKILLs itself just before or just after one of the file
  operations that saves and keeps checkpoints (publishing ``last``/``best``, writing ``checkpoints/index.json``,
  linking a kept checkpoint, deleting one, removing a kept directory's trash), the one at ``fraction`` of the
  uninterrupted run's count (``"op_counts": true`` in the scenario counts them, in run 0, which must be ``[]``);
  the other ranks are killed with it, as a job's processes are.

Each run starts fresh in its own folder, is killed at its first point, resumed and killed at the next, ...,
then resumed to the end; ``[]`` is the uninterrupted reference. The report gives, per run, the exit codes of
its attempts and digests of the final weights, optimizer state and ``metrics.jsonl``, and with ``ckpt.keep`` the
kept checkpoints (step, epoch, epoch end, scores) and every name left in ``checkpoints/``.

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
import threading
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
TRAINER = "StepTrainer"
"""The class of tests.helpers.trainers every attempt trains (a driver that imports this module may change it)."""


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


PUBLISHED = ("last.pt", "best.pt", "last.ckpt", "best.ckpt")


def _published(destination: Any) -> bool:
    """Whether a rename publishes a checkpoint: ``last``/``best``, or a kept ``checkpoints/step-<N>`` one."""
    path = Path(os.fspath(destination))
    return path.name in PUBLISHED or (path.parent.name == "checkpoints" and path.name.startswith("step-"))


def _count_ops(kill: list | None) -> list[int]:
    """Count, on this process, the file operations that save and keep checkpoints, and SIGKILL it just before or
    just after the ``kill[1]``-th (``["op", n, where]``); return the count, as a one-item list that grows."""
    import shutil

    import trainkit.checkpoint.kept as kept

    seen = [0]
    lock = threading.Lock()  # the background deletion counts its operations while a save counts its own
    at, where = (int(kill[1]), kill[2]) if kill and kill[0] == "op" else (0, "")

    def counted(real, matters=lambda *args, **kwargs: True):
        def op(*args, **kwargs):
            if not matters(*args, **kwargs):
                return real(*args, **kwargs)
            with lock:
                seen[0] += 1
                number = seen[0]
            if number == at and where == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if number == at and where == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return op

    kept.write_index = counted(kept.write_index)
    kept.remove_kept = counted(kept.remove_kept)
    shutil.rmtree = counted(shutil.rmtree, lambda path, *a, **k: str(path).endswith(".trash"))
    # a publish: last/best into out_dir, or a kept checkpoint's link (a file or a directory) into checkpoints/
    os.replace = counted(os.replace, lambda src, dst, *a, **k: _published(dst))
    os.rename = counted(os.rename, lambda src, dst, *a, **k: _published(dst))
    return seen


def _kept(out_dir: Path) -> dict[str, Any] | None:
    """The kept checkpoints as the folder describes them, and every name in ``checkpoints/`` (None without it)."""
    from trainkit.checkpoint.kept import read_kept

    directory = out_dir / "checkpoints"
    if not directory.is_dir():
        return None
    described = [[c.step, c.epoch, c.epoch_end, sorted(c.scores.items())] for c in read_kept(directory).described]
    return {"described": described, "names": sorted(os.listdir(directory))}


def _attempt(
    config: dict[str, Any], rank: int, world_size: int, kill: list | None, report: Path, ops: Path | None = None
) -> None:
    trainers.KILL_AT = tuple(kill) if kill and kill[0] not in ("sigterm", "op") else None
    trainers.SIGTERM_AT = ("batch", *kill[1:]) if kill and kill[0] == "sigterm" else None
    seen = _count_ops(kill) if rank == 0 and (ops is not None or (kill and kill[0] == "op")) else None
    trainer = getattr(trainers, TRAINER)(config, rank, world_size)
    summary = None
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
    finally:
        trainer.close()  # a deletion in flight lands first
    if summary is not None:
        summary["kept"] = _kept(Path(config["out_dir"]))
        report.write_text(json.dumps(summary))
    if ops is not None and seen is not None:
        ops.write_text(str(seen[0]))


def fork_attempt(
    config: dict[str, Any], world_size: int, kill: list | None, report: Path, ops: Path | None = None
) -> list[int]:
    """Run one attempt (every rank a forked child); return each rank's exit code (-9 when killed). After an
    ``"op"`` kill of rank 0 the other ranks are killed at once, as the rest of a killed job is."""
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
                _attempt(config, rank, world_size, kill, report, ops)
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
                if kill and kill[0] == "op" and codes[-1] == -signal.SIGKILL:
                    for other in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGKILL)
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
    total_ops = None
    for number, kills in enumerate(scenario["runs"]):
        out = base / f"run{number}"
        config = {**scenario["config"], "out_dir": str(out)}
        summary_path = base / f"run{number}.json"
        counter = base / "ops.txt" if scenario.get("op_counts") and number == 0 else None
        if kills and any(kill[0] == "op" for kill in kills):
            assert total_ops, "op kills need op_counts and an uninterrupted run 0"
            kills = [["op", max(1, round(kill[1] * total_ops)), kill[2]] if kill[0] == "op" else kill for kill in kills]
        codes = []
        for kill in [*kills, None]:
            codes.append(fork_attempt(config, world_size, kill, summary_path, counter))
        if counter is not None:
            total_ops = int(counter.read_text())
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        results.append({"kills": kills, "exit_codes": codes, "summary": summary, "ops": total_ops})
    report_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
