"""throughput.mfu: perf/mfu from the model FLOPs counted once on a real batch (or given), against a hand count."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import trainkit
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import param_digest
from trainkit import BaseTrainer, Config
from trainkit.errors import ConfigError
from trainkit.loop.flops import ForwardFlops

D_IN, D_OUT, BATCH, N = 12, 5, 8, 96
PEAK = 1e9  # a configured peak: a CPU has none of its own
HAND = 2 * D_IN * D_OUT + 4 * D_IN * D_OUT
"""The model FLOPs of one sample through a bias-free Linear: 2*d_in*d_out forward (a multiply and an add per
weight), twice that backward (the gradients of the weight and of the input)."""


@attrs.frozen(kw_only=True)
class LinearConfig(Config):
    micro_batches: int = 1  # micro-batches a step: gradient accumulation
    compiled: bool = False


class LinearTrainer(BaseTrainer):
    """A bias-free Linear regressor trained by SGD, ``micro_batches`` batches a step, on every rank its share."""

    config_class = LinearConfig
    cfg: LinearConfig

    def setup(self, ckpt):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(N, D_IN, generator=generator), torch.randn(N, D_OUT, generator=generator))
        sampler = DistributedSampler(data, num_replicas=self.world_size, rank=self.rank, shuffle=False)
        self.loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        torch.manual_seed(0)
        self.model = self.make_ddp(nn.Linear(D_IN, D_OUT, bias=False))
        self.compiles = CompileCounterWithBackend("aot_eager")
        self.forward = torch.compile(self.model, backend=self.compiles) if self.cfg.compiled else self.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)

    def train_epoch(self):
        for i, (x, y) in enumerate(self.progress(self.loader)):
            loss = nn.functional.mse_loss(self.forward(x), y) / self.cfg.micro_batches
            loss.backward()
            if (i + 1) % self.cfg.micro_batches == 0:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.log({"train/loss": loss.detach()})

    def val_epoch(self):
        self.log({"val/loss": 0.0})


def run(tmp_path, trainer_class=LinearTrainer, **overrides):
    """Train, and return the rows of metrics.jsonl and the trainer."""
    trainer = trainer_class(make_cfg(tmp_path, {"epochs": 2}, **overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()], trainer


def test_the_forward_count_is_flop_counter_modes_and_the_hand_count():
    """ForwardFlops counts the forward as FlopCounterMode does (2*d_in*d_out a sample, by its formulas), and
    nothing of the backward; FlopCounterMode's forward+backward is 4*d_in*d_out a sample here, since no input
    gradient is computed for a leaf input: why the model FLOPs are 3x the forward, not a measured backward."""
    model, x = nn.Linear(D_IN, D_OUT, bias=False), torch.randn(BATCH, D_IN)
    with ForwardFlops() as mode:
        model(x).sum().backward()
    with FlopCounterMode(display=False) as forward:
        out = model(x)
    with FlopCounterMode(display=False) as both:
        model(x).sum().backward()
    assert mode.by_dtype == {"fp32": forward.get_total_flops()} == {"fp32": 2 * D_IN * D_OUT * BATCH}
    assert both.get_total_flops() == 4 * D_IN * D_OUT * BATCH
    assert 3 * mode.by_dtype["fp32"] == HAND * BATCH and out.shape == (BATCH, D_OUT)


def test_a_recomputed_forward_is_not_counted():
    """Under activation checkpointing the forward runs again inside backward: hardware FLOPs, not model FLOPs."""
    model, x = nn.Linear(D_IN, D_OUT, bias=False), torch.randn(BATCH, D_IN, requires_grad=True)
    with ForwardFlops() as mode:
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert mode.by_dtype == {"fp32": 2 * D_IN * D_OUT * BATCH}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_mfu_is_the_hand_count_times_the_rate_over_the_peak(tmp_path, micro_batches):
    """Every row with rates has perf/mfu = 6*d_in*d_out * samples/s / peak exactly, with 2 micro-batches a step
    too (the FLOPs are per sample, the rate is samples, not steps)."""
    rows, _ = run(tmp_path, micro_batches=micro_batches, throughput={"mfu": True, "peak_flops": PEAK})
    assert len(rows) == 2
    for row in rows:
        assert row["perf/mfu"] == pytest.approx(HAND * row["perf/samples_per_s"] / PEAK, rel=1e-12)
        assert row["perf/samples_per_s"] / row["perf/steps_per_s"] == pytest.approx(BATCH * micro_batches)


def test_a_given_count_is_used_as_given(tmp_path):
    """throughput.flops_per_sample replaces the count (and mfu turns the rates on without log_throughput)."""
    rows, _ = run(tmp_path, throughput={"mfu": True, "peak_flops": PEAK, "flops_per_sample": 1234.0})
    for row in rows:
        assert row["perf/mfu"] == pytest.approx(1234.0 * row["perf/samples_per_s"] / PEAK, rel=1e-12)


def test_no_mfu_on_a_cpu_without_a_configured_peak(tmp_path):
    """A CPU has no peak in the table: the rates come, perf/mfu does not, and nothing is counted or warned."""
    rows, _ = run(tmp_path, log_throughput=True, throughput={"mfu": True})
    assert all("perf/samples_per_s" in row and "perf/mfu" not in row for row in rows)


@pytest.mark.parametrize("compiled", [False, True])
def test_counting_changes_no_weight(tmp_path, compiled):
    """The weights after training are bit-identical with and without perf/mfu, for an eager and a compiled model;
    the compiled one is still compiled after the counted step (a first call under a dispatch mode never would be)."""
    digests, compiles = [], []
    for mfu in (False, True):
        rows, trainer = run(tmp_path / str(mfu), compiled=compiled, throughput={"mfu": mfu, "peak_flops": PEAK})
        digests.append(param_digest(trainer.model))
        compiles.append(trainer.compiles.frame_count)
        assert ("perf/mfu" in rows[0]) == mfu
    assert digests[0] == digests[1]
    assert compiles[0] == compiles[1] == (1 if compiled else 0)


def test_counted_mfu_is_the_same_on_two_ranks(tmp_path):
    """On 2 gloo ranks each rank trains half the samples: perf/samples_per_s counts both, and perf/mfu divides by
    both devices' peak, so the FLOPs a sample stay the hand count."""
    trainkit.spawn(
        LinearTrainer,
        make_cfg(tmp_path, {"epochs": 2}, throughput={"mfu": True, "peak_flops": PEAK}, dist={"timeout_s": 60}),
        2,
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["perf/mfu"] == pytest.approx(HAND * row["perf/samples_per_s"] / (2 * PEAK), rel=1e-12)


class ElementwiseTrainer(LinearTrainer):
    """LinearTrainer whose forward has no op with a FLOP formula (a slice scaled by the weights' sum)."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.forward = lambda x: x[:, :D_OUT] * self.model.weight.sum()


def test_a_count_that_finds_nothing_warns_once_and_logs_no_mfu(tmp_path):
    """A counted step with no FLOPs (no matrix multiply) gives no perf/mfu, with one warning that says how to give
    the count."""
    with pytest.warns(RuntimeWarning, match="perf/mfu is left out.*throughput.flops_per_sample") as caught:
        rows, _ = run(tmp_path, ElementwiseTrainer, throughput={"mfu": True, "peak_flops": PEAK})
    assert len([w for w in caught if "perf/mfu" in str(w.message)]) == 1
    assert rows and all("perf/samples_per_s" in row and "perf/mfu" not in row for row in rows)


def test_the_section_checks_its_keys():
    """A peak or a count that is not > 0, or an unknown dtype, is a ConfigError naming the key."""
    for bad, match in (
        ({"peak_flops": 0}, "peak_flops"),
        ({"flops_per_sample": -1.0}, "flops_per_sample"),
        ({"dtype": "int8"}, "dtype"),
    ):
        with pytest.raises(ConfigError, match=match):
            Config.from_mapping({"epochs": 1, "throughput": bad})
