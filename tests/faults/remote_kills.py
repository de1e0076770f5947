"""SIGKILL a run with ``ckpt.remote`` at chosen calls of its store, resume it, and report what every run ended with.

Usage: ``python -m tests.faults.remote_kills SCENARIO.json REPORT.json``. The scenario holds
``{"config": {...}, "trainer": "TinyTrainer" | "ShardTrainer", "world_size": 1 or 2, "lease_s": float,
"requeue": bool (optional), "runs": [[kill, ...], ...]}``; run 0 must be ``[]``: the uninterrupted reference, which
also counts the store calls.
A kill is ``[verb, fraction, "before" | "after"]``: rank 0 SIGKILLs itself just before or just after its n-th call
of that verb on the store, n = ``max(1, round(fraction * the reference run's count))``, or n itself for a fraction
``"#<n>"`` (counted from 1 in every attempt: an attempt that makes fewer calls is not killed, and the run's later
kills are skipped). The verbs are the store calls of :mod:`trainkit.checkpoint.remote`:

- ``put``: one object of an upload (``put``'s files, one ``put_file`` each: a kill between two is mid-upload);
- ``commit``: writing a folder's ``commit.json`` (a sharded save's too);
- ``lease``: creating, renewing or deleting ``lease.json`` (a takeover deletes an expired one first);
- ``delete``: deleting a folder (its ``commit.json``, then the rest) for retention or as an uncommitted leftover;
- ``fetch``: opening an object of a committed folder to download it (a resume on an empty ``out_dir``); n is
  ``1 + round(fraction * 2)`` (the reference run fetches nothing).

A kill may carry a fourth item, ``"fresh"``: the attempts after it run on a new, empty ``out_dir`` (another machine),
so they resume from the remote. Every attempt's report lists what it left in ``out_dir/.remote-staging``.

The store of the tier is wrapped in this process only (no trainkit source is changed). The wrapper also makes a
hand-over (and a sharded save's report) wait until the uploader is idle, so that no upload is superseded while
queued: then every save of an uninterrupted run is committed, and the committed set is a function of the save
schedule alone (see ``tests/checkpoint/test_remote_kills.py``). Each commit is logged, with its commit record, to
``run<n>.events.jsonl`` before (``"start"``) and after (``"done"``) the write, and so is each kill: a run's log says
exactly which steps were ever committed, even those retention deleted later.

Every attempt is a process forked from this one (torch imported once; see :mod:`tests.faults.step_kills`); a
killed attempt's lease is left to expire (``lease_s``) before the next attempt starts on the same folder and prefix,
unless ``requeue`` is true: then an attempt on the same folder starts at once (a scheduler's requeue), and takes the
killed attempt's lease over; one on a fresh folder still waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec.implementations.local  # noqa: F401 - imported once here, not in every forked attempt

import trainkit.checkpoint.remote  # noqa: F401
from tests.faults import step_kills
from tests.helpers import trainers

with contextlib.suppress(ImportError):
    import s3fs  # noqa: F401 - no event loop runs before a fork: s3fs starts its own in each attempt

VERBS = ("put", "commit", "lease", "delete", "fetch")
IDLE_WAIT_S = 60.0
"""The longest a hand-over waits for the uploader to be idle (it never takes that long unless something hangs)."""


class KillingStore:
    """An fsspec filesystem that counts the store calls the remote tier makes, logs commits, and SIGKILLs this
    process just before or just after the n-th call of one verb. Everything else goes to the real filesystem."""

    def __init__(self, fs: Any, kill: list | None, log: Path, counts: dict[str, int]) -> None:
        self._fs, self._kill, self._log, self._counts = fs, kill, log, counts
        self._lock = threading.Lock()  # the uploader thread and the loop's thread (acquire, close) both call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def _event(self, **fields: Any) -> None:
        line = json.dumps({"pid": os.getpid(), **fields}) + "\n"
        fd = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write: a SIGKILL after it cannot lose the line
        finally:
            os.close(fd)

    def _call(self, verb: str, path: str, real: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._counts[verb] = self._counts.get(verb, 0) + 1
            number = self._counts[verb]
        hit = self._kill is not None and self._kill[0] == verb and self._kill[1] == number
        if hit and self._kill[2] == "before":
            self._event(event="kill", verb=verb, n=number, where="before", path=path)
            os.kill(os.getpid(), signal.SIGKILL)
        record = json.loads(args[1]) if verb == "commit" else None
        if record is not None:
            self._event(event="start", folder=path.rsplit("/", 2)[-2], manifest=record)
        result = real(*args, **kwargs)
        if record is not None:
            self._event(event="done", folder=path.rsplit("/", 2)[-2], manifest=record)
        if hit and self._kill[2] == "after":
            self._event(event="kill", verb=verb, n=number, where="after", path=path)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    @staticmethod
    def _verb(path: str, default: str) -> str:
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        return "lease" if name == "lease.json" else "commit" if name == "commit.json" and default == "pipe" else default

    def open(self, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        if mode == "rb" and name not in ("commit.json", "lease.json"):
            return self._call("fetch", str(path), self._fs.open, path, mode, *args, **kwargs)
        return self._fs.open(path, mode, *args, **kwargs)

    def put(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> None:
        """One ``put_file`` per file, so a kill can land between two objects of one upload."""
        pairs = zip(lpath, rpath, strict=True) if isinstance(lpath, list) else [(lpath, rpath)]
        for local, remote in pairs:
            self.put_file(local, remote)

    def put_file(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call("put", str(rpath), self._fs.put_file, lpath, rpath, *args, **kwargs)

    def pipe_file(self, path: Any, value: bytes, *args: Any, **kwargs: Any) -> Any:
        verb = self._verb(path, "pipe")
        if verb == "pipe":  # nothing the tier writes this way today; counted apart so it is seen if it starts to
            with self._lock:
                self._counts["pipe"] = self._counts.get("pipe", 0) + 1
            return self._fs.pipe_file(path, value, *args, **kwargs)
        return self._call(verb, str(path), self._fs.pipe_file, path, value, *args, **kwargs)

    def rm_file(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._verb(path, "delete"), str(path), self._fs.rm_file, path, *args, **kwargs)

    def rm(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._verb(path, "delete"), str(path), self._fs.rm, path, *args, **kwargs)


def install(kill: list | None, log: Path, counts: dict[str, int]) -> None:
    """Wrap the store of every remote tier this process builds (see :class:`KillingStore`), and make its hand-overs
    and reports wait for an idle uploader (no upload superseded)."""
    from trainkit.checkpoint import remote
    from trainkit.checkpoint.remote import store

    real_build = remote.RemoteTier.build.__func__
    real_open = store.open_store

    def build(cls: type, ckpt: Any, out_dir: Path, *, rank: int) -> Any:
        def open_killing(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
            fs, root = real_open(url, options)
            return KillingStore(fs, kill if rank == 0 else None, log, counts), root

        store.open_store = open_killing
        try:
            tier = real_build(cls, ckpt, out_dir, rank=rank)
        finally:
            store.open_store = real_open
        if tier is not None:
            for name in ("hand_over", "report"):
                real = getattr(tier, name)

                def waiting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                    tier.wait_idle(IDLE_WAIT_S)
                    return _real(*args, **kwargs)

                setattr(tier, name, waiting)
        return tier

    remote.RemoteTier.build = classmethod(build)


def _attempt(
    config: dict[str, Any], trainer_name: str, rank: int, world_size: int, kill: list | None, report: Path, log: Path
) -> None:
    counts: dict[str, int] = {}
    install(kill, log, counts)
    trainer = getattr(trainers, trainer_name)(config, rank, world_size)
    summary = None
    try:
        trainer.train()
        if rank == 0:
            summary = {
                "model": trainers.param_digest(trainer.model),
                "optimizer": trainers.optimizer_digest(trainer.optimizer),
                "step": trainer.step,
            }
    finally:
        trainer.close()  # the last upload lands first (ckpt.remote_wait_s)
    if summary is not None:
        summary["counts"] = counts
        report.write_text(json.dumps(summary))


def fork_attempt(
    config: dict[str, Any], trainer_name: str, world_size: int, kill: list | None, report: Path, log: Path
) -> list[int]:
    """Run one attempt, every rank a forked child; return each rank's exit code (-9: killed). When rank 0 is
    SIGKILLed the other ranks are killed at once, as the rest of a killed job is."""
    from trainkit.distributed.collectives import free_port

    port = free_port()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                _attempt(config, trainer_name, rank, world_size, kill, report, log)
            except BaseException:  # noqa: BLE001 - reported on stderr, then a non-zero exit
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + step_kills.TIMEOUT_S
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] == -signal.SIGKILL or time.monotonic() > deadline:
                    for other in pids:
                        if other not in codes:
                            os.kill(other, signal.SIGKILL)
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -999
            print(f"attempt {kill} timed out after {step_kills.TIMEOUT_S} s", file=sys.stderr, flush=True)
        time.sleep(0.002)
    return [codes[pid] for pid in pids]


def main() -> None:
    """Run the scenario named on the command line and write the report."""
    scenario = json.loads(Path(sys.argv[1]).read_text())
    report_path = Path(sys.argv[2])
    base = Path(scenario["config"]["out_dir"])
    world_size = int(scenario.get("world_size", 1))
    trainer_name = scenario.get("trainer", "TinyTrainer")
    lease_s = float(scenario["lease_s"])
    requeue = bool(scenario.get("requeue", False))
    if scenario["config"]["ckpt"].get("format") == "sharded":
        import torch.distributed.checkpoint  # noqa: F401 - once here, not in every forked attempt
    remote = scenario["config"]["ckpt"]["remote"]
    results: list[dict[str, Any]] = []
    counts: dict[str, int] | None = None
    for number, kills in enumerate(scenario["runs"]):
        assert kills or number > 0 or counts is None
        ckpt = {**scenario["config"]["ckpt"], "remote": f"{remote}/run{number}"}
        config = {**scenario["config"], "out_dir": str(base / f"run{number}"), "ckpt": ckpt}
        summary_path, log = base / f"run{number}.json", base / f"run{number}.events.jsonl"
        aimed = []
        for verb, fraction, where, *fresh in kills:
            assert counts is not None and verb in VERBS, (verb, counts)
            if isinstance(fraction, str):  # "#<n>": the n-th call itself
                n = int(fraction.removeprefix("#"))
            else:
                n = 1 + round(fraction * 2) if verb == "fetch" else max(1, round(fraction * counts.get(verb, 0)))
            aimed.append([verb, n, where, *fresh])
        codes, seconds, staged = [], [], []
        for attempt, kill in enumerate([*aimed, None]):
            started = time.monotonic()
            codes.append(fork_attempt(config, trainer_name, world_size, kill and kill[:3], summary_path, log))
            seconds.append(round(time.monotonic() - started, 2))
            staging = Path(config["out_dir"], ".remote-staging")
            # each rank's staging folder (rank-<r>/) holds one folder per staged upload
            staged.append(sorted(str(path.relative_to(staging)) for path in staging.glob("*/*")))
            if codes[-1][0] != -signal.SIGKILL:
                break  # not killed (the aimed call never came): the run is over
            fresh = kill is not None and kill[3:] == ["fresh"]
            if fresh:
                config = {**config, "out_dir": str(base / f"run{number}-{attempt + 1}")}
            if fresh or not requeue:
                time.sleep(lease_s * 1.2 + 0.05)  # the killed attempt's lease expires
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        if number == 0 and summary is not None:
            counts = summary["counts"]
        results.append(
            {
                "kills": aimed,
                "exit_codes": codes,
                "seconds": seconds,
                "staged": staged,
                "summary": summary,
                "out_dir": config["out_dir"],
                "remote": ckpt["remote"],
                "events": str(log),
            }
        )
    report_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
