"""Misuse of the trainer API gets a clear, typed error (the table in docs/bad_input.rst)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit import BookkeepingError, DistributedError, RegistryError, UsageError
from trainkit.distributed import collectives as dist_utils
from trainkit.trainer import BaseTrainer


class NoModel(BaseTrainer):
    """A trainer that forgets to set self.model."""

    def setup(self, ckpt):
        pass

    def train_epoch(self):
        pass

    def val_epoch(self):
        return self.step_patience(self.save_if_best(1.0))


def test_missing_abstract_hook_is_a_type_error():
    """A subclass without val_epoch() cannot be instantiated, and the error names the hook."""

    class NoVal(BaseTrainer):
        def setup(self, ckpt):
            pass

        def train_epoch(self):
            pass

    with pytest.raises(TypeError, match="val_epoch"):
        NoVal({"epochs": 1})


@pytest.mark.parametrize("rank, world_size", [(1, 1), (-1, 2), (0, 0)])
def test_impossible_rank_is_refused(tmp_path, rank, world_size):
    """A rank outside [0, world_size) is a UsageError naming both values."""
    with pytest.raises(UsageError, match=f"rank={rank}"):
        TinyTrainer(make_cfg(tmp_path), rank=rank, world_size=world_size)


def test_config_of_the_wrong_type_is_refused():
    """cfg must be a Config or a mapping."""
    with pytest.raises(UsageError, match="cfg must be a TinyConfig or a mapping, got list"):
        TinyTrainer([1, 2])


def test_save_if_best_without_a_model_names_the_fix(tmp_path):
    """save_if_best() on a trainer without self.model says to assign it in setup()."""
    with pytest.raises(UsageError, match="assign it in setup"):
        NoModel(make_cfg(tmp_path)).train()


def test_optimizer_helpers_without_a_model_name_the_fix(tmp_path):
    """get_param_groups() and clip_and_log_grad_norm() default to self.model and say so when it is unset."""
    trainer = NoModel(make_cfg(tmp_path))
    with pytest.raises(UsageError, match="get_param_groups"):
        trainer.get_param_groups()
    with pytest.raises(UsageError, match="clip_and_log_grad_norm"):
        trainer.clip_and_log_grad_norm()


@pytest.mark.parametrize("score", [True, "0.5", torch.ones(3)])
def test_scores_that_are_not_numbers_are_refused(tiny_trainer, score):
    """A bool, a string or a multi-element tensor is not a score."""
    trainer = tiny_trainer()
    with pytest.raises(BookkeepingError, match="must be a real number"):
        trainer.save_if_best(score)


def test_nan_scores_are_misses_that_exhaust_patience(tiny_trainer):
    """A diverged run (NaN scores) never improves: patience runs out and the best weights stay the finite ones."""
    scores = (2.0, float("nan"), float("nan"), float("nan"), 1.0)
    trainer = tiny_trainer(epochs=5, scripted_scores=scores, val={"patience": 2})
    trainer.train()
    assert trainer.epochs_trained == [0, 1, 2]
    assert trainer.best_state.score == 2.0 and not math.isnan(trainer.best_state.score)


def test_non_scalar_logged_value_names_the_key(tiny_trainer):
    """log() refuses a vector or a string, naming the metric."""
    trainer = tiny_trainer()
    with pytest.raises(TypeError, match="'train/vec' must be a 1-element tensor"):
        trainer.log({"train/vec": torch.ones(2)})
    with pytest.raises(TypeError, match="'train/name' must be a number or a tensor"):
        trainer.log({"train/name": "x"})
    complex_refused = r"'train/phase' must be a real-valued 1-element tensor, got dtype torch.complex64"
    with pytest.raises(TypeError, match=complex_refused):
        trainer.log({"train/phase": torch.ones(1, dtype=torch.complex64)})


def test_samplers_need_set_epoch(tiny_trainer):
    """add_samplers() refuses an object without set_epoch()."""
    trainer = tiny_trainer()
    with pytest.raises(UsageError, match="set_epoch"):
        trainer.add_samplers(object())


def test_test_epoch_must_return_a_mapping(tmp_path):
    """test_epoch() returning a float instead of a dict is a UsageError."""

    class BadTest(TinyTrainer):
        def test_epoch(self):
            return 0.5

    with pytest.raises(UsageError, match="test_epoch\\(\\) must return a dict"):
        BadTest(make_cfg(tmp_path, epochs=1, test={"enable": True})).train()


def test_resume_with_different_registered_items_names_them(tmp_path):
    """Resuming with an item registered that the checkpoint lacks names the missing item."""
    TinyTrainer(make_cfg(tmp_path, epochs=1)).train()

    class Extra(TinyTrainer):
        def setup(self, ckpt):
            super().setup(ckpt)
            self.add_checkpoint_items(scheduler=torch.optim.lr_scheduler.StepLR(self.optimizer, 1))

    with pytest.raises(RegistryError, match=r"missing from the checkpoint: \['scheduler'\]"):
        Extra(make_cfg(tmp_path, epochs=2))


@pytest.mark.parametrize("local_world_size", [None, "2"])
def test_nccl_with_more_processes_than_gpus_names_the_fix(monkeypatch, local_world_size):
    """Two processes per node on one GPU is refused with the numbers and the fix, before NCCL says 'Duplicate GPU'."""
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # spawn: every process on this node
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    expected = r"2 processes share this node's 1 visible CUDA device.*--nproc_per_node=1"
    with pytest.raises(DistributedError, match=expected):
        dist_utils.init_process_group(0, 2, backend="nccl", timeout_s=5, device=torch.device("cuda", 0))
    assert not torch.distributed.is_initialized()


def test_nccl_with_one_process_per_gpu_passes_the_check(monkeypatch):
    """Four ranks on two nodes of two GPUs each (LOCAL_WORLD_SIZE=2) are not refused by the GPU count."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    dist_utils.check_one_gpu_per_process(world_size=4)
