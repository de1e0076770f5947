"""A step checkpoint written inside an epoch on some number of gloo ranks resumes on another number, exactly.

Every scenario runs in tests/faults/elastic_kills.py: real forked ranks, real SIGTERMs and SIGKILLs, real files. The
ElasticTrainer holds a global batch of 6 on every world size (a DistributedSampler everywhere, 6 // world_size
samples per rank), accumulates 2 batches per optimizer step and writes a sample ledger: the indices each rank served,
per optimizer step and attempt. A resumed run must serve each later step the same set of samples as the
uninterrupted run's step of that number, serve every sample of the epoch exactly once across the interruption, and
end with the same weights up to the order in which floats are summed.

Each test takes ~20 s on 2 shared cores: it runs every world-size pair the issue names (or every refusal) as real
ranks in one driver process (torch imported once), which is the cheapest way to see real SIGTERMs and SIGKILLs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from tests.faults.harness import run_driver
from tests.helpers.sampling import ATOL, RTOL
from tests.helpers.slow import SLOW
from tests.helpers.wandb_files import offline_runs
from trainkit.cli.inspect import describe_checkpoint

pytestmark = pytest.mark.timeout(600)

N_SAMPLES = 36  # 6 batches of the global batch per epoch, 3 optimizer steps
BASE = {
    "epochs": 2,
    "n_samples": N_SAMPLES,
    "wandb": {"mode": "disabled"},
    "progress": {"enable": False},
    "ckpt": {"every_n_steps": 1},
    "dist": {"backend": "gloo", "timeout_s": 30},
}
SHARDED = {"ckpt": {"every_n_steps": 1, "format": "sharded"}}
WANDB = {"wandb": {"mode": "offline"}}


def run_scenario(tmp_path: Path, runs: list[list[dict]]) -> tuple[list[dict], str]:
    """Run every run's attempts in order; return the report and the driver's stderr."""
    scenario = {"config": {**BASE, "out_dir": str(tmp_path / "out")}, "runs": runs}
    return run_driver("elastic_kills", scenario, tmp_path)


def ledger(out_dir: str) -> dict[tuple[int, int], list[int]]:
    """Every optimizer step's samples, ``(epoch, step) -> sorted indices over all ranks``; a step that a later
    attempt trained again (after a resume from an earlier checkpoint) counts from that attempt only."""
    served: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in Path(out_dir).glob("ledger-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            served[(row["epoch"], row["step"])][row["attempt"]] += row["indices"]
    return {key: sorted(by_attempt[max(by_attempt)]) for key, by_attempt in sorted(served.items())}


def journal(out_dir: str) -> list[tuple[int, int, list[str]]]:
    """metrics.jsonl as (step, epoch, keys) per row: the same rows at the same steps, whatever the world size (the
    values of a rank-0 metric such as train/batch_loss depend on which samples rank 0 held)."""
    rows = [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()]
    return [(row["trainer/step"], row["trainer/epoch"], sorted(row)) for row in rows]


def epoch_means(out_dir: str) -> dict[int, list[float]]:
    """Each epoch's per-rank mean loss (each rank's own RunningMean), by rank, from the last attempt that ended it."""
    rows = defaultdict(dict)
    for path in sorted(Path(out_dir).glob("means-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[(row["epoch"], row["attempt"])][rank] = row["mean"]
    last = {epoch: max(a for e, a in rows if e == epoch) for epoch, _ in rows}
    return {
        epoch: [rows[(epoch, attempt)][r] for r in sorted(rows[(epoch, attempt)])] for epoch, attempt in last.items()
    }


def final_weights(out_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(out_dir, "final.pt"), weights_only=True)


def test_a_run_interrupted_mid_epoch_resumes_on_other_world_sizes_with_the_same_steps(tmp_path):
    """2 -> 1 (SIGTERM), 2 -> 3 (SIGKILL), 2 -> 2 (SIGKILL) in single files (and 3 -> 2 (SIGTERM), 1 -> 2 (SIGKILL)
    under TRAINKIT_SLOW=1: a shrink and a growth the others cover), 2 -> 3 (SIGTERM), 2 -> 1 (SIGKILL) and
    1 -> 2 (SIGTERM) sharded, 2 -> 1 (SIGTERM) with an offline W&B run: each
    later step serves the uninterrupted run's samples, each sample once per epoch, metrics.jsonl continues with the
    same rows at the same steps (and the W&B run as the same run), and the final weights match. Each rank's own
    RunningMean of the loss (registered) comes back as its own on the same world size (every rank's epoch mean bit for
    bit the uninterrupted run's) and pooled on another, so the ranks' epoch means average to the uninterrupted run's."""
    runs = [
        [{"world": 2}],  # the uninterrupted reference
        [{"world": 2, "kill": ["sigterm", 0, 0]}, {"world": 1}],
        [{"world": 2, "kill": ["batch", 1, 2]}, {"world": 3}],
        [{"world": 2, "kill": ["sigterm", 1, 1], "config": SHARDED}, {"world": 3, "config": SHARDED}],
        [{"world": 2, "kill": ["batch", 1, 2], "config": SHARDED}, {"world": 1, "config": SHARDED}],
        [{"world": 1, "kill": ["sigterm", 0, 1], "config": SHARDED}, {"world": 2, "config": SHARDED}],
        [{"world": 2, "kill": ["batch", 0, 2]}, {"world": 2}],
    ]
    if SLOW:
        runs += [
            [{"world": 3, "kill": ["sigterm", 0, 0]}, {"world": 2}],
            [{"world": 1, "kill": ["batch", 0, 4]}, {"world": 2}],
        ]
    # last: the W&B checks below read the last run's folder
    runs.append([{"world": 2, "kill": ["sigterm", 1, 1], "config": WANDB}, {"world": 1, "config": WANDB}])
    report, stderr = run_scenario(tmp_path, runs)
    reference = report[0]
    assert reference["exit_codes"] == [[0, 0]], stderr[-3000:]
    expected = ledger(reference["out_dir"])
    assert len(expected) == 6  # 2 epochs of 3 optimizer steps
    for epoch in (0, 1):  # the reference itself: each sample once per epoch
        served = [i for (e, _), indices in expected.items() if e == epoch for i in indices]
        assert Counter(served) == Counter(range(N_SAMPLES))
    reference_weights = final_weights(reference["out_dir"])
    reference_means = epoch_means(reference["out_dir"])
    assert reference_means[0][0] != reference_means[0][1]  # each rank's own mean: the ranks' states differ
    for run, result in zip(runs[1:], report[1:], strict=True):
        first, last = result["exit_codes"]
        interrupted = run[0]["kill"][0]
        assert first == ([-9] * run[0]["world"] if interrupted == "batch" else first), (run, result, stderr[-3000:])
        assert first != [0] * run[0]["world"], (run, result)  # the interruption landed
        assert last == [0] * run[1]["world"], (run, result, stderr[-3000:])
        assert ledger(result["out_dir"]) == expected, f"{run}: a step served other samples than the uninterrupted run's"
        assert journal(result["out_dir"]) == journal(reference["out_dir"]), f"{run}: metrics.jsonl rows differ"
        means = epoch_means(result["out_dir"])
        assert sorted(means) == [0, 1], run
        for epoch, expected_means in reference_means.items():
            if run[0]["world"] == run[1]["world"]:
                assert means[epoch] == expected_means, f"{run}: epoch {epoch}'s per-rank means"
            else:
                average = sum(means[epoch]) / len(means[epoch])
                assert average == pytest.approx(sum(expected_means) / 2, rel=RTOL), f"{run}: epoch {epoch}"
        weights = final_weights(result["out_dir"])
        for name, value in reference_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=RTOL, atol=ATOL, msg=f"{run}: {name}")
    assert "dealt anew over" in stderr  # the resume said it resharded
    # the W&B run continues as the same run on the new world size: one id, every row of metrics.jsonl once, at its
    # step, and W&B's step never goes back from the first folder to the second
    out_dir = Path(report[-1]["out_dir"])
    run_id = torch.load(out_dir / "last.pt", weights_only=True)["wandb_run_id"]
    parts = offline_runs(out_dir)
    assert [part.run_id for part in parts] == [run_id, run_id] and parts[-1].exit_code == 0
    steps = [row["_step"] for part in parts for row in part.history]
    rows = Path(out_dir, "metrics.jsonl").read_text().splitlines()
    assert steps == list(range(len(rows))), steps


def test_world_size_changes_that_cannot_continue_the_order_are_refused_before_anything_is_written(tmp_path):
    """A global batch the new world size does not divide (2 -> 4), a per-rank batch changed otherwise (2 -> 1 with 3
    samples per rank), an order that depends on the world size (a plain shuffle on 1 -> 2), a registered item whose
    state differs between the ranks and is no running mean (2 -> 1): each refused, naming what changed and what would
    work, with the checkpoint and metrics.jsonl left as they were; ``inspect`` says which world sizes each checkpoint
    resumes on. The same item resumes on the world size that wrote it, as before."""
    plain = {"distributed_sampler": False}
    tally = {"rank_item": True}
    written, stderr = run_scenario(
        tmp_path,
        [
            [{"world": 2, "kill": ["sigterm", 0, 0]}],
            [{"world": 2, "kill": ["sigterm", 0, 0]}],
            [{"world": 1, "kill": ["sigterm", 0, 0], "config": plain}],
            [{"world": 2, "kill": ["sigterm", 0, 0], "config": tally}],
            [{"world": 2, "kill": ["sigterm", 0, 0], "config": tally}],
        ],
    )
    assert all(code not in ([0], [0, 0]) for result in written for code in result["exit_codes"]), stderr[-3000:]
    kept = {result["out_dir"]: snapshot(result["out_dir"]) for result in written}
    described = [describe_checkpoint(Path(result["out_dir"], "last.pt")) for result in written]
    assert (
        "global order: 24 samples consumed, a global batch of 6, DistributedSampler(shuffle=True, seed=0, "
        "drop_last=False)" in described[0]
    )
    assert (
        "resumes on:   1 rank (batch_size=6), 2 ranks (batch_size=3), 3 ranks (batch_size=2), 6 ranks "
        "(batch_size=1)" in described[0]
    )
    assert any(line.startswith("resumes on:   1 rank (batch_size=6) only") for line in described[2])
    pooled = "a running mean per rank (each rank's own on 2 ranks, pooled on another world size)"
    assert f"per rank:     loss_mean: {pooled}" in described[0]
    assert "resumes on:   2 ranks (batch_size=3) only (registered items differ between its ranks)" in described[3]
    assert "per rank:     tally: differs between ranks (resumes on 2 ranks only)" in described[3]
    report, stderr = run_scenario(
        tmp_path,
        [
            [{"world": 4}],
            [{"world": 1, "config": {"batch_size": 3}}],
            [{"world": 2, "config": plain}],
            [{"world": 1, "config": tally}],
            [{"world": 2, "config": tally}],
        ],
    )
    resumed = report.pop()
    assert resumed["exit_codes"] == [[0, 0]], stderr[-3000:]
    assert [result["exit_codes"] for result in report] == [[[1] * 4], [[1]], [[1] * 2], [[1]]], stderr[-3000:]
    assert (
        "checkpoint item 'tally' held a different state on each of the 2 ranks that wrote it, which does not map onto "
        "1 rank (only a trainkit.RunningMean pools); resume on 2 ranks, or make the item's state the same on every "
        "rank" in stderr
    )
    assert (
        "the global batch of 6 samples (3 per rank on 2 ranks) cannot be split over 4 ranks; it resumes on "
        "1, 2, 3 or 6 ranks (a per-rank batch of 6, 3, 2 or 1)" in stderr
    )
    assert (
        "the per-rank batch_size is 3 on 1 ranks, a global batch of 3; the checkpoint's is 6 (3 per rank on 2 "
        "ranks): set batch_size=6 (global_batch // world_size) to resume it on 1 ranks" in stderr
    )
    assert "its epoch was ordered by a RandomSampler, whose order depends on the world size" in stderr
    assert "DistributedSampler(dataset, shuffle=..., seed=...) on every world size, 1 included" in stderr
    for result in report:
        assert snapshot(result["out_dir"]) == kept[result["out_dir"]], f"{result['out_dir']} changed"


def snapshot(out_dir: str) -> dict[str, bytes]:
    """The bytes of what a refused resume must not change: the checkpoint and the journal."""
    folder = Path(out_dir)
    files = [folder / "last.pt", folder / "last.prev.pt", folder / "metrics.jsonl"]
    return {path.name: path.read_bytes() for path in files if path.exists()}
