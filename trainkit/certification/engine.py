"""certify's engine: run a trainer straight through and interrupted, compare the two runs, and give the verdict.

:func:`certify_trainer` runs the user's trainer on a small budget in certify's own temporary run folders, twice:
straight through, and interrupted at step boundaries (``SIGTERM``, after which the engine saves at that boundary,
and ``SIGKILL`` of the process, after which the run redoes the steps since its last checkpoint), resumed each time
with the same config until it finishes. Drawn interruptions each come after a step checkpoint, a validation and an
epoch end (:func:`~trainkit.certification.plan.covering_steps`, from the straight run's own boundaries: a stream has
no length to compute them from); certify's own budget grows to allow it, a given one too small is refused. It then
compares the two runs bit for bit (:func:`~trainkit.certification.comparison.compare_runs`: every kept step
checkpoint in step order, the final ``last`` and ``best`` checkpoints, and ``metrics.jsonl`` without the wall-clock
keys) and, when they diverge, names the likely cause (:mod:`trainkit.certification.diagnosis`).

The runs touch none of the user's stores: ``out_dir`` is each run's own folder in the work folder, ``ckpt.resume``
is ``auto`` (a checkpoint the config names is never read), W&B is ``disabled``, and ``ckpt.remote`` (with its
``remote_options``) is turned off, so the remote tier is not certified (the report says so when it is set). A
config subclass's own keys are passed on as they are.

Side effects: runs the trainer in subprocesses, writes the work folder (kept for inspection, never the config's
``out_dir`` nor its remote prefix), and the ``--json`` report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from trainkit.certification.attempts import Attempts, kept_checkpoints, run_to_the_end, step_boundaries, steps_taken
from trainkit.certification.comparison import compare_runs
from trainkit.certification.diagnosis import diagnose, lost_value
from trainkit.certification.plan import FEWEST_STEPS, covering_steps, crossed_lines, minimum_steps, plan_interruptions
from trainkit.certification.report import CertifyReport
from trainkit.errors import ConfigError, UsageError

__all__ = [
    "DEFAULT_EPOCHS",
    "DEFAULT_MAX_STEPS",
    "MAX_DERIVED_STEPS",
    "ParseWords",
    "certify_trainer",
    "resolve_classes",
]

ParseWords = Callable[..., Any]
"""Builds a config from words, as :func:`trainkit.cli.config_from_argv` does: ``(config_class, words, defaults)``
to the validated config (the command line's parser, given by the layer above)."""


DEFAULT_MAX_STEPS = 12
"""The budget of a run measured in steps (or of a config with no budget), unless ``--max-steps`` says otherwise."""


DEFAULT_EPOCHS = 2
"""The budget of a run measured in epochs, unless ``--epochs`` says otherwise."""


MAX_DERIVED_STEPS = 400
"""The most optimizer steps certify gives a run on its own (no ``--max-steps``/``--epochs``) to cover an epoch end and
a validation before each interruption: past it, it interrupts without and says so."""


_MARKER = ".trainkit-certify"
"""The file that marks a folder as certify's work folder (the only kind it clears and writes)."""


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
user's), no bars. Each run's ``out_dir`` is its own folder in the work folder (:meth:`Attempts.attempt`)."""


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


def resolve_classes(target: str, config_class: str | None) -> tuple[type, type]:
    """Import the trainer class and its config class, and check what they are.

    Side effects: imports their modules.

    :param target: The trainer class, ``MODULE:Class``.
    :param config_class: ``MODULE:Class`` of the config; None: the trainer's ``config_class``.
    :returns: The trainer class and the config class.
    :raises UsageError: When either cannot be imported, or is no subclass of ``BaseTrainer``/``Config``.
    """
    import trainkit.trainer
    from trainkit.certification.child import load_object
    from trainkit.config import Config

    trainer_class = load_object(target)
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, trainkit.trainer.BaseTrainer)):
        raise UsageError(f"the trainer class {target!r} is no subclass of trainkit.BaseTrainer")
    config = load_object(config_class, "config class") if config_class else trainer_class.config_class
    if not (isinstance(config, type) and issubclass(config, Config)):
        raise UsageError(f"the config class {config_class!r} is no subclass of trainkit.Config")
    return trainer_class, config


def certify_trainer(
    target: str,
    words: Sequence[str],
    parse_words: ParseWords,
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
    """Check that a trainer resumed at step boundaries ends bit for bit where it ends run straight through (what
    :func:`trainkit.cli.certify.certify` does, with the command line's parser given).

    Side effects: runs the trainer in subprocesses in a work folder (a new temporary one, or ``work_dir``), keeps
    it, and writes ``json_path``.

    :param target: The trainer class, ``MODULE:Class``.
    :param words: YAML config files and ``dotted.key=value`` overrides.
    :param parse_words: Builds a config from words (:data:`~trainkit.certification.engine.ParseWords`).
    :param config_class: ``MODULE:Class`` of the config; the trainer's ``config_class`` by default.
    :param max_steps: The runs' budget in optimizer steps.
    :param epochs: The runs' budget in epochs.
    :param kill_at: Steps at which the interrupted run's process is SIGKILLed.
    :param term_at: Steps at which it gets SIGTERM.
    :param seed: Seed of the drawn steps.
    :param world_size: Processes per run.
    :param work_dir: The work folder; a new temporary one by default.
    :param timeout_s: The bound on the whole check.
    :param json_path: Where to write the report as JSON.
    :returns: The report.
    :raises ConfigError: On a bad option, config word or step.
    :raises UsageError: When the trainer or config class cannot be imported.
    :raises CertifyError: When a run fails or the check runs past ``timeout_s``.
    """
    from trainkit.distributed.launch import fork_server

    started = time.monotonic()
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("--world-size", "must be an integer >= 1", world_size)
    if not timeout_s > 0:
        raise ConfigError("--timeout-s", "must be > 0", timeout_s)
    _, config = resolve_classes(target, config_class)
    configs = _Configs(config, list(words), parse_words, _budget_words(None, max_steps, epochs))
    user_cfg = configs.user()
    budget = configs.given or _budget_words(user_cfg, None, None)
    cfg, notes = configs.runs(budget)
    folder = _work_folder(work_dir, user_cfg.out_dir)
    base = {
        "target": target,
        "config_class": config_class or f"{config.__module__}:{config.__qualname__}",
        "config": cfg.to_dict(),
        "world_size": world_size,
        "env": dict(os.environ),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
    }
    runs = Attempts(base, folder, started + timeout_s, timeout_s)
    straight, interrupted = folder / "straight", folder / "interrupted"
    drawn = not kill_at and not term_at
    if drawn and max_steps is not None and max_steps < FEWEST_STEPS:
        raise ConfigError("--max-steps", f"must be at least {FEWEST_STEPS} for each of two interruptions to come "
                          "after a step checkpoint, an epoch end and a validation", max_steps)  # fmt: skip
    with fork_server(preload=["trainkit.certification.child"]):
        budget, total, covered, notes = _straight_run(runs, straight, configs, budget, notes, drawn=drawn)
        plan = plan_interruptions(total, kill_at=kill_at, term_at=term_at, seed=seed, epoch_ends=covered[0],
                                  validations=covered[1])  # fmt: skip
        first_interrupted = runs.attempts
        resumes = run_to_the_end(runs, interrupted, "interrupted", plan)
        divergence, compared, rows = compare_runs(straight, interrupted)
        logs = [Path(f"{stem}.steps.jsonl") for stem in runs.stems[first_interrupted:]]
        straight_log = Path(f"{runs.stems[first_interrupted - 1]}.steps.jsonl")
        causes, found = diagnose(runs, folder, divergence, resumes, lost_value(straight_log, logs))
    notes = (*notes, *found, *_checkpoint_note(len(kept_checkpoints(straight)), total))
    report = CertifyReport(
        passed=divergence is None, trainer=target, budget=", ".join(budget), world_size=world_size,
        total_steps=total, interruptions=plan, resumes=tuple(resumes), straight_dir=str(straight),
        interrupted_dir=str(interrupted), checkpoints_compared=compared, rows_compared=rows, divergence=divergence,
        causes=causes, notes=notes, seconds=time.monotonic() - started, timeout_s=timeout_s,
        crossed=crossed_lines(plan, resumes, *step_boundaries(straight_log, total)),
    )  # fmt: skip
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


class _Configs:
    """The configs certify builds from the user's words: the user's own (its ``out_dir``, its budget) and the runs'
    (certify's budget and :data:`_RUN_WORDS` added, the user's stores turned off)."""

    def __init__(self, config: type, words: list[str], parse_words: ParseWords, given: list[str]) -> None:
        self.config, self.words, self.parse_words, self.given = config, words, parse_words, given

    def user(self) -> Any:
        try:
            return self.parse_words(self.config, [*self.words, *self.given])
        except ConfigError:
            if self.given:
                raise
            # a config with no budget of its own (a script sets it in code): certify's default; other errors raise
            return self.parse_words(self.config, self.words, defaults={"max_steps": DEFAULT_MAX_STEPS})

    def runs(self, budget: list[str]) -> tuple[Any, tuple[str, ...]]:
        return _without_user_stores(self.parse_words(self.config, [*self.words, *budget, *_RUN_WORDS]))


def _straight_run(
    runs: Attempts, straight: Path, configs: _Configs, budget: list[str], notes: tuple[str, ...], *, drawn: bool
) -> tuple[list[str], int, tuple[list[int] | None, list[int] | None], tuple[str, ...]]:
    """Run straight through, on a longer budget (certify's own only, at most 3 times) until drawn interruptions can
    each come after an epoch end and a validation; return the budget run, its steps, the epoch ends and validations
    to plan by (None: interrupt without) and ``notes`` with what happened added."""
    own, own_total = list(budget), None
    for _ in range(4):  # the budget given or certify's, then (certify's only) at most 3 longer ones
        run_to_the_end(runs, straight, "straight", ())
        total = steps_taken(straight)
        ends, validations = step_boundaries(Path(f"{runs.stems[-1]}.steps.jsonl"), total)
        if not drawn or covering_steps(total, ends, validations) is not None:
            break
        longer = _longer_budget(budget, total, ends, validations, derived=not configs.given)
        if longer is None:
            notes += (_uncovered_note(total, ends, validations),)
            ends = validations = None  # interrupt without: said in the notes
            break
        own_total = total if own_total is None else own_total
        budget = longer
        runs.base["config"] = configs.runs(budget)[0].to_dict()
        shutil.rmtree(straight)
    if own_total is not None:
        notes = (
            f"certify's own budget ({', '.join(own)}: {own_total} steps) let too few epoch ends and validations "
            f"come before its interruptions; it ran {', '.join(budget)} ({total} steps) instead (give --max-steps "
            "or --epochs to choose)",
            *notes,
        )
    return budget, total, (ends, validations), notes


def _checkpoint_note(kept: int, total: int) -> tuple[str, ...]:
    """The note when the straight run kept fewer step checkpoints than it took steps (a loop resumable at epoch ends
    only)."""
    if kept >= total:
        return ()
    return (
        f"step checkpoints at {kept} of {total} step boundaries: this trainer's loop resumes at epoch ends only "
        "(iterate the epoch's DataLoader through self.progress() for step-exact resume; docs: Step checkpoints)",
    )


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
