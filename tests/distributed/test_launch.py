"""``trainkit.launch``: what a rank's failure leaves for the process-group teardown and for the user."""

from __future__ import annotations

import traceback
import weakref

import pytest
import torch

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import Crash, TinyTrainer


class HoldingTrainer(TinyTrainer):
    """Fails inside its epoch with a tensor in a local variable, as a rank whose collective failed holds its
    tensors (gloo's "Connection closed by peer" leaves them in the failed call's frames)."""

    held: weakref.ref | None = None

    def train_epoch(self):
        in_flight = torch.ones(4)
        HoldingTrainer.held = weakref.ref(in_flight)
        raise Crash("the peer is gone")


def test_a_failed_rank_lets_go_of_its_frames_values_and_keeps_its_traceback(tmp_path):
    """The error ``launch`` raises no longer holds the failed frames' tensors (teardown would wait for them for
    nothing, delaying torchrun's restart), and its traceback still names the line that failed."""
    with pytest.raises(Crash) as caught:
        trainkit.launch(HoldingTrainer, make_cfg(tmp_path / "run", epochs=1))
    assert HoldingTrainer.held is not None and HoldingTrainer.held() is None
    shown = "".join(traceback.format_exception(caught.value))
    assert 'raise Crash("the peer is gone")' in shown and "in train_epoch" in shown
