"""The divergence guard on real runs: a NaN planted at a step is skipped exactly or stops the run there."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import trainkit
import trainkit.loop.divergence_guard
import trainkit.loop.trainer_metrics
from tests.helpers.configs import make_cfg
from tests.helpers.host_syncs import count_host_syncs
from tests.helpers.trainers import Crash, GuardTrainer, TwoOptimizerTrainer
from trainkit.errors import ConfigError, DivergenceError

GUARD_FILE = trainkit.loop.divergence_guard.__file__
METRICS_FILE = trainkit.loop.trainer_metrics.__file__


@pytest.fixture(scope="module", autouse=True)
def one_fork_server():
    """One fork server for the module's 2-rank spawns: torch imported once, not once per call (~4 s of CPU each)."""
    with trainkit.fork_server(preload=["tests.helpers.trainers"]):
        yield


NAN_AT = 3
"""The global batch whose loss is scaled by inf (optimizer step 3: one step per batch)."""


def run(out_dir, world_size=1, trainer_class=GuardTrainer, **overrides):
    """Train a GuardTrainer (2 epochs of 6 batches); return rank 0's report, every rank's, and the journal."""
    cfg = make_cfg(out_dir, **{"epochs": 2, "n_samples": 320, **overrides})
    if world_size == 1:
        trainer = trainer_class(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
    else:
        trainkit.spawn(GuardTrainer, {**cfg, "dist": {"timeout_s": 60}}, world_size)
    reports = [json.loads((out_dir / f"guard{rank}.json").read_text()) for rank in range(world_size)]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return reports, rows


@pytest.mark.parametrize("optimizer, on_device", [("sgd", False), ("adam", False), ("adam_fused", True)])
def test_a_skipped_step_equals_the_step_left_out_bitwise(tmp_path, optimizer, on_device):
    """guard.nonfinite=skip drops the planted step exactly: weights and optimizer state (momentum, Adam's moments
    and step counts) equal a run that never called optimizer.step() there; without the guard the NaN spreads."""
    skip = {"nonfinite": "skip"}
    with count_host_syncs(only_from=GUARD_FILE) as syncs:
        (guarded,), rows = run(
            tmp_path / "a", nan_batches=(NAN_AT,), optimizer=optimizer, guard=skip, guard_on_device=on_device
        )
    (left_out,), _ = run(tmp_path / "b", steps_left_out=(NAN_AT,), optimizer=optimizer)
    (unguarded,), _ = run(tmp_path / "c", nan_batches=(NAN_AT,), optimizer=optimizer)
    assert guarded["on_device"] is on_device and guarded["skipped"] == 1
    # the device path reads nothing on the host; on the host path the log buffer has read the CPU norm already, and
    # the verdict takes that float (test_the_host_verdict_reads_a_norm_the_buffer_kept_once_per_step: one it kept)
    assert sum(syncs.values()) == 0
    assert (guarded["digest"], guarded["optimizer"]) == (left_out["digest"], left_out["optimizer"])
    assert unguarded["digest"] != left_out["digest"]
    assert [row["guard/skipped_steps"] for row in rows if "train/grad_norm" in row] == [1, 1]


def test_the_host_verdict_reads_a_norm_the_buffer_kept_once_per_step(tmp_path, monkeypatch):
    """When the log buffer keeps the norm as a tensor (an accelerator's norm), the host path reads it itself, once
    per optimizer step, and skips the planted step exactly as when it reuses the buffer's read."""
    monkeypatch.setattr(trainkit.loop.trainer_metrics.LogBuffer, "read_cpu_at_log", False)
    with count_host_syncs(only_from=GUARD_FILE) as syncs:
        (guarded,), _ = run(tmp_path / "a", nan_batches=(NAN_AT,), guard={"nonfinite": "skip"})
    (left_out,), _ = run(tmp_path / "b", steps_left_out=(NAN_AT,))
    assert guarded["on_device"] is False and guarded["skipped"] == 1
    assert sum(syncs.values()) == 12
    assert (guarded["digest"], guarded["optimizer"]) == (left_out["digest"], left_out["optimizer"])


def test_raise_stops_before_the_step_naming_it_and_its_batch(tmp_path):
    """guard.nonfinite=raise stops before the planted step: the error names step, epoch and batch, and the weights
    and optimizer state are those after the steps before it (as a run that leaves out every later step)."""
    with pytest.raises(DivergenceError, match=rf"before optimizer step {NAN_AT} \(epoch 0, batch {NAN_AT} of") as info:
        run(tmp_path / "a", nan_batches=(NAN_AT,), guard={"nonfinite": "raise"}, ckpt={"every_n_steps": 2})
    assert (info.value.step, info.value.epoch, info.value.batch) == (NAN_AT, 0, NAN_AT)
    assert "set guard.nonfinite=skip to drop such steps" in str(info.value)
    stopped = json.loads((tmp_path / "a" / "guard0.json").read_text())
    (frozen,), _ = run(tmp_path / "b", steps_left_out=tuple(range(NAN_AT, 12)))
    assert (stopped["digest"], stopped["optimizer"]) == (frozen["digest"], frozen["optimizer"])


def test_skip_raises_once_max_skips_non_finite_steps_fall_within_the_window(tmp_path):
    """With guard.max_skips=2 and guard.window=3 two NaNs 4 steps apart are skipped, two 2 apart stop the run."""
    (report,), _ = run(tmp_path / "a", nan_batches=(2, 6), guard={"nonfinite": "skip", "max_skips": 2, "window": 3})
    assert report["skipped"] == 2
    with pytest.raises(
        DivergenceError, match=r"2 non-finite steps fell within guard.window=3 steps \(steps 6, 8;"
    ) as e:
        run(tmp_path / "b", nan_batches=(2, 6, 8), guard={"nonfinite": "skip", "max_skips": 2, "window": 3})
    assert "raise guard.max_skips" in str(e.value) and "set guard.nonfinite=skip" not in str(e.value)  # set already


def test_off_installs_nothing(tmp_path, monkeypatch):
    """The default guard.nonfinite=off builds no guard, hangs no hook on any optimizer, and logs no skip count."""
    hooked = []
    register = torch.optim.Optimizer.register_step_pre_hook
    monkeypatch.setattr(
        torch.optim.Optimizer, "register_step_pre_hook", lambda self, hook: hooked.append(hook) or register(self, hook)
    )
    trainer = GuardTrainer(make_cfg(tmp_path, epochs=1))
    try:
        assert trainer.guard is None
        trainer.train()
    finally:
        trainer.close()
    assert hooked == []
    assert not any("guard/skipped_steps" in row for row in journal(tmp_path))


def test_an_unknown_mode_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="guard.nonfinite.*must be one of 'off', 'raise', 'skip', 'rollback'"):
        GuardTrainer(make_cfg(tmp_path, epochs=1, guard={"nonfinite": "undo"}))
    with pytest.raises(ConfigError, match=r"guard.skip_batches must be a list of 'EPOCH:BATCH' strings.*got '1-3'"):
        GuardTrainer(make_cfg(tmp_path, epochs=1, guard={"skip_batches": ["1-3"]}))


@pytest.mark.ddp
def test_two_gloo_ranks_skip_together_when_one_rank_diverges(tmp_path):
    """A NaN planted on rank 1 only: both ranks skip that step, and end bitwise as 2 ranks that left it out."""
    guarded, rows = run(
        tmp_path / "a", 2, nan_batches=(NAN_AT,), nan_rank=1, guard={"nonfinite": "skip"}, n_samples=200
    )
    left_out, _ = run(tmp_path / "b", 2, steps_left_out=(NAN_AT,), n_samples=200)
    assert [r["skipped"] for r in guarded] == [1, 1]
    digests = {r["digest"] for r in guarded}
    assert digests == {r["digest"] for r in left_out} and len(digests) == 1
    assert rows[-1]["guard/skipped_steps"] == 1


def test_the_skip_count_survives_a_resume(tmp_path):
    """A resumed run counts on from the skips the checkpoint's run recorded (each process plants one NaN)."""
    planted = {"nan_batches": (NAN_AT,), "guard": {"nonfinite": "skip"}}
    (first,), _ = run(tmp_path, epochs=1, **planted)
    (resumed,), rows = run(tmp_path, epochs=2, **planted)
    assert (first["skipped"], resumed["skipped"]) == (1, 2)
    assert [row["guard/skipped_steps"] for row in rows if "train/grad_norm" in row] == [1, 2]


@pytest.mark.ddp
def test_ranks_whose_norms_differ_take_one_verdict(tmp_path):
    """Two ranks training models of their own (no DDP): rank 1's NaN makes rank 0 skip the same step too."""
    reports, _ = run(
        tmp_path, 2, nan_batches=(NAN_AT,), nan_rank=1, guard={"nonfinite": "skip"}, n_samples=200, wrap_ddp=False
    )
    assert [r["skipped"] for r in reports] == [1, 1]


def test_the_guard_and_the_throughput_rates_share_a_row(tmp_path):
    """With guard.nonfinite=skip and log_throughput both on, each epoch's row has the skip count and the rates,
    and the skipped step still counts as a step (trainer.step advances, so steps/s does)."""
    (report,), rows = run(tmp_path, nan_batches=(NAN_AT,), guard={"nonfinite": "skip"}, log_throughput=True)
    assert report["skipped"] == 1
    epoch_rows = [row for row in rows if "train/grad_norm" in row]
    assert [row["guard/skipped_steps"] for row in epoch_rows] == [1, 1]
    assert all(row["perf/steps_per_s"] > 0 and "perf/samples_per_s" in row for row in epoch_rows)


class EpochNormTrainer(GuardTrainer):
    """GuardTrainer that logs the epoch's grad-norm mean, and raises Crash before optimizer step ``crash_at``; the
    host reads the metrics make while train_epoch() runs (its steps and pushes, no save) add up in ``SYNCS``."""

    crash_at: int | None = None

    def clip_and_log_grad_norm(self, *modules):
        if self.step == self.crash_at:
            raise Crash
        return super().clip_and_log_grad_norm(*modules)

    def train_epoch(self):
        with count_host_syncs(only_from=METRICS_FILE) as syncs:
            super().train_epoch()
            self.log_epoch_grad_norm()
        SYNCS.update(syncs)


SYNCS: Counter[str] = Counter()
"""What EpochNormTrainer runs counted (cleared by the test that reads it)."""


NORM_PLANTED = {"nan_positions": ("0:3",), "push_every_step": True, "guard": {"nonfinite": "skip"}}
"""Epoch 0's batch 3 diverges (optimizer step 4, skipped); a journal row per step with its grad norm."""


def epoch_norms(rows, epoch):
    """An epoch's per-step grad norms and its epoch-end row, from the journal."""
    norms = [row["train/grad_norm"] for row in rows if row["trainer/epoch"] == epoch and "train/grad_norm" in row]
    (end,) = [row for row in rows if row["trainer/epoch"] == epoch and "train/grad_norm_epoch" in row]
    return norms, end


@pytest.mark.parametrize("on_device", [False, True])
def test_the_epochs_grad_norm_mean_leaves_a_skipped_steps_norm_out(tmp_path, monkeypatch, on_device):
    """guard.nonfinite=skip: train/grad_norm_epoch is the mean of the epoch's finite per-step norms (the skipped
    step's NaN left out), and its row says how many steps were skipped; the same with the norms kept as tensors
    (an accelerator's path), where the metrics read nothing on the host that the run without the guard does not.
    Without the guard the NaN step trained: the mean is NaN."""
    options = {"optimizer": "adam_fused", "guard_on_device": True} if on_device else {}
    options = {**NORM_PLANTED, **options}
    if on_device:
        monkeypatch.setattr(trainkit.loop.trainer_metrics.LogBuffer, "read_cpu_at_log", False)
    SYNCS.clear()
    (report,), rows = run(tmp_path / "a", trainer_class=EpochNormTrainer, **options)
    guarded_syncs = Counter(SYNCS)
    assert report["skipped"] == 1 and report["on_device"] is on_device
    for epoch in (0, 1):
        norms, end = epoch_norms(rows, epoch)
        finite = [norm for norm in norms if math.isfinite(norm)]
        assert len(norms) == 6 and len(finite) == 6 - (epoch == 0)
        assert end["train/grad_norm_epoch"] == pytest.approx(sum(finite) / len(finite), rel=1e-6)
        assert end["guard/skipped_steps"] == 1
    SYNCS.clear()
    _, rows = run(tmp_path / "b", trainer_class=EpochNormTrainer, **{**options, "guard": {"nonfinite": "off"}})
    assert math.isnan(epoch_norms(rows, 0)[1]["train/grad_norm_epoch"])
    assert guarded_syncs <= SYNCS and sum(guarded_syncs.values()) > 0  # (the CPU mean is a float: fewer)


@pytest.mark.parametrize("as_tensors", [False, True])
def test_the_finite_grad_norm_mean_resumes_from_a_step_checkpoint(tmp_path, monkeypatch, as_tensors):
    """A run stopped inside epoch 0 after its skipped step resumes from the step checkpoint with the epoch's
    finite-norm sum and count, and logs the uninterrupted run's grad_norm_epoch, bit for bit (norms read on the
    host, or kept as tensors as an accelerator's are)."""
    if as_tensors:
        monkeypatch.setattr(trainkit.loop.trainer_metrics.LogBuffer, "read_cpu_at_log", False)
    options = {**NORM_PLANTED, "ckpt": {"every_n_steps": 1}}
    _, whole = run(tmp_path / "whole", trainer_class=EpochNormTrainer, **options)
    crashing = type("Crashing", (EpochNormTrainer,), {"crash_at": 5})  # after steps 1-5, step 4 skipped
    with pytest.raises(Crash):
        run(tmp_path / "run", trainer_class=crashing, **options)
    _, resumed = run(tmp_path / "run", trainer_class=EpochNormTrainer, **options)
    for epoch in (0, 1):
        assert (
            epoch_norms(resumed, epoch)[1]["train/grad_norm_epoch"]
            == epoch_norms(whole, epoch)[1]["train/grad_norm_epoch"]
        )
    norms, end = epoch_norms(whole, 0)
    assert math.isfinite(end["train/grad_norm_epoch"]) and not all(map(math.isfinite, norms))


ROLLBACK = {"nonfinite": "rollback", "max_skips": 2, "window": 3}
"""Two non-finite steps within 3 steps roll back; the first of them is skipped until then."""


def rolled_back_run(tmp_path, world_size=1, **overrides):
    """Epoch 1 (steps 6-11) diverges at batches 1 and 3 (steps 7 and 9): the rollback at step 9 passes over last.pt
    (step 8) to last.prev.pt (step 6, the end of epoch 0), then runs epoch 1 again without those two batches.
    Returns the rolled-back run's reports and journal, and the run resumed from a copy of the step-6 checkpoint with
    guard.skip_batches naming the same batches."""
    planted = {"nan_positions": ("1:1", "1:3"), "guard": ROLLBACK, "ckpt": {"every_n_steps": 2, "keep": "latest:9"}}
    rolled, rows = run(tmp_path / "a", world_size, **planted, **overrides)
    copy = tmp_path / "a" / "checkpoints" / "step-6.pt"  # ckpt.keep's copy of that checkpoint, beside its run
    again = {**planted, "guard": {**ROLLBACK, "skip_batches": ["1:1", "1:3"]}, "ckpt": {"resume": str(copy)}}
    resumed, _ = run(tmp_path / "b", world_size, **again, **overrides)
    return rolled, rows, resumed


def test_a_rollback_equals_the_run_resumed_from_its_checkpoint_with_the_batches_skipped_bitwise(tmp_path):
    """guard.nonfinite=rollback reloads the newest checkpoint before the first bad step and leaves the offending
    batches out at the index level: weights and optimizer state equal, bitwise, a run resumed from a copy of that
    checkpoint with guard.skip_batches naming them; the journal says where it went and what it left out."""
    (rolled,), rows, (resumed,) = rolled_back_run(tmp_path)
    assert (rolled["digest"], rolled["optimizer"]) == (resumed["digest"], resumed["optimizer"])
    (rollback,) = [row for row in rows if "guard/rolled_back_to_step" in row]
    assert rollback["guard/rolled_back_to_step"] == 6 and rollback["guard/rollback_from_step"] == 7
    assert rollback["guard/skipped_batches"] == ["1:1", "1:3"]
    dropped = [
        (row["guard/skipped_batch"], row["guard/skipped_samples"]) for row in rows if "guard/skipped_batch" in row
    ]
    assert [batch for batch, _ in dropped] == [1, 3] and all(len(samples) == 32 for _, samples in dropped)
    assert rows[-1]["trainer/step"] == 10  # 6 steps in epoch 0, 4 in epoch 1 (2 of its 6 batches left out)
    # every later checkpoint carries the positions left out, so a resume from it leaves them out too
    last = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    assert last["guard_skips"] == [[1, 1], [1, 3]]


def test_a_rollback_under_gradient_accumulation_leaves_the_whole_window_out(tmp_path):
    """Two batches per optimizer step: the NaN in batch 3 of epoch 1 makes step 4 (batches 2 and 3) non-finite, so
    the rollback to the step-4 checkpoint leaves both of that step's batches out, not only the one that held the
    NaN, and the run ends bitwise as the run resumed from a copy of that checkpoint skipping both."""
    planted = {
        "accumulate": 2,
        "nan_positions": ("1:3",),
        "guard": {"nonfinite": "rollback"},
        "ckpt": {"every_n_steps": 1, "keep": "latest:9"},
    }
    (rolled,), rows = run(tmp_path / "a", **planted)
    (rollback,) = [row for row in rows if "guard/rolled_back_to_step" in row]
    assert rollback["guard/rolled_back_to_step"] == 4 and rollback["guard/rollback_from_step"] == 4
    assert rollback["guard/skipped_batches"] == ["1:2", "1:3"]
    assert [row["guard/skipped_batch"] for row in rows if "guard/skipped_batch" in row] == [2, 3]
    assert rows[-1]["trainer/step"] == 5  # 3 steps in epoch 0, 2 in epoch 1 (its middle window left out)
    copy = tmp_path / "a" / "checkpoints" / "step-4.pt"
    again = {
        **planted,
        "guard": {"nonfinite": "rollback", "skip_batches": ["1:2", "1:3"]},
        "ckpt": {"resume": str(copy)},
    }
    (resumed,), _ = run(tmp_path / "b", **again)
    assert (rolled["digest"], rolled["optimizer"]) == (resumed["digest"], resumed["optimizer"])


@pytest.mark.parametrize("fmt, suffix", [("file", ".pt"), ("sharded", ".ckpt")])
def test_a_rollback_past_both_last_checkpoints_takes_the_newest_kept_one_before_the_window(tmp_path, fmt, suffix):
    """A window of 5 steps wider than ckpt.every_n_steps=1: at the second NaN (step 10) last and its previous copy
    (steps 10 and 9) are newer than the first (step 7), so the kept step-7 checkpoint (a .pt file, or a .ckpt
    directory with ckpt.format=sharded) is the one loaded; the run equals, bitwise, the run resumed from it."""
    planted = {
        "nan_positions": ("1:1", "1:4"),
        "guard": {"nonfinite": "rollback", "max_skips": 2, "window": 5},
        "ckpt": {"every_n_steps": 1, "keep": "latest:9", "format": fmt},
    }
    rolled, rows = run(tmp_path / "a", **planted)
    (rollback,) = [row for row in rows if "guard/rolled_back_to_step" in row]
    assert (rollback["guard/rolled_back_to_step"], rollback["guard/rollback_from_step"]) == (7, 7)
    assert rollback["guard/skipped_batches"] == ["1:1", "1:4"]
    copy = tmp_path / "a" / "checkpoints" / f"step-7{suffix}"
    again = {
        **planted,
        "guard": {"nonfinite": "rollback", "skip_batches": ["1:1", "1:4"]},
        "ckpt": {"format": fmt, "resume": str(copy)},
    }
    resumed, _ = run(tmp_path / "b", **again)
    assert (rolled[0]["digest"], rolled[0]["optimizer"]) == (resumed[0]["digest"], resumed[0]["optimizer"])


@pytest.mark.ddp
def test_two_gloo_ranks_roll_back_together_bitwise(tmp_path):
    """A NaN planted on rank 1 only: both ranks roll back to the same checkpoint, leave the same batches out, and
    end bitwise as 2 ranks resumed from a copy of it with those batches skipped."""
    rolled, rows, resumed = rolled_back_run(tmp_path, 2, nan_rank=1, n_samples=640)
    digests = {r["digest"] for r in rolled}
    assert digests == {r["digest"] for r in resumed} and len(digests) == 1
    assert [row["guard/rolled_back_to_step"] for row in rows if "guard/rolled_back_to_step" in row] == [6]


def test_skip_batches_past_the_epoch_are_warned_about(tmp_path):
    """A position past the epoch's last batch (a typo, or 1-based counting) leaves nothing out: a warning says so,
    and the run trains every batch."""
    with pytest.warns(RuntimeWarning, match=r"guard.skip_batches names batches \[6\] of epoch 1, but its loader has 6"):
        _, rows = run(tmp_path, guard={"skip_batches": ["1:6"]})
    assert rows[-1]["trainer/step"] == 12


def test_rollback_without_a_checkpoint_before_the_bad_step_stops_naming_it(tmp_path):
    """In the first epoch without step checkpoints there is nothing to go back to: a DivergenceError says so."""
    with pytest.raises(DivergenceError, match="found no checkpoint written before step 3 to roll back to"):
        run(tmp_path, nan_positions=("0:3",), guard={"nonfinite": "rollback"})


def journal(out_dir):
    """The rows of ``out_dir/metrics.jsonl``."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_non_finite_step_after_the_loop_stops_instead_of_rolling_back_for_ever(tmp_path):
    """An optimizer step after the epoch's self.progress() loop (an extra step on a fixed batch) trained on no batch
    the loop yielded: a rollback to the step checkpoint at the loop's end could leave nothing out and would fail
    again for ever, so the run stops at once with a DivergenceError saying why, without a single rollback."""
    planted = {"nan_step_after_loop": (1,), "guard": {"nonfinite": "rollback"}, "ckpt": {"every_n_steps": 1}}
    with pytest.raises(DivergenceError, match="step\\(s\\) 12 trained on no batch of the epoch's counted loop"):
        run(tmp_path, **planted)
    assert [row for row in journal(tmp_path) if "guard/rolled_back_to_step" in row] == []


def test_a_second_optimizer_diverging_on_a_batch_rolls_back_leaving_that_batch_out(tmp_path):
    """Two optimizers step on every batch, each after a grad norm of its own (a GAN's): the second one's non-finite
    step at batch 3 of epoch 1 trained on that batch, so the run rolls back leaving it out and ends bitwise as the
    run resumed from a copy of the checkpoint with it skipped (it used to stop, saying the step trained on no batch
    of the loop: only a step after the loop's end did)."""
    planted = {"nan_second": ("1:3",), "guard": {"nonfinite": "rollback"}}
    ckpt = {"every_n_steps": 1, "keep": "latest:9"}

    def two(out_dir, **overrides):
        trainer = TwoOptimizerTrainer(make_cfg(out_dir, epochs=2, n_samples=320, **overrides))
        try:
            trainer.train()
        finally:
            trainer.close()
        report = json.loads((out_dir / "guard0.json").read_text())
        return (report["digest"], report["optimizer"], (out_dir / "head.txt").read_text()), journal(out_dir)

    rolled, rows = two(tmp_path / "a", **planted, ckpt=ckpt)
    (rollback,) = [row for row in rows if "guard/rolled_back_to_step" in row]
    assert rollback["guard/rolled_back_to_step"] == 9 and rollback["guard/skipped_batches"] == ["1:3"]
    again = {**planted, "guard": {"nonfinite": "rollback", "skip_batches": ["1:3"]}}
    resumed, _ = two(tmp_path / "b", **again, ckpt={"resume": str(tmp_path / "a" / "checkpoints" / "step-9.pt")})
    assert rolled == resumed


def test_persistent_divergence_stops_after_guard_max_rollbacks_rollbacks_in_a_row(tmp_path):
    """Every batch of epoch 1 from its third on diverges (no one batch's fault): each rollback leaves one more batch
    out and goes back to the same checkpoint, so after guard.max_rollbacks of them the run stops with a
    DivergenceError naming the key; the journal holds that many rollback rows, not one per batch left."""
    planted = {
        "nan_positions": ("1:2", "1:3", "1:4", "1:5"),
        "guard": {"nonfinite": "rollback", "max_rollbacks": 2},
        "ckpt": {"every_n_steps": 1},
    }
    with pytest.raises(DivergenceError, match=r"rolled back 2 times in a row to \S+last.pt \(step 8\) without a newer"):
        run(tmp_path, **planted)
    rollbacks = [row["guard/rolled_back_to_step"] for row in journal(tmp_path) if "guard/rolled_back_to_step" in row]
    assert rollbacks == [8, 8]


def test_rollbacks_to_a_newer_checkpoint_start_the_count_again(tmp_path):
    """Rollbacks to the step-8 and then the step-10 checkpoint (the run got past step 8 and saved in between) are
    not in a row: with guard.max_rollbacks=1 the run rolls back twice and finishes."""
    planted = {
        "nan_positions": ("1:2", "1:5"),
        "guard": {"nonfinite": "rollback", "max_rollbacks": 1},
        "ckpt": {"every_n_steps": 1},
    }
    _, rows = run(tmp_path, **planted)
    assert [row["guard/rolled_back_to_step"] for row in rows if "guard/rolled_back_to_step" in row] == [8, 10]
    assert rows[-1]["trainer/step"] == 10


def test_bad_batches_all_over_an_epoch_without_step_checkpoints_stop_after_max_rollbacks(tmp_path):
    """Every other batch of epoch 1 diverges and only epoch ends are checkpointed: each rollback replays the epoch
    from its start (the step-6 checkpoint) and fails at a later batch, so the run never saves past the failures;
    the third rollback to the same checkpoint with guard.max_rollbacks=2 stops the run instead of replaying the
    epoch once per bad batch (the journal growing quadratically)."""
    planted = {"nan_positions": ("1:0", "1:2", "1:4"), "guard": {"nonfinite": "rollback", "max_rollbacks": 2}}
    with pytest.raises(DivergenceError, match=r"rolled back 2 times in a row to \S+last.pt \(step 6\)"):
        run(tmp_path, **planted)
    rollbacks = [row["guard/rolled_back_to_step"] for row in journal(tmp_path) if "guard/rolled_back_to_step" in row]
    assert rollbacks == [6, 6]


def test_guard_max_rollbacks_must_be_at_least_one(tmp_path):
    """A bound of 0 would forbid every rollback: refused naming the key, the rule and the value."""
    with pytest.raises(ConfigError, match=r"guard.max_rollbacks must be >= 1, got 0"):
        run(tmp_path, guard={"nonfinite": "rollback", "max_rollbacks": 0})


def test_a_rollback_passes_over_a_damaged_last_checkpoint_to_the_previous_one(tmp_path):
    """last.pt is damaged on disk when the rollback reads it: the rollback warns and takes last.prev.pt (the step-8
    checkpoint), as an automatic resume falls back, and ends bitwise as the run resumed from a copy of that
    checkpoint with the bad batch skipped (it used to die with CheckpointCorruptError)."""
    planted = {"nan_positions": ("1:3",), "guard": {"nonfinite": "rollback"}}
    ckpt = {"every_n_steps": 1, "keep": "latest:9"}
    with pytest.warns(RuntimeWarning, match="last.pt cannot be rolled back to"):
        (rolled,), rows = run(tmp_path / "a", **planted, ckpt=ckpt, damage_last_at="1:3")
    assert [row["guard/rolled_back_to_step"] for row in rows if "guard/rolled_back_to_step" in row] == [8]
    # set aside at the next save, which therefore could not rotate it into last.prev.pt, the intact copy
    assert (tmp_path / "a" / "last.corrupt.pt").is_file()
    again = {**planted, "guard": {"nonfinite": "rollback", "skip_batches": ["1:3"]}}
    copy = tmp_path / "a" / "checkpoints" / "step-8.pt"
    (resumed,), _ = run(tmp_path / "b", **again, ckpt={"resume": str(copy)})
    assert (rolled["digest"], rolled["optimizer"]) == (resumed["digest"], resumed["optimizer"])
