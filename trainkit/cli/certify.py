"""``python -m trainkit certify MODULE:Trainer [config.yaml ...] [key=value ...]``: prove a trainer's resume exact.

:func:`certify` runs the user's trainer on a small budget in certify's own temporary run folders, twice: straight
through, and interrupted at step boundaries (``SIGTERM``, after which the engine saves at that boundary, and ``SIGKILL``
of the process, after which the run redoes the steps since its last checkpoint), resumed each time with the same config
until it finishes. Drawn interruptions each come after a step checkpoint, a validation and an epoch end
(:func:`covering_steps`, from the straight run's own boundaries: a stream has no length to compute them from); certify's
own budget grows to allow it, a given one too small is refused. It then compares the two runs bit for bit: every kept
step checkpoint in step order (every registered item, the RNG states, the epoch position, the loop/best/patience
records, the latest metrics: :mod:`trainkit.checkpoint.compare`), the final ``last`` and ``best`` checkpoints (the best
weights), and ``metrics.jsonl`` without the wall-clock keys (:func:`trainkit.run.read_metrics.is_wall_clock`). The
report says PASS, or names the first checkpoint after which the runs diverge, the first item and tensor that differ, and
the likely cause from :data:`CAUSES`, with its fix: first a value (a counter, a generator's state) seen to differ right
after a resume, at the same step; what a loader that carries its own position reaches is that loader's state's, not
"unregistered".

Every attempt is a real process (``torch.multiprocessing.start_processes`` from a fork server that imported torch
once), one per rank with ``world_size`` > 1 (a gloo group); the interruption is a global optimizer step post-hook in
that process (:mod:`trainkit.cli.certify_child`): the user's code is run as it is. Every attempt of a run has the
same ``world_size``: a resume on another number of processes (elastic resume) matches a straight run to rounding
(another reduction order), not bit for bit, so certify does not check it.

The runs touch none of the user's stores: ``out_dir`` is each run's own folder in the work folder, ``ckpt.resume``
is ``auto`` (a checkpoint the config names is never read), W&B is ``disabled``, and ``ckpt.remote`` (with its
``remote_options``) is turned off, so the remote tier is not certified (the report says so when it is set). A
config subclass's own keys are passed on as they are.

Side effects: runs the trainer in subprocesses, writes the work folder (kept for inspection, never the config's
``out_dir`` nor its remote prefix), and the ``--json`` report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from trainkit.errors import ConfigError, TrainkitError, UsageError

__all__ = [
    "CAUSES",
    "DEFAULT_EPOCHS",
    "DEFAULT_MAX_STEPS",
    "EXIT_SIGTERM",
    "Cause",
    "CertifyError",
    "CertifyReport",
    "Divergence",
    "Interruption",
    "add_certify_parser",
    "certify",
    "certify_main",
    "compare_runs",
    "covering_steps",
    "likely_causes",
    "minimum_steps",
    "plan_interruptions",
]

DEFAULT_MAX_STEPS = 12
"""The budget of a run measured in steps (or of a config with no budget), unless ``--max-steps`` says otherwise."""

DEFAULT_EPOCHS = 2
"""The budget of a run measured in epochs, unless ``--epochs`` says otherwise."""

MAX_DERIVED_STEPS = 400
"""The most optimizer steps certify gives a run on its own (no ``--max-steps``/``--epochs``) to cover an epoch end and
a validation before each interruption: past it, it interrupts without and says so."""

_ENGINE = "trainkit.pt"
"""The engine's own file inside a sharded checkpoint directory (``ENGINE_FILE`` of
:mod:`trainkit.checkpoint.formats.dcp_directory`)."""

_MARKER = ".trainkit-certify"
"""The file that marks a folder as certify's work folder (the only kind it clears and writes)."""

EXIT_SIGTERM = 143
"""What an attempt stopped by ``SIGTERM`` exits with (``128 + 15``, as :func:`trainkit.launch` does)."""


class CertifyError(TrainkitError, RuntimeError):
    """certify could not run the trainer to a verdict: a run failed, or ran past ``--timeout-s``."""


CAUSES: dict[str, tuple[str, str]] = {
    "unregistered": (
        "an optimizer, LR scheduler, torch.Generator or module the trainer holds but never registered: a resume "
        "starts it afresh",
        "register it in setup(): self.add_checkpoint_items(NAME=self.NAME)",
    ),
    "uncaptured_rng": (
        "randomness from a generator trainkit does not capture (a random.Random or numpy Generator of the trainer's "
        "or its dataset's own): a resume draws from its start again",
        "draw from the global generators trainkit captures (random, np.random, torch), from "
        "trainkit.sample_generator(seed, index) per sample, or from a torch.Generator registered with "
        "add_checkpoint_items()",
    ),
    "loader_outside_progress": (
        "a DataLoader iterated in train_epoch() without self.progress(): a resume inside the epoch restarts it "
        "from its first batch",
        "iterate the epoch's loader through self.progress(loader); draw from a second loader by index, or give it "
        "state_dict()/load_state_dict() and register it",
    ),
    "nondeterministic": (
        "a non-deterministic op: two straight runs differ from each other, so no resume can match",
        "call torch.use_deterministic_algorithms(True) (and on CUDA set CUBLAS_WORKSPACE_CONFIG=:4096:8) to find "
        "the op; avoid atomics-based kernels (index_add_, scatter_add_ on CUDA) or randomness from time or os.urandom",
    ),
    "local_state": (
        "state held across batches in a local variable of train_epoch(): a resume inside the epoch starts it afresh "
        "(a resume at an epoch's end does not)",
        "keep it in a registered item (trainkit.RunningMean, or an object with state_dict()/load_state_dict()), "
        "or on an attribute registered with add_checkpoint_items()",
    ),
    "unregistered_value": (
        "a value the trainer or its data keeps (a counter, a generator's state) that no checkpoint restores: right "
        "after a resume it differs from the straight run's",
        "keep it in a registered item (an object with state_dict()/load_state_dict() passed to "
        "add_checkpoint_items(), trainkit.RunningMean); a dataset's: save it in the dataset's state_dict() and put it "
        "back in load_state_dict() (a StatefulDataLoader saves and loads a dataset's state with its own)",
    ),
    "loader_state_incomplete": (
        "the state of a loader that carries its own position (state_dict()/load_state_dict(), e.g. a "
        "StatefulDataLoader) does not restore a value its dataset or sampler holds: right after a resume it differs "
        "from the straight run's",
        "save the value in the dataset's state_dict() and put it back in load_state_dict() (a torch.Generator: "
        "get_state() and set_state(), not a new generator); a StatefulDataLoader saves a dataset's state only when the "
        "dataset has both methods, and otherwise replays the epoch from the dataset as a resume made it",
    ),
    "unknown": (
        "none of the documented causes was detected",
        "compare the two kept run folders (python -m trainkit inspect FOLDER/checkpoints/step-N.pt) at the step "
        "named above",
    ),
}
"""The likely causes certify names, by key: what goes wrong, and the fix."""


@attrs.frozen(kw_only=True)
class Interruption:
    """One interruption of the interrupted run.

    :ivar how: ``"term"`` (``SIGTERM``: the engine stops at that step boundary and saves) or ``"kill"`` (``SIGKILL``
        right after the optimizer step: the boundary's checkpoint is never written).
    :ivar step: The optimizer step (the trainer's ``step`` after it) at which the signal is sent.
    """

    how: str = attrs.field(validator=attrs.validators.in_(("term", "kill")))
    step: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def signal(self) -> str:
        """``SIGTERM`` or ``SIGKILL``."""
        return "SIGTERM" if self.how == "term" else "SIGKILL"


def plan_interruptions(
    total_steps: int,
    *,
    kill_at: Sequence[int] = (),
    term_at: Sequence[int] = (),
    seed: int = 0,
    epoch_ends: Sequence[int] | None = None,
    validations: Sequence[int] | None = None,
) -> tuple[Interruption, ...]:
    """Choose the interrupted run's interruptions, in step order.

    Pure. With neither ``kill_at`` nor ``term_at`` it picks one ``SIGTERM`` and one ``SIGKILL`` at two distinct
    steps drawn from ``random.Random(seed)``: given ``epoch_ends`` (and ``validations``), at steps
    :func:`covering_steps` draws, so that the run before each signal, from its start or its last resume, crosses a
    step checkpoint, an epoch end and a validation; else in ``[1, total_steps - 1]`` (one step of each when the run
    has only 2 steps).

    :param total_steps: The optimizer steps of the straight run.
    :param kill_at: Steps at which the process is SIGKILLed.
    :param term_at: Steps at which it gets SIGTERM.
    :param seed: The seed of the random choice.
    :param epoch_ends: The steps after which the straight run ended an epoch (before its last step).
    :param validations: The steps after which it validated (before its last step).
    :returns: The interruptions, by step.
    :raises ConfigError: When a step is outside ``[1, total_steps - 1]``, given twice, or the run is too short to
        be interrupted (or, with ``epoch_ends``, to cover them).

    >>> plan_interruptions(12, kill_at=[7], term_at=[3])
    (Interruption(how='term', step=3), Interruption(how='kill', step=7))
    >>> [i.how for i in plan_interruptions(12, seed=1)] in (["term", "kill"], ["kill", "term"])
    True
    >>> [i.step for i in plan_interruptions(10, epoch_ends=[4, 8], validations=[4, 8], seed=3)][1]
    9
    """
    if total_steps < 2:
        raise ConfigError(
            "the budget", "must give at least 2 optimizer steps to interrupt the run between", total_steps,
            hint="raise --max-steps or --epochs",
        )  # fmt: skip
    chosen = [("kill", step, "--kill-at") for step in kill_at] + [("term", step, "--term-at") for step in term_at]
    if not chosen:
        rng = random.Random(seed)
        if epoch_ends is not None:
            steps = covering_steps(total_steps, epoch_ends, validations or (), seed=seed)
            if steps is None:
                raise ConfigError(
                    "the budget", "must let an epoch end and a validation come before each of two interruptions",
                    total_steps, hint="raise --max-steps or --epochs",
                )  # fmt: skip
            hows = rng.sample(["term", "kill"], k=2)
            chosen = [(hows[0], steps[0], ""), (hows[1], steps[1], "")]
        else:
            steps = rng.sample(range(1, total_steps), k=min(2, total_steps - 1))
            chosen = [("term", steps[0], ""), *([("kill", steps[1], "")] if len(steps) > 1 else [])]
    seen: set[int] = set()
    for _, step, option in chosen:
        if not isinstance(step, int) or not 1 <= step < total_steps:
            raise ConfigError(
                option, f"must name steps in [1, {total_steps - 1}] (the straight run took {total_steps})", step
            )
        if step in seen:
            raise ConfigError(option, "must name each step once", step)
        seen.add(step)
    return tuple(Interruption(how=how, step=step) for how, step, _ in sorted(chosen, key=lambda c: c[1]))


def _crossed(boundaries: Sequence[int], start: int, stop: int) -> bool:
    """Whether a boundary (a step after which something happened) falls in a segment that resumed from ``start`` and
    is interrupted at ``stop``: the step ``start`` itself counts (its epoch end or validation comes after the resume),
    ``stop`` does not (the signal comes first)."""
    return any(start <= step < stop for step in boundaries)


def covering_steps(
    total_steps: int, epoch_ends: Sequence[int], validations: Sequence[int], *, seed: int = 0
) -> tuple[int, int] | None:
    """Draw two interruption steps ``s1 < s2 < total_steps`` such that the run from its start to ``s1``, and from
    ``s1`` to ``s2``, each crosses an epoch end and (when ``validations`` has any) a validation; every step has a step
    checkpoint under certify, so each crosses one when it is 2 steps or more.

    A state lost at a resume often shows only once it has built up across such a boundary: a dataset whose generator
    a resume makes afresh draws the same first epoch again, which a resume inside the first epoch cannot tell apart.

    Pure.

    :param total_steps: The straight run's optimizer steps.
    :param epoch_ends: The steps after which an epoch ended.
    :param validations: The steps after which the run validated.
    :param seed: The seed of the draw.
    :returns: The two steps, or None when the run is too short.

    >>> first, second = covering_steps(10, [4, 8], [4, 8])
    >>> 5 <= first <= 7 and second == 9
    True
    >>> covering_steps(8, [4], [4]) is None
    True
    """
    kinds = [sorted(set(epoch_ends))] + ([sorted(set(validations))] if validations else [])

    def ok(start: int, stop: int) -> bool:
        return stop - start >= 2 and all(_crossed(kind, start, stop) for kind in kinds)

    pairs = [(a, b) for a in range(2, total_steps) for b in range(a + 1, total_steps) if ok(0, a) and ok(a, b)]
    if not pairs:
        return None
    rng = random.Random(seed)
    first = rng.choice(sorted({a for a, _ in pairs}))
    return first, rng.choice([b for a, b in pairs if a == first])


def minimum_steps(epoch_ends: Sequence[int], validations: Sequence[int]) -> int | None:
    """The fewest optimizer steps a run needs for :func:`covering_steps` to find its two steps, extrapolated from the
    first epoch end and the first validation a run saw (epochs of that many steps, validations that often).

    Pure.

    :param epoch_ends: The steps after which an epoch ended (at least one, else None: the length is unknown).
    :param validations: The steps after which the run validated (none: no validation to cover).
    :returns: The budget in steps, or None.

    >>> minimum_steps([4, 8], [4, 8]), minimum_steps([5], [2, 4]), minimum_steps([], [])
    (10, 12, None)
    """
    if not epoch_ends:
        return None
    periods = [min(epoch_ends)] + ([min(validations)] if validations else [])
    first = max(max(periods) + 1, 2)
    second = max(max(-(-first // p) * p for p in periods) + 1, first + 2)
    return second + 1


@attrs.frozen(kw_only=True)
class Cause:
    """A likely cause of a divergence (:data:`CAUSES`).

    :ivar key: Its key in :data:`CAUSES`.
    :ivar found: What was found: attribute names with their kinds, or a loader's name; empty for a hint.
    """

    key: str = attrs.field(validator=attrs.validators.in_(tuple(CAUSES)))
    found: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def what(self) -> str:
        """What goes wrong."""
        return CAUSES[self.key][0]

    @property
    def fix(self) -> str:
        """How to fix it."""
        return CAUSES[self.key][1]


_RNG_KINDS = ("random.Random", "numpy.random.Generator", "numpy.random.RandomState")


def likely_causes(
    unregistered: Sequence[tuple[str, str]],
    loaders_outside: Sequence[str],
    *,
    straight_runs_agree: bool | None,
    resumed_mid_epoch: bool,
    batches_after_resume: str | None = None,
    lost: tuple[str, str] | None = None,
) -> tuple[Cause, ...]:
    """Name the likely causes of a divergence, most certain first.

    Pure. A value seen to differ right after a resume comes first (``lost``: a counter or a generator's state no
    checkpoint restored, under a loader that carries its own position or not); then what the attempts found
    (unregistered objects, generators of their own, loaders outside ``progress()``); then two straight runs that differ
    name a non-deterministic op; then training batches that differ right after a resume name randomness from a generator
    trainkit does not capture (one no attribute scan reaches: a module's global ``random.Random``, say); then a
    divergence right after a resume inside an epoch names state held in a local variable; else ``unknown``.

    :param unregistered: ``(attribute, kind)`` pairs from :func:`trainkit.cli.certify_child.unregistered_objects`.
    :param loaders_outside: Names of loaders iterated in ``train_epoch()`` without ``progress()``.
    :param straight_runs_agree: Whether a second straight run matched the first (None: not run).
    :param resumed_mid_epoch: Whether the resume before the first diverging checkpoint was inside an epoch.
    :param batches_after_resume: How the batches a resumed attempt trained on first differ from the straight
        run's (None: they do not).
    :param lost: ``(key, what)``: the first value that differed right after a resume, its cause key
        (``unregistered_value`` or ``loader_state_incomplete``) and what was seen; None when none did.
    :returns: The causes.

    >>> found = likely_causes([("sched", "LR scheduler")], [], straight_runs_agree=None, resumed_mid_epoch=True)
    >>> [(cause.key, cause.found) for cause in found]
    [('unregistered', ('sched (LR scheduler)',))]
    >>> likely_causes([], [], straight_runs_agree=True, resumed_mid_epoch=True)[0].key
    'local_state'
    >>> seen = "data.seen: 8 in the straight run, 2 after the resume from step 5 (at step 6)"
    >>> [c.key for c in likely_causes([], [], straight_runs_agree=None, resumed_mid_epoch=True,
    ...                               lost=("unregistered_value", seen))]
    ['unregistered_value']
    """
    causes = [] if lost is None else [Cause(key=lost[0], found=[lost[1]])]
    objects = [f"{name} ({kind})" for name, kind in unregistered if kind not in _RNG_KINDS]
    generators = [f"{name} ({kind})" for name, kind in unregistered if kind in _RNG_KINDS]
    if objects:
        causes.append(Cause(key="unregistered", found=objects))
    if generators:
        causes.append(Cause(key="uncaptured_rng", found=generators))
    if loaders_outside:
        causes.append(Cause(key="loader_outside_progress", found=loaders_outside))
    if straight_runs_agree is False and lost is None:
        causes.append(Cause(key="nondeterministic"))
    elif not causes and batches_after_resume is not None:  # data drawn from a generator no scan could reach
        causes.append(Cause(key="uncaptured_rng", found=[batches_after_resume]))
    if not causes and resumed_mid_epoch:
        causes.append(Cause(key="local_state"))
    return tuple(causes) or (Cause(key="unknown"),)


@attrs.frozen(kw_only=True)
class Divergence:
    """Where the two runs first differ.

    :ivar where: The file: ``checkpoints/step-7.pt``, ``last.pt``, ``best.pt`` or ``metrics.jsonl``.
    :ivar step: The step of that checkpoint (of that row), when it has one.
    :ivar section: The item (``model``, ``optimizer``, ...), ``rng``, ``position``, ``records``, ``metrics``,
        ``best weights``, or a metrics row.
    :ivar name: The tensor or key inside it.
    :ivar detail: What differs.
    :ivar max_abs_diff: The largest absolute difference, for numbers and tensors.
    """

    where: str
    step: int | None
    section: str
    name: str
    detail: str
    max_abs_diff: float | None = None


@attrs.frozen(kw_only=True)
class CertifyReport:
    """What :func:`certify` found.

    :ivar passed: Whether the interrupted run ended bit for bit where the straight one did.
    :ivar trainer: The trainer, as ``MODULE:Class``.
    :ivar budget: The budget both runs had (``max_steps=12``, ``epochs=2``).
    :ivar world_size: Processes per run.
    :ivar total_steps: The optimizer steps the straight run took.
    :ivar interruptions: The interruptions planned, in step order.
    :ivar resumes: For each interruption: the step it fired at and the step the next attempt resumed from.
    :ivar straight_dir: The straight run's folder (kept).
    :ivar interrupted_dir: The interrupted run's folder (kept).
    :ivar checkpoints_compared: The step checkpoints compared (plus ``last`` and ``best``).
    :ivar rows_compared: The ``metrics.jsonl`` rows compared.
    :ivar divergence: The first difference, or None.
    :ivar causes: Its likely causes (empty on PASS).
    :ivar notes: What the attempts found that a PASS did not need (an unregistered object that did not matter), what
        a loader's state covers, and what certify left out (the remote tier, a boundary no interruption crossed).
    :ivar crossed: For each interruption: what the run crossed between its start (or last resume) and the signal
        (step checkpoints, validations, epoch ends).
    :ivar seconds: The wall-clock time certify took.
    :ivar timeout_s: Its bound.
    """

    passed: bool
    trainer: str
    budget: str
    world_size: int
    total_steps: int
    interruptions: tuple[Interruption, ...]
    resumes: tuple[tuple[int, int], ...]
    straight_dir: str
    interrupted_dir: str
    checkpoints_compared: int
    rows_compared: int
    divergence: Divergence | None
    causes: tuple[Cause, ...]
    notes: tuple[str, ...]
    seconds: float
    timeout_s: float
    crossed: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (what ``--json`` writes).

        :returns: A JSON-serialisable dict (causes with their ``what`` and ``fix``).
        """
        data = attrs.asdict(self, recurse=True)
        data["verdict"] = "PASS" if self.passed else "DIVERGED"
        data["causes"] = [{"key": c.key, "found": list(c.found), "what": c.what, "fix": c.fix} for c in self.causes]
        return data

    def lines(self) -> list[str]:
        """The report as printed.

        :returns: The lines.
        """
        verdict = "PASS" if self.passed else "DIVERGED"
        stops = ", ".join(
            f"{i.signal} at step {fired} (resumed from step {resumed})"
            for i, (fired, resumed) in zip(self.interruptions, self.resumes)
        )
        lines = [
            f"certify {self.trainer}: {verdict}",
            f"  budget:      {self.budget}: {self.total_steps} optimizer steps, {self.world_size} process(es)",
            f"  interrupted: {stops}",
        ]
        lines += [f"  crossed:     {line}" for line in self.crossed]
        found = self.divergence
        if found is None or found.where == "metrics.jsonl":
            lines.append(
                f"  compared:    {self.checkpoints_compared} step checkpoints, last and best, {self.rows_compared} "
                "metrics.jsonl rows (wall-clock keys left out: perf/*, time, timestamp)"
            )
        else:
            lines.append(f"  compared:    {self.checkpoints_compared} step checkpoints, up to the first that differs")
        if found is not None:
            at = f" (step {found.step})" if found.step is not None else ""
            lines.append(f"  first diverging checkpoint: {found.where}{at}")
            name = f"{found.section}: {found.name}" if found.name else found.section
            lines.append(f"  first difference: {name} ({found.detail})")
            for cause in self.causes:
                named = f" [{', '.join(cause.found)}]" if cause.found else ""
                lines += [f"  likely cause: {cause.what}{named}", f"    fix: {cause.fix}"]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [
            f"  runs kept:   straight {self.straight_dir}",
            f"               interrupted {self.interrupted_dir}",
            f"  time:        {self.seconds:.1f} s (bound: --timeout-s {self.timeout_s:g})",
        ]
        return lines


def _budget_words(cfg: Any, max_steps: int | None, epochs: int | None) -> list[str]:
    """The overrides that give both runs their small budget: the ones given; else (``cfg`` given) the config's own,
    capped."""
    for option, value in (("--max-steps", max_steps), ("--epochs", epochs)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(option, "must be an integer >= 1", value)
    if max_steps is not None or epochs is not None or cfg is None:
        return [f"{key}={value}" for key, value in (("max_steps", max_steps), ("epochs", epochs)) if value is not None]
    if cfg.max_steps is not None:
        return [f"max_steps={min(cfg.max_steps, DEFAULT_MAX_STEPS)}"]
    if cfg.epochs is not None:
        return [f"epochs={min(cfg.epochs, DEFAULT_EPOCHS)}"]
    return [f"max_steps={DEFAULT_MAX_STEPS}"]


_RUN_WORDS = (
    "ckpt.enable=true",
    "ckpt.every_n_steps=1",
    "ckpt.keep=every_steps:1",
    "ckpt.resume=auto",
    "wandb.mode=disabled",
    "progress.enable=false",
)
"""What certify sets in every run: a step checkpoint at every step boundary, all of them kept, resumed from the run's
own folder only (never a checkpoint ``ckpt.resume`` names), no W&B (nothing online, nothing in a W&B folder of the
user's), no bars. Each run's ``out_dir`` is its own folder in the work folder (:meth:`_Runs.attempt`)."""

_REMOTE_NOTE = (
    "ckpt.remote is set, but certify runs without a remote tier: the remote tier was not certified, and nothing under "
    "that prefix was read or written"
)
"""The note a report carries when the config names a remote prefix (the URL is not repeated: it may name more than
a prefix)."""


def _without_user_stores(cfg: Any) -> tuple[Any, tuple[str, ...]]:
    """The config with every engine key that points at a store of the user's outside certify's work folder turned
    off, and the notes that say so.

    ``out_dir`` (set per run), ``ckpt.resume`` and ``wandb.mode`` are already certify's (:data:`_RUN_WORDS`); here
    ``ckpt.remote`` goes, with its ``remote_options``: the user's prefix holds the user's real run, which an upload
    would mix certify's checkpoints into and a ``resume=auto`` would fetch from (a private prefix would cost a
    lease wait after each SIGKILL and certify the engine's upload, not the trainer's resume).

    :param cfg: The config certify built from the user's words and its own.
    :returns: The config for the runs, and the report's notes.
    """
    if cfg.ckpt.remote is None:
        return cfg, ()
    ckpt = attrs.evolve(cfg.ckpt, remote=None, remote_options={})
    return attrs.evolve(cfg, ckpt=ckpt), (_REMOTE_NOTE,)


def _work_folder(work_dir: str | Path | None, user_out_dir: str) -> Path:
    """Certify's own folder: a new temporary one, or ``work_dir`` when it is empty, absent or certify's."""
    if work_dir is None:
        folder = Path(tempfile.mkdtemp(prefix="trainkit-certify-"))
    else:
        folder = Path(work_dir)
        user = Path(user_out_dir).resolve()
        if folder.resolve() == user or user in folder.resolve().parents:
            raise ConfigError(
                "--work-dir", "must not be the config's out_dir or inside it (certify never writes there)", str(folder)
            )
        if folder.exists() and any(folder.iterdir()) and not (folder / _MARKER).is_file():
            raise ConfigError("--work-dir", "must be empty, absent, or a folder certify made before", str(folder))
        for stale in ("straight", "interrupted", "straight-again", "logs"):  # ours, from a previous certify
            shutil.rmtree(folder / stale, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
    (folder / _MARKER).write_text("made by python -m trainkit certify; it may delete what is in here\n")
    (folder / "logs").mkdir(exist_ok=True)
    return folder


class _Runs:
    """Starts each attempt's processes and waits for them within the deadline."""

    def __init__(self, base: dict[str, Any], folder: Path, deadline: float, timeout_s: float) -> None:
        self.base, self.folder, self.deadline, self.timeout_s = base, folder, deadline, timeout_s
        self.attempts = 0
        self.stems: list[Path] = []

    def attempt(self, out_dir: Path, label: str, interruption: Interruption | None) -> tuple[str, dict | None]:
        """Run one attempt; return how it ended (``done``, ``term``, ``kill``) and what fired (step, epoch)."""
        import torch.multiprocessing as mp

        from trainkit.cli.certify_child import run_rank
        from trainkit.distributed.collectives import free_port

        self.attempts += 1
        stem = self.folder / "logs" / f"{self.attempts:02d}-{label}"
        paths = {name: f"{stem}.{name}.json" for name in ("findings", "fired", "done")}
        paths["batches"] = f"{stem}.batches.jsonl"
        paths["steps"] = f"{stem}.steps.jsonl"
        self.stems.append(stem)
        env = {**self.base["env"], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        config = {**self.base["config"], "out_dir": str(out_dir)}
        interrupt = None if interruption is None else {"how": interruption.how, "step": interruption.step}
        spec = {**self.base, **paths, "config": config, "env": env, "log": f"{stem}.rank{{rank}}.log",
                "interrupt": interrupt}  # fmt: skip
        context = mp.start_processes(
            run_rank, args=(spec,), nprocs=self.base["world_size"], join=False, start_method="forkserver"
        )
        failure = self._wait(context, stem)
        codes = [process.exitcode for process in context.processes]
        fired = _read_json(paths["fired"])
        if failure is None and Path(paths["done"]).is_file():
            return "done", fired
        if interruption is not None and fired is not None:
            expected = -9 if interruption.how == "kill" else EXIT_SIGTERM
            if expected in codes and all(code in (0, expected, EXIT_SIGTERM, -9, -15) for code in codes):
                return interruption.how, fired
        raise CertifyError(
            f"the {label} run's attempt {self.attempts} ended with exit status(es) {codes} "
            f"{'after' if fired else 'before'} its interruption: see {stem}.rank0.log\n{_tail(f'{stem}.rank0.log')}"
            f"{failure or ''}"
        )

    def _wait(self, context: Any, stem: Path) -> str | None:
        import torch.multiprocessing as mp

        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()  # a process this call started, by its own handle
                    process.join()
                raise CertifyError(
                    f"certify ran past --timeout-s {self.timeout_s:g}: the attempt running then was killed (its log: "
                    f"{stem}.rank0.log); raise --timeout-s or lower --max-steps/--epochs"
                )
            try:
                if context.join(timeout=min(left, 0.5), grace_period=10):
                    return None
            except mp.ProcessRaisedException as exc:
                return str(exc)
            except mp.ProcessExitedException:
                return None  # a signal's exit status: judged by the caller


def _read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _tail(path: str | Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_to_the_end(runs: _Runs, out_dir: Path, label: str, plan: Sequence[Interruption]) -> list[tuple[int, int]]:
    """Run attempts in ``out_dir`` until one finishes, the i-th interrupted by ``plan[i]``; return, for each
    interruption, the step it fired at and the step the next attempt resumed from."""
    from trainkit.checkpoint import load_checkpoint

    resumes = []
    for index in range(len(plan) + 1):
        interruption = plan[index] if index < len(plan) else None
        how, fired = runs.attempt(out_dir, label, interruption)
        if how == "done":
            if interruption is not None:
                raise CertifyError(f"the {label} run finished before its {interruption.signal} at step "
                                   f"{interruption.step}")  # fmt: skip
            return resumes
        last = _final(out_dir, "last")
        resumed = 0 if last is None else int(load_checkpoint(last if last.is_file() else last / _ENGINE)["step"])
        resumes.append((fired["step"], resumed))
    raise CertifyError(f"the {label} run did not finish after {len(plan) + 1} attempts")  # pragma: no cover


def _kept(out_dir: Path) -> dict[int, Path]:
    from trainkit.checkpoint.kept import kept_step

    folder = out_dir / "checkpoints"
    found = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        step = kept_step(entry.name)
        if step is not None:
            found[step] = entry
    return found


def _final(out_dir: Path, stem: str) -> Path | None:
    for name in (f"{stem}.pt", f"{stem}.ckpt"):
        if (out_dir / name).exists():
            return out_dir / name
    return None


def compare_runs(straight: Path, interrupted: Path) -> tuple[Divergence | None, int, int]:
    """Compare two run folders: their kept step checkpoints in step order, ``last``, ``best``, then ``metrics.jsonl``.

    Side effects: reads both folders.

    :param straight: One run folder.
    :param interrupted: The other.
    :returns: The first divergence (None: the same), the step checkpoints compared and the rows compared.
    :raises CheckpointError: When a checkpoint is damaged or unsafe.
    """
    from trainkit.checkpoint.compare import compare_checkpoints
    from trainkit.run.read_metrics import read_metrics, without_wall_clock

    left, right = _kept(straight), _kept(interrupted)
    compared = 0
    for step in sorted(set(left) | set(right)):
        if step not in left or step not in right:
            only = "straight" if step in left else "interrupted"
            return Divergence(where=f"checkpoints/step-{step}", step=step, section="checkpoint", name="",
                              detail=f"kept by the {only} run only"), compared, 0  # fmt: skip
        compared += 1
        found = compare_checkpoints(left[step], right[step])
        if found is not None:
            return _divergence(f"checkpoints/{left[step].name}", step, found), compared, 0
    for stem in ("last", "best"):
        a, b = _final(straight, stem), _final(interrupted, stem)
        if (a is None) != (b is None):
            return Divergence(where=stem, step=None, section="checkpoint", name="",
                              detail="written by one run only"), compared, 0  # fmt: skip
        found = None if a is None else compare_checkpoints(a, b)
        if found is not None:
            return _divergence(a.name, None, found), compared, 0
    rows_a = [without_wall_clock(row) for row in read_metrics(straight)]
    rows_b = [without_wall_clock(row) for row in read_metrics(interrupted)]
    for index, (a_row, b_row) in enumerate(zip(rows_a, rows_b)):
        if a_row != b_row:
            key = next((k for k in [*a_row, *b_row] if a_row.get(k, None) != b_row.get(k, None)), "")
            gap = _gap(a_row.get(key), b_row.get(key))
            detail = f"{a_row.get(key, 'absent')!r} against {b_row.get(key, 'absent')!r}"
            return Divergence(where="metrics.jsonl", step=a_row.get("trainer/step"), section=f"row {index + 1}",
                              name=key, detail=detail, max_abs_diff=gap), compared, index  # fmt: skip
    if len(rows_a) != len(rows_b):
        detail = f"{len(rows_a)} rows against {len(rows_b)}"
        return Divergence(where="metrics.jsonl", step=None, section="rows", name="", detail=detail), compared, 0
    return None, compared, len(rows_a)


def _gap(a: Any, b: Any) -> float | None:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return abs(float(a) - float(b)) if numbers else None


def _divergence(where: str, step: int | None, found: Any) -> Divergence:
    return Divergence(where=where, step=step, section=found.section, name=found.name, detail=found.detail,
                      max_abs_diff=found.max_abs_diff)  # fmt: skip


def _resolve(target: str, config_class: str | None) -> tuple[type, type]:
    from trainkit.cli.certify_child import load_object
    from trainkit.config import Config

    trainer_class = load_object(target)
    import trainkit.trainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, trainkit.trainer.BaseTrainer)):
        raise UsageError(f"the trainer class {target!r} is no subclass of trainkit.BaseTrainer")
    config = load_object(config_class, "config class") if config_class else trainer_class.config_class
    if not (isinstance(config, type) and issubclass(config, Config)):
        raise UsageError(f"the config class {config_class!r} is no subclass of trainkit.Config")
    return trainer_class, config


def certify(
    target: str,
    words: Sequence[str] = (),
    *,
    config_class: str | None = None,
    max_steps: int | None = None,
    epochs: int | None = None,
    kill_at: Sequence[int] = (),
    term_at: Sequence[int] = (),
    seed: int = 0,
    world_size: int = 1,
    work_dir: str | Path | None = None,
    timeout_s: float = 600.0,
    json_path: str | Path | None = None,
) -> CertifyReport:
    """Check that a trainer resumed at step boundaries ends bit for bit where it ends run straight through.

    Side effects: runs the trainer in subprocesses in a work folder (a new temporary one, or ``work_dir``), keeps
    it, and writes ``json_path``. None of the config's stores is touched: each run has its own ``out_dir``, resumes
    from its own folder only, has W&B disabled and no remote tier (``ckpt.remote`` is turned off).

    :param target: The trainer class, ``MODULE:Class`` (importable: the module's folder on ``sys.path`` or
        ``PYTHONPATH``).
    :param words: YAML config files and ``dotted.key=value`` overrides, as the trainer's script takes them
        (:func:`~trainkit.cli.config_from_argv`).
    :param config_class: ``MODULE:Class`` of the config; the trainer's ``config_class`` by default.
    :param max_steps: The runs' budget in optimizer steps (replaces the config's ``max_steps``).
    :param epochs: The runs' budget in epochs (replaces the config's ``epochs``). With neither, the config's own,
        capped at :data:`DEFAULT_MAX_STEPS` steps or :data:`DEFAULT_EPOCHS` epochs.
    :param kill_at: Steps at which the interrupted run's process is SIGKILLed.
    :param term_at: Steps at which it gets SIGTERM. With neither, one of each at steps drawn with ``seed``.
    :param seed: Seed of the drawn steps.
    :param world_size: Processes per run (a gloo group when > 1).
    :param work_dir: The work folder; a new temporary one by default.
    :param timeout_s: The bound on the whole check; the attempt running then is killed.
    :param json_path: Where to write the report as JSON.
    :returns: The report.
    :raises ConfigError: On a bad option, config word or step.
    :raises UsageError: When the trainer or config class cannot be imported.
    :raises CertifyError: When a run fails or the check runs past ``timeout_s``.
    """
    from trainkit.cli.argv import config_from_argv
    from trainkit.distributed.launch import fork_server

    started = time.monotonic()
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("--world-size", "must be an integer >= 1", world_size)
    if not timeout_s > 0:
        raise ConfigError("--timeout-s", "must be > 0", timeout_s)
    trainer_class, config = _resolve(target, config_class)
    given = _budget_words(None, max_steps, epochs)
    try:
        user_cfg = config_from_argv(config, [*words, *given])
    except ConfigError:
        if given:
            raise
        # a config with no budget of its own (a script sets it in code): certify's default; other errors raise again
        user_cfg = config_from_argv(config, list(words), defaults={"max_steps": DEFAULT_MAX_STEPS})
    budget = given or _budget_words(user_cfg, None, None)
    cfg, notes = _without_user_stores(config_from_argv(config, [*words, *budget, *_RUN_WORDS]))
    folder = _work_folder(work_dir, user_cfg.out_dir)
    base = {
        "target": target,
        "config_class": config_class or f"{config.__module__}:{config.__qualname__}",
        "config": cfg.to_dict(),
        "world_size": world_size,
        "env": dict(os.environ),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
    }
    runs = _Runs(base, folder, started + timeout_s, timeout_s)
    straight, interrupted = folder / "straight", folder / "interrupted"
    drawn = not kill_at and not term_at
    if drawn and max_steps is not None and max_steps < _FEWEST_STEPS:
        raise ConfigError("--max-steps", f"must be at least {_FEWEST_STEPS} for each of two interruptions to come "
                          "after a step checkpoint, an epoch end and a validation", max_steps)  # fmt: skip
    own = (list(budget), None)  # certify's own budget, and the straight run's steps on it: one note on a longer one
    with fork_server(preload=["trainkit.cli.certify_child"]):
        for _ in range(4):  # the budget given or certify's, then (certify's only) at most 3 longer ones
            _run_to_the_end(runs, straight, "straight", ())
            total = _total_steps(straight)
            ends, validations = _boundaries(Path(f"{runs.stems[-1]}.steps.jsonl"), total)
            if not drawn or covering_steps(total, ends, validations) is not None:
                break
            longer = _longer_budget(budget, total, ends, validations, derived=not given)
            if longer is None:
                notes += (_uncovered_note(total, ends, validations),)
                ends = validations = None  # interrupt without: said in the notes
                break
            own = (own[0], total if own[1] is None else own[1])
            budget = longer
            cfg, _ = _without_user_stores(config_from_argv(config, [*words, *budget, *_RUN_WORDS]))
            runs.base["config"] = cfg.to_dict()
            shutil.rmtree(straight)
        if own[1] is not None:
            notes = (
                f"certify's own budget ({', '.join(own[0])}: {own[1]} steps) let too few epoch ends and validations "
                f"come before its interruptions; it ran {', '.join(budget)} ({total} steps) instead (give --max-steps "
                "or --epochs to choose)",
                *notes,
            )
        plan = plan_interruptions(total, kill_at=kill_at, term_at=term_at, seed=seed, epoch_ends=ends,
                                  validations=validations)  # fmt: skip
        first_interrupted = runs.attempts
        resumes = _run_to_the_end(runs, interrupted, "interrupted", plan)
        divergence, compared, rows = compare_runs(straight, interrupted)
        logs = [Path(f"{stem}.steps.jsonl") for stem in runs.stems[first_interrupted:]]
        lost = _lost_value(Path(f"{runs.stems[first_interrupted - 1]}.steps.jsonl"), logs)
        causes, found = _diagnose(runs, folder, divergence, resumes, lost)
    notes += found
    full = _boundaries(Path(f"{runs.stems[first_interrupted - 1]}.steps.jsonl"), total)
    crossed = _crossed_lines(plan, resumes, *full)
    kept = len(_kept(straight))
    if kept < total:
        notes += (
            f"step checkpoints at {kept} of {total} step boundaries: this trainer's loop resumes at epoch ends only "
            "(iterate the epoch's DataLoader through self.progress() for step-exact resume; docs: Step checkpoints)",
        )
    report = CertifyReport(
        passed=divergence is None, trainer=target, budget=", ".join(budget), world_size=world_size,
        total_steps=total, interruptions=plan, resumes=tuple(resumes), straight_dir=str(straight),
        interrupted_dir=str(interrupted), checkpoints_compared=compared, rows_compared=rows, divergence=divergence,
        causes=causes, notes=notes, seconds=time.monotonic() - started, timeout_s=timeout_s, crossed=crossed,
    )  # fmt: skip
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


_FEWEST_STEPS = 5
"""The fewest steps two interruptions can each come after a step checkpoint, an epoch end and a validation in
(epochs of one step, validated at each end: :func:`minimum_steps`)."""


def _total_steps(out_dir: Path) -> int:
    from trainkit.checkpoint import load_checkpoint

    last = _final(out_dir, "last")
    if last is None:
        raise CertifyError(f"the run in {out_dir} finished without writing last.pt")
    return int(load_checkpoint(last if last.is_file() else last / _ENGINE)["step"])


def _step_rows(path: Path) -> list[dict[str, Any]]:
    """The rows an attempt's step log holds (a row per step, one per validation); none when absent."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a SIGKILL
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _boundaries(path: Path, total: int) -> tuple[list[int], list[int]]:
    """The steps (before ``total``) after which a run's attempt ended an epoch, and those after which it validated."""
    steps = [(row["step"], row["epoch"]) for row in _step_rows(path) if "step" in row]
    ends = [a for (a, epoch_a), (_, epoch_b) in zip(steps, steps[1:]) if epoch_b != epoch_a and a < total]
    validations = sorted({row["val"] for row in _step_rows(path) if 1 <= row.get("val", 0) < total})
    return ends, validations


def _longer_budget(
    budget: list[str], total: int, ends: list[int], validations: list[int], *, derived: bool
) -> list[str] | None:
    """The budget to run straight again with, for interruptions that cover an epoch end and a validation; None:
    interrupt without (no epoch end within :data:`MAX_DERIVED_STEPS` steps).

    :raises ConfigError: When the budget was given and is too small, naming the option and the minimum.
    """
    need = minimum_steps(ends, validations)
    key, _, value = budget[0].partition("=")
    if not derived:
        if need is None:
            return None
        option = "--epochs" if key == "epochs" else "--max-steps"
        least = -(-need // min(ends)) if key == "epochs" else need
        raise ConfigError(
            option, f"must be at least {least} for each of two interruptions to come after a step checkpoint, an epoch "
            f"end and a validation (an epoch is {min(ends)} steps here)", int(value),
        )  # fmt: skip
    if need is None:  # no epoch ended yet: a longer run tells
        need = total * 4
    if need <= total or total >= MAX_DERIVED_STEPS:
        return None
    if key == "epochs":
        return [f"epochs={-(-need // min(ends))}"] if ends else None
    return [f"max_steps={min(need, MAX_DERIVED_STEPS)}"]


def _uncovered_note(total: int, ends: list[int], validations: list[int]) -> str:
    what = "no epoch ended" if not ends else "too few epoch ends and validations came"
    return (
        f"{what} within the {total} steps certify ran: its interruptions do not all come after an epoch end and a "
        "validation, so state lost only across one was not checked (raise --max-steps or --epochs)"
    )


def _crossed_lines(
    plan: Sequence[Interruption], resumes: Sequence[tuple[int, int]], ends: list[int], validations: list[int]
) -> tuple[str, ...]:
    """What the run crossed before each interruption, from its start or its last resume."""
    lines = []
    start = 0
    for interruption, (fired, resumed) in zip(plan, resumes):
        saved = [step for step in range(start + 1, fired)]
        parts = [
            f"step checkpoints after steps {saved[0]}-{saved[-1]}" if saved else "no step checkpoint",
            _listed("validation", [v for v in validations if start <= v < fired]),
            _listed("epoch end", [e for e in ends if start <= e < fired]),
        ]
        lines.append(f"before the {interruption.signal} at step {fired} (from step {start}): {', '.join(parts)}")
        start = resumed
    return tuple(lines)


def _listed(what: str, steps: list[int]) -> str:
    if not steps:
        return f"no {what}"
    shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    return f"{what}{'s' if len(steps) > 1 else ''} after step{'s' if len(steps) > 1 else ''} {shown}"


def _lost_value(straight: Path, attempts: Sequence[Path]) -> tuple[str, str, str] | None:
    """The first value (a counter, a generator's state) that a resumed attempt of the interrupted run held at a step and
    the straight run did not: its cause key, what was seen and its path. Values that already differ in the first
    attempt, before any resume, vary from run to run (a time, an id) and are left out."""
    base = {row["step"]: row.get("values", {}) for row in _step_rows(straight) if "step" in row}

    def differing(step: int, values: dict[str, str]) -> list[str]:
        there = base.get(step)
        return [] if there is None else [key for key in {**there, **values} if there.get(key) != values.get(key)]

    rows = [[row for row in _step_rows(path) if "step" in row] for path in attempts]
    noise = {key for row in (rows[0] if rows else []) for key in differing(row["step"], row.get("values", {}))}
    for attempt in rows[1:]:
        for row in attempt:
            keys = [key for key in differing(row["step"], row.get("values", {})) if key not in noise]
            if keys:
                key = keys[0]
                path, _, loader = key.partition("@")
                step, resumed = row["step"], attempt[0]["step"] - 1
                seen = (
                    f"{path}: {base[step].get(key, 'absent')} in the straight run, {row['values'].get(key, 'absent')} "
                    f"after the resume from step {resumed} (at step {step})"
                )
                if loader:
                    return "loader_state_incomplete", f"{seen}; reached from {loader}", path
                kind = str(base[step].get(key, row["values"].get(key))).split(" state ")
                if len(kind) == 2:  # a generator of its own, which no scan reached
                    return ("unregistered" if kind[0] == "torch.Generator" else "uncaptured_rng"), seen, path
                return "unregistered_value", seen, path
    return None


def _findings(folder: Path) -> tuple[list[tuple[str, str]], list[str], list[tuple[str, str, str]]]:
    """What the attempts found, merged in attempt order without repeats: from the attempts that got to the end of
    their training loop where any did (they know the loaders ``train_epoch()`` handed to ``progress()``)."""
    unregistered: dict[tuple[str, str], None] = {}
    loaders: dict[str, None] = {}
    covered: dict[tuple[str, str, str], None] = {}
    found_all = [_read_json(path) or {} for path in sorted((folder / "logs").glob("*.findings.json"))]
    final = [found for found in found_all if "loaders_outside_progress" in found]
    for found in final or found_all:
        unregistered.update((tuple(pair), None) for pair in found.get("unregistered", []))
        loaders.update((name, None) for name in found.get("loaders_outside_progress", []))
        covered.update((tuple(entry), None) for entry in found.get("covered", []))
    return list(unregistered), list(loaders), list(covered)  # type: ignore[arg-type]


def _diagnose(
    runs: _Runs,
    folder: Path,
    divergence: Divergence | None,
    resumes: Sequence[tuple[int, int]],
    lost: tuple[str, str, str] | None = None,
) -> tuple[tuple[Cause, ...], tuple[str, ...]]:
    unregistered, loaders, covered = _findings(folder)
    if lost is not None and any(lost[2] == name or lost[2].startswith(f"{name}.") for name, _ in unregistered):
        lost = None  # what the scan found and names (first) itself
    lost_path = None if lost is None else lost[2]
    notes = [
        f"left to the state of {loader}, which every checkpoint saves, step and epoch-end (not to be registered): "
        f"{name} ({kind})"
        for name, kind, loader in covered
        if name != lost_path
    ]
    if divergence is None:
        notes += [f"not registered, but it did not matter here: {name} ({kind})" for name, kind in unregistered]
        notes += [f"iterated outside progress(), but it did not matter here: {name}" for name in loaders]
        return (), tuple(notes)
    agree = None
    if not unregistered and not loaders and lost is None:  # a second straight run tells a non-deterministic op
        again = folder / "straight-again"
        _run_to_the_end(runs, again, "straight-again", ())
        agree = compare_runs(folder / "straight", again)[0] is None
    before = [resumed for _, resumed in resumes if divergence.step is None or resumed < divergence.step]
    mid_epoch = bool(before) and _mid_epoch(folder / "interrupted", before[-1])
    causes = likely_causes(
        unregistered, loaders, straight_runs_agree=agree, resumed_mid_epoch=mid_epoch,
        batches_after_resume=_batches_after_resume(folder / "logs"), lost=None if lost is None else lost[:2],
    )  # fmt: skip
    return causes, tuple(notes)


def _batches_after_resume(logs: Path) -> str | None:
    """How the first training batch of a resumed attempt differs from the straight run's batch at the same epoch and
    index, for the first resumed attempt where it does; None when every resume saw the straight run's batches."""
    straight: dict[tuple[int, int], str] = {}
    for path in logs.glob("*-straight.batches.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            straight[row["epoch"], row["index"]] = row["digest"]
    for path in sorted(logs.glob("*-interrupted.batches.jsonl"))[1:]:  # the first attempt resumed nothing
        lines = path.read_text().splitlines()
        first = json.loads(lines[0]) if lines else None
        if first is not None and straight.get((first["epoch"], first["index"])) != first["digest"]:
            return (
                f"the first batch after a resume (epoch {first['epoch']}, batch {first['index']}) differs from the "
                "straight run's"
            )
    return None


def _mid_epoch(out_dir: Path, step: int) -> bool:
    """Whether the kept checkpoint at ``step`` stands inside an epoch."""
    from trainkit.checkpoint.compare import read_comparable

    path = _kept(out_dir).get(step)
    return path is not None and read_comparable(path).get("position") is not None


def _add_options(parser: Any, default: Any = None) -> None:
    """certify's options, on the command's parser (``default`` None: their defaults) or on the parser of the words
    after the trainer (``argparse.SUPPRESS``: only those given)."""

    def given(value: Any) -> Any:
        return value if default is None else default

    parser.add_argument("--config-class", default=given(None), help="MODULE:Class of the config (default: the "
                        "trainer's config_class)")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=given(None), help=f"budget in optimizer steps (default: "
                        f"the config's, at most {DEFAULT_MAX_STEPS}, longer to cover an epoch end and a validation "
                        f"before each interruption)")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=given(None), help=f"budget in epochs (default: the config's, "
                        f"at most {DEFAULT_EPOCHS})")  # fmt: skip
    parser.add_argument("--kill-at", default=given(None), help="steps at which to SIGKILL the run, e.g. 3,7")
    parser.add_argument("--term-at", default=given(None), help="steps at which to send SIGTERM, e.g. 5")
    parser.add_argument("--seed", type=int, default=given(0), help="seed of the steps drawn when none is given (0)")
    parser.add_argument("--world-size", type=int, default=given(1), help="processes per run, a gloo group (1)")
    parser.add_argument("--work-dir", default=given(None), help="the folder for both runs (default: a new "
                        "temporary one); kept")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=given(600.0), help="bound on the whole check (600)")
    parser.add_argument("--json", default=given(None), help="also write the report as JSON to this file")


def add_certify_parser(commands: Any) -> None:
    """Add the ``certify`` command to ``python -m trainkit``'s subcommands.

    :param commands: The parser's subparsers (``add_subparsers()``'s result).
    """
    parser = commands.add_parser(
        "certify",
        help="check that a trainer's resume is exact: run it straight and interrupted (SIGTERM, SIGKILL), compare",
        description="Run MODULE:Trainer on a small budget in certify's own temporary folders, straight through and "
        "interrupted at step boundaries, and compare the two runs bit for bit. Exit status 0: PASS; 1: the runs "
        "diverge; 2: bad input, a failed run or --timeout-s. None of the config's stores is touched: out_dir, "
        "ckpt.resume, W&B and ckpt.remote are replaced by certify's own (no remote tier: it is not certified). "
        "Every attempt runs on --world-size processes: a resume on another number (elastic) is not checked.",
    )
    parser.add_argument("trainer", help="the trainer class, MODULE:Class (its folder on PYTHONPATH)")
    # everything after the trainer, options among the config words included: certify_main sorts them out
    parser.add_argument(
        "words", nargs=argparse.REMAINDER, help="config files (*.yaml) and dotted.key=value overrides, in any order "
        "with the options",
    )  # fmt: skip
    _add_options(parser)


def certify_main(args: Any) -> int:
    """Run ``python -m trainkit certify`` from parsed arguments: print the report, return the exit status.

    The options given among the config words (after the trainer) are read there and win over those before it.

    :param args: The parsed arguments (an ``argparse.Namespace`` from the command's parser).
    :returns: 0 on PASS, 1 on a divergence.
    :raises ConfigError: On bad input.
    :raises SystemExit: With status 2 for an unknown option after the trainer, as argparse does.
    """
    after = argparse.ArgumentParser(prog="python -m trainkit certify TRAINER", add_help=False)
    after.add_argument("words", nargs="*")
    _add_options(after, default=argparse.SUPPRESS)
    options = {**vars(args), **vars(after.parse_intermixed_args(args.words))}
    args = argparse.Namespace(**options)
    report = certify(
        args.trainer, args.words, config_class=args.config_class, max_steps=args.max_steps, epochs=args.epochs,
        kill_at=_steps(args.kill_at, "--kill-at"), term_at=_steps(args.term_at, "--term-at"), seed=args.seed,
        world_size=args.world_size, work_dir=args.work_dir, timeout_s=args.timeout_s, json_path=args.json,
    )  # fmt: skip
    print("\n".join(report.lines()), flush=True)
    return 0 if report.passed else 1


def _steps(text: str | None, option: str) -> list[int]:
    """``"3,7"`` -> ``[3, 7]``."""
    if not text:
        return []
    try:
        return [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise ConfigError(option, "must be comma-separated step numbers, e.g. 3,7", text) from None
