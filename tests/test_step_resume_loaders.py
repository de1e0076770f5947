"""Step checkpoints over loaders that keep their own position (torchdata's StatefulDataLoader, a stream with
state_dict()) and runs measured in steps (max_steps, val.every_n_steps): a run SIGKILLed or stopped by SIGTERM
resumes inside the epoch, bit for bit. Split from tests/test_step_resume.py so that the two halves run on two
workers (``--dist loadfile`` keeps a file on one); the scenarios run in tests/faults/step_kills.py.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers.step_scenarios import assert_all_exact, run_scenario

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_a_stateful_dataloader_resumes_from_its_own_state_bit_identically(tmp_path, workers):
    """torchdata's StatefulDataLoader (shuffled with a registered generator): its state_dict() is the position, given
    back through load_state_dict() before the resumed epoch is iterated; kills inside windows, at an epoch's last batch,
    twice in a run, and a SIGTERM."""
    pytest.importorskip("torchdata.stateful_dataloader")
    runs = [[["batch", 0, 3]], [["batch", 1, 7]], [["batch", 0, 6], ["batch", 1, 2]], [["sigterm", 0, 4]]]
    reference, results, stderr = run_scenario(tmp_path, runs, loader="stateful", num_workers=workers)
    assert_all_exact(reference, results[:-1], stderr)
    assert_all_exact(reference, results[-1:], stderr, killed=143)


@pytest.mark.parametrize("loader", ["stream", "stateful iterable"])
def test_an_iterable_without_a_length_resumes_from_its_own_state_bit_identically(tmp_path, loader):
    """A stream of batches with state_dict()/load_state_dict() of its own, and a StatefulDataLoader over an
    IterableDataset (no state: torchdata reads it again up to the position, drawing its order from the iterator-time
    RNG states trainkit puts back): no length, no index-level skip, and exact."""
    if loader != "stream":
        pytest.importorskip("torchdata.stateful_dataloader")
    runs = [[["batch", 0, 3]], [["batch", 1, 4]], [["batch", 0, 1], ["batch", 1, 6]]]
    reference, results, stderr = run_scenario(tmp_path, runs, loader=loader)
    assert_all_exact(reference, results, stderr)
    assert "inside it: 2 batches done" in stderr  # the resume line of a position of unknown length


@pytest.mark.ddp
def test_two_gloo_ranks_each_resume_their_own_loader_state(tmp_path):
    """2 ranks, each with its own stream (its own order, drawn from its own RNG): each rank's share of the checkpoint
    holds its own state_dict(), and a stream given another rank's state raises, so an exact resume is per rank."""
    runs = [[["batch", 0, 3]], [["sigterm", 1, 2]]]
    reference, results, stderr = run_scenario(tmp_path, runs, world_size=2, loader="stream")
    assert_all_exact(reference, results[:1], stderr)
    assert_all_exact(reference, results[1:], stderr, killed=143)


STEP_BUDGET = {
    "epochs": None,
    "max_steps": 10,
    "val": {"every_n_steps": 3, "patience": 20},
    "log_every_n_steps": 2,
    "loader": "stateful",
}
"""A run measured in steps over torchdata's StatefulDataLoader: 10 steps (4 per epoch, so it ends inside epoch 2), a
validation every 3 steps, a row every 2 steps."""


def budget_points(seed, count):
    """``count`` kill points drawn with ``seed`` among every batch and validation of the STEP_BUDGET run."""
    points = [["batch", e, b] for e in range(2) for b in range(8)] + [["batch", 2, b] for b in range(4)]
    points += [["val", e, 0] for e in range(3)]
    return random.Random(seed).sample(points, count)


def test_sigkill_at_random_steps_of_a_run_with_step_validation_and_max_steps_resumes_exactly(tmp_path):
    """SIGKILLs at seeded-random batches and validations (one per run, then two in one run) of a run over a
    StatefulDataLoader with val.every_n_steps, log_every_n_steps and max_steps: every run ends with the uninterrupted
    run's weights, optimizer state and metrics.jsonl."""
    pytest.importorskip("torchdata.stateful_dataloader")
    points = budget_points(44, 6)
    runs = [[point] for point in points[:4]] + [sorted(points[4:], key=lambda p: (p[1], p[0] == "val", p[2]))]
    reference, results, stderr = run_scenario(tmp_path, runs, **STEP_BUDGET)
    assert reference["step"] == 10
    assert_all_exact(reference, results, stderr)


def test_sigterm_at_random_steps_of_a_run_with_step_validation_resumes_exactly(tmp_path):
    """SIGTERM at seeded-random batches of the same run: it stops at the next step boundary, saves, exits 143, and
    the rerun ends where the uninterrupted run does."""
    pytest.importorskip("torchdata.stateful_dataloader")
    runs = [[["sigterm", e, b]] for e, b in random.Random(45).sample([(0, 3), (1, 2), (1, 6), (2, 1)], 2)]
    reference, results, stderr = run_scenario(tmp_path, runs, **STEP_BUDGET)
    assert_all_exact(reference, results, stderr, killed=143)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "one-worker"])
def test_a_stateful_dataloader_over_a_stateless_stream_resumes_twice_inside_one_epoch_exactly(tmp_path, workers):
    """torchdata's StatefulDataLoader over an IterableDataset without state resumes by reading it again for as many
    batches as its state counts, and counts that re-reading again: without trainkit writing the batches its loop
    consumed into the saved state, a second resume inside the same epoch skips data. Killed twice and three times
    inside epoch 0 (each kill after a step checkpoint the previous resume wrote), every run ends with the
    uninterrupted run's weights."""
    pytest.importorskip("torchdata.stateful_dataloader")
    runs = [[["batch", 0, 2], ["batch", 0, 5]], [["batch", 0, 3], ["batch", 0, 5], ["batch", 0, 7]]]
    reference, results, stderr = run_scenario(tmp_path, runs, loader="stateful iterable", num_workers=workers)
    assert_all_exact(reference, results, stderr)


def test_a_stateful_dataloader_over_a_stateless_stream_resumes_twice_after_a_sigterm(tmp_path):
    """The same stream stopped by SIGTERM (saved at the next step boundary, exit 143) twice inside one epoch."""
    pytest.importorskip("torchdata.stateful_dataloader")
    runs = [[["sigterm", 0, 0], ["sigterm", 0, 4]]]
    reference, results, stderr = run_scenario(tmp_path, runs, loader="stateful iterable")
    assert_all_exact(reference, results, stderr, killed=143)
