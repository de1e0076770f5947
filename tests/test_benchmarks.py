"""The benchmark scripts run in their smoke modes, so they cannot rot between full runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run a benchmark script from the repository root, its output captured, bounded by 300 s."""
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_overhead_quick_mode_runs_and_checks_same_work(tmp_path):
    """benchmarks/overhead.py --quick runs every section and writes its JSON and Markdown tables."""
    proc = run_script("benchmarks/overhead.py", "--quick", "--no-lightning", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "latest.md").is_file()
    assert json.loads((tmp_path / "latest.json").read_text())


def test_gpu_check_cpu_smoke_runs(tmp_path):
    """benchmarks/gpu_check.py --cpu-smoke exercises the GPU check's code paths and reports the same work."""
    proc = run_script("benchmarks/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert report["failures"] == []
    for name in ("tiny/off", "tiny/helpers", "medium/off", "medium/helpers"):
        assert report["timing"][name]["same_final_loss"], name
    assert report["snapshot"]["snapshot_equals_weights"]
    assert report["resume"]["bitwise_equal_weights"] and report["resume"]["checkpoint_epoch"] == 1


def test_async_save_benchmark_runs(tmp_path):
    """benchmarks/async_save.py measures blocked and lost time (gates apply at ~600 MB, not at this size)."""
    proc = run_script("benchmarks/async_save.py", "--mb", "16", "--rounds", "1", "--out", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads((tmp_path / "async_save.json").read_text())
    assert report["median_s"]["sync_s"] > 0 and report["median_s"]["blocked_s"] > 0


def test_step_resume_quick_mode_runs_and_resumes_exactly(tmp_path):
    """benchmarks/step_resume.py --quick: latency vs position, blocked time, and trainkit's exact mid-epoch resume.

    Lightning is left out (--no-lightning): the smoke run needs only trainkit; the README's table comes from a
    full run with Lightning installed.
    """
    proc = run_script("benchmarks/step_resume.py", "--quick", "--no-lightning", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "step_resume.md").is_file()
    report = json.loads((tmp_path / "step_resume.json").read_text())
    for section in ("latency", "blocked", "exactness", "gates"):
        assert section in report, section
    latency = report["latency"]
    positions = [str(p) for p in latency["positions"]]
    assert set(latency["median_s"]["trainkit"]) == set(latency["median_s"]["discard"]) == set(positions)
    assert all(latency["first_batch_matches_uninterrupted"][p] for p in positions)
    assert all(latency["resumed_to_end_exact"][p] for p in positions)
    # the iterate-and-discard baseline really loads the skipped batches
    assert latency["median_s"]["discard"][positions[-1]] > latency["median_s"]["discard"][positions[0]]
    assert report["blocked"]["same_weights"] and report["blocked"]["median_blocked_s"]["sync"] > 0
    trainkit = report["exactness"]["trainkit"]
    assert trainkit["exit_codes"] == {"reference": 0, "killed": -9} and trainkit["resumed_exit_code"] == 0
    assert trainkit["exact"] is True and trainkit["max_abs_diff"] == 0.0
    assert trainkit["steps"]["reference"] == trainkit["steps"]["resumed"]
    assert report["exactness"]["lightning"] == {"skipped": "--no-lightning"}
    assert report["trainkit_exact"] is True


@pytest.mark.ddp
def test_sharded_save_quick_mode_runs(tmp_path):
    """benchmarks/sharded_save.py --quick: every variant saves through trainkit on 2 gloo ranks and reports blocked
    seconds, peak memory per rank and the disk's own speed (the goals apply at full size, not here)."""
    proc = run_script("benchmarks/sharded_save.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sharded_save_quick.json").read_text())
    (row,) = report["rows"]
    for name in ("file", "sharded", "sharded async", "bare dcp.save", "bare dcp.async_save"):
        assert row[f"{name} blocked_s"] > 0 and len(row[f"{name} peak_mib"]) == 2
    assert len(row["disk_dd_s"]) == len(row["sharded each_s"]) == 1 and row["disk_dd_s"][0] > 0
    assert row["bytes"] > 9 * 2**20
    assert all(4.5 < held < 5.5 for held in row["sharded async held_mib"])  # its half of 10 MB
