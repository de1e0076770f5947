"""``overhead.py``'s run modes (sizes, rounds) and the limits of its gates.

The ratio gates (:data:`GATES`) hold on any host: both sides of a ratio ran on it. The engine section's costs are
absolute (CPU microseconds), so each of its gates is judged as a fraction of the raw loop's own cost per step in
the same run (:data:`ENGINE_FRACTION_GATES`); the microseconds (:data:`ENGINE_GATES`) are printed as information.
"""

from __future__ import annotations

from dataclasses import dataclass

SEED = 0
LR = 1e-3


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts of one run mode."""

    mode: str
    rounds: int  # measured rounds (after one discarded warm-up round)
    tiny_epochs: int
    tiny_reps: int  # runs per contestant per round, interleaved; each repetition pairs up
    wandb_reps: int  # the same for the W&B variant, whose runs vary the most
    medium_samples: int
    medium_epochs: int
    medium_reps: int
    import_rounds: int
    import_warmups: int  # fresh interpreters per import run first and discarded (the page cache warmed)
    snapshot_params: int
    micro_reps: int
    norm_tensors: int
    norm_calls: int  # calls per timed grad-norm sample
    save_params: int  # model parameters of the checkpoint-save micro-benchmark (Adam state doubles it)
    save_rounds: int
    save_reps: int
    engine_shapes: tuple[tuple[int, int], ...]  # the null workload's run lengths: (epochs, batches per epoch)
    engine_rounds: int  # measured rounds of the engine section
    engine_group_rounds: tuple[tuple[str, int], ...]  # groups measured over more rounds: cheap ones whose gates sit
    # within a microsecond of their limit (more pairs narrow the interval; each round of these takes ~0.4 s)
    engine_reps: int  # runs per contestant and run length per round
    engine_wandb_reps: int  # the same for the W&B group, whose every run starts a W&B run (~0.15 s)


FULL = Settings(
    mode="full",
    rounds=15,
    tiny_epochs=16,
    tiny_reps=5,
    wandb_reps=6,
    medium_samples=1024,
    medium_epochs=1,
    medium_reps=5,
    import_rounds=9,
    import_warmups=1,
    snapshot_params=50_000_000,
    micro_reps=3,
    norm_tensors=200,
    norm_calls=20,
    save_params=50_000_000,
    save_rounds=7,
    save_reps=2,
    # short runs: this host's speed wanders in phases of tens of milliseconds or more, so two runs of 10 ms
    # back to back differ by ~7 %, two of 50 ms or more by 11-18 %: many short pairs resolve a step finer
    engine_shapes=((1, 10), (1, 200), (10, 10)),
    engine_rounds=15,
    engine_group_rounds=(("off", 40), ("guard", 60)),
    engine_reps=6,
    engine_wandb_reps=4,
)
QUICK = Settings(
    mode="quick",
    rounds=3,
    tiny_epochs=2,
    tiny_reps=1,
    wandb_reps=1,
    medium_samples=256,
    medium_epochs=1,
    medium_reps=1,
    import_rounds=1,  # a fresh interpreter per import: the smoke run checks the section runs
    import_warmups=1,  # (writes trainkit's .pyc files, so the timed import reads them as a user's does)
    snapshot_params=5_000_000,
    micro_reps=1,
    norm_tensors=200,
    norm_calls=5,
    save_params=5_000_000,
    save_rounds=3,
    save_reps=1,
    engine_shapes=((1, 5), (1, 50), (5, 5)),
    engine_rounds=1,
    engine_group_rounds=(),
    engine_reps=1,
    engine_wandb_reps=1,
)

# ratio gates, judged on the 95 % bootstrap interval of the median paired ratio (confidence.judge). tiny/wandb
# and tiny/steps are information now: what trainkit adds per W&B row and per tracked step is gated in the
# engine section (ENGINE_GATES), where W&B's start and the model's work do not drown it. Every "no slower" limit
# stands above the host's measured noise (MEDIUM_NOISE for the medium group), so that a true ratio of 1 can pass
GATES = {
    "tiny/off": 1.02,
    "medium/off": 1.02,
    "tiny/tqdm": 1.02,
    "tiny/ckpt": 1.03,
    "medium/steps": 1.02,
    "import/trainkit": 1.10,
    "import/BaseTrainer": 1.10,
    "micro/snapshot": 1.30,
    "micro/grad_norm": 1.05,
    "micro/ckpt_save": 1.10,
}

MEDIUM_NOISE = 1.017
"""The medium group's noise floor on the 2-core host: ``raw (again) / raw`` reached 1.7 % in the quiet recorded run
(benchmarks/README.md), which a limit of 1.01 could not tell from trainkit's cost: ``medium/off`` and
``medium/steps`` are judged at 1.02, above it."""

# the engine section's limits in added CPU microseconds per optimizer step / epoch / run (construction to the end
# of train()), set on a 2-core host whose raw null step cost ~30 us. W&B's per-run gate leaves out wandb.init and
# Run.finish (timed apart); steps' per-epoch gate is against trainkit with the same epoch-end writes. Information
# now: a host twice as slow pays every line of the engine twice, so the verdicts come from ENGINE_FRACTION_GATES
ENGINE_GATES = {
    "engine/off/step": 2.0,
    "engine/off/epoch": 150.0,
    "engine/off/run": 5000.0,
    "engine/steps/step": 3.0,
    "engine/steps/epoch": 150.0,
    "engine/tqdm/step": 5.0,
    "engine/tqdm/epoch": 150.0,
    "engine/tqdm/run": 5000.0,
    "engine/wandb/step": 10.0,
    "engine/wandb/epoch": 150.0,
    "engine/wandb/run": 5000.0,
    "engine/guard/step": 2.0,
    "engine/guard/rollback/step": 2.0,
}

RAW_STEP_US_AT_LIMITS = {"off": 30.12, "steps": 30.12, "tqdm": 30.98, "wandb": 78.11, "guard": 49.82}
"""The raw step the microsecond limits were judged against: each engine group's baseline's own fitted CPU cost
per step (``raw`` for ``off`` and ``steps``, ``raw_tqdm``, ``raw_wandb``, ``trainkit (clip)`` for ``guard``) in
the last full run before the fraction gates (6031f83, 2026-12-06 04:16 UTC; ``engine.baselines`` of
``benchmarks/results/latest.json``), read to 0.01 us."""

ENGINE_FRACTION_GATES = {
    gate: float(f"{limit_us / RAW_STEP_US_AT_LIMITS[gate.split('/')[1]]:.3g}")
    for gate, limit_us in ENGINE_GATES.items()
}
"""The engine gates' limits, in the group's raw steps: what a contestant adds per step, per epoch or per run over
its baseline, divided by the group baseline's own cost per step in the same run, must stay under
``ENGINE_GATES[gate] / RAW_STEP_US_AT_LIMITS[group]`` (3 significant digits), the microsecond limit read on the
host that set it. The fraction is the same on a host of any speed: both sides scale with it."""
