"""Two checkpoints compared section by section: the first differing item and tensor, and what is left out by rule."""

from __future__ import annotations

import math

import torch

from trainkit.checkpoint import atomic_save
from trainkit.checkpoint.compare import comparable_sections, compare_checkpoints, first_difference


def _last(weight: torch.Tensor, **extra) -> dict:
    """A last-checkpoint-shaped payload with a model and an optimizer item."""
    return {
        "model": {"weight": weight, "bias": torch.zeros(2)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]},
        "items": ["model", "optimizer"],
        "loop": {"epoch": 0, "step": 3},
        "rng": [{"torch": b"\x01"}],
        "trainkit": None,
        "latest_metrics": {"train/loss": 0.5, "perf/train_s": 0.01},
        "config": {"out_dir": "runs/a"},
        "wandb_run_id": "abc",
        "metrics_offset": 120,
        **extra,
    }


def test_the_first_differing_tensor_is_named_with_its_largest_difference():
    """Walking in key order, the first tensor that differs is reported with its max abs difference."""
    a = {"layers": {"0.weight": torch.zeros(3), "1.weight": torch.zeros(2)}}
    b = {"layers": {"0.weight": torch.tensor([0.0, -0.25, 0.125]), "1.weight": torch.ones(2)}}
    found = first_difference(a, b, section="model")
    assert (found.section, found.name, found.max_abs_diff) == ("model", "layers.0.weight", 0.25)


def test_nan_where_both_have_nan_is_the_same_but_a_dtype_or_shape_change_is_not():
    """NaN at the same places compares equal (and NaN floats too); another dtype or shape is a difference."""
    nan = torch.tensor([1.0, math.nan])
    assert first_difference({"w": nan}, {"w": nan.clone()}) is None
    assert first_difference({"x": math.nan}, {"x": math.nan}) is None
    assert "float64" in first_difference({"w": nan}, {"w": nan.double()}).detail
    assert first_difference([1, 2], [1, 2, 3]).detail == "2 entries against 3"
    assert first_difference({"a": 1}, {"b": 1}).detail == "present in one run only"


def test_run_specific_entries_and_wall_clock_metrics_are_left_out():
    """Two runs' payloads that differ only in their config, W&B run id, metrics offset and perf/* metrics compare
    equal; the sections come in registration order."""
    a = _last(torch.zeros(2))
    b = _last(torch.zeros(2), config={"out_dir": "runs/b"}, wandb_run_id="xyz", metrics_offset=133)
    b["latest_metrics"] = {"train/loss": 0.5, "perf/train_s": 0.02}
    left, right = comparable_sections(a), comparable_sections(b)
    assert list(left)[:2] == ["model", "optimizer"]
    assert all(first_difference(left[key], right[key]) is None for key in left)


def test_two_checkpoint_files_name_the_first_item_that_differs(tmp_path):
    """On real files: a changed optimizer state is found in the optimizer item when the model is the same."""
    atomic_save(_last(torch.zeros(2)), tmp_path / "a.pt")
    changed = _last(torch.zeros(2))
    changed["optimizer"]["state"][0]["momentum_buffer"] = torch.tensor([1.0, 1.5])
    atomic_save(changed, tmp_path / "b.pt")
    assert compare_checkpoints(tmp_path / "a.pt", tmp_path / "a.pt") is None
    found = compare_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt")
    assert (found.section, found.name, found.max_abs_diff) == ("optimizer", "state.0.momentum_buffer", 0.5)
