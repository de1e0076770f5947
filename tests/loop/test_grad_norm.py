"""Gradient norms, clipping and per-parameter statistics: values against torch's own, and no host syncs."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.helpers.configs import make_cfg
from tests.helpers.host_syncs import HOST_SYNCS, count_host_syncs
from trainkit import BaseTrainer
from trainkit.loop.trainer_metrics import FiniteMean, LogBuffer


class Net(nn.Module):
    """Two trained layers around a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.frozen(self.inp(x).tanh()).tanh())


TRAINABLE = ["inp.weight", "inp.bias", "out.weight", "out.bias"]


class NetTrainer(BaseTrainer):
    """Builds Net and an SGD optimizer; the tests drive the steps themselves."""

    def setup(self, ckpt):
        torch.manual_seed(0)
        self.model = Net()
        self.optimizer = torch.optim.SGD(self.get_param_groups(), lr=0.1)
        self.other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer, other=self.other)

    def train_epoch(self):
        pass

    def val_epoch(self):
        return None


@pytest.fixture
def make_trainer(tmp_path):
    made = []

    def make(**overrides):
        # 2 epochs, no checkpoints, and the engine's default direction (the validation loss maximized)
        trainer = NetTrainer(make_cfg(tmp_path, {"epochs": 2, "ckpt": {"enable": False}, "val": {"minimize": False}},
                                      **overrides))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()


def backward(model: nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    model.zero_grad(set_to_none=True)
    (scale * nn.functional.mse_loss(model(x), y)).backward()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------- clip_and_log_grad_norm


def test_unclipped_norm_equals_torch_and_leaves_grads_alone(make_trainer):
    """With grad_clip unset the returned norm equals clip_grad_norm_'s and the gradients are untouched."""
    trainer = make_trainer()
    reference = copy.deepcopy(trainer.model)
    backward(trainer.model, scale=10.0)
    backward(reference, scale=10.0)
    before = grads(trainer.model)

    norm = trainer.clip_and_log_grad_norm()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), max_norm=float("inf"))

    assert norm.shape == ()
    torch.testing.assert_close(norm, expected)
    after = grads(trainer.model)
    assert after.keys() == before.keys() == set(TRAINABLE)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)


def test_clipped_grads_equal_torch_clip_grad_norm(make_trainer):
    """With grad_clip set, grads are scaled exactly as clip_grad_norm_ scales them and the pre-clip norm is returned."""
    trainer = make_trainer(grad_clip=0.25)
    reference = copy.deepcopy(trainer.model)
    backward(trainer.model, scale=10.0)
    backward(reference, scale=10.0)

    norm = trainer.clip_and_log_grad_norm()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.25)

    torch.testing.assert_close(norm, expected)
    assert norm > 0.25, "the test must actually clip"
    clipped, want = grads(trainer.model), grads(reference)
    assert clipped.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(clipped[name], want[name])
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()]))
    torch.testing.assert_close(total, torch.tensor(0.25), atol=1e-5, rtol=0)


def test_clip_over_several_modules_spans_all_of_them(make_trainer):
    """clip_and_log_grad_norm(model, head) measures and clips the gradients of both modules together."""
    trainer = make_trainer(grad_clip=0.1)
    torch.manual_seed(3)
    head = nn.Linear(1, 1)
    ref_model, ref_head = copy.deepcopy(trainer.model), copy.deepcopy(head)
    x = torch.randn(8, 4)
    for model, extra in ((trainer.model, head), (ref_model, ref_head)):
        extra(model(x)).pow(2).sum().mul(10).backward()

    norm = trainer.clip_and_log_grad_norm(trainer.model, head)
    expected = nn.utils.clip_grad_norm_([*ref_model.parameters(), *ref_head.parameters()], max_norm=0.1)

    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(head.weight.grad, ref_head.weight.grad)
    torch.testing.assert_close(trainer.model.inp.weight.grad, ref_model.inp.weight.grad)


def test_grad_norm_is_buffered_until_push(make_trainer):
    """train/grad_norm waits in the buffer and push_logs() delivers the pre-clip norm as a float."""
    trainer = make_trainer(grad_clip=0.25)
    backward(trainer.model, scale=10.0)
    norm = trainer.clip_and_log_grad_norm()
    pushed = trainer.push_logs()
    assert pushed == {"train/grad_norm": pytest.approx(float(norm))}
    assert trainer.push_logs() == {}


@pytest.mark.parametrize("grad_clip", [None, 0.25])
def test_clip_and_log_grad_norm_does_not_sync_with_the_host(make_trainer, monkeypatch, grad_clip):
    """Measuring, clipping and logging the norm (and the epoch mean) call no tensor-to-host method.

    The norm takes the accelerator's path (``LogBuffer.read_cpu_at_log`` off: a CPU tensor is read at log time).
    """
    monkeypatch.setattr(LogBuffer, "read_cpu_at_log", False)
    trainer = make_trainer(grad_clip=grad_clip)
    backward(trainer.model, scale=10.0)
    with count_host_syncs() as counts:
        trainer.clip_and_log_grad_norm()
        trainer.clip_and_log_grad_norm()
        trainer.log_epoch_grad_norm()
    assert counts == Counter()


def test_host_sync_counter_sees_syncs(monkeypatch):
    """The counter used above does notice each kind of host transfer (so a zero count means something)."""
    t = torch.ones(())
    with count_host_syncs() as counts:
        t.item(), float(t), t.tolist(), t.cpu(), int(t), bool(t), t.numpy()
    assert counts == Counter({name: 1 for name in HOST_SYNCS})


def test_epoch_grad_norm_is_the_mean_since_the_last_call(make_trainer):
    """log_epoch_grad_norm() logs the mean of the norms measured since its last call, then starts over."""
    trainer = make_trainer()
    norms = []
    for seed, scale in enumerate([1.0, 3.0, 5.0]):
        backward(trainer.model, seed, scale)
        norms.append(float(trainer.clip_and_log_grad_norm()))
    trainer.log_epoch_grad_norm()
    pushed = trainer.push_logs()
    assert pushed["train/grad_norm_epoch"] == pytest.approx(sum(norms) / 3)
    assert pushed["train/grad_norm"] == pytest.approx(norms[-1])

    second = []
    for seed, scale in enumerate([7.0, 2.0], start=10):
        backward(trainer.model, seed, scale)
        second.append(float(trainer.clip_and_log_grad_norm()))
    trainer.log_epoch_grad_norm()
    assert trainer.push_logs()["train/grad_norm_epoch"] == pytest.approx(sum(second) / 2)

    trainer.log_epoch_grad_norm()  # nothing measured since
    assert trainer.push_logs() == {}


# ---------------------------------------------------------------------------------- log_param_grad_stats


def stat_keys(kinds):
    return {f"params/{name}/{kind}" for name in TRAINABLE for kind in kinds}


def test_param_stats_log_nothing_with_both_gates_off(make_trainer):
    """With log_weight_stats and log_grad_stats both off (the default) no params/* key is logged."""
    trainer = make_trainer(log_stats_every_n_steps=1)
    backward(trainer.model)
    trainer.log_param_grad_stats()
    assert trainer.push_logs() == {}


def test_weight_stats_gate_logs_weight_norms_only(make_trainer):
    """log_weight_stats logs params/<name>/weight_norm per trainable parameter, equal to its vector norm."""
    trainer = make_trainer(log_weight_stats=True)
    backward(trainer.model)
    trainer.log_param_grad_stats()
    pushed = trainer.push_logs()
    assert set(pushed) == stat_keys(["weight_norm"])
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            expected = torch.linalg.vector_norm(param).item()
            assert pushed[f"params/{name}/weight_norm"] == pytest.approx(expected, rel=1e-6)


def test_grad_stats_gate_logs_grad_norms_and_ratios(make_trainer):
    """log_grad_stats logs params/<name>/grad_norm and grad_to_weight: the per-parameter norms and their ratio."""
    trainer = make_trainer(log_grad_stats=True)
    backward(trainer.model, scale=4.0)
    trainer.log_param_grad_stats()
    pushed = trainer.push_logs()
    assert set(pushed) == stat_keys(["grad_norm", "grad_to_weight"])
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:
            continue
        grad_norm = torch.linalg.vector_norm(param.grad).item()
        weight_norm = torch.linalg.vector_norm(param).item()
        assert pushed[f"params/{name}/grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
        assert pushed[f"params/{name}/grad_to_weight"] == pytest.approx(grad_norm / weight_norm, rel=1e-5)


def test_grad_to_weight_of_an_all_zero_weight_is_finite(make_trainer):
    """A zero-initialised bias has an undefined grad-to-weight ratio: it is logged as 0, never inf or NaN."""
    trainer = make_trainer(log_grad_stats=True, log_weight_stats=True)
    with torch.no_grad():
        trainer.model.out.bias.zero_()
    backward(trainer.model)
    assert trainer.model.out.bias.grad.abs().sum() > 0  # a real gradient on a zero weight
    trainer.log_param_grad_stats()
    pushed = trainer.push_logs()
    assert pushed["params/out.bias/weight_norm"] == 0.0
    assert pushed["params/out.bias/grad_to_weight"] == 0.0
    assert all(math.isfinite(value) for value in pushed.values())
    grad_norm = torch.linalg.vector_norm(trainer.model.inp.bias.grad).item()
    weight_norm = torch.linalg.vector_norm(trainer.model.inp.bias).item()
    assert pushed["params/inp.bias/grad_to_weight"] == pytest.approx(grad_norm / weight_norm, rel=1e-5)


def test_both_gates_log_all_three_stats(make_trainer):
    """With both gates on every trainable parameter gets weight_norm, grad_norm and grad_to_weight."""
    trainer = make_trainer(log_weight_stats=True, log_grad_stats=True)
    backward(trainer.model)
    trainer.log_param_grad_stats()
    assert set(trainer.push_logs()) == stat_keys(["weight_norm", "grad_norm", "grad_to_weight"])


def test_grad_stats_without_gradients_log_nothing(make_trainer):
    """Before any backward (no .grad anywhere) the grad gate logs nothing instead of failing, and weights still log."""
    trainer = make_trainer(log_grad_stats=True)
    trainer.log_param_grad_stats()
    assert trainer.push_logs() == {}

    both = make_trainer(log_grad_stats=True, log_weight_stats=True)
    both.log_param_grad_stats()
    assert set(both.push_logs()) == stat_keys(["weight_norm"])


def test_step_advances_with_the_first_registered_optimizer_only(make_trainer):
    """trainer.step counts step() calls of the first registered optimizer; a second registered one does not move it."""
    trainer = make_trainer()
    assert trainer.step == 0
    for expected in (1, 2, 3):
        backward(trainer.model)
        trainer.optimizer.step()
        assert trainer.step == expected
    trainer.other.step()
    assert trainer.step == 3


def test_param_stats_are_throttled_to_every_n_steps(make_trainer):
    """Statistics are logged only when trainer.step (the optimizer advances it) divides by log_stats_every_n_steps."""
    trainer = make_trainer(log_weight_stats=True, log_grad_stats=True, log_stats_every_n_steps=3)
    logged_at = []
    for _ in range(8):
        backward(trainer.model)
        step = trainer.step
        trainer.log_param_grad_stats()
        trainer.optimizer.step()
        if any(key.startswith("params/") for key in trainer.push_logs()):
            logged_at.append(step)
    assert trainer.step == 8
    assert logged_at == [0, 3, 6]


def test_param_stats_do_not_sync_with_the_host(make_trainer, monkeypatch):
    """Computing and buffering the per-parameter statistics calls no tensor-to-host method."""
    trainer = make_trainer(log_weight_stats=True, log_grad_stats=True)
    backward(trainer.model)
    with count_host_syncs() as counts:
        trainer.log_param_grad_stats()
    assert counts == Counter()
    assert len(trainer.push_logs()) == 3 * len(TRAINABLE)


# ---------------------------------------------------------------------------------- the guard's finite mean

NORMS = st.lists(st.one_of(st.floats(0, 1e6, width=32), st.just(math.nan), st.just(math.inf)), min_size=1, max_size=30)


@given(NORMS, st.integers(0, 30), st.booleans())
def test_the_finite_mean_is_that_of_the_finite_values_and_resumes_exactly(values, cut, on_host):
    """FiniteMean (train/grad_norm_epoch under the guard) is the mean of the finite values, NaN when there is none;
    a copy restored from its state after ``cut`` values and fed the rest ends bit for bit where it does, whether the
    values come read on the host or as tensors."""

    def add(mean, value):
        mean.add(torch.tensor(value), value if on_host else None)

    mean = FiniteMean()
    for value in values[:cut]:
        add(mean, value)
    resumed = FiniteMean()
    resumed.load_state_dict(mean.state_dict())
    for value in values[cut:]:
        add(mean, value)
        add(resumed, value)
    got, again = float(mean.take()), float(resumed.take())
    finite = [value for value in values if math.isfinite(value)]
    if finite:
        assert got == again == pytest.approx(sum(finite) / len(finite), rel=1e-5)
    else:
        assert math.isnan(got) and math.isnan(again)
    assert mean.take() is None
