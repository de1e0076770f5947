"""Interrupt an ElasticTrainer run on some number of ranks and resume it on another; report every attempt's exit codes.

Usage: ``python -m tests.faults.elastic_kills SCENARIO.json REPORT.json``. The scenario holds
``{"config": {...}, "runs": [[attempt, ...], ...]}``; an attempt is ``{"world": ranks, "kill": point or null,
"config": {overrides}}``, a kill point as in :mod:`tests.faults.step_kills` (``["batch", epoch, index]`` SIGKILLs
every rank after that batch, ``["sigterm", epoch, index]`` makes rank 0 send itself SIGTERM there). Each run trains in
its own folder, ``run<n>``, where the trainer leaves its sample ledger and final weights; the report lists, per run,
the folder and each attempt's exit codes. Attempts are forked from this process, as step_kills forks them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.faults import step_kills
from tests.helpers import trainers


def main() -> None:
    """Run the scenario named on the command line and write the report."""
    scenario = json.loads(Path(sys.argv[1]).read_text())
    base = Path(scenario["config"]["out_dir"])
    step_kills.TRAINER = "ElasticTrainer"
    results = []
    for number, attempts in enumerate(scenario["runs"]):
        out = base / f"run{number}"
        codes = []
        for attempt, spec in enumerate(attempts):
            trainers.ATTEMPT = attempt  # inherited by the forked ranks: the ledger's key
            config = {**scenario["config"], **spec.get("config", {}), "out_dir": str(out)}
            codes.append(step_kills.fork_attempt(config, spec["world"], spec.get("kill"), base / f"run{number}.json"))
        results.append({"out_dir": str(out), "exit_codes": codes})
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
