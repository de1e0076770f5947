"""Nothing trainkit does per step forces a device-to-host sync: counted over whole training steps."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import attrs
from torch import nn

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.host_syncs import count_host_syncs
from tests.helpers.trainers import TinyConfig, TinyTrainer
from trainkit.loop.trainer_metrics import LogBuffer

TRAINKIT_DIR = str(Path(trainkit.__file__).parent)


@attrs.frozen(kw_only=True)
class HotConfig(TinyConfig):
    """TinyConfig with the per-parameter statistics on, every step."""

    log_weight_stats: bool = True
    log_grad_stats: bool = True
    log_stats_every_n_steps: int = 1


class CountingTrainer(TinyTrainer):
    """Counts host syncs made from trainkit code during each optimizer step (forward to optimizer.step)."""

    config_class = HotConfig

    def train_epoch(self):
        counts: Counter[str] = Counter()
        self.model.train()
        for x, y in self.progress(self.loader):
            x, y = x.to(self.device), y.to(self.device)
            with count_host_syncs(only_from=TRAINKIT_DIR) as step_counts:
                loss = nn.functional.mse_loss(self.model(x), y)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.log_param_grad_stats()
                self.clip_and_log_grad_norm()
                self.optimizer.step()
                self.log({"train/loss": loss.detach(), "train/lr": self.optimizer.param_groups[0]["lr"]})
                self.log_lr()
            counts += step_counts
        self.log_epoch_grad_norm()
        self.syncs = getattr(self, "syncs", Counter()) + counts


def test_no_host_sync_per_step(tmp_path, monkeypatch):
    """Over two epochs of steps with every per-step helper on, trainkit code calls no syncing tensor method.

    The logged tensors take the accelerator's path (kept on their device until the push), which a CPU tensor
    takes with ``LogBuffer.read_cpu_at_log`` off.
    """
    monkeypatch.setattr(LogBuffer, "read_cpu_at_log", False)
    trainer = CountingTrainer(make_cfg(tmp_path, epochs=2, progress={"enable": True}, grad_clip=0.5))
    trainer.train()
    assert trainer.step > 10
    assert trainer.syncs == Counter()


def test_cpu_tensors_are_read_once_each_at_log_time(tmp_path):
    """On the CPU, the per-step helpers read each logged CPU tensor once with item() (nothing to wait for), no more."""
    trainer = CountingTrainer(make_cfg(tmp_path, epochs=1, progress={"enable": True}, grad_clip=0.5))
    trainer.train()
    # per step: the loss and the grad norm (clip_and_log_grad_norm); the lr is a float, the statistics a vector
    assert set(trainer.syncs) <= {key for key in trainer.syncs if key.startswith("item from trainer_metrics.py:")}
    assert sum(trainer.syncs.values()) == 2 * trainer.step
