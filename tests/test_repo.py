"""The repository's promises about itself: CI runs the README's test command, and the README's commands exist."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def readme_commands() -> list[str]:
    """The one-line commands inside ```bash blocks of README.md."""
    text = (ROOT / "README.md").read_text()
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run executes the README's test command verbatim, with errexit on."""
    tests = [c for c in readme_commands() if c.endswith("python -m pytest")]
    assert len(tests) == 1
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert tests[0] in [line.strip() for line in ci.splitlines()]


def test_readme_example_command_runs_the_main_example():
    """The README's first command sets up a venv and runs examples/digits.py, which exists."""
    commands = readme_commands()
    assert commands[0].startswith("python3 -m venv .venv") and commands[0].endswith("examples/digits.py")
    assert (ROOT / "examples" / "digits.py").is_file()


def test_changelog_has_an_unreleased_section():
    """CHANGELOG.md follows Keep a Changelog with an Unreleased section."""
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and "Keep a Changelog" in text


def readme_python_blocks() -> list[str]:
    """The ```python blocks of README.md, as a user copies them."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_python_block_runs_unchanged(tmp_path):
    """Each Python block of the README runs as a script, unchanged, in a fresh folder (as a user pastes it)."""
    import subprocess
    import sys

    blocks = readme_python_blocks()
    assert blocks, "the README has Python blocks"
    for index, block in enumerate(blocks):
        script = tmp_path / f"block{index}.py"
        script.write_text(block)
        env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, f"README block {index} failed:\n{block}\n{proc.stderr[-3000:]}"


def test_the_trainer_class_stays_thin():
    """BaseTrainer is the API and the loop (issue "The facade, for real"): at most 700 lines with its docstrings,
    at most 20 attributes set in __init__, no method over 40 lines, and no branch on ckpt.format."""
    import ast

    source = (ROOT / "trainkit" / "trainer.py").read_text()
    (cls,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "BaseTrainer"]
    assert cls.end_lineno - cls.lineno + 1 <= 700
    methods = [node for node in cls.body if isinstance(node, ast.FunctionDef)]
    too_long = {m.name: m.end_lineno - m.lineno + 1 for m in methods if m.end_lineno - m.lineno + 1 > 40}
    assert not too_long, too_long
    (init,) = [m for m in methods if m.name == "__init__"]
    attributes = {
        node.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    assert len(attributes) <= 20, sorted(attributes)
    reads_format = [node.lineno for node in ast.walk(cls) if isinstance(node, ast.Attribute) and node.attr == "format"]
    assert not reads_format, f"BaseTrainer reads ckpt.format at lines {reads_format}: the checkpointer picks the format"


TEST_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:tests(?:\.\w+)*\.test_\w+|\.+test_\w+)", re.M)


def test_no_test_file_imports_another():
    """What tests share comes from tests/helpers or tests/faults: no file under tests/ imports a test file."""
    importers = {
        str(path.relative_to(ROOT)): TEST_IMPORT.findall(path.read_text())
        for path in sorted((ROOT / "tests").rglob("*.py"))
    }
    assert not {path: found for path, found in importers.items() if found}
    assert TEST_IMPORT.search("x = 1\nfrom tests.run.test_wandb import offline_runs\n")  # the check can see one


def test_the_test_folders_mirror_the_package():
    """Every folder of test files under tests/ is a package named for one of trainkit's subpackages."""
    subpackages = {path.parent.name for path in (ROOT / "trainkit").glob("*/__init__.py")}
    folders = {path.parent for path in (ROOT / "tests").rglob("test_*.py")} - {ROOT / "tests"}
    assert folders and all((folder / "__init__.py").is_file() for folder in folders)
    assert sorted(folder.name for folder in folders if folder.name not in subpackages) == []
    assert not list((ROOT / "tests" / "helpers").glob("test_*.py"))  # the helpers hold no test file


def readme_config_table() -> dict[str, str]:
    """README's config table as dotted key to the default as written (``a / b`` rows split into their keys)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| key | default | meaning |") :].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        keys = [key.strip("` ") for key in cells[0].split(" / ")]
        defaults = [value.strip("` ") for value in cells[1].split(" / ")]
        section = keys[0].rsplit(".", 1)[0] + "." if "." in keys[0] else ""
        keys = [key if "." in key or not section else section + key for key in keys]
        assert len(keys) == len(defaults), f"README config row {line!r}: {len(keys)} keys, {len(defaults)} defaults"
        rows.update(zip(keys, defaults, strict=True))
    return rows


def schema_default(key: str) -> object:
    """The default of a dotted config key, as the schema declares it."""
    import attrs

    from trainkit import Config
    from trainkit.config.secrets import field_types

    cls: type = Config
    *sections, name = key.split(".")
    for section in sections:
        cls = field_types(cls)[section]
    default = attrs.fields_dict(cls)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[misc]


def test_readme_config_table_lists_every_key_with_its_true_default():
    """Every key of the engine's config appears in README's table, with the default the schema gives it (an empty
    list and an empty tuple read alike), and the table names no key the schema does not have."""
    import ast

    from trainkit import Config
    from trainkit.config.overrides import all_keys

    table = readme_config_table()
    keys = set(all_keys(Config))
    assert sorted(keys - set(table)) == [], "config keys missing from README's table"
    assert sorted(set(table) - keys) == [], "README's table names keys the schema does not have"

    def plain(value: object) -> object:
        return tuple(value) if isinstance(value, list | tuple) else value

    wrong = {
        key: (written, schema_default(key))
        for key, written in table.items()
        if plain(ast.literal_eval(written)) != plain(schema_default(key))
    }
    assert wrong == {}, "README default (as written) differs from the schema's"
