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
    ("trainkit.torch_private",),
    ("trainkit.files",),
    ("trainkit.state",),
    ("trainkit.distributed",),
    ("trainkit.run",),
    ("trainkit.checkpoint",),
    ("trainkit.loop",),
    ("trainkit.trainer",),
    ("trainkit.certification",),
    ("trainkit.cli",),
    ("trainkit", "trainkit.__main__"),
)
"""The layers, lowest first: a module may import from its own layer and from the layers below it, never above."""


def module_name(path: Path) -> str:
    """``trainkit/loop/rollback.py`` -> ``trainkit.loop.rollback``; a package's ``__init__.py`` is the package."""
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


FOREIGN_PRIVATE = {
    ("os", "_exit"),  # the standard library's exit without cleanup: a kill at an exact moment
    ("sys", "_getframe"),
    ("torch", "_foreach_copy_"),
    ("usage", "_replace"),  # a namedtuple's public API, underscored so as not to clash with field names
    ("state", "_metadata"),  # torch's state-dict convention
    ("metadata", "_metadata"),
    ("loaded", "_metadata"),
}
"""Underscored names of the standard library's, torch's and namedtuples' own, which tests and benchmarks may use."""


def trainer_private_names() -> set[str]:
    """The trainer's own underscored attributes, the parts and records it holds (what a trainer subclass in a test
    must not reach as ``self._x``)."""
    names = set()
    for node in ast.walk(ast.parse((PACKAGE / "trainer.py").read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and ast.unparse(element.value) == "self":
                    names.add(element.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_test_or_benchmark_reads_a_private_attribute():
    """Tests and benchmarks observe trainkit through its public surface: no ``obj._x`` (but ``self._x`` of their
    own classes, never one of the trainer's, and the foreign names above), no ``from trainkit... import _x``."""
    trainers = trainer_private_names()
    assert {"_position", "_metrics", "_checkpointer"} <= trainers
    reads = []
    for folder in ("tests", "benchmarks"):
        for path in (PACKAGE.parent / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    base = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
                    own = base in ("self", "cls") and node.attr not in trainers
                    if not own and (base, node.attr) not in FOREIGN_PRIVATE:
                        reads.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {base}.{node.attr}")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainkit"):
                    reads += [
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module} import {alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_")
                    ]
    assert reads == []


def imports_of_the_package() -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """Every import statement in the package's source, with the module it stands in."""
    return [
        (module, node)
        for module, path in sorted(MODULES.items())
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]


def test_no_module_is_imported_under_another_name():
    """A module is called by its own name wherever it is used (``from trainkit import bookkeeping``, never
    ``... as core``): a reader who greps a module's name finds every use. Names inside a module may be imported as
    they are; torch's own conventions for its modules (``torch.distributed as dist``) are torch's, not ours."""
    renamed = []
    for module, node in imports_of_the_package():
        for alias in node.names:
            if alias.asname is None or alias.asname == alias.name.rsplit(".", 1)[-1]:
                continue
            if isinstance(node, ast.Import):
                target = alias.name
            elif node.level == 0 and node.module:
                target = f"{node.module}.{alias.name}"
            else:
                continue
            if target in MODULES or target == "trainkit":
                renamed.append(f"{module}: {target} as {alias.asname}")
    assert renamed == []


def test_no_module_imports_another_modules_private_name():
    """``from trainkit.x import _name`` across modules ties one module to another's insides: what two modules
    share is public (named without the underscore, documented)."""
    reaches = [
        f"{module}: from {node.module} import {alias.name}"
        for module, node in imports_of_the_package()
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("trainkit")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert reaches == []
