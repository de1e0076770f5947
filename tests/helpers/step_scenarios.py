"""The step-resume scenarios of tests/test_step_resume*.py: a reference run and kill sequences in
:mod:`tests.faults.step_kills` (real forked processes, real SIGKILLs, real files), and the check that each ends
exactly as the reference."""

from __future__ import annotations

from tests.faults.harness import run_driver

BASE = {
    "epochs": 2,
    "wandb": {"mode": "disabled"},
    "progress": {"enable": False},
    "ckpt": {"every_n_steps": 1},
    "dist": {"backend": "gloo", "timeout_s": 30},
}


def run_scenario(tmp_path, runs, world_size=1, op_counts=False, **config):
    """Run the reference and every kill sequence of ``runs``; return (reference summary, results)."""
    scenario = {
        "config": {**BASE, **config, "out_dir": str(tmp_path / "out")},
        "world_size": world_size,
        "runs": [[], *runs],
        "op_counts": op_counts,
    }
    results, stderr = run_driver("step_kills", scenario, tmp_path)
    reference = results[0]
    assert reference["exit_codes"] == [[0] * world_size], stderr[-4000:]
    return reference["summary"], results[1:], stderr


def assert_all_exact(reference, results, stderr, killed=-9):
    """Assert each run's attempts ended ``killed`` but the last (0), and its final weights, optimizer state,
    metrics.jsonl and step are the reference's."""
    for result in results:
        codes = result["exit_codes"]
        assert all(code == [killed] * len(code) for code in codes[:-1]), (result["kills"], codes, stderr[-3000:])
        assert codes[-1] == [0] * len(codes[-1]), (result["kills"], codes, stderr[-3000:])
        summary = result["summary"]
        for key in ("model", "optimizer", "metrics_text", "step"):
            assert summary[key] == reference[key], f"{key} differs after kills at {result['kills']}"
