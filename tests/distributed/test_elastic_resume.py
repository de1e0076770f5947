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
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from tests.faults.harness import ROOT, child_env
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
RTOL, ATOL = 1e-5, 1e-6
"""What docs/checkpoints.rst states for float32 on this model: measured, the largest difference after a world-size
change was 1.2e-7 absolute (one unit in the last place at the weights' scale of ~1), the float summation order."""


def run_scenario(tmp_path: Path, runs: list[list[dict]]) -> tuple[list[dict], str]:
    """Run every run's attempts in order; return the report and the driver's stderr."""
    scenario = {"config": {**BASE, "out_dir": str(tmp_path / "out")}, "runs": runs}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.elastic_kills", str(path), str(report)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(report.read_text()), proc.stderr


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


def final_weights(out_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(out_dir, "final.pt"), weights_only=True)


def test_a_run_interrupted_mid_epoch_resumes_on_other_world_sizes_with_the_same_steps(tmp_path):
    """2 -> 1 (SIGTERM), 2 -> 3 (SIGKILL), 3 -> 2 (SIGTERM), 1 -> 2 (SIGKILL) in single files, 2 -> 3 (SIGTERM) sharded:
    each later step serves the uninterrupted run's samples, each sample once per epoch, metrics.jsonl continues with
    the same rows at the same steps, and the final weights match."""
    runs = [
        [{"world": 2}],  # the uninterrupted reference
        [{"world": 2, "kill": ["sigterm", 0, 0]}, {"world": 1}],
        [{"world": 2, "kill": ["batch", 1, 2]}, {"world": 3}],
        [{"world": 3, "kill": ["sigterm", 0, 0]}, {"world": 2}],
        [{"world": 1, "kill": ["batch", 0, 4]}, {"world": 2}],
        [{"world": 2, "kill": ["sigterm", 1, 1], "config": SHARDED}, {"world": 3, "config": SHARDED}],
    ]
    report, stderr = run_scenario(tmp_path, runs)
    reference = report[0]
    assert reference["exit_codes"] == [[0, 0]], stderr[-3000:]
    expected = ledger(reference["out_dir"])
    assert len(expected) == 6  # 2 epochs of 3 optimizer steps
    for epoch in (0, 1):  # the reference itself: each sample once per epoch
        served = [i for (e, _), indices in expected.items() if e == epoch for i in indices]
        assert Counter(served) == Counter(range(N_SAMPLES))
    reference_weights = final_weights(reference["out_dir"])
    for run, result in zip(runs[1:], report[1:], strict=True):
        first, last = result["exit_codes"]
        interrupted = run[0]["kill"][0]
        assert first == ([-9] * run[0]["world"] if interrupted == "batch" else first), (run, result, stderr[-3000:])
        assert first != [0] * run[0]["world"], (run, result)  # the interruption landed
        assert last == [0] * run[1]["world"], (run, result, stderr[-3000:])
        assert ledger(result["out_dir"]) == expected, f"{run}: a step served other samples than the uninterrupted run's"
        assert journal(result["out_dir"]) == journal(reference["out_dir"]), f"{run}: metrics.jsonl rows differ"
        weights = final_weights(result["out_dir"])
        for name, value in reference_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=RTOL, atol=ATOL, msg=f"{run}: {name}")
    assert "dealt anew over" in stderr  # the resume said it resharded


def test_world_size_changes_that_cannot_continue_the_order_are_refused_before_anything_is_written(tmp_path):
    """A global batch the new world size does not divide (2 -> 4), a per-rank batch changed otherwise (2 -> 1 with 3
    samples per rank), an order that depends on the world size (a plain shuffle on 1 -> 2): each refused, naming what
    changed and what would work, with the checkpoint and metrics.jsonl left as they were; ``inspect`` says which
    world sizes each checkpoint resumes on."""
    plain = {"distributed_sampler": False}
    written, stderr = run_scenario(
        tmp_path,
        [
            [{"world": 2, "kill": ["sigterm", 0, 0]}],
            [{"world": 2, "kill": ["sigterm", 0, 0]}],
            [{"world": 1, "kill": ["sigterm", 0, 0], "config": plain}],
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
    report, stderr = run_scenario(
        tmp_path,
        [[{"world": 4}], [{"world": 1, "config": {"batch_size": 3}}], [{"world": 2, "config": plain}]],
    )
    assert [result["exit_codes"] for result in report] == [[[1] * 4], [[1]], [[1] * 2]], stderr[-3000:]
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
