"""Metric buffering and where pushed metrics go: ``metrics.jsonl`` and W&B (rank 0), through one :class:`RunLog`.

Side effects: W&B runs, file appends, and reading the W&B run folders a resumed run left. This is the only
trainkit module that imports wandb, and it does so lazily, when a run is started in a mode other than
``disabled`` or resumed.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainkit.config import WandbConfig
from trainkit.messages import say
from trainkit.run.folder import same_directory
from trainkit.run.journal import JsonlSink
from trainkit.run.wandb_run import NullSink, WandbHistory, WandbSink, mark_as_synced, read_wandb_history

__all__ = [
    "WandbSink",
    "NullSink",
    "JsonlSink",
    "RunLog",
    "WandbHistory",
    "read_wandb_history",
    "mark_as_synced",
    "open_run_log",
    "new_run_id",
]


def new_run_id() -> str:
    """Return a fresh W&B-compatible run id (8 lowercase alphanumerics)."""
    return uuid.uuid4().hex[:8]


def _same_row(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in ((a[k], b[k]) for k in a)
    )


class RunLog:
    """Where the pushed rows go: ``metrics.jsonl`` (the record) and the W&B run (rank 0).

    A row's W&B step is its 0-based line in ``metrics.jsonl``, so W&B's ``_step`` continues across the
    offline folders a resumed run writes and ``wandb sync`` uploads them as one history. Rows the file holds
    but W&B lost (a kill -9 takes the rows W&B had not written yet) are sent when the run resumes. A row
    whose step W&B already holds (a crash cut an epoch short after W&B got some of its rows, and the resumed run
    redoes them) is written to the file but not sent again: W&B keeps the first row it got at a step, as it
    does online. When those kept rows differ from the redone ones (the rerun was not bit-exact), one line
    on stderr says which steps and how many.

    :param journal: ``metrics.jsonl``; None when checkpoints are off (rows are then numbered from 0).
    :param wandb: The W&B run, or a :class:`NullSink`.
    :param wandb_history: What W&B's folders of this run already hold (offline); the W&B run's own next
        step counts as well (online).
    :param run_id: The run's W&B id, kept in checkpoints also while W&B is off (so a later run with W&B on
        continues the same run); the W&B run's own id when None.
    """

    def __init__(
        self,
        journal: JsonlSink | None = None,
        wandb: WandbSink | NullSink | None = None,
        wandb_history: WandbHistory | None = None,
        run_id: str | None = None,
    ) -> None:
        self._journal = journal
        self._wandb = wandb if wandb is not None else NullSink()
        self._run_id = run_id if run_id is not None else self._wandb.run_id
        history = wandb_history or WandbHistory(0, {})
        self._next_row = journal.rows if journal is not None else 0
        self._first_new = max(history.next_step, self._wandb.next_step)  # W&B holds the steps below this
        self._earlier = history.rows
        self._kept: list[int] = []
        self._differing = 0
        if journal is not None and not isinstance(self._wandb, NullSink) and self._first_new < journal.rows:
            # rows the file kept but W&B never got (a kill took them before W&B wrote them): send them now
            for step, row in journal.rows_from(self._first_new):
                self._wandb.log(row, step)
            self._first_new = journal.rows

    @property
    def run_id(self) -> str | None:
        """The W&B run id; None when neither given nor a W&B run."""
        return self._run_id

    def offset(self) -> int | None:
        """The size of ``metrics.jsonl`` for the checkpoint; None without the file."""
        return self._journal.tell() if self._journal is not None else None

    def sync(self) -> None:
        """Make the rows written so far durable, before a checkpoint records :meth:`offset`."""
        if self._journal is not None:
            self._journal.sync()

    def pending_sync(self) -> Callable[[], None] | None:
        """What a checkpoint that records :meth:`offset` now must run before it is published.

        :returns: :meth:`sync`, or None when every row is durable already (the save then starts no thread for it).
        """
        return None if self._journal is None or self._journal.synced else self.sync

    def log(self, row: Mapping[str, float]) -> None:
        """Append ``row`` to the file, then send it to W&B unless W&B already holds its step.

        :param row: Name to float, with ``trainer/step`` and ``trainer/epoch``.
        """
        step = self._next_row
        if self._journal is not None:
            self._journal.log(row)
        self._next_row = step + 1
        if step >= self._first_new:
            if self._kept:
                self._report_kept()
            self._wandb.log(row, step)
            return
        self._kept.append(step)
        earlier = self._earlier.get(step)
        if earlier is not None and not _same_row(earlier, row):
            self._differing += 1

    def summary(self, values: Mapping[str, Any]) -> None:
        """Write values into the W&B run summary.

        :param values: Name to value.
        """
        self._wandb.summary(values)

    def finish(self, failed: bool = False) -> None:
        """Finish the W&B run and close the file (idempotent).

        :param failed: Marks the W&B run as failed (exit code 1).
        """
        self._report_kept()
        self._wandb.finish(exit_code=1 if failed else 0)
        self._wandb = NullSink()
        if self._journal is not None:
            self._journal.finish()
            self._journal = None

    def _report_kept(self) -> None:
        if self._kept and self._differing:
            say(
                f"W&B already held steps {self._kept[0]}-{self._kept[-1]} of this run from before the "
                f"interruption and keeps them; {self._differing} of those {len(self._kept)} rows differ from the "
                "rerun's rows in metrics.jsonl (the rerun was not bit-exact)"
            )
        self._kept, self._differing = [], 0


def open_run_log(
    journal: JsonlSink | None,
    *,
    wandb: WandbConfig | None,
    run_id: str,
    out_dir: Path,
    resumed_from: Path | None,
    config: Mapping[str, Any],
    config_class: Any = None,
) -> RunLog:
    """Start rank 0's :class:`RunLog`: ``metrics.jsonl`` and, unless W&B is off, the W&B run.

    Side effects: starts a W&B run; on a resume first reads what the run's earlier W&B folders hold (in
    ``out_dir`` and, for ``ckpt.resume=<path>``, in the folder resumed from) and marks as synced the empty
    ones in ``out_dir`` (:func:`mark_as_synced`). A failure closes ``journal``.

    :param journal: ``metrics.jsonl``, already cut back to the checkpoint's offset; None without checkpoints.
    :param wandb: The ``wandb`` config section; None for no W&B run.
    :param run_id: The W&B run id.
    :param out_dir: The run folder (W&B writes under ``out_dir/wandb``).
    :param resumed_from: The folder of the checkpoint the run resumed from; None for a fresh run.
    :param config: The config for W&B's config panel (``public_config``'s output).
    :param config_class: The config record, whose declared secrets stay out of W&B.
    :returns: The run log.
    """
    if wandb is None:
        return RunLog(journal, run_id=run_id)
    try:
        history = None
        if resumed_from is not None:  # read before this session's folder exists
            folders = [out_dir / "wandb"]
            if not same_directory(resumed_from, out_dir):
                folders.append(resumed_from / "wandb")
            history = read_wandb_history(folders, run_id, since=journal.rows if journal is not None else 0)
            for datastore in history.empty:  # only in this run's own folder: never write where it resumed from
                if same_directory(datastore.parent.parent, out_dir / "wandb"):
                    mark_as_synced(datastore)
        sink = WandbSink(
            mode=wandb.mode,
            run_id=run_id,
            directory=out_dir,
            config=config,
            project=wandb.project,
            entity=wandb.entity,
            name=wandb.name,
            tags=wandb.tags,
            config_class=config_class,
        )
    except BaseException:
        if journal is not None:
            journal.finish()
        raise
    return RunLog(journal, sink, history, run_id=run_id)
