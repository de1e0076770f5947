"""``python -m trainkit certify MODULE:Trainer [config.yaml ...] [key=value ...]``: prove a trainer's resume exact.

The command: its options (:func:`add_certify_parser`), :func:`certify_main` (parse, run, print the report, exit
status 0 on PASS and 1 on a divergence), and :func:`certify` (``trainkit.certify``), the same check from Python.
The engine is :mod:`trainkit.certification`: it runs the trainer straight through and interrupted at step
boundaries (``SIGTERM`` and ``SIGKILL``), in real processes, resumed each time until it finishes, compares the two
runs bit for bit (every kept step checkpoint, ``last``, ``best``, ``metrics.jsonl`` without its wall-clock keys)
and names the likely cause of a divergence (:data:`trainkit.certification.causes.CAUSES`). This module turns the
command's words into configs (:func:`~trainkit.cli.config_from_argv`) for it.

Every attempt of a run has the same ``--world-size``. Resuming on another number of processes works, mid-epoch
included, by hand or under torchrun's elastic agent (:ref:`elastic-resume`), but it matches a straight run only to
float rounding (the gradients are summed in another order), so certify, which compares bit for bit, does not check
it. The runs touch none of the user's stores (``out_dir``, ``ckpt.resume``, W&B, ``ckpt.remote``: replaced by
certify's own), so the remote tier is not certified.

Side effects: runs the trainer in subprocesses, writes the work folder (kept for inspection, never the config's
``out_dir`` nor its remote prefix), and the ``--json`` report.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainkit.certification import DEFAULT_EPOCHS, DEFAULT_MAX_STEPS, CertifyReport, certify_trainer
from trainkit.cli.argv import config_from_argv
from trainkit.errors import ConfigError

__all__ = ["add_certify_parser", "certify", "certify_main"]


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
        capped at :data:`~trainkit.certification.engine.DEFAULT_MAX_STEPS` steps or
        :data:`~trainkit.certification.engine.DEFAULT_EPOCHS` epochs.
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
    :raises trainkit.certification.attempts.CertifyError: When a run fails or the check runs past ``timeout_s``.
    """
    return certify_trainer(
        target, words, config_from_argv, config_class=config_class, max_steps=max_steps, epochs=epochs,
        kill_at=kill_at, term_at=term_at, seed=seed, world_size=world_size, work_dir=work_dir, timeout_s=timeout_s,
        json_path=json_path,
    )  # fmt: skip


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
        "Every attempt runs on --world-size processes: resuming on another number (elastic resume, mid-epoch "
        "included) works, but matches a straight run only to float rounding, so certify does not check it.",
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
