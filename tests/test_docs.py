"""The documentation builds with warnings as errors, and the API pages cover the public API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# The public methods on the BaseTrainer API page (shared/spec/BaseTrainer-api.txt).
BASE_TRAINER_METHODS = [
    "train",
    "train_epoch",
    "val_epoch",
    "test",
    "log_training_results",
    "setup",
    "add_checkpoint_items",
    "make_ddp",
    "make_fsdp",
    "barrier",
    "reduce_mean",
    "reset_best_tracking",
    "save_if_best",
    "step_patience",
    "get_param_groups",
    "log_lr",
    "clip_and_log_grad_norm",
    "log_epoch_grad_norm",
    "log_param_grad_stats",
    "push_logs",
    "get_best_pbar_metrics",
]


def _anchors(page: Path) -> set[str]:
    return set(re.findall(r'<dt class="sig sig-object py" id="([^"]+)"', page.read_text(encoding="utf-8")))


def test_docs_build_without_warnings_and_cover_the_api(tmp_path: Path) -> None:
    """Sphinx builds docs/ with -W (every cross-reference resolves) and documents every public name."""
    out = tmp_path / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"the docs build failed ({proc.returncode}; Sphinx comes with pip install -e '.[test]'):\n"
        f"{proc.stdout}\n{proc.stderr}"
    )

    trainer = _anchors(out / "trainer.html")
    missing = [m for m in BASE_TRAINER_METHODS if f"trainkit.BaseTrainer.{m}" not in trainer]
    assert not missing, f"trainer.html does not document BaseTrainer methods {missing}"

    import trainkit.bookkeeping
    import trainkit.errors

    bookkeeping = _anchors(out / "bookkeeping.html")
    missing = [n for n in trainkit.bookkeeping.__all__ if f"trainkit.bookkeeping.{n}" not in bookkeeping]
    assert not missing, f"bookkeeping.html does not document trainkit.bookkeeping.{missing}; add them there"
    errors = _anchors(out / "errors.html")
    missing = [n for n in trainkit.errors.__all__ if f"trainkit.{n}" not in errors]
    assert not missing, f"errors.html does not document {missing}; add them there"


_CODE_BLOCK = re.compile(r"^\.\. code-block:: (\w+)\n((?:\n|[ \t]+.*\n)+)", re.M)
_BARE_LITERAL = re.compile(r"^(?![ \t]*\.\. ).*[^:\s]::\n\n[ \t]+\S", re.M)  # a directive (.. math::) is no literal


def doc_blocks(page: Path) -> list[tuple[str, str]]:
    """The ``.. code-block::`` blocks of a page: (language, dedented code)."""
    import textwrap

    return [(lang, textwrap.dedent(body).strip("\n") + "\n") for lang, body in _CODE_BLOCK.findall(page.read_text())]


def test_every_docs_code_block_says_its_language():
    """No bare ``::`` literal block in the docs: each block is a code-block that says whether it is Python."""
    bare = [page.name for page in sorted((ROOT / "docs").glob("*.rst")) if _BARE_LITERAL.search(page.read_text())]
    assert not bare, f"use '.. code-block:: python' (or text) instead of '::' in {bare}"


def runnable_blocks(page: Path) -> list[str]:
    """A page's Python blocks but those that start with ``# not run: <why>`` (a sketch with your code in it)."""
    return [code for lang, code in doc_blocks(page) if lang == "python" and not code.startswith("# not run:")]


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.rst") if runnable_blocks(p)))
def test_every_python_block_of_the_docs_runs(page, tmp_path):
    """The Python blocks of a docs page run, in order, in one fresh interpreter and folder, as a reader pastes them;
    a block that is only a sketch starts with ``# not run: <why>``."""
    runnable = runnable_blocks(ROOT / "docs" / page)
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(runnable))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"a Python block of docs/{page} failed:\n{proc.stderr[-3000:]}"
