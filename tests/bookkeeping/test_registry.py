"""Point tests of the checkpoint registry: registration rules, collecting and applying payloads."""

from __future__ import annotations

import pytest

from trainkit.bookkeeping import RESERVED_NAMES, CkptRegistry, apply_payload, collect_payload, register_items
from trainkit.errors import RegistryError


class Stateful:
    """A model or optimizer stand-in that records the state dicts it was given."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.loaded: list[dict[str, int]] = []

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded.append(state)
        self.value = state["value"]


def registry_with(**items) -> CkptRegistry:
    registry, _ = register_items(CkptRegistry(), items)
    return registry


def test_registration_returns_a_new_registry_and_leaves_the_old_unchanged():
    """register_items returns a new registry with the names added, in order; the old one is untouched."""
    old = registry_with(model=Stateful())
    new, added = register_items(old, {"optimizer": Stateful(), "note": "hi"})
    assert added == ("optimizer", "note")
    assert new.names == ("model", "optimizer", "note")
    assert old.names == ("model",)


def test_registry_items_are_read_only():
    """The registry's mapping cannot be changed in place."""
    registry = registry_with(model=Stateful())
    with pytest.raises(TypeError):
        registry.items["other"] = 1  # type: ignore[index]


def test_duplicate_name_error_names_it():
    """Registering a name twice is an error naming that item, and the registry stays as it was."""
    registry = registry_with(model=Stateful())
    with pytest.raises(RegistryError, match="'model' is already registered"):
        register_items(registry, {"ema": Stateful(), "model": Stateful()})
    assert registry.names == ("model",)


@pytest.mark.parametrize("name", sorted(RESERVED_NAMES))
def test_reserved_name_error_names_it(name):
    """Each of trainkit's own checkpoint keys is refused as an item name, and the error names it."""
    with pytest.raises(RegistryError, match=f"checkpoint item name '{name}' is reserved"):
        register_items(CkptRegistry(), {name: 1})


@pytest.mark.parametrize("name", ["my-model", "2model", "", "a.b", 3])
def test_non_identifier_name_is_refused(name):
    """Item names must be Python identifiers, so they stay valid keys everywhere."""
    with pytest.raises(RegistryError, match="must be a Python identifier"):
        register_items(CkptRegistry(), {name: 1})


def test_collect_payload_uses_state_dict_or_the_plain_value():
    """Objects with state_dict() contribute its result; anything else is stored as it is."""
    registry = registry_with(model=Stateful(7), epochs_seen=3, note={"a": 1})
    assert collect_payload(registry) == {"model": {"value": 7}, "epochs_seen": 3, "note": {"a": 1}}


def test_collect_payload_treats_classes_as_plain_values():
    """A class object is stored as it is, not asked for state_dict() as if it were an instance."""
    registry = registry_with(kind=Stateful)
    assert collect_payload(registry) == {"kind": Stateful}


def test_apply_payload_calls_load_state_dict():
    """Objects with load_state_dict() receive their entry of the payload, once."""
    model = Stateful()
    registry = registry_with(model=model)
    new, restored = apply_payload(registry, {"model": {"value": 5}})
    assert model.loaded == [{"value": 5}]
    assert restored == ("model",)
    assert new.items["model"] is model


def test_apply_payload_restores_plain_values_into_the_returned_registry():
    """Plain values cannot be restored in place, so the returned registry holds them; the old one does not."""
    registry = registry_with(epochs_seen=0)
    new, restored = apply_payload(registry, {"epochs_seen": 4})
    assert new.items["epochs_seen"] == 4
    assert registry.items["epochs_seen"] == 0
    assert restored == ("epochs_seen",)


def test_apply_payload_ignores_reserved_engine_keys():
    """A whole checkpoint can be passed: the engine's own keys are not unexpected items."""
    registry = registry_with(model=Stateful())
    _, restored = apply_payload(registry, {"model": {"value": 1}, "epoch": 3, "best": {}, "rng": None})
    assert restored == ("model",)


def test_strict_error_names_every_missing_and_unexpected_entry():
    """In strict mode the error lists every registered name missing from the payload and every extra entry."""
    model = Stateful()
    registry = registry_with(model=model, optimizer=Stateful(), note="x")
    with pytest.raises(RegistryError) as info:
        apply_payload(registry, {"model": {"value": 1}, "ema": {}, "scaler": {}})
    message = str(info.value)
    assert "missing from the checkpoint: ['optimizer', 'note']" in message
    assert "in the checkpoint but not registered: ['ema', 'scaler']" in message
    assert model.loaded == []  # nothing is applied when the check fails


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({}, "missing from the checkpoint: ['model']"),
        ({"model": {"value": 1}, "ema": {}}, "in the checkpoint but not registered: ['ema']"),
    ],
    ids=["missing-only", "unexpected-only"],
)
def test_strict_refuses_either_kind_of_mismatch_alone(payload, message):
    """In strict mode a missing item alone, or an unexpected entry alone, is already an error."""
    with pytest.raises(RegistryError, match=message.replace("[", "\\[").replace("]", "\\]")):
        apply_payload(registry_with(model=Stateful()), payload)


def test_non_strict_ignores_missing_and_unexpected_entries():
    """With strict=False, missing items keep their state and extra entries are ignored."""
    model, optimizer = Stateful(), Stateful(2)
    registry = registry_with(model=model, optimizer=optimizer)
    _, restored = apply_payload(registry, {"model": {"value": 1}, "ema": {}}, strict=False)
    assert restored == ("model",)
    assert (model.value, optimizer.value) == (1, 2)
    assert optimizer.loaded == []


def test_payload_round_trip_restores_state():
    """Collecting from one registry and applying to a fresh one with the same names restores every item."""
    source = registry_with(model=Stateful(9), epochs_seen=5)
    target_model = Stateful()
    target = registry_with(model=target_model, epochs_seen=0)
    new, _ = apply_payload(target, collect_payload(source))
    assert target_model.value == 9
    assert collect_payload(new) == collect_payload(source)


class _ManyMismatches:
    """Loads nothing: fails as torch does for a model of other shapes, a line per tensor."""

    def load_state_dict(self, state):
        lines = "".join(f"\n\tsize mismatch for layer{i}.weight: copying a param of shape [64]" for i in range(40))
        raise RuntimeError("Error(s) in loading state_dict for Net:" + lines)


def test_an_item_that_cannot_load_is_refused_in_one_bounded_line_naming_it():
    """A model of other shapes: the refusal names the item and its class, repeats the first lines of torch's error and
    counts the rest, on one line (torch's own lists every tensor: 40 lines of it here)."""
    registry = CkptRegistry({"model": _ManyMismatches()})
    with pytest.raises(RegistryError) as refused:
        apply_payload(registry, {"model": {}})
    text = str(refused.value)
    assert "\n" not in text and len(text) < 800, text
    assert text.startswith("checkpoint item 'model' could not be restored into the registered _ManyMismatches: ")
    assert "size mismatch for layer0.weight" in text and "... and 37 more lines" in text
