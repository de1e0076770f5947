"""``certify`` on stream trainers (issue 56, item 1): torchdata's ``StatefulDataLoader`` over an ``IterableDataset``
with its own ``torch.Generator``, 16 steps a pass, run by certify's own default budget.

Real trainers (:mod:`tests.helpers.certify_trainers`) in real child processes: a clean one PASSes with no false
"not registered" note for the generator its loader's state covers; a planted counter and a planted lost generator
are each named as the cause, not the generator the loader covers; a budget too small to cover an epoch end and a
validation before each interruption is refused in one line.
"""

from __future__ import annotations

import pytest

import trainkit
from trainkit.certification import covering_steps, minimum_steps
from trainkit.cli import main
from trainkit.cli.certify import certify
from trainkit.errors import ConfigError

pytest.importorskip("torchdata")

HELPERS = "tests.helpers.certify_trainers"
STREAM_WORDS = ["max_steps=1000"]  # the user's budget: certify runs its own default


@pytest.fixture(scope="module", autouse=True)
def server():
    """One fork server (torch, torchdata and trainkit loaded once) for every certify of this file."""
    with trainkit.fork_server(preload=["trainkit.certification.child", "torchdata.stateful_dataloader"]):
        yield


def _covered(report) -> None:
    """Each interruption came after a step checkpoint, a validation and an epoch end, and the report says so."""
    assert len(report.crossed) == len(report.interruptions) == 2, report.lines()
    for line in report.crossed:
        assert "step checkpoints after steps" in line and "no " not in line, report.lines()
        assert "validation after step" in line and "epoch end after step" in line, report.lines()
    assert any(line.startswith("  crossed:     before the SIG") for line in report.lines())


def test_a_clean_stream_trainer_passes_without_a_false_unregistered_note(tmp_path):
    """The dataset's generator, reached from the registered StatefulDataLoader, is the loader's state's: no "not
    registered" note, and the report says which loader covers it."""
    report = certify(f"{HELPERS}:StreamTrainer", STREAM_WORDS, work_dir=tmp_path)
    assert report.passed, report.lines()
    assert not any("not registered" in note for note in report.notes), report.notes
    assert any(
        note.startswith("left to the state of loader (StatefulDataLoader)")
        and note.endswith("data.gen (torch.Generator)")
        for note in report.notes
    ), report.notes
    _covered(report)


def test_a_counter_on_the_dataset_is_named_not_the_generator(tmp_path):
    """A counter the dataset keeps outside its state_dict(): the cause names the counter, its values in both runs and
    the resume, and not the generator the loader's state covers."""
    report = certify(f"{HELPERS}:CountingStreamTrainer", STREAM_WORDS, work_dir=tmp_path)
    assert not report.passed
    first = report.causes[0]
    assert first.key == "loader_state_incomplete", report.lines()
    assert first.found[0].startswith("data.served: ") and "after the resume from step" in first.found[0]
    assert not any("gen" in found for cause in report.causes for found in cause.found), report.lines()
    assert report.divergence.step == report.resumes[0][1] + 1  # the step right after the first resume


def test_a_generator_a_resume_makes_afresh_is_caught_at_the_default_budget(tmp_path):
    """A stream with no state of its own is replayed on resume from a fresh dataset: exact inside the first pass, so
    12 steps inside it missed it. certify's default now comes after an epoch end before each interruption, catches
    it and names the generator, with the loader it was reached from."""
    report = certify(f"{HELPERS}:ReplayedStreamTrainer", STREAM_WORDS, work_dir=tmp_path)
    assert not report.passed, report.lines()
    first = report.causes[0]
    assert first.key == "loader_state_incomplete", report.lines()
    assert first.found[0].startswith("data.gen: torch.Generator state "), report.lines()
    assert "reached from loader (StatefulDataLoader)" in first.found[0]
    grown = [note for note in report.notes if note.startswith("certify's own budget")]
    assert len(grown) == 1 and "(max_steps=12: 12 steps)" in grown[0], report.notes  # one note, however many runs
    _covered(report)


def test_a_budget_too_small_to_cover_the_boundaries_is_refused_in_one_line(tmp_path, capsys):
    """A --max-steps that cannot let an epoch end and a validation come before each of two interruptions: one line
    naming --max-steps and the minimum (known before any run when under 5, else from the straight run's epochs)."""
    with pytest.raises(ConfigError) as raised:
        certify(f"{HELPERS}:StreamTrainer", STREAM_WORDS, max_steps=3, work_dir=tmp_path / "a")
    assert str(raised.value).startswith("--max-steps must be at least 5 ") and "\n" not in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        certify(f"{HELPERS}:StreamTrainer", STREAM_WORDS, max_steps=20, work_dir=tmp_path / "b")
    message = str(raised.value)
    assert message.startswith("--max-steps must be at least 34 ") and "got 20" in message and "\n" not in message
    argv = ["certify", f"{HELPERS}:StreamTrainer", *STREAM_WORDS, "--max-steps", "4", "--work-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --max-steps must be at least 5 ") and "\n" not in err, err


def test_covering_steps_put_an_epoch_end_and_a_validation_before_each_interruption():
    """Pure: the drawn steps leave a boundary of each kind before the first signal and between the two; the
    minimum budget is the smallest that allows it."""
    for seed in range(20):
        first, second = covering_steps(34, [16, 32], [16, 32], seed=seed)
        assert 16 < first <= 32 < second < 34
    assert covering_steps(33, [16, 32], [16, 32]) is None
    assert minimum_steps([16, 32], [16, 32]) == 34
    assert minimum_steps([16], [4, 8, 12]) == 34 and minimum_steps([], []) is None
