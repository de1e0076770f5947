"""Every reach into torch's private API goes through :mod:`trainkit.torch_private`, and every one of them resolves on
the installed torch: a torch upgrade that moves one fails here, with the message a user would see, not in a run."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import trainkit
from trainkit import torch_private
from trainkit.errors import TorchInternalsError, TrainkitError

PACKAGE = Path(trainkit.__file__).parent
HOME = PACKAGE / "torch_private.py"

NOT_TORCH_PRIVATE = {
    "_metadata": "a module state dict's metadata: torch's state-dict convention, which load_state_dict reads",
    "_replace": "a namedtuple's public API, underscored so as not to clash with field names",
    "_getframe": "CPython's sys._getframe (messages.py: the caller's frame for a warning)",
    "_strip_protocol": "fsspec's, not torch's (a local path from a file:// URL)",
    "_forkserver": "the standard library's multiprocessing.forkserver, not torch's",
    "_forkserver_pid": "the standard library's multiprocessing.forkserver, not torch's",
    "_forkserver_alive_fd": "the standard library's multiprocessing.forkserver, not torch's",
    "_stop": "the standard library's multiprocessing.forkserver, not torch's",
}
"""Underscored names the package reads from objects it does not define, that are not torch's private API."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _private_torch_path(text: str) -> bool:
    """``text`` is a dotted torch path with a private part, e.g. ``"torch._dynamo"``."""
    parts = text.split(".")
    return (
        parts[0] == "torch"
        and len(parts) > 1
        and all(part.isidentifier() for part in parts)
        and any(_private(part) for part in parts)
    )


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py")) if path != HOME}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name trainkit defines outside torch_private: functions, classes, variables, arguments, attributes it
    sets on ``self``/``cls``. An underscored attribute read that is none of these is somebody else's."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
                names.add(node.attr)
    return names


def _foreign_private(node: ast.AST, own: set[str]) -> str | None:
    """The foreign private name ``node`` reaches, if any: ``x._name``, ``getattr(x, "_name")``, an import from a
    private torch module or of a private name, or a private torch module named in a string."""
    if isinstance(node, ast.Attribute):
        return node.attr if _private(node.attr) and node.attr not in own and not _on_self(node) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
        name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
        accessor = node.func.id in ("getattr", "hasattr", "setattr", "delattr")
        return name if accessor and isinstance(name, str) and _private(name) and name not in own else None
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
        names = node.module.split(".") + [alias.name for alias in node.names]
        return node.module if any(_private(part) for part in names) else None
    if isinstance(node, ast.Import):
        return next((alias.name for alias in node.names if _private_torch_path(alias.name)), None)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if _private_torch_path(node.value) else None
    return None


def test_no_module_but_torch_private_reaches_into_torch_internals():
    """Outside torch_private.py, no underscored name that trainkit does not define itself is read, imported or named
    (but those of :data:`NOT_TORCH_PRIVATE`, each justified)."""
    trees = _trees()
    own = _own_names(trees)
    reaches = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if (name := _foreign_private(node, own)) is not None and name not in NOT_TORCH_PRIVATE
    ]
    assert reaches == []


def test_the_scan_catches_a_reach():
    """The check itself: DataLoader internals, a private torch import and a private module by name are reported."""
    source = (
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "batched = loader._auto_collation\n"
        "held = getattr(loader, '_iterator', None)\n"
        "PRELOAD = ['torch._dynamo']\n"
    )
    found = {_foreign_private(node, set()) for node in ast.walk(ast.parse(source))} - {None}
    assert found == {"torch.utils._python_dispatch", "_auto_collation", "_iterator", "torch._dynamo"}


def test_every_bound_kernel_is_torchs_own_function():
    """The hot bindings are torch's functions themselves (no wrapper per call), and none is missing."""
    assert torch_private.missing() == []
    for name, private in [("foreach_norm", "_foreach_norm"), ("foreach_mul_", "_foreach_mul_")]:
        assert getattr(torch_private, name) is torch_private.resolve("torch", private)
    assert torch_private.foreach_copy_ is torch_private.resolve("torch", "_foreach_copy_")
    assert torch_private.autograd_task_id is torch_private.resolve("torch._C", "_current_graph_task_id")


def test_every_reach_works_on_the_installed_torch():
    """Each function, called on what trainkit calls it on."""
    tensors = [torch.ones(3), torch.full((2,), 2.0)]
    assert [float(n) for n in torch_private.foreach_norm(tensors, 2.0)] == pytest.approx([3**0.5, 8**0.5])
    torch_private.foreach_mul_(tensors, 2.0)
    targets = [torch.zeros(3), torch.zeros(2)]
    torch_private.foreach_copy_(targets, tensors)
    assert targets[1].tolist() == [4.0, 4.0]
    assert torch_private.autograd_task_id() == -1  # outside any backward

    loader = DataLoader(list(range(6)), batch_size=2)
    assert torch_private.loader_uses_batch_sampler(loader)
    assert not torch_private.loader_uses_batch_sampler(DataLoader(list(range(6)), batch_size=None))
    assert torch_private.makes_iterator_as_dataloader(DataLoader)
    assert torch_private.persistent_iterator(loader) is None and torch_private.persistent_iterator([1]) is None
    iterator = iter(loader)
    stream = torch_private.index_stream(iterator)
    assert stream is not None and torch_private.index_stream(iter([1])) is None
    torch_private.set_index_stream(iterator, iter([[4, 5]]))
    torch_private.set_index_sampler(iterator, loader.batch_sampler)
    assert next(iterator).tolist() == [4, 5]

    assert issubclass(torch_private.dispatch_mode_base(), object)
    assert str(torch_private.legacy_convolution_op()) == "aten._convolution"
    assert torch_private.dcp_storage_info_class().__name__ == "_StorageInfo"
    assert torch_private.tensor_layout_by_name()("torch.strided") is torch.strided
    filled: dict = {}
    torch_private.dcp_set_element(filled, ("a", "b"), 1)
    assert filled == {"a": {"b": 1}}
    assert torch_private.narrow_tensor_by_index(torch.arange(10), [2], [3]).tolist() == [2, 3, 4]
    plain = torch.zeros(2)
    assert torch_private.dtensor_local_shard(plain) is plain
    assert not torch_private.optimizer_unscales_itself(torch.optim.SGD([torch.nn.Parameter(plain)], lr=0.1))
    linear = torch.nn.Linear(1, 1)
    assert torch_private.compiled_inner_module(linear) is None
    assert importlib.util.find_spec(torch_private.COMPILER_MODULE) is not None  # found, not imported (2-3 s)


def test_a_moved_name_fails_with_the_thing_the_version_and_the_fix(monkeypatch):
    """A torch without the name: the error names it and the torch found, and says which versions to use."""
    monkeypatch.delattr(torch, "_foreach_norm")
    with pytest.raises(TorchInternalsError) as caught:
        torch_private.resolve("torch", "_foreach_norm")
    message = str(caught.value)
    assert "torch._foreach_norm" in message and torch.__version__ in message and ">=2.4" in message
    assert isinstance(caught.value, TrainkitError) and isinstance(caught.value, RuntimeError)
    stand_in = torch_private.bind("torch", "_foreach_norm")
    with pytest.raises(TorchInternalsError, match="torch._foreach_norm"):
        stand_in([torch.ones(1)], 2.0)
    assert torch_private.missing() == ["torch._foreach_norm"]


def test_a_dataloader_without_its_internals_fails_with_the_name(monkeypatch):
    """A DataLoader attribute torch renamed: the message names ``DataLoader.<name>`` and the version."""
    loader = DataLoader(list(range(4)), batch_size=2)
    monkeypatch.delattr(DataLoader, "_auto_collation")
    with pytest.raises(
        TorchInternalsError, match=rf"DataLoader\._auto_collation.*torch {re.escape(torch.__version__)}"
    ):
        torch_private.loader_uses_batch_sampler(loader)
    with pytest.raises(TorchInternalsError, match="torch.no_such_module.thing"):
        torch_private.resolve("torch.no_such_module", "thing")
