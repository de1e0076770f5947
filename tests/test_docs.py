"""The documentation builds with warnings as errors, and the API pages cover the public API."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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
