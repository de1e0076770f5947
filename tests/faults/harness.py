"""Start, watch, signal and reap the real training processes of the fault tests; leave none behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from tests.helpers import ROOT


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a training process: this one, one thread per op, unbuffered, the repo importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.update(extra)
    return env


def run_driver(
    module: str, scenario: dict[str, Any], folder: Path, *, timeout: float = 540, label: str = ""
) -> tuple[Any, str]:
    """Run a fault driver, ``python -m tests.faults.MODULE SCENARIO REPORT``, on ``scenario`` (written into
    ``folder``, with the driver's stderr beside it for a failure's diagnosis); assert it exits 0.

    :returns: The driver's report (its JSON) and its stderr.
    """
    path, report = folder / "scenario.json", folder / "report.json"
    path.write_text(json.dumps(scenario))
    proc = subprocess.run(
        [sys.executable, "-m", f"tests.faults.{module}", str(path), str(report)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (folder / "driver.err").write_text(proc.stderr)
    assert proc.returncode == 0, f"{label}the {module} driver failed\n{proc.stderr[-4000:]}"
    return json.loads(report.read_text()), proc.stderr


def offline_wandb_env(home: Path, **extra: str) -> dict[str, str]:
    """A training process's environment with an isolated W&B home, offline, and no W&B settings inherited."""
    home.mkdir(parents=True, exist_ok=True)
    env = child_env(
        **extra,
        WANDB_CONFIG_DIR=str(home),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_DATA_DIR=str(home / "data"),
        NETRC=str(home / "netrc"),
        WANDB_SILENT="true",
    )
    for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        if name not in extra:
            env.pop(name, None)
    return env


def write_run(path: Path, config: dict[str, Any], fault: dict[str, Any] | None = None) -> Path:
    """Write the JSON file that tests/faults/train.py reads: the trainer's config and the injected faults."""
    path.write_text(json.dumps({"config": config, "fault": fault or {}}))
    return path


class Run:
    """One training process (or a torchrun job) in its own session, its output in files.

    :param args: The command after the interpreter, e.g. ``["-m", "tests.faults.train", run_json]``.
    :param log: Where stdout and stderr go (``log`` and ``log.err``).
    """

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.err = log.with_suffix(".err")
        with open(self.log, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env or child_env(), stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.pids = {self.proc.pid}
        self.ended: float | None = None
        """``time.monotonic()`` when :meth:`wait` saw the process end (before it looked for leftovers)."""

    @property
    def stdout(self) -> str:
        """Everything printed on stdout so far."""
        return self.log.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        """Everything printed on stderr so far."""
        return self.err.read_text(errors="replace")

    def members(self) -> list[psutil.Process]:
        """The live processes of this run's session (the process, its workers, their helpers)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.proc.pid and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    def worker_pids(self) -> set[int]:
        """The pids that tests/faults/train.py printed at its epoch starts (every rank, every attempt)."""
        return {int(line.rsplit(" pid ", 1)[1]) for line in self.stdout.splitlines()
                if line.startswith("epoch ") and " pid " in line}

    def wait_for(self, text: str, timeout: float = 120.0) -> bool:
        """Wait until ``text`` is on stdout; False when the process ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stdout:
                return True
            if self.proc.poll() is not None:
                return text in self.stdout
            time.sleep(0.005)
        raise TimeoutError(f"{text!r} did not appear within {timeout} s; stderr:\n{self.stderr[-3000:]}")

    def signal(self, number: int) -> None:
        """Send a signal to the process (not its session)."""
        if self.proc.poll() is None:
            self.proc.send_signal(number)

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the process to end and every member of its session to be gone; return its exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
            self.ended = time.monotonic()
        except subprocess.TimeoutExpired:
            self.kill_session()
            raise AssertionError(f"process did not end within {timeout} s; stderr:\n{self.stderr[-3000:]}") from None
        self.assert_nothing_left()
        return code

    def leftovers(self) -> list[psutil.Process]:
        """Live processes of this run: its session's members, and workers that printed their pid."""
        found = {p.pid: p for p in self.members()}
        for pid in self.worker_pids() - found.keys():
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and "tests.faults.train" in " ".join(proc.cmdline()):
                    found[pid] = proc
            except psutil.Error:
                continue
        return list(found.values())

    def assert_nothing_left(self, grace: float = 10.0) -> None:
        """Fail (after killing them) when processes of this run outlive it by more than ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            names = [" ".join(p.cmdline())[:200] for p in left]
            self.kill_session()
            raise AssertionError(f"processes left behind by {self.proc.args[:4]}: {names}")

    def kill_session(self) -> None:
        """SIGKILL every process of this run (cleanup after a failure)."""
        for proc in self.leftovers():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def train(run_json: Path, log: Path, env: dict[str, str] | None = None) -> Run:
    """Start ``python -m tests.faults.train run_json``."""
    return Run(["-m", "tests.faults.train", str(run_json)], log, env)


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint the way a user would inspect one."""
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_training(got_dir: Path, ref_dir: Path, *, metrics: bool = True) -> None:
    """Assert two runs ended with bit-identical model and optimizer states (and, optionally, metrics.jsonl)."""
    got, ref = load(got_dir / "last.pt"), load(ref_dir / "last.pt")
    assert got["loop"] == ref["loop"] and got["step"] == ref["step"]
    assert got["model"].keys() == ref["model"].keys()
    for key, value in ref["model"].items():
        assert torch.equal(got["model"][key], value), f"model[{key!r}] differs"
    assert_equal_state(got["optimizer"], ref["optimizer"], "optimizer")
    best_got, best_ref = load(got_dir / "best.pt"), load(ref_dir / "best.pt")
    assert best_got["best"] == best_ref["best"]
    for key, value in best_ref["model"].items():
        assert torch.equal(best_got["model"][key], value), f"best model[{key!r}] differs"
    if metrics:
        assert (got_dir / "metrics.jsonl").read_bytes() == (ref_dir / "metrics.jsonl").read_bytes()


def assert_equal_state(got: Any, ref: Any, where: str) -> None:
    """Assert two nested states are equal, tensors bit for bit (torch.equal), naming the first difference."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == ref.dtype and torch.equal(got, ref), f"{where} differs"
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), f"{where} keys differ"
        for key in ref:
            assert_equal_state(got[key], ref[key], f"{where}[{key!r}]")
    elif isinstance(ref, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(ref), f"{where} lengths differ"
        for index, (a, b) in enumerate(zip(got, ref)):
            assert_equal_state(a, b, f"{where}[{index}]")
    else:
        assert got == ref, f"{where}: {got!r} != {ref!r}"


SIGTERM_CODE = 128 + signal.SIGTERM
