"""What two or more benchmark scripts share: the repository's path, quiet runs, digests, run metadata, results.

Every benchmark runs from the repository root as a module (``python -m benchmarks.overhead``), so the
``trainkit`` it measures is this checkout's; nothing here edits ``sys.path``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import platform
import subprocess
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

REPO = Path(__file__).resolve().parent.parent
"""The repository root: the working directory of every child process a benchmark starts."""

RESULTS = REPO / "benchmarks" / "results"
"""Where the benchmarks write their results unless told otherwise (``--out``)."""


def log(msg: str) -> None:
    """Print one line at once (the benchmarks run for minutes; their progress must show as it happens).

    :param msg: The line.
    """
    print(msg, flush=True)


class NullTerminal(io.TextIOBase):
    """An output that drops what it is given and says it is a terminal, so progress bars draw as on one."""

    def isatty(self) -> bool:
        """:returns: True, always."""
        return True

    def writable(self) -> bool:
        """:returns: True, always."""
        return True

    def write(self, text: str) -> int:
        """Drop ``text``.

        :param text: What would be written.
        :returns: Its length, as if it had been written.
        """
        return len(text)


@contextlib.contextmanager
def quiet(terminal: bool = False) -> Iterator[None]:
    """Send stdout and stderr (tqdm bars, trainkit's summary line, Lightning chatter) to /dev/null.

    :param terminal: Send them to a :class:`NullTerminal` instead: trainkit draws its step bar only on a
        terminal, so its per-step cost shows only there.
    :returns: A context manager.
    """
    with (
        NullTerminal() if terminal else open(os.devnull, "w") as sink,
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        yield


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order: two runs that did the same work end with the same digest.

    :param tensors: The tensors (on any device).
    :returns: The first 16 hex digits.
    """
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def weights_digest(module: nn.Module) -> str:
    """:func:`digest` of every parameter in registration order (parameter names differ across wrappers).

    :param module: The model.
    :returns: The first 16 hex digits.
    """
    return digest(module.parameters())


def keep_weights(kept: dict[str, torch.Tensor] | None, module: nn.Module) -> dict[str, torch.Tensor]:
    """A hand-written loop's in-memory best model: the module's state copied into tensors allocated once.

    :param kept: The copy from an earlier call, refilled in place; None on the first call.
    :param module: The model whose state is kept.
    :returns: The copy.
    """
    import torch

    state = module.state_dict()
    if kept is None:
        return {k: v.detach().clone() for k, v in state.items()}
    with torch.no_grad():
        torch._foreach_copy_(list(kept.values()), [v.detach() for v in state.values()])
    return kept


def git(*args: str) -> str:
    """Run ``git`` in the repository: metadata only, so a failure reads as an empty answer.

    :param args: git's arguments.
    :returns: Its stripped stdout, or ``""`` when git is missing or fails.
    """
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - metadata only
        return ""


def git_description() -> str:
    """The commit a result was measured at, and whether trainkit's sources differed from it.

    :returns: The short hash (``?`` outside a checkout), with `` + uncommitted trainkit changes`` when so.
    """
    dirty = git("status", "--porcelain", "--", "trainkit")
    return (git("rev-parse", "--short", "HEAD") or "?") + (" + uncommitted trainkit changes" if dirty else "")


def load_average() -> str:
    """:returns: The load averages over 1, 5 and 15 minutes, as one string."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_meta() -> dict[str, Any]:
    """What every result file records about the run that wrote it, taken at its start.

    :returns: ``timestamp``, ``python``, ``torch``, ``cpus``, ``git`` (:func:`git_description`) and
        ``loadavg_start``; the caller adds ``loadavg_end`` and ``seconds`` at the end.
    """
    import torch

    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "git": git_description(),
        "loadavg_start": load_average(),
    }


def machine_was_busy(meta: Mapping[str, Any], threshold: float = 1.5) -> bool:
    """Whether other processes competed for the CPUs: the 1-minute load at the start or the end over ``threshold``.

    :param meta: :func:`run_meta`'s record, with ``loadavg_end``.
    :param threshold: The load that counts as busy.
    :returns: True when either load average was over it.
    """
    return any(float(meta[key].split()[0]) > threshold for key in ("loadavg_start", "loadavg_end"))


def one_thread() -> None:
    """Run torch on one thread (intra- and inter-op): every contestant gets the same CPU, whatever the host."""
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # once set (or once parallel work ran), it cannot change
        torch.set_num_interop_threads(1)


def lightning_missing() -> str | None:
    """Import Lightning quietly: the benchmarks compare against it when it is installed, and skip it otherwise.

    :returns: None when ``lightning.pytorch`` imports, else why it does not (``ExcType: message``).
    """
    try:
        with quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import lightning.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip"
        return f"{type(exc).__name__}: {exc}"
    return None


def write_json(out_dir: Path | str, name: str, doc: Any, indent: int = 2) -> Path:
    """Write a result file, creating its folder.

    :param out_dir: The folder (``--out``).
    :param name: The file's name.
    :param doc: What to write (JSON-serializable).
    :param indent: JSON indentation.
    :returns: The file's path.
    """
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path


def save_inputs(items: dict[str, Any]) -> tuple[Any, Any]:
    """What a checkpointer's save of ``items`` takes besides them, built from plain values as the trainer builds
    them: an empty loop's save record and the items' registry.

    :param items: The checkpoint's items (name to a module, an optimizer, ...).
    :returns: The save record and the registry.
    """
    from trainkit import bookkeeping
    from trainkit.checkpoint.checkpointer import SaveRecord

    registry, _ = bookkeeping.register_items(bookkeeping.CkptRegistry(), items)
    record = SaveRecord(
        loop=bookkeeping.LoopState(),
        best=None,
        patience=None,
        latest_metrics={},
        results=None,
        run_id=None,
        metrics_offset=None,
    )
    return record, registry
