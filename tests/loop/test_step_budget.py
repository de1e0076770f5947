"""Runs measured in steps: ``max_steps``, validation every N steps (``val.every_n_steps``), a row every N steps
(``log_every_n_steps``) and ``planned_steps()``, on real small models (TinyTrainer: 192 training samples in batches
of 32, so 6 optimizer steps per epoch)."""

from __future__ import annotations

import json

import pytest
import torch

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import StepTrainer, StepValTrainer, TinyTrainer, optimizer_digest, param_digest
from trainkit import UsageError

STEPS_PER_EPOCH = 6


def run(trainer_class, out, **overrides):
    trainer = trainer_class(make_cfg(out, **overrides))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return trainer, result


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_ckpt(out):
    return torch.load(out / "last.pt", weights_only=True)


def test_max_steps_ends_inside_an_epoch_with_the_final_validation_save_and_test(tmp_path):
    """max_steps=8 stops 2 steps into epoch 1: the loop ends at that boundary, then the last validation, the save
    and the test run as after a last epoch; epochs may be left out."""
    trainer, result = run(StepValTrainer, tmp_path, epochs=None, max_steps=8, test={"enable": True},
                          ckpt={"every_n_steps": 3})
    assert trainer.step == 8 and trainer.epoch == 1
    assert trainer.validations == [(0, 6), (1, 8)]  # epoch 0's end, then the run's end
    assert "test/loss" in result
    loop = last_ckpt(tmp_path)["loop"]
    assert (loop["step"], loop["epoch"], loop["stop_reason"], loop["in_epoch"]) == (8, 1, "max_steps", True)
    assert last_ckpt(tmp_path)["trainkit"]["position"]["batches"] == 2
    assert rows(tmp_path)[-1]["trainer/step"] == 8


def test_the_first_budget_reached_ends_the_run(tmp_path):
    """epochs=2 and max_steps=100: the epochs end it (12 steps); epochs=5 and max_steps=9: the steps do."""
    by_epochs, _ = run(TinyTrainer, tmp_path / "a", epochs=2, max_steps=100)
    assert (by_epochs.step, last_ckpt(tmp_path / "a")["loop"]["stop_reason"]) == (12, "max_epochs")
    by_steps, _ = run(TinyTrainer, tmp_path / "b", epochs=5, max_steps=9)
    assert (by_steps.step, last_ckpt(tmp_path / "b")["loop"]["stop_reason"]) == (9, "max_steps")


def test_max_steps_at_an_epochs_last_batch_ends_at_the_epoch_end(tmp_path):
    trainer, _ = run(StepValTrainer, tmp_path, epochs=None, max_steps=12)
    loop = last_ckpt(tmp_path)["loop"]
    assert (trainer.step, loop["epoch"], loop["in_epoch"], loop["stop_reason"]) == (12, 2, False, "max_steps")
    assert trainer.validations == [(0, 6), (1, 12)]  # never twice at step 12


def test_step_validation_runs_every_n_steps_never_twice_and_puts_the_train_mode_back(tmp_path):
    """val.every_n_steps=4 over 14 steps: validations at steps 4 and 8 inside epochs (in train mode, as the loop
    left it, and the loop goes on in train mode), at epoch ends (val.every_n_epochs=1), at step 12 once (the last
    batch of epoch 1: validated at the epoch's end only), and at the run's end (14)."""
    trainer, _ = run(StepValTrainer, tmp_path, epochs=None, max_steps=14, val={"every_n_steps": 4})
    assert trainer.validations == [(0, 4), (0, 6), (1, 8), (1, 12), (2, 14)]
    assert trainer.eval_steps == []  # val_epoch() calls model.eval(); the loop goes on in train mode
    assert [row["trainer/step"] for row in rows(tmp_path) if "val/loss" in row] == [4, 6, 8, 12, 14]


def test_step_validation_selects_the_best_step_and_early_stops_at_that_boundary(tmp_path):
    """Scores scripted per validation: the best is the 2nd (step 4); patience 2 is spent at the 4th validation
    (step 8, inside epoch 1): the loop ends there, no further validation, the best weights are those of step 4."""
    scores = (5.0, 1.0, 3.0, 4.0, 0.1, 0.1)
    trainer, result = run(StepValTrainer, tmp_path, epochs=9, val={"every_n_steps": 2, "every_n_epochs": 100,
                          "patience": 2}, scripted_scores=scores)
    assert [step for _, step in trainer.validations] == [2, 4, 6, 8]
    assert trainer.step == 8
    loop = last_ckpt(tmp_path)["loop"]
    assert (loop["stop_reason"], loop["in_epoch"], loop["epoch"]) == ("early_stop", True, 1)
    assert result["best/val/loss"] == 1.0


def test_log_every_n_steps_pushes_a_row_every_n_steps_without_push_logs(tmp_path):
    """TinyTrainer logs train/grad_norm every step and pushes nothing itself: with log_every_n_steps=2 a row
    lands every 2 steps, each with the norm of its last step."""
    run(TinyTrainer, tmp_path, epochs=2, log_every_n_steps=2, val={"every_n_epochs": 100})
    steps = [row["trainer/step"] for row in rows(tmp_path) if "train/grad_norm" in row]
    assert steps[:5] == [2, 4, 6, 8, 10]


def test_raising_max_steps_continues_a_run_that_ended_inside_an_epoch_exactly(tmp_path):
    """A run stopped by max_steps=9 (inside epoch 1) and resumed with max_steps=17 continues from the position its
    final checkpoint recorded: the same weights, validations and val/* rows as one run of 17 steps. (Its epoch-end
    code ran at the cut, so the epoch's own aggregates, logged over the part trained, are rows of their own.)"""
    common = {"epochs": None, "val": {"every_n_steps": 4}, "ckpt": {"every_n_steps": 5}}
    whole, _ = run(StepValTrainer, tmp_path / "whole", max_steps=17, **common)
    run(StepValTrainer, tmp_path / "cut", max_steps=9, **common)
    resumed, _ = run(StepValTrainer, tmp_path / "cut", max_steps=17, **common)
    assert param_digest(resumed.model) == param_digest(whole.model)
    assert resumed.validations == [v for v in whole.validations if v[1] > 9]

    def val_rows(out):
        return [(r["trainer/step"], r["val/loss"]) for r in rows(out) if "val/loss" in r and r["trainer/step"] != 9]

    assert val_rows(tmp_path / "cut") == val_rows(tmp_path / "whole")


class CrashAtStep4(StepValTrainer):
    """Raises before its 5th optimizer step (a crash inside epoch 0)."""

    def clip_and_log_grad_norm(self, *modules):
        if self.step == 4:
            raise RuntimeError("crash at step 4")
        return super().clip_and_log_grad_norm(*modules)


def test_a_finished_max_steps_run_returns_its_results_and_a_lowered_one_finishes_with_a_validation(tmp_path):
    """Rerunning a finished run returns its results; resuming a step checkpoint (step 3, inside epoch 0) with
    max_steps lowered to 3 trains nothing more and finishes with a validation of those weights."""
    run(TinyTrainer, tmp_path / "done", epochs=None, max_steps=5)
    again, result = run(TinyTrainer, tmp_path / "done", epochs=None, max_steps=5)
    assert again.step == 5 and "val/loss" in result
    out = tmp_path / "lowered"
    with pytest.raises(RuntimeError, match="crash at step 4"):
        run(CrashAtStep4, out, epochs=None, max_steps=40, ckpt={"every_n_steps": 3})
    with pytest.warns(RuntimeWarning, match="max_steps=3 ends the run before it"):
        finished, _ = run(StepValTrainer, out, epochs=None, max_steps=3, ckpt={"every_n_steps": 3})
    assert (finished.step, finished.validations) == (3, [(0, 3)])
    assert last_ckpt(out)["loop"]["stop_reason"] == "max_steps"


def test_a_run_measured_in_steps_that_takes_none_is_refused_instead_of_looping_forever(tmp_path):
    class NoSteps(TinyTrainer):
        def train_epoch(self):
            for _ in self.progress(self.loader):
                pass

    with pytest.raises(UsageError, match=r"max_steps=5 counts optimizer steps.*epoch 0 took none"):
        run(NoSteps, tmp_path, epochs=None, max_steps=5)


def test_planned_steps_sizes_a_schedule(tmp_path):
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=None, max_steps=500))
    try:
        assert trainer.planned_steps() == 500
    finally:
        trainer.close()
    trainer = TinyTrainer(make_cfg(tmp_path / "b", epochs=3, max_steps=10))
    try:
        assert trainer.planned_steps(STEPS_PER_EPOCH) == 10
        with pytest.raises(trainkit.BookkeepingError, match="steps_per_epoch"):
            trainer.planned_steps()
    finally:
        trainer.close()


class ListTrainer(StepValTrainer):
    """Iterates a list of the loader's batches: a loop trainkit cannot skip into."""

    def train_epoch(self):
        self.model.train()
        for x, y in self.progress(list(self.loader)):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


def test_an_iterable_loop_is_watched_for_the_budget_but_writes_no_step_checkpoint(tmp_path):
    """A list of batches cannot be skipped into: max_steps and step validation still act at its boundaries."""

    with pytest.warns(RuntimeWarning, match="writes no step checkpoints"):
        trainer, _ = run(ListTrainer, tmp_path, epochs=None, max_steps=4, val={"every_n_steps": 2},
                         ckpt={"every_n_steps": 1})
    assert [step for _, step in trainer.validations] == [2, 4]
    assert last_ckpt(tmp_path)["trainkit"] is None  # the run's end records no position it could not resume


def test_two_gloo_ranks_validate_and_stop_at_the_same_step_boundary(tmp_path):
    """On 2 ranks (each 3 steps per epoch) the step validations, the early-stop verdict and the stop agree."""
    scores = (5.0, 1.0, 3.0, 4.0, 0.1)
    cfg = make_cfg(tmp_path, epochs=9, val={"every_n_steps": 2, "every_n_epochs": 100, "patience": 2},
                   scripted_scores=scores, dist={"backend": "gloo", "timeout_s": 60})
    trainkit.spawn(StepValTrainer, cfg, 2)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0] == reports[1]
    assert [v[1] for v in reports[0]["validations"]] == [2, 4, 6, 8] and reports[0]["step"] == 8


def step_run(out, **overrides):
    """A StepTrainer run (gradient accumulation over 2 batches, dropout, per-sample noise, a RunningMean loss; 8
    batches so 4 optimizer steps per epoch) measured in steps; returns the trainer and torch's RNG state after it."""
    trainer, _ = run(StepTrainer, out, **{"epochs": None, **overrides})
    return trainer, torch.get_rng_state()


def cut_epoch_rows(out, cut_step, cut_epoch):
    """metrics.jsonl less what the shorter run logged at the cut and the cut epoch's epoch-end aggregates (those
    are the shorter run's own: its epoch-end code ran at the cut, see docs/trainer.rst)."""
    kept = []
    for row in rows(out):
        row = {key: value for key, value in row.items() if key != "time"}
        if row["trainer/step"] == cut_step:
            continue
        if row["trainer/epoch"] == cut_epoch and "train/loss" in row:
            row = {key: value for key, value in row.items() if key not in ("train/loss", "train/grad_norm_epoch")}
        kept.append(row)
    return kept


def assert_one_longer_run(whole, whole_rng, resumed, resumed_rng, out_whole, out_cut, cut_step, cut_epoch):
    assert param_digest(resumed.model) == param_digest(whole.model)
    assert optimizer_digest(resumed.optimizer) == optimizer_digest(whole.optimizer)
    assert torch.equal(resumed_rng, whole_rng)  # dropout drew the same numbers in the same order
    assert (resumed.step, resumed.epoch) == (whole.step, whole.epoch)
    assert cut_epoch_rows(out_cut, cut_step, cut_epoch) == cut_epoch_rows(out_whole, cut_step, cut_epoch)


@pytest.mark.parametrize("fmt", ["file", "sharded"])
@pytest.mark.parametrize("loader", ["distributed sampler", "stateful"])
def test_raising_max_steps_without_step_checkpoints_continues_from_the_next_batch(tmp_path, loader, fmt):
    """No ckpt.every_n_steps: a run cut by max_steps=7 (3 steps into epoch 1, after 6 of its 8 batches) and resumed
    with max_steps=11 continues from the next batch: the weights, optimizer state, RNG, step validations (every 3
    steps: 9, not 7 + 3) and rows of one 11-step run. A plain DataLoader with a DistributedSampler (trainkit skips
    into it) and torchdata's StatefulDataLoader (it carries its own position), in both checkpoint formats."""
    if loader == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    common = {"val": {"every_n_steps": 3}, "log_every_n_steps": 2, "ckpt": {"format": fmt},
              "loader": "stateful" if loader == "stateful" else "dataloader",
              "distributed_sampler": True}
    whole, whole_rng = step_run(tmp_path / "whole", max_steps=11, **common)
    step_run(tmp_path / "cut", max_steps=7, **common)
    resumed, resumed_rng = step_run(tmp_path / "cut", max_steps=11, **common)
    assert_one_longer_run(whole, whole_rng, resumed, resumed_rng, tmp_path / "whole", tmp_path / "cut", 7, 1)
    val_steps = [row["trainer/step"] for row in rows(tmp_path / "cut") if "val/loss" in row]
    assert val_steps == [3, 4, 6, 7, 8, 9, 11]  # 7: the shorter run's final validation; then 8 (epoch end), 9, 11


def test_a_run_cut_at_an_epochs_end_and_extended_counts_that_epoch_once(tmp_path):
    """max_steps=8 ends exactly at epoch 1's last batch: no position is recorded, and max_steps=11 starts epoch 2
    (epoch 1 is neither trained again nor counted twice), as one 11-step run."""
    common = {"val": {"every_n_steps": 3}}
    whole, whole_rng = step_run(tmp_path / "whole", max_steps=11, **common)
    step_run(tmp_path / "cut", max_steps=8, **common)
    loop = last_ckpt(tmp_path / "cut")["loop"]
    assert (loop["epoch"], loop["in_epoch"], last_ckpt(tmp_path / "cut")["trainkit"]) == (2, False, None)
    resumed, resumed_rng = step_run(tmp_path / "cut", max_steps=11, **common)
    assert_one_longer_run(whole, whole_rng, resumed, resumed_rng, tmp_path / "whole", tmp_path / "cut", 8, None)
    assert [row["trainer/epoch"] for row in rows(tmp_path / "cut")] == [
        row["trainer/epoch"] for row in rows(tmp_path / "whole")
    ]
    assert last_ckpt(tmp_path / "cut")["loop"]["epoch"] == 2  # epochs completed: 0, 1; epoch 2 ended inside


def test_epochs_changed_with_max_steps_on_a_run_cut_inside_an_epoch(tmp_path):
    """A run of epochs=3, max_steps=6 cut inside epoch 1: resumed with epochs=2 and max_steps=20 it finishes
    epoch 1 from the next batch (the epochs end it) as one run of epochs=2 does; resumed with epochs=1 it is past
    that budget and trains nothing."""
    whole, whole_rng = step_run(tmp_path / "whole", epochs=2, max_steps=20)
    step_run(tmp_path / "cut", epochs=3, max_steps=6)
    resumed, resumed_rng = step_run(tmp_path / "cut", epochs=2, max_steps=20)
    assert_one_longer_run(whole, whole_rng, resumed, resumed_rng, tmp_path / "whole", tmp_path / "cut", 6, 1)
    assert last_ckpt(tmp_path / "cut")["loop"]["stop_reason"] == "max_epochs"
    step_run(tmp_path / "lowered", epochs=3, max_steps=6)
    lowered, _ = step_run(tmp_path / "lowered", epochs=1, max_steps=20)
    assert lowered.step == 6


def test_raising_max_steps_on_a_cut_loop_that_recorded_no_position_is_refused(tmp_path):
    """A list of batches cannot be skipped into: a run it cut inside an epoch cannot continue that epoch from the
    next batch, so raising max_steps is refused (naming why) instead of training the epoch's first batches twice."""

    run(ListTrainer, tmp_path, epochs=None, max_steps=8)
    before = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(trainkit.CheckpointMismatchError, match=r"ended inside epoch 1 at step 8 \(max_steps\) but "
                       r"recorded no position.*max_steps=12 would train that epoch's first batches twice"):
        run(ListTrainer, tmp_path, epochs=None, max_steps=12)
    assert (tmp_path / "last.pt").read_bytes() == before
