"""torchrun's elastic agent, two agents on this machine as two nodes: a run keeps training when a node's worker (or a
whole node) is killed, and resumes from the newest step checkpoint mid-epoch.

Each test reads the workers' sample ledger (tests/distributed/elastic_worker.py): per optimizer step, the dataset
indices each rank trained on, tagged with the attempt that trained them. A resume discards the steps after its
checkpoint, so the checks are on each step's FINAL set (the latest attempt that trained it): the uninterrupted run's
set for that step, every sample of an epoch exactly once, at most ``ckpt.every_n_steps`` steps trained again per kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
import torch

import trainkit
from tests.faults.harness import assert_equal_state, child_env, load
from tests.helpers import ROOT
from tests.helpers.configs import make_cfg
from tests.helpers.sampling import ATOL, RTOL
from trainkit.distributed.collectives import free_port

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]

N_SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 8, 2
STEPS_PER_EPOCH = N_SAMPLES // GLOBAL_BATCH
EVERY_N_STEPS = 1
STEP_SLEEP = {"1": 1.5, "2": 0.2}
"""Seconds each step sleeps, by world size: slow enough to kill mid-epoch, and a window for a new agent to join
(~25 s of steps left on 1 process when it starts: a loaded host's torchrun takes its time; the window ends at the
join, so a quiet one waits no longer)."""


def run_cfg(out_dir: Path) -> dict:
    """The run: 2 epochs of 12 steps of a global batch of 8, a step checkpoint after every step."""
    return make_cfg(
        out_dir, epochs=EPOCHS, n_samples=N_SAMPLES, global_batch=GLOBAL_BATCH, ckpt={"every_n_steps": EVERY_N_STEPS},
        dist={"backend": "gloo", "timeout_s": 30},
    )  # fmt: skip


class Agents:
    """torchrun agents of one elastic job (``--nnodes=1:2``), each in its own session; :meth:`kill_all` reaps them
    and every worker they started, whatever state the test left them in."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.ledger = tmp_path / "ledger"
        self.ledger.mkdir()
        self.run_json = tmp_path / "run.json"
        self.out = tmp_path / "run"
        self.run_json.write_text(
            json.dumps({"config": run_cfg(self.out), "ledger": str(self.ledger), "step_sleep": STEP_SLEEP})
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: set[int] = set()
        self.killed: set[str] = set()

    def start(self, name: str) -> None:
        """Start an agent; its and its workers' output goes to ``<name>.log``. The first one started hosts the
        rendezvous store (``is_host``: the node the recipe keeps alive); the others connect to it."""
        conf = f"is_host={int(not self.procs)},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
        args = [
            "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
            "--monitor-interval=0.1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=elastic-test", f"--rdzv-conf={conf}",
            "-m", "tests.distributed.elastic_worker", str(self.run_json),
        ]  # fmt: skip
        # the recipe's settings (docs: "torchrun elastic"): each attempt's process group gets a store of its own, and
        # a dead node's heartbeat expires in 3 s instead of 15
        env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        with open(self.tmp_path / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def workers(self, name: str) -> list[psutil.Process]:
        """The agent's live workers (torchrun starts each in a session of its own: the agent's children)."""
        try:
            found = psutil.Process(self.procs[name].pid).children(recursive=True)
        except psutil.Error:
            return []
        self.seen.update(proc.pid for proc in found)
        return found

    def entries(self) -> list[dict]:
        """Every ledger line written so far."""
        return [json.loads(line) for path in self.ledger.glob("*.jsonl") for line in path.read_text().splitlines()]

    def wait_for(self, condition, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.entries()):
            for name, proc in self.procs.items():
                if proc.poll() is not None and proc.returncode != 0 and name not in self.killed:
                    raise AssertionError(
                        f"agent {name} exited {proc.returncode} waiting for {what}:\n{self.log(name)[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.log('a')[-3000:]}")
            for name in self.procs:
                self.workers(name)
            time.sleep(0.05)

    def kill_node(self, name: str, *, agent: bool) -> float:
        """SIGKILL the agent's workers (and, with ``agent``, the agent); returns when, as ``time.time()``."""
        workers = self.workers(name)
        killed = time.time()
        if agent:
            os.killpg(self.procs[name].pid, signal.SIGKILL)
            self.killed.add(name)
        for proc in workers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return killed

    def wait(self, name: str, timeout: float = 120.0) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {name} did not end within {timeout} s:\n{self.log(name)[-3000:]}") from None

    def kill_all(self) -> None:
        """SIGKILL every agent and every worker seen or still running (pids from the ledger too)."""
        pids = set(self.seen) | {entry["pid"] for entry in self.entries()}
        for name, proc in self.procs.items():
            pids.update(worker.pid for worker in self.workers(name))
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                worker = psutil.Process(pid)
                if "tests.distributed.elastic_worker" in " ".join(worker.cmdline()):
                    worker.kill()


@pytest.fixture
def agents(tmp_path):
    """The job's agents; every process of it is killed at the end, whatever happens."""
    job = Agents(tmp_path)
    try:
        yield job
    finally:
        job.kill_all()


def final_steps(entries: list[dict]) -> dict[int, list[dict]]:
    """For each step, the entries of the latest attempt that trained it (a resume discards the later ones)."""
    by_step: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for entry in entries:
        by_step[entry["step"]][entry["attempt"]].append(entry)
    return {
        step: max(attempts.values(), key=lambda group: max(entry["time"] for entry in group))
        for step, attempts in sorted(by_step.items())
    }


def expected_step_sets() -> dict[int, set[int]]:
    """The uninterrupted run's samples of each step, on any world size that divides the global batch: the
    ``DistributedSampler`` deals the epoch's permutation of ``(seed, epoch)`` round robin, so step k of an epoch
    trains on positions ``[k * G, (k + 1) * G)`` of it."""
    seed = trainkit.Config(epochs=1).seed
    sets = {}
    for epoch in range(EPOCHS):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for k in range(STEPS_PER_EPOCH):
            sets[epoch * STEPS_PER_EPOCH + k + 1] = set(order[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH])
    return sets


def check_ledger(entries: list[dict], *, kills: int) -> dict[str, int]:
    """Assert the final per-step sets are the uninterrupted run's, each sample once per epoch, and at most
    ``kills * EVERY_N_STEPS`` steps trained again; return what was re-done and on which world sizes."""
    final = final_steps(entries)
    expected = expected_step_sets()
    assert sorted(final) == sorted(expected), f"steps trained: {sorted(final)}"
    for step, group in final.items():
        served = [index for entry in group for index in entry["indices"]]
        assert len(group) == group[0]["world"] and {entry["rank"] for entry in group} == set(range(len(group)))
        assert sorted(served) == sorted(expected[step]), f"step {step}: {sorted(served)} != {sorted(expected[step])}"
    for epoch in range(EPOCHS):
        served = [i for step, group in final.items() for e in group if e["epoch"] == epoch for i in e["indices"]]
        assert sorted(served) == list(range(N_SAMPLES)), f"epoch {epoch}: a sample twice or never"
    attempts_per_step = defaultdict(set)
    for entry in entries:
        attempts_per_step[entry["step"]].add(entry["attempt"])
    redone = sum(len(attempts) - 1 for attempts in attempts_per_step.values())
    assert redone <= kills * EVERY_N_STEPS, f"{redone} steps trained again after {kills} kill(s)"
    return {"redone": redone, "worlds": sorted({entry["world"] for entry in entries})}


def restart_cost(entries: list[dict], since: float) -> str:
    """From ``since`` (a kill, an agent's start) to the first optimizer step of an attempt that started after it,
    in seconds, and how much of it the new processes spent from their start to that step."""
    before = {entry["attempt"] for entry in entries if entry["time"] < since}
    first = min((entry for entry in entries if entry["attempt"] not in before), key=lambda entry: entry["time"])
    born = max(entry["born"] for entry in entries if entry["attempt"] == first["attempt"])
    return f"{first['time'] - since:.1f} s (the new workers' start to their first step: {first['time'] - born:.1f} s)"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run's last.pt, on 2 processes."""
    from tests.distributed.elastic_worker import LedgerTrainer

    out = tmp_path_factory.mktemp("elastic") / "ref"
    trainkit.spawn(LedgerTrainer, run_cfg(out), world_size=2)
    return load(out / "last.pt")


def test_a_killed_worker_is_restarted_by_both_agents_and_the_run_resumes_bit_identically(agents, reference):
    """SIGKILL one node's worker mid-epoch: the other worker fails fast out of its collective, both agents restart
    their workers on 2 processes again, and they resume from the newest step checkpoint: each step's final samples
    are the uninterrupted run's, at most ckpt.every_n_steps steps trained again, the weights bit for bit."""
    agents.start("a")
    agents.start("b")
    agents.wait_for(lambda entries: any(entry["step"] >= 5 for entry in entries), "step 5")
    killed = agents.kill_node("b", agent=False)
    assert agents.wait("a") == 0, agents.log("a")[-4000:]
    assert agents.wait("b") == 0, agents.log("b")[-4000:]
    entries = agents.entries()
    done = check_ledger(entries, kills=1)
    assert done["worlds"] == [2]
    # the survivor left its failed collective at once: no wait for the backend to let go of its tensors
    assert "still held the tensors" not in agents.log("a") + agents.log("b")
    print(f"restart cost: {restart_cost(entries, killed)} from the kill; {done['redone']} step(s) trained again")
    got, ref = load(agents.out / "last.pt"), reference
    assert got["step"] == ref["step"] == EPOCHS * STEPS_PER_EPOCH
    for key, value in ref["model"].items():
        assert torch.equal(got["model"][key], value), f"model[{key!r}] differs"
    assert_equal_state(got["optimizer"], ref["optimizer"], "optimizer")


def test_a_lost_node_continues_on_one_process_and_scales_back_to_two_when_it_joins(agents, reference):
    """2 agents -> 1 -> 2. SIGKILL a node (its agent and worker) mid-epoch: the survivor fails fast, its agent
    restarts it alone and it resumes the newest step checkpoint on 1 process. A new agent joins: the running agent
    sees a node waiting and stops its worker with SIGTERM, which writes a step checkpoint at the next step
    boundary; both resume it on 2 processes and finish. Each step's final samples are the uninterrupted run's (only
    the SIGKILL re-does steps), and the weights match it within the documented tolerance."""
    agents.start("a")
    agents.start("b")
    agents.wait_for(lambda entries: any(entry["step"] >= 4 for entry in entries), "step 4")
    killed = agents.kill_node("b", agent=True)
    agents.wait_for(lambda entries: any(e["world"] == 1 and e["step"] >= 7 for e in entries), "step 7 on 1 process")
    joined = time.time()
    agents.start("b2")
    assert agents.wait("a") == 0, agents.log("a")[-4000:]
    assert agents.wait("b2") == 0, agents.log("b2")[-4000:]
    entries = agents.entries()
    done = check_ledger(entries, kills=1)
    assert done["worlds"] == [1, 2]
    final = final_steps(entries)
    assert final[EPOCHS * STEPS_PER_EPOCH][0]["world"] == 2
    # the agent's SIGTERM made the worker save at a step boundary: no step trained alone is trained again on 2
    assert "SIGTERM received" in agents.log("a")
    alone = {e["step"] for e in entries if e["world"] == 1}
    assert not alone & {e["step"] for e in entries if e["world"] == 2 and e["time"] > joined}
    print(
        f"restart cost: {restart_cost(entries, killed)} from the SIGKILL, on 1 process; "
        f"{restart_cost(entries, joined)} from starting the new agent, on 2; {done['redone']} step(s) re-done"
    )
    got = load(agents.out / "last.pt")
    assert got["step"] == reference["step"] == EPOCHS * STEPS_PER_EPOCH
    for name, value in reference["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=RTOL, atol=ATOL, msg=f"model[{name!r}]")
