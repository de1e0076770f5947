"""The repository's promises about itself: CI runs the README's test command, and the README's commands exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
