"""The pure core stays pure: importing it loads no heavy dependency; its modules import only the stdlib and attrs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainkit

PACKAGE = Path(trainkit.__file__).parent
HEAVY = ("torch", "wandb", "tqdm")
CORE_MODULES = [
    *sorted((PACKAGE / "bookkeeping").glob("*.py")), *sorted((PACKAGE / "config").glob("*.py")), PACKAGE / "errors.py"
]
ALLOWED_THIRD_PARTY = {"attrs"}
ALLOWED_TRAINKIT = ("trainkit.bookkeeping", "trainkit.config", "trainkit.errors")


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this same trainkit checkout; return its stdout."""
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("module", ["trainkit.bookkeeping", "trainkit.config.schema", "trainkit"])
def test_import_loads_no_heavy_dependency(module):
    """Importing the core, the config or the package in a fresh interpreter loads none of torch, wandb or tqdm."""
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    assert json.loads(run_python(code)) == []


def test_the_purity_check_can_see_a_heavy_import():
    """The subprocess check above does report a heavy module when one is imported (so it cannot pass vacuously)."""
    code = "import json, sys, tqdm; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'tqdm')))"
    assert "tqdm" in json.loads(run_python(code))


def imported_modules(source: str, package: str) -> list[str]:
    """Every absolute module name ``source`` imports, at any depth, with relative imports resolved in ``package``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            names.append("<dynamic import>")
    return names


def is_allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
        return True
    return any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED_TRAINKIT)


@pytest.mark.parametrize("path", CORE_MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_core_module_imports_only_stdlib_attrs_and_core(path):
    """Each core module imports only stdlib modules, attrs, trainkit.bookkeeping and trainkit.errors."""
    package = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
    names = imported_modules(path.read_text(encoding="utf-8"), package)
    assert names, f"found no imports at all in {path}"
    assert [name for name in names if not is_allowed(name)] == []


def test_import_checker_flags_forbidden_imports():
    """The static check rejects a third-party import, a relative import of the shell and a dynamic import."""
    source = (
        "import math, attrs\n"
        "from numpy import float32\n"
        "from ..errors import BookkeepingError\n"
        "from .best import BestState\n"
        "def f():\n"
        "    import torch\n"
        "    from ..trainer import BaseTrainer\n"
        "    return importlib.import_module('wandb')\n"
    )
    names = imported_modules(source, "trainkit.bookkeeping")
    assert names[:4] == ["math", "attrs", "numpy", "trainkit.errors"]
    assert [name for name in names if not is_allowed(name)] == [
        "numpy",
        "torch",
        "trainkit.trainer",
        "<dynamic import>",
    ]
