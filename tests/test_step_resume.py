"""Step checkpoints (ckpt.every_n_steps): a run SIGKILLed at any step resumes inside the epoch, bit for bit.

Every scenario runs in tests/faults/step_kills.py: real processes (forked), real SIGKILLs, real files. The
StepTrainer accumulates gradients over 2 batches, uses dropout (global RNG), per-sample noise from
trainkit.sample_generator, a RunningMean epoch loss and log pushes in the middle of epochs; each run's final
weights, optimizer state and metrics.jsonl must equal the uninterrupted run's. Loaders that keep their own position
and runs measured in steps: tests/test_step_resume_loaders.py (a second file, so ``--dist loadfile`` runs the two
on two workers).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers.slow import SLOW
from tests.helpers.step_scenarios import assert_all_exact, run_scenario

pytestmark = pytest.mark.timeout(600)



def kill_points(epochs, batches):
    """A kill after every batch of every epoch (inside and at the end of accumulation windows, the last batch)
    and after every validation; under ``TRAINKIT_SLOW=1`` only. By default one point of each kind: inside a
    window and at its end in the first epoch, an epoch's last batch, inside a window of the last epoch, the run's
    last batch, the first and the last validation."""
    if not SLOW:
        last = epochs - 1
        points = [(0, 0), (0, 1), (0, batches - 1), (last, 2), (last, batches - 1)]
        return [[["batch", e, b]] for e, b in points] + [[["val", 0, 0]], [["val", last, 0]]]
    points = [[["batch", e, b]] for e in range(epochs) for b in range(batches)]
    return points + [[["val", e, 0]] for e in range(epochs)]


def test_a_kill_after_any_batch_resumes_bit_identically(tmp_path):
    """One process, no workers: 30 samples in batches of 4 (8 per epoch, the last short), windows of 2; each kind
    of kill point (every one under TRAINKIT_SLOW=1), and two kills in one epoch."""
    runs = kill_points(2, 8) + [[["batch", 0, 1], ["batch", 0, 4]], [["batch", 1, 2], ["batch", 1, 6]]]
    reference, results, stderr = run_scenario(tmp_path, runs)
    assert reference["step"] == 8  # 4 steps per epoch: windows of 2 over 8 batches
    assert_all_exact(reference, results, stderr)
    # a kill inside a window resumes from the step boundary before it: the run said where it resumed
    assert "resuming" in stderr


@pytest.mark.parametrize(
    ("workers", "persistent", "loader_generator"),
    [(2, False, False), (2, True, True), (0, False, True)],
    ids=["workers", "persistent-workers-own-generator", "own-generator"],
)
def test_workers_and_loader_generators_resume_bit_identically(tmp_path, workers, persistent, loader_generator):
    """Sample order and per-sample noise are exact with worker processes, persistent or not, and own generators."""
    runs = [[["batch", 0, 2]], [["batch", 0, 5]], [["batch", 0, 7]], [["batch", 1, 0]], [["val", 0, 0]],
            [["batch", 0, 1], ["batch", 0, 4]]]
    reference, results, stderr = run_scenario(
        tmp_path, runs, num_workers=workers, persistent_workers=persistent, loader_generator=loader_generator
    )
    assert_all_exact(reference, results, stderr)


def test_a_sampler_that_shuffles_with_python_random_resumes_bit_identically(tmp_path):
    """A sampler of the user's own may draw from Python's generator when its iterator is made: trainkit keeps
    every generator's state at that moment for it (for torch's own samplers it keeps torch's alone)."""
    runs = [[["batch", 0, 3]], [["batch", 1, 2]], [["batch", 1, 5], ["batch", 1, 6]]]
    reference, results, stderr = run_scenario(tmp_path, runs, python_sampler=True)
    assert_all_exact(reference, results, stderr)


@pytest.mark.ddp
def test_two_gloo_ranks_with_a_distributed_sampler_resume_bit_identically(tmp_path):
    """2 ranks, a DistributedSampler (4 batches per rank per epoch): each kind of kill point (every one under
    TRAINKIT_SLOW=1), and two in one epoch."""
    runs = kill_points(2, 4) + [[["batch", 0, 0], ["batch", 0, 2]]]
    reference, results, stderr = run_scenario(tmp_path, runs, world_size=2, distributed_sampler=True)
    assert_all_exact(reference, results, stderr)


def test_background_saves_and_sparser_step_checkpoints_resume_bit_identically(tmp_path):
    """ckpt.async_save, every_n_steps=3: a kill resumes from the last step checkpoint written, up to 2 steps back."""
    runs = [[["batch", 0, 3]], [["batch", 0, 6]], [["batch", 1, 1]], [["batch", 1, 5]]]
    reference, results, stderr = run_scenario(tmp_path, runs, ckpt={"every_n_steps": 3, "async_save": True})
    assert_all_exact(reference, results, stderr)


def test_sigterm_stops_at_the_next_step_boundary_and_resumes_exactly(tmp_path):
    """SIGTERM after batch 2 (inside a window): the run finishes that window's step, saves, exits 143."""
    reference, results, stderr = run_scenario(tmp_path, [[["sigterm", 0, 2]]])
    assert_all_exact(reference, results, stderr, killed=143)
    stopped = json.loads((tmp_path / "out" / "run1.json.stopped0").read_text())
    assert stopped["step"] == 2  # batches 2 and 3 make step 2: stopped at the first boundary after the signal
    assert "stopped after step 2, batch 4 of 8 of epoch 0" in stopped["message"]


@pytest.mark.ddp
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_boundary(tmp_path):
    """Only rank 0 gets SIGTERM; the vote tells rank 1 a step later; both save once, exit 143, resume exactly."""
    reference, results, stderr = run_scenario(tmp_path, [[["sigterm", 0, 0]]], world_size=2,
                                              distributed_sampler=True)
    assert_all_exact(reference, results, stderr, killed=143)
    steps = [json.loads((tmp_path / "out" / f"run1.json.stopped{rank}").read_text())["step"] for rank in (0, 1)]
    # the signal lands in step 1; the vote cast at its boundary is read at the next one
    assert steps == [2, 2]


KEEP = "latest:2,best:1,every_epochs:2"
"""Rules that keep, delete and rank at every save: the two newest, the best validation, every second epoch's end."""


@pytest.mark.parametrize(
    ("fmt", "world_size", "trials"),
    [
        ("file", 1, 24 if SLOW else 5),
        pytest.param("sharded", 2, 16 if SLOW else 2, marks=pytest.mark.ddp),
    ],
)
def test_sigkill_fuzz_with_retention_keeps_the_uninterrupted_kept_set(tmp_path, fmt, world_size, trials):
    """SIGKILL just before or just after a random one of the file operations that save and keep checkpoints
    (publishing last and best, writing index.json, linking a kept checkpoint, deleting one, removing a kept
    directory's trash), once or twice a run, with ckpt.keep on: every run ends with the uninterrupted run's kept
    set, the same descriptions (epoch, epoch end, scores), no leftover name in checkpoints/, and bit-identical
    training. Sharded: 2 gloo ranks, both killed with rank 0."""
    rng = random.Random(4300 + world_size + trials)
    runs = [
        [["op", rng.uniform(0.0, 1.0), rng.choice(["before", "after"])] for _ in range(rng.choice([1, 1, 2]))]
        for _ in range(trials)
    ]
    config = {"epochs": 3, "ckpt": {"every_n_steps": 1, "keep": KEEP, "format": fmt}}
    if world_size > 1:
        config.update(distributed_sampler=True, dist={"backend": "gloo", "timeout_s": 30})
    reference, results, stderr = run_scenario(tmp_path, runs, world_size=world_size, op_counts=True, **config)
    kept = reference["kept"]
    assert len(kept["described"]) >= 3 and kept["names"][0] == "index.json", kept
    assert all(name == "index.json" or name.startswith("step-") for name in kept["names"]), kept
    landed = 0
    for result in results:
        codes = result["exit_codes"]
        assert codes[0] == [-9] * world_size, (result["kills"], codes, stderr[-3000:])  # the first kill always lands
        assert all(code in ([-9] * world_size, [0] * world_size) for code in codes[1:-1]), (result, stderr[-3000:])
        assert codes[-1] == [0] * world_size, (result["kills"], codes, stderr[-3000:])
        landed += sum(code == [-9] * world_size for code in codes)
        summary = result["summary"]
        assert summary["kept"] == kept, f"kept set differs after kills at {result['kills']} of {result['ops']} ops"
        for key in ("model", "optimizer", "metrics_text", "step"):
            assert summary[key] == reference[key], f"{key} differs after kills at {result['kills']}"
    print(f"retention fuzz ({fmt}, {world_size} rank(s)): {trials} runs, {landed} kills over {results[0]['ops']} ops")
