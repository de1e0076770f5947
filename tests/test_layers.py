"""The house in layers: which layer imports which, written once, and held against every import in the package.

Every ``import`` counts, at module level, inside a function or under ``TYPE_CHECKING`` alike: an import hidden in a
function still ties the two modules together.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import trainkit

PACKAGE = Path(trainkit.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("trainkit.errors", "trainkit.messages"),
    ("trainkit.bookkeeping",),
    ("trainkit.config",),
    ("trainkit.files",),
    ("trainkit.state",),
    ("trainkit.distributed",),
    ("trainkit.run",),
    ("trainkit.checkpoint",),
    ("trainkit.loop",),
    ("trainkit.trainer",),
    ("trainkit.cli",),
    ("trainkit", "trainkit.__main__"),
)
"""The layers, lowest first: a module may import from its own layer and from the layers below it, never above."""


def module_name(path: Path) -> str:
    """``trainkit/loop/guard.py`` -> ``trainkit.loop.guard``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix that names ``module``'s layer."""
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (index, len(name))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def imported_modules(module: str) -> set[str]:
    """Every trainkit module ``module`` imports, anywhere in its source (a name taken from a package whose
    ``__init__`` defines it counts as the package)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name for name in submodules if name in MODULES]
            if len(names) < len(submodules):
                names.append(node.module)
        else:
            continue
        found.update(name for name in names if name in MODULES and name != module)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module: imported_modules(module) for module in MODULES}


def test_every_module_belongs_to_a_layer_and_imports_nothing_from_a_higher_one():
    """No module of a lower layer imports a module of a higher one (the order is :data:`LAYERS`)."""
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_two_modules_import_each_other_even_through_others():
    """The import graph has no circle: a strongly connected component of more than one module is one."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert circles == []


def test_the_layer_order_catches_an_upward_import():
    """The check itself: a module of the files layer that imported the trainer would be reported."""
    assert layer_of("trainkit.trainer") > layer_of("trainkit.files.durable")
    assert layer_of("trainkit.bookkeeping.best") > layer_of("trainkit.errors")
    assert layer_of("trainkit.cli.report") > layer_of("trainkit.trainer")


def test_at_most_eight_modules_sit_directly_under_the_package():
    """The top of the package is its face (``__init__``, ``__main__``), the trainer and the errors: every other
    module lives in the subpackage of its layer."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_every_subpackage_says_what_it_owns():
    """Each subpackage's ``__init__`` opens with a docstring."""
    for init in PACKAGE.glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


PRIVATE_REACH = re.compile(r"\b(trainer|owner)\._[a-z]")


def test_no_part_reads_the_trainers_private_attributes():
    """Only the trainer's own module touches ``trainer._x``: a part is given what it acts on."""
    reaching = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "trainer.py" or path.parent != PACKAGE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_REACH.search(line)
    ]
    assert reaching == []
