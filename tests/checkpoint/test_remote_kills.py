"""Kill fuzz on the remote tier with retention: SIGKILL at random calls of the store (an object of an upload, a
commit record, the lease's create, renewal or release, a deletion), both checkpoint formats, against the local S3
server and ``file://``. The driver is :mod:`tests.faults.remote_kills`.

What every killed sequence must end with, once its last attempt completed:

(a) the final weights and optimizer state bit for bit the uninterrupted run's;
(b) the committed steps on the remote exactly ``keep_reasons(ckpt.keep, U, newest=final step)``, where ``U`` is
    every step committed at some moment of the sequence (the driver logs each commit record as it is written, so
    ``U`` includes those retention deleted later). Retention after each commit is applied to what is committed then;
    for ``latest:N``/``best:N`` that is the same as applying it once to ``U`` (a checkpoint dropped once never
    re-enters: later ones are only newer or better). The driver makes a hand-over wait for an idle uploader, so no
    upload is superseded while queued and the uninterrupted run commits every save (``U`` = the save schedule
    ``S``). A kill loses at most the upload in flight (the step resumed from is not uploaded again), so
    ``S - U`` holds at most one step per kill, and the committed set is the uninterrupted run's when that step
    is not one the policy keeps at the end; :func:`test_the_remote_ends_with_the_uninterrupted_runs_committed_set`
    checks the strict form;
(c) every committed folder downloads and verifies against its commit record (sizes, CRC-32);
(d) no ``.remote-staging`` or ``.remote-fetch-*`` left in ``out_dir``;
(e) no uncommitted folder and no lease left on the remote.

``TRAINKIT_SLOW=1`` runs many more rounds; ``TRAINKIT_FUZZ_SEED=<n>`` replays a failing round's plan (the seed is
in every failure's message).
"""

from __future__ import annotations

import json
import os
import random
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import run_driver
from tests.helpers.configs import make_cfg
from tests.helpers.slow import SLOW
from trainkit import bookkeeping as core
from trainkit.checkpoint.remote import FETCH_PREFIX, STAGING_DIR, RemoteTier, open_store

pytest.importorskip("fsspec")

LEASE_S = 0.5
"""The lease of every run: renewed every ~0.17 s (many renewals to kill), expired soon after a kill."""
KEEP = "latest:2,best:1"
VERBS = ("put", "commit", "lease", "delete", "fetch")
FORMATS = {
    # 4 epochs of 6 steps, a save every 2 steps (12 saves); the best score at the end of epoch 1 (step 12)
    "file": {
        "trainer": "TinyTrainer",
        "config": {"epochs": 4, "scripted_scores": [0.5, 0.2, 0.3, 0.4]},
    },
    # 1 process (2 gloo ranks take ~3 s per attempt): the sharded save, its report and rank 0's commit record
    "sharded": {
        "trainer": "ShardTrainer",
        "config": {"epochs": 3, "wrap": "ddp", "report": False, "ckpt": {"format": "sharded"}},
    },
}


def plan(rng: random.Random, rounds: int) -> list[list[list[Any]]]:
    """The uninterrupted reference, then ``rounds`` runs of 1 to 3 kills each at random calls of random verbs; a
    quarter of the kills move the next attempt to an empty out_dir (``"fresh"``: it resumes from the remote), and
    only such an attempt is killed while it fetches."""
    runs: list[list[list[Any]]] = [[]]
    for _ in range(rounds):
        kills: list[list[Any]] = []
        for index in range(rng.randint(1, 3)):
            verbs = VERBS if kills and kills[-1][3:] == ["fresh"] else VERBS[:-1]  # "fetch" is last
            # a later attempt resumes and makes fewer calls: aim at the earlier ones
            fraction = rng.uniform(0.0, 1.0 if index == 0 else 0.5)
            kill = [rng.choice(verbs), round(fraction, 3), rng.choice(["before", "after"])]
            kills.append([*kill, "fresh"] if rng.random() < 0.25 else kill)
        runs.append(kills)
    return runs


def fuzz(tmp_path: Path, url: str, fmt: str, rounds: int, seed: int) -> list[dict[str, Any]]:
    """Run the driver: the reference, then ``rounds`` killed sequences planned from ``seed``; its report."""
    return fuzz_plan(tmp_path, url, fmt, plan(random.Random(seed), rounds), f"seed {seed}")


def fuzz_plan(
    tmp_path: Path,
    url: str,
    fmt: str,
    runs: list[list[list[Any]]],
    seed: str = "",
    *,
    lease_s: float = LEASE_S,
    requeue: bool = False,
) -> list[dict[str, Any]]:
    """Run the driver on these runs (the first the uninterrupted reference); its report. ``requeue``: an attempt
    after a kill on the same folder starts at once, not once the killed one's lease (``lease_s``) expired."""
    spec = FORMATS[fmt]
    ckpt = {"remote": url, "remote_lease_s": lease_s, "remote_wait_s": 30, "keep": KEEP, "every_n_steps": 2}
    config = make_cfg(tmp_path / "runs", spec["config"], ckpt=ckpt)
    scenario = {
        "config": config,
        "trainer": spec["trainer"],
        "world_size": 1,
        "lease_s": lease_s,
        "requeue": requeue,
        "runs": runs,
    }
    report, _ = run_driver("remote_kills", scenario, tmp_path, timeout=240 + 60 * len(runs), label=f"{seed}: ")
    return report


def tier(url: str, out_dir: Path) -> RemoteTier:
    """A tier that only reads the prefix (no lease taken)."""
    fs, root = open_store(url)
    out_dir.mkdir(parents=True, exist_ok=True)
    return RemoteTier(url, fs, root, out_dir=out_dir, lease_s=LEASE_S, wait_s=1.0)


def events(run: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(run["events"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ever_committed(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every step whose commit record was written in the run (even if retention deleted it later): its record."""
    return {e["manifest"]["step"]: e["manifest"] for e in events(run) if e["event"] == "done"}


def kept_steps(records: dict[int, dict[str, Any]], newest: int) -> set[int]:
    """The steps ``ckpt.keep`` keeps of these committed ones, as retention on the remote decides it."""
    described = [
        core.Checkpoint(
            step=step,
            epoch=record["epoch"],
            epoch_end=record["description"]["epoch_end"],
            time=record["description"]["time"],
            scores=record["description"]["scores"],
        )
        for step, record in records.items()
    ]
    reasons = core.keep_reasons(core.parse_keep(KEEP, minimize=True), described, newest=newest)
    return {step for step, why in reasons.items() if why}


def check_run(run: dict[str, Any], reference: dict[str, Any], scratch: Path, where: str) -> set[tuple[int, bool]]:
    """Checks (a) to (e) of the module's docstring on one completed run; returns its committed checkpoints as
    ``(step, written at an epoch's end)``: a step saved inside an epoch and again at its end is two checkpoints."""
    assert run["exit_codes"][-1] == [0], f"{where}: the last attempt did not complete: {run['exit_codes']}"
    summary, ref = run["summary"], reference["summary"]
    assert summary is not None, f"{where}: no summary"
    assert (summary["model"], summary["optimizer"], summary["step"]) == (ref["model"], ref["optimizer"], ref["step"]), (
        f"{where}: the final weights differ from the uninterrupted run's"
    )  # (a)

    reader = tier(run["remote"], scratch)
    committed = reader.committed()
    steps = [manifest.step for _, manifest in committed]
    assert len(steps) == len(set(steps)), f"{where}: a step committed twice on the remote: {steps}"
    expected = kept_steps(ever_committed(run), newest=summary["step"])
    assert set(steps) == expected, (
        f"{where}: committed {sorted(steps)}, retention over what was committed keeps "
        f"{sorted(expected)} (ever committed: {sorted(ever_committed(run))})"
    )  # (b)
    for name, manifest in committed:  # (c)
        verified = reader.download(name, manifest)
        assert sorted(p.name for p in verified.rglob("*") if p.is_file()), f"{where}: {name} is empty"
    assert reader.uncommitted() == [], f"{where}: uncommitted folders left: {reader.uncommitted()}"  # (e)
    assert reader.lease() is None, f"{where}: a lease is left on the prefix"
    out_dir = Path(run["out_dir"])  # (d)
    staged = out_dir / STAGING_DIR
    left = [p.name for p in out_dir.glob(f"{FETCH_PREFIX}*")] + (os.listdir(staged) if staged.exists() else [])
    assert not left, f"{where}: leftovers in out_dir: {left}"
    return {(manifest.step, manifest.description["epoch_end"]) for _, manifest in committed}


def remote_url(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if store == "s3":
        request.getfixturevalue("s3_endpoint")  # the driver and its attempts inherit the endpoint's variables
        return f"s3://trainkit-{secrets.token_hex(4)}/fuzz"
    return f"file://{tmp_path}/remote"


def seed_and_rounds(default: int, slow: int) -> tuple[int, int]:
    seed = int(os.environ.get("TRAINKIT_FUZZ_SEED") or random.SystemRandom().randrange(10**9))
    return seed, slow if SLOW else default


@pytest.mark.parametrize(("fmt", "store"), [("file", "s3"), ("sharded", "file")])
def test_kills_at_random_store_calls_end_like_the_uninterrupted_run(fmt, store, tmp_path, request):
    """A few sequences of 1-3 SIGKILLs at random calls of the store, each resumed to its end on the same folder
    and prefix: checks (a)-(e) of the module's docstring on each. ~15 s."""
    url = remote_url(store, tmp_path, request)
    seed, rounds = seed_and_rounds(1, 30)
    report = fuzz(tmp_path, url, fmt, rounds, seed)
    reference = report[0]
    schedule = ever_committed(reference)
    assert len(schedule) >= 8, f"the reference committed only {sorted(schedule)}"
    reference_steps = {step for step, _ in check_run(reference, reference, tmp_path / "scratch0", f"seed {seed}")}
    assert reference_steps == kept_steps(schedule, reference["summary"]["step"])
    for number, run in enumerate(report[1:], start=1):
        check_run(run, reference, tmp_path / f"scratch{number}", f"seed {seed}, run {number}, kills {run['kills']}")


def test_a_killed_runs_staged_files_are_gone_once_the_next_run_is_under_way(tmp_path):
    """Two SIGKILLs in a row during uploads (before an object's put): what the first attempt left staged is gone
    when the second is killed (a run clears the staging folder when it starts), and the third ends cleanly."""
    kills = [["put", 0.5, "before"], ["put", 0.1, "before"]]
    report = fuzz_plan(tmp_path, f"file://{tmp_path}/remote", "file", [[], kills])
    run = report[1]
    assert [codes[0] for codes in run["exit_codes"]] == [-9, -9, 0], run["exit_codes"]
    first, second = run["staged"][:2]
    assert first, "the first kill left nothing staged: the test does not test anything"
    assert not set(first) & set(second), f"the second attempt kept the first one's staged {first}"
    check_run(run, report[0], tmp_path / "scratch", "after two kills")


def test_the_remote_ends_with_the_uninterrupted_runs_committed_set(tmp_path):
    """SIGKILL just before the last commit record (the finished run's final checkpoint; step 24 was committed once
    already, as saved inside the epoch): the rerun of the command must leave the remote with the uninterrupted
    run's committed set, the final checkpoint among it."""
    report = fuzz_plan(tmp_path, f"file://{tmp_path}/remote", "file", [[], [["commit", 1.0, "before"]]])
    reference, run = report
    assert [codes[0] for codes in run["exit_codes"]] == [-9, 0], run["exit_codes"]
    expected = check_run(reference, reference, tmp_path / "scratch0", "reference")
    assert check_run(run, reference, tmp_path / "scratch1", "killed at the last commit") == expected


# The reference run of FORMATS["file"] commits 16 times: the 8th is step 12 at the end of epoch 1 (the best score,
# which best:1 keeps to the end), the 16th the final checkpoint (step 24 at the end of the last epoch).
BEST_COMMIT, FINAL_COMMIT = "#8", "#16"


def test_a_best_checkpoint_whose_commit_a_kill_cut_is_uploaded_by_the_next_run(tmp_path):
    """SIGKILL just before the commit record of the best checkpoint (mid-run; the run had gone on meanwhile): the
    rerun resumes from a later local checkpoint, and still the remote ends with the uninterrupted run's set, the best
    among it (the rerun uploads its kept copy)."""
    report = fuzz_plan(tmp_path, f"file://{tmp_path}/remote", "file", [[], [["commit", BEST_COMMIT, "before"]]])
    reference, run = report
    assert [codes[0] for codes in run["exit_codes"]] == [-9, 0], run["exit_codes"]
    expected = check_run(reference, reference, tmp_path / "scratch0", "reference")
    assert (12, True) in expected, f"the policy no longer keeps the best step 12: {sorted(expected)}"
    assert check_run(run, reference, tmp_path / "scratch1", "killed at the best's commit") == expected


def test_a_finished_runs_rerun_after_a_kill_before_its_retention_leaves_one_copy_per_step(tmp_path):
    """SIGKILL right after the final commit record, before its retention (the step saved inside the last epoch and
    again at its end, both committed): the finished run's rerun runs retention, which keeps the final copy."""
    report = fuzz_plan(tmp_path, f"file://{tmp_path}/remote", "file", [[], [["commit", FINAL_COMMIT, "after"]]])
    reference, run = report
    assert [codes[0] for codes in run["exit_codes"]] == [-9, 0], run["exit_codes"]
    expected = check_run(reference, reference, tmp_path / "scratch0", "reference")
    assert check_run(run, reference, tmp_path / "scratch1", "killed after the final commit") == expected


REQUEUES = {
    # on S3 the lease is written through the store (counted): a kill just after the lease's creation, before the
    # run's first commit; on file:// it is written with the operating system's calls (not counted)
    "s3": [[["lease", "#1", "after"]], [["put", 0.5, "before"], ["commit", 0.3, "after"]], [["delete", 0.5, "before"]]],
    "file": [[["put", 0.2, "after"]], [["commit", 0.5, "before"], ["put", 0.3, "before"]], [["delete", 0.5, "after"]]],
}


@pytest.mark.parametrize(("fmt", "store"), [("file", "s3"), ("sharded", "file")])
def test_a_requeue_at_once_after_each_kill_takes_the_killed_runs_lease_over(fmt, store, tmp_path, request):
    """The default lease of 60 s, and every attempt after a SIGKILL (at calls of the store: the lease's creation, an
    upload, a commit record, a deletion) started at once on the same folder and prefix, as a scheduler's requeue:
    each takes the killed attempt's lease over, and every run ends as the uninterrupted one, checks (a)-(e) of the
    module's docstring (a refused attempt would end the run with exit status 1). ~20 s, far under one lease."""
    url = remote_url(store, tmp_path, request)
    report = fuzz_plan(tmp_path, url, fmt, [[], *REQUEUES[store]], f"requeue on {store}", lease_s=60.0, requeue=True)
    reference = report[0]
    check_run(reference, reference, tmp_path / "scratch0", "reference")
    for number, run in enumerate(report[1:], start=1):
        codes = [codes[0] for codes in run["exit_codes"]]
        assert codes[:-1] == [-9] * (len(codes) - 1) and len(codes) > 1, f"run {number}: not killed: {codes}"
        check_run(run, reference, tmp_path / f"scratch{number}", f"requeue run {number}, kills {run['kills']}")
