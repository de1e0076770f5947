"""Weight-decay parameter groups and learning-rate logging, on a tiny language-model-shaped network.

The network has every kind of parameter the decay rule must sort: an embedding table tied to the output
head, a custom RMSNorm with a 1-D gain, a 2-D positional table held as a bare ``nn.Parameter``, a frozen
layer and a Linear with a bias.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from tests.helpers.configs import make_cfg
from trainkit import BaseTrainer
from trainkit.config import DEFAULT_NO_WEIGHT_DECAY
from trainkit.loop.optim import make_param_groups, named_trainable_parameters, trainable_parameters

VOCAB, DIM, CTX = 11, 6, 5


class RMSNorm(nn.Module):
    """A norm layer that is not a torch built-in, so nothing but its shape marks the gain as a scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class TinyLM(nn.Module):
    """Embedding tied to the head, positional table, frozen layer, biased projection, custom norm."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Parameter(0.02 * torch.randn(CTX, DIM))
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.proj = nn.Linear(DIM, DIM)
        self.ln_f = RMSNorm(DIM)  # named so that only the 1-D rule, not a name fragment, exempts its gain
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[-1]]
        x = self.proj(self.frozen(x)).relu()
        return self.lm_head(self.ln_f(x))


class Head(nn.Module):
    """An extra trained module (an objective's projection head) sharing the model's embedding table."""

    def __init__(self, shared: nn.Embedding) -> None:
        super().__init__()
        self.emb_ref = shared
        self.out = nn.Linear(DIM, 3)


# With the default fragments: pos_emb is 2-D but a *_emb table, tok_emb.weight is the tied table (listed
# under its first name), proj.bias and ln_f.gain are 1-D. Only proj.weight is decayed.
EXPECTED_DECAY = ["proj.weight"]
EXPECTED_NO_DECAY = ["pos_emb", "tok_emb.weight", "proj.bias", "ln_f.gain"]


class LMTrainer(BaseTrainer):
    """A trainer whose setup builds TinyLM and an AdamW over get_param_groups()."""

    def setup(self, ckpt):
        torch.manual_seed(0)
        self.model = TinyLM()
        self.optimizer = torch.optim.AdamW(self.get_param_groups(), lr=1e-2)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)

    def train_epoch(self):
        batch = torch.randint(0, VOCAB, (4, CTX))
        loss = nn.functional.cross_entropy(self.model(batch).flatten(0, 1), batch.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def val_epoch(self):
        return None


def make_trainer(tmp_path, cls=LMTrainer, **overrides):
    """A ``cls`` on 2 epochs, weight decay 0.1, and the engine's default direction (the validation loss maximized)."""
    return cls(make_cfg(tmp_path, {"epochs": 2, "weight_decay": 0.1, "val": {"minimize": False}}, **overrides))


def default_groups(model: nn.Module) -> list[dict]:
    return make_param_groups([model], weight_decay=0.1, no_weight_decay=DEFAULT_NO_WEIGHT_DECAY)


def by_name(groups):
    return {group["name"]: group for group in groups}


def names(group: dict, *modules: nn.Module) -> list[str]:
    """The names of a group's parameters, in its order, as named_trainable_parameters() names them."""
    name_of = {id(param): name for name, param in named_trainable_parameters(list(modules))}
    return [name_of[id(param)] for param in group["params"]]


def lm_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, VOCAB, (4, CTX), generator=gen)
    loss = nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def test_trainer_groups_split_decay_by_shape_and_name(tmp_path):
    """get_param_groups() makes a decay group at cfg.weight_decay and a no_decay group at 0 for 1-D and *_emb params."""
    trainer = make_trainer(tmp_path)
    try:
        groups = trainer.get_param_groups()
        assert [g["name"] for g in groups] == ["decay", "no_decay"]
        decay, no_decay = groups
        assert decay["weight_decay"] == 0.1
        assert no_decay["weight_decay"] == 0.0
        assert names(decay, trainer.model) == EXPECTED_DECAY
        assert names(no_decay, trainer.model) == EXPECTED_NO_DECAY
        for group in groups:
            for param in group["params"]:
                if param.ndim <= 1:
                    assert group["name"] == "no_decay"
    finally:
        trainer.close()


def test_every_trainable_param_lands_in_exactly_one_group_once(tmp_path):
    """Each trainable parameter appears once across both groups (the tied weight once), and frozen ones not at all."""
    trainer = make_trainer(tmp_path)
    try:
        model = trainer.model
        grouped = [p for group in trainer.get_param_groups() for p in group["params"]]
        assert len(grouped) == len({id(p) for p in grouped})
        trainable = {id(p) for p in model.parameters() if p.requires_grad}  # parameters() dedups the tie
        assert {id(p) for p in grouped} == trainable
        assert sum(1 for p in grouped if p is model.tok_emb.weight) == 1
        assert model.lm_head.weight is model.tok_emb.weight
        frozen = {id(p) for p in model.frozen.parameters()}
        assert not frozen & {id(p) for p in grouped}
    finally:
        trainer.close()


def test_param_groups_work_with_everything_torch_optimizers_accept():
    """Groups carry no param_names, so a plain group added later with add_param_group() works, on any optimizer."""
    model = TinyLM()
    groups = make_param_groups([model], weight_decay=0.1, no_weight_decay=DEFAULT_NO_WEIGHT_DECAY)
    assert all("param_names" not in group for group in groups)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    extra = nn.Linear(DIM, 2)
    optimizer.add_param_group({"params": list(extra.parameters()), "lr": 1e-4})
    assert optimizer.param_groups[-1]["lr"] == 1e-4
    lm_step(model, optimizer)  # the optimizer still steps with the added group
    for build in (torch.optim.SGD, torch.optim.Adam, torch.optim.RMSprop, torch.optim.Adagrad):
        build(make_param_groups([TinyLM()], weight_decay=0.1, no_weight_decay=("_emb",)), lr=1e-3)


def test_name_fragments_decide_for_2d_params_only():
    """A fragment exempts a 2-D parameter; without fragments 2-D tables are decayed but 1-D ones never are."""
    model = TinyLM()
    none_exempt = by_name(make_param_groups([model], weight_decay=0.5, no_weight_decay=()))
    assert names(none_exempt["decay"], model) == ["pos_emb", "tok_emb.weight", "proj.weight"]
    assert names(none_exempt["no_decay"], model) == ["proj.bias", "ln_f.gain"]
    assert none_exempt["decay"]["weight_decay"] == 0.5

    proj_exempt = by_name(make_param_groups([model], weight_decay=0.5, no_weight_decay=["proj"]))
    assert names(proj_exempt["decay"], model) == ["pos_emb", "tok_emb.weight"]
    assert names(proj_exempt["no_decay"], model) == ["proj.weight", "proj.bias", "ln_f.gain"]


def test_empty_group_is_left_out():
    """A model with nothing to decay gets only the no_decay group, which torch optimizers accept."""
    groups = make_param_groups([RMSNorm(4)], weight_decay=0.1, no_weight_decay=DEFAULT_NO_WEIGHT_DECAY)
    assert [g["name"] for g in groups] == ["no_decay"]
    torch.optim.AdamW(groups, lr=1e-3)


def test_groups_are_deterministic_across_builds():
    """Two builds over identically constructed models give the same names in the same order, in the same groups."""

    def layout():
        torch.manual_seed(0)
        model = TinyLM()
        groups = make_param_groups([model], weight_decay=0.1, no_weight_decay=DEFAULT_NO_WEIGHT_DECAY)
        return [(g["name"], g["weight_decay"], names(g, model), [tuple(p.shape) for p in g["params"]]) for g in groups]

    assert layout() == layout()


def test_extra_modules_join_the_same_groups_with_shared_params_once(tmp_path):
    """Modules passed to get_param_groups(model, head) share the two groups; a param in both is listed once."""
    trainer = make_trainer(tmp_path)
    try:
        model = trainer.model
        head = Head(model.tok_emb)
        groups = by_name(trainer.get_param_groups(model, head))
        assert set(groups) == {"decay", "no_decay"}
        assert names(groups["decay"], model, head) == ["0." + n for n in EXPECTED_DECAY] + ["1.out.weight"]
        assert names(groups["no_decay"], model, head) == ["0." + n for n in EXPECTED_NO_DECAY] + ["1.out.bias"]
        grouped = [p for g in groups.values() for p in g["params"]]
        assert len(grouped) == len({id(p) for p in grouped})
        assert sum(1 for p in grouped if p is model.tok_emb.weight) == 1
        assert any(p is head.out.weight for p in groups["decay"]["params"])
    finally:
        trainer.close()


def test_adamw_steps_with_the_groups_and_decays_only_the_decay_group():
    """AdamW accepts the groups; with a zero gradient only decay-group weights shrink, no_decay ones stay put."""
    torch.manual_seed(0)
    model = TinyLM()
    groups = make_param_groups([model], weight_decay=0.5, no_weight_decay=DEFAULT_NO_WEIGHT_DECAY)
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    for name in EXPECTED_DECAY:
        torch.testing.assert_close(after[name].detach(), before[name] * (1 - 0.1 * 0.5))
    for name in EXPECTED_NO_DECAY:
        torch.testing.assert_close(after[name].detach(), before[name], rtol=0, atol=0)
    torch.testing.assert_close(after["frozen.weight"].detach(), before["frozen.weight"], rtol=0, atol=0)

    lm_step(model, optimizer)  # and a real step with real gradients
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_optimizer_state_round_trips_through_state_dict():
    """AdamW state saved over one model's groups loads into AdamW over a rebuilt model's groups and continues alike."""
    torch.manual_seed(0)
    model_a = TinyLM()
    opt_a = torch.optim.AdamW(default_groups(model_a), lr=1e-2)
    for seed in range(3):
        lm_step(model_a, opt_a, seed)

    torch.manual_seed(1)
    model_b = TinyLM()
    model_b.load_state_dict(model_a.state_dict())
    opt_b = torch.optim.AdamW(default_groups(model_b), lr=1e-2)
    buffer = io.BytesIO()  # through bytes, as a checkpoint file would; a live state_dict shares its tensors
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))

    assert [g["name"] for g in opt_b.param_groups] == ["decay", "no_decay"]
    assert [names(g, model_b) for g in opt_b.param_groups] == [names(g, model_a) for g in opt_a.param_groups]
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for pa, pb in zip(params_a, params_b, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_b.state[pb][key], opt_a.state[pa][key], rtol=0, atol=0)

    lm_step(model_a, opt_a, 7)
    lm_step(model_b, opt_b, 7)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------- log_lr


class ScheduledTrainer(LMTrainer):
    """LMTrainer with a StepLR halving the learning rate each step, and an unregistered second optimizer."""

    def setup(self, ckpt):
        super().setup(ckpt)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.add_checkpoint_items(scheduler=self.scheduler)


def test_log_lr_keys_name_optimizer_and_group_and_follow_the_scheduler(tmp_path):
    """log_lr() logs lr/<registered name>/<group name> with the current lr, halved after a StepLR step."""
    trainer = make_trainer(tmp_path, ScheduledTrainer, ckpt={"enable": False})
    try:
        trainer.log_lr()
        assert trainer.push_logs() == {"lr/optimizer/decay": 1e-2, "lr/optimizer/no_decay": 1e-2}
        lm_step(trainer.model, trainer.optimizer)
        trainer.scheduler.step()
        trainer.log_lr()
        assert trainer.push_logs() == {"lr/optimizer/decay": 5e-3, "lr/optimizer/no_decay": 5e-3}
    finally:
        trainer.close()


def test_log_lr_uses_registered_names_only_and_group_index_without_a_name(tmp_path):
    """Registered optimizers are logged under their registered name; a group without a name uses its index."""

    class TwoOptimizers(LMTrainer):
        def setup(self, ckpt):
            torch.manual_seed(0)
            self.model = TinyLM()
            self.head = nn.Linear(DIM, 2)
            self.main_opt = torch.optim.AdamW(self.get_param_groups(), lr=1e-2)
            self.head_opt = torch.optim.SGD(self.head.parameters(), lr=0.3)  # plain groups: no "name"
            self.add_checkpoint_items(model=self.model, adam=self.main_opt, sgd=self.head_opt)

    trainer = make_trainer(tmp_path, TwoOptimizers, ckpt={"enable": False})
    try:
        trainer.log_lr()
        assert trainer.push_logs() == {"lr/adam/decay": 1e-2, "lr/adam/no_decay": 1e-2, "lr/sgd/0": 0.3}
    finally:
        trainer.close()


class HeadFirstLM(nn.Module):
    """An LM whose output head is declared before the embedding it is tied to."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.tok_emb = nn.Embedding(50, 16)
        self.lm_head.weight = self.tok_emb.weight


def test_tied_embedding_is_undecayed_whichever_is_declared_first():
    """A weight tied between lm_head and tok_emb is exempt from decay even when lm_head comes first."""
    model = HeadFirstLM()
    groups = default_groups(model)
    assert {group["name"]: names(group, model) for group in groups} == {"no_decay": ["lm_head.weight"]}


def test_trainable_parameters_match_the_named_walk_without_names():
    """The name-free walk the per-step helpers use lists the same parameters, in the same order."""
    embed = nn.Embedding(7, 4)
    head = nn.Linear(4, 7, bias=False)
    head.weight = embed.weight  # tied
    frozen = nn.Linear(4, 4).requires_grad_(False)
    body = nn.Sequential(embed, nn.Linear(4, 4), frozen, head)
    extra = nn.Sequential(nn.Linear(4, 2), body[1])  # shares a layer with body
    for modules in ([body], [body, extra], [extra, body], [frozen], [nn.Sequential(frozen), extra]):
        expected = [id(p) for _, p in named_trainable_parameters(modules)]
        assert [id(p) for p in trainable_parameters(modules)] == expected
