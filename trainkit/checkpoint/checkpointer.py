"""The checkpointer: everything about a run's checkpoint files, behind the calls the trainer makes.

Side effects: files in ``out_dir`` (through :mod:`trainkit.checkpoint.formats.base`), the run folder's lock,
collectives (every rank calls :meth:`Checkpointer.claim`, :meth:`~Checkpointer.load`, :meth:`~Checkpointer.restore`,
:meth:`~Checkpointer.read_best`, :meth:`~Checkpointer.save` and :meth:`~Checkpointer.finish` together),
warnings and the ``trainkit: resuming ...`` line on rank 0.

Built from plain values (the run folder, the ``ckpt`` section, rank flags, the device, the saved config), never
from the trainer, as torchtitan's ``CheckpointManager`` is: the trainer's constructor calls ``claim``, ``load``
and ``restore``; the loop calls ``save``; the end of the run calls ``finish``. The storage format is picked
once, here (``ckpt.format``); reading takes whichever format a checkpoint is in, which is how a checkpoint
converts by being named in ``ckpt.resume``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from trainkit import bookkeeping
from trainkit.checkpoint.formats import dcp_directory
from trainkit.checkpoint.formats.base import BestWeights, SaveRequest, Storage
from trainkit.checkpoint.formats.dcp import DcpStorage, published_directories
from trainkit.checkpoint.formats.pt import PtStorage
from trainkit.checkpoint.kept import (
    KEPT_DIR,
    KeptCheckpoints,
    describe_save,
    kept_path,
    kept_step,
    read_kept,
    run_folder_of,
)
from trainkit.checkpoint.payload import (
    MAX_ITEM_DEPTH,
    finished_run,
    is_running_mean,
    item_states_for_rank,
    last_payload,
    mid_epoch_state,
    rank_items_state,
    resume_refusal,
)
from trainkit.checkpoint.remote import (
    Anchor,
    RemoteTier,
    Upload,
    folder_identity,
    folder_name,
    published_files,
    remove_transfer_leftovers,
)
from trainkit.config import CkptConfig, Config, changed_on_resume, render_value, strip_secrets
from trainkit.distributed import fsdp
from trainkit.distributed.collectives import all_gather_objects, broadcast_object, raise_if_any_rank_failed
from trainkit.errors import (
    BookkeepingError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointUnsafeError,
    OutDirError,
    UsageError,
)
from trainkit.files.bounded_read import load_json, read_regular
from trainkit.files.durable import atomic_write_bytes
from trainkit.files.weights_only_load import load_checkpoint
from trainkit.messages import say, warn_user
from trainkit.run.folder import same_directory
from trainkit.run.journal import JsonlSink
from trainkit.run.lock import RunLock
from trainkit.state.digest import state_digest
from trainkit.state.graph import check_state_graph
from trainkit.state.modules import load_module_state, restore_training_modes, training_modes
from trainkit.state.rng import capture_rng, reshard_seed, restore_rng, seed_everything

__all__ = ["Checkpointer", "Resume", "SaveRecord", "load_item", "LINEAGE_RECORD"]

LINEAGE_RECORD = ".trainkit-lineage.json"
"""The run folder's record of the life that started there last: its lineage and the step it started at, written as
a run with ``ckpt.remote`` starts; ``ckpt.resume=auto`` reads it when the folder holds no checkpoint."""
MAX_LINEAGE_RECORD_BYTES = 64 << 10
"""A lineage record larger than this is refused unread."""
FETCH_TRIES = 8
"""The most remote checkpoints one resume downloads and refuses before it gives up on the remote."""


def _same_checkpoint(a: bookkeeping.Checkpoint, b: bookkeeping.Checkpoint) -> bool:
    """Whether two descriptions are of one checkpoint: a step saved inside an epoch and again at its end is two."""
    return (a.step, a.epoch, a.epoch_end) == (b.step, b.epoch, b.epoch_end)


def load_item(obj: Any, state: Any) -> None:
    """Load a registered object's state; a module takes names saved with compile on or off.

    An item whose state is in a sharded checkpoint's DCP files (marked in its ``trainkit.pt``) was loaded from
    there already.

    :param obj: The registered object.
    :param state: Its saved state.
    """
    if isinstance(state, str) and state == dcp_directory.SHARDED:
        return
    if isinstance(obj, nn.Module):
        load_module_state(obj, state)
    else:
        obj.load_state_dict(state)


def _checked_item_states(registry: bookkeeping.CkptRegistry) -> tuple[dict[str, Any], CheckpointUnsafeError | None]:
    """Every registered item's state but the modules' and optimizers' (torch's own), each checked by
    :func:`~trainkit.state.graph.check_state_graph` (no cycle, a depth a resume reads back, bounded size), with the
    first refusal (None when all pass).

    Checked on every rank before anything of the save is gathered or written; the later walks over the states
    (digest, copy, size, the loadable check) then meet no cycle, and visit each shared part once.
    """
    states: dict[str, Any] = {}
    for name, obj in registry.items.items():
        if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            continue
        state = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
        try:
            check_state_graph(name, state, owner=f"checkpoint item {name!r}", max_depth=MAX_ITEM_DEPTH)
        except CheckpointUnsafeError as exc:
            return states, exc
        states[name] = state
    return states, None


def _raise_refused(refusals: list[CheckpointUnsafeError | None]) -> None:
    """Raise on every rank when a rank's item states were refused: that rank's refusal, said as its."""
    for rank, refused in enumerate(refusals):
        if refused is not None:
            message = f"rank {rank}: {refused}" if len(refusals) > 1 else str(refused)
            raise CheckpointUnsafeError(message, refused.type_name, refused.location)


@attrs.frozen(kw_only=True)
class Resume:
    """A checkpoint to resume from: its payload, where it was read, and its records reconciled with the config.

    :ivar ckpt: The loaded payload (``setup(ckpt)`` gets it).
    :ivar path: Where it was read.
    :ivar records: Its records with the current config applied (:func:`~trainkit.bookkeeping.reconcile`).
    :ivar results: A finished run's final results that this run returns without training (None if it trains).
    :ivar lineage: The lineage of the life that resumes it (a new segment after the checkpoint's own).
    """

    ckpt: dict[str, Any]
    path: Path
    records: bookkeeping.Resumed
    results: dict[str, float] | None
    lineage: bookkeeping.Lineage = ()


@attrs.frozen(kw_only=True)
class SaveRecord:
    """The engine's state at a save, as the loop hands it to :meth:`Checkpointer.save`.

    :ivar loop: The loop record (with the current step, for a step checkpoint inside an epoch): its epoch and
        step are the checkpoint's.
    :ivar best: The best record, if tracked.
    :ivar patience: The patience record, if tracked.
    :ivar latest_metrics: The last pushed value of every metric.
    :ivar results: The final results of a finished run, else None.
    :ivar run_id: The W&B run id.
    :ivar metrics_offset: The size of ``metrics.jsonl`` (None without it).
    :ivar position: Where the epoch stands, for a step checkpoint inside it; None at an epoch's end.
    :ivar rank_position: This rank's share of a step checkpoint (RNG and loader states at the iterator's
        creation, unpushed logs, the epoch's grad-norm mean); None at an epoch's end.
    :ivar left_out: Every ``(epoch, batch)`` the counted loop leaves out (``guard.skip_batches``, a rollback's).
    :ivar loader_state: At an epoch's end, this rank's ``state_dict()`` of the loader that carries its own position
        whose epoch ended (copied); None elsewhere, or without such a loader.
    """

    loop: bookkeeping.LoopState
    best: bookkeeping.BestState | None
    patience: bookkeeping.PatienceState | None
    latest_metrics: Mapping[str, float]
    results: Mapping[str, float] | None
    run_id: str | None
    metrics_offset: int | None
    position: bookkeeping.EpochPosition | None = None
    rank_position: dict[str, Any] | None = None
    left_out: tuple[tuple[int, int], ...] = ()
    loader_state: dict[str, Any] | None = None


class Checkpointer:
    """A run's checkpoints: claim the folder, load and restore what to resume, save, wait, release.

    :param out_dir: The run folder.
    :param ckpt: The ``ckpt`` config section.
    :param rank: This process's rank.
    :param world_size: The number of processes.
    :param timeout_s: The bound on a background sharded save's collectives (``dist.timeout_s``).
    :param device: Where best weights read back go.
    :param config: The config as saved (``public_config``: no secrets).
    :param remote: The remote tier (``ckpt.remote``: rank 0's, or every rank's for sharded checkpoints; see
        :meth:`~trainkit.checkpoint.remote.tier.RemoteTier.build`), or None.
    """

    def __init__(
        self,
        out_dir: Path,
        ckpt: CkptConfig,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
        config: dict[str, Any],
        remote: RemoteTier | None = None,
    ) -> None:
        in_shards = ckpt.format == "sharded"
        self._ckpt = ckpt
        self._rank = rank
        self._world_size = world_size
        self._config = config
        self._files = PtStorage(
            out_dir,
            enabled=ckpt.enable,
            writer=rank == 0,
            async_save=ckpt.async_save and not in_shards,
            world_size=world_size,
            device=device,
        )
        self._lock = RunLock(out_dir)
        # a checkpoint is read in its own format, whatever this run writes; written in this run's
        self._readers: dict[str, Storage] = {
            "file": self._files,
            "sharded": DcpStorage(
                out_dir,
                enabled=ckpt.enable,
                rank=rank,
                world_size=world_size,
                async_save=in_shards and ckpt.async_save,
                timeout_s=timeout_s,
            ),
        }
        self._storage = self._readers[ckpt.format]
        self.last_path: Path = self._storage.last_path
        """Where ``last`` is written: ``out_dir/last.pt``, or the directory ``out_dir/last.ckpt``."""
        self.best_path: Path = self._storage.best_path
        """Where ``best`` is written: ``out_dir/best.pt``, or the directory ``out_dir/best.ckpt``."""
        self._best_changed = False
        self._kept = KeptCheckpoints(out_dir, ckpt.keep, writes=ckpt.enable and rank == 0, sharded=in_shards)
        self._minimize = bool((config.get("val") or {}).get("minimize", False))
        self._score: tuple[int, float] | None = None  # (step, score) of the last save_if_best call
        self._resumed: Path | None = None
        self._damaged_last = False  # a rollback found last damaged: set aside at the next save
        self._remote = remote
        self._remote_token: str | None = None  # sharded with ckpt.remote: names the run's remote folders
        self._remote_saves = 0
        self._lineage: bookkeeping.Lineage = ()  # this life's: a fresh start's, or the resumed one's plus a segment

    @property
    def config(self) -> dict[str, Any]:
        """The config as saved in every checkpoint (``public_config``: no secrets); not to be changed."""
        return self._config

    @property
    def last_seconds(self) -> float | None:
        """The seconds rank 0's last finished save took (after :meth:`wait`)."""
        return self._storage.last_seconds

    # ------------------------------------------------------------------ before the run

    def claim(self) -> None:
        """Lock ``out_dir`` for this run (rank 0, when it writes checkpoints) and check it can be written.

        Done before anything is read, so a second run on the same folder is refused at once, and a folder that
        cannot take a checkpoint is found before the first epoch. Every rank learns whether it worked.

        :raises OutDirError: When another run holds the folder or it cannot be written.
        """
        error: BaseException | None = None
        try:
            if self._files.writes:
                self._lock.acquire()
                self._files.check_writable()
            if self._files.writes:  # rank 0 holds the folder now, and no rank staged anything yet
                remove_transfer_leftovers(self._files.out_dir)
            if self._remote is not None:  # a lease a killed run of this folder left is taken over at once
                self._remote.acquire(folder=folder_identity(self._files.out_dir) if self._files.writes else None)
        except OutDirError as exc:
            error = exc
        raise_if_any_rank_failed(
            error,
            lambda: OutDirError(f"rank 0 could not use out_dir {self._files.out_dir}; see rank 0's error"),
            world_size=self._world_size,
        )
        if self._ckpt.remote is not None and self._ckpt.enable and self._ckpt.format == "sharded":
            self._remote_token = broadcast_object(secrets.token_hex(4))

    def load(self, cfg: Config, path: Path | None = None, *, quiet: bool = False) -> Resume | None:
        """Find and load what ``ckpt.resume`` names, with fallback, checked and reconciled with ``cfg``.

        A named checkpoint is read in its own format (that is how a DDP run's ``last.pt`` continues as an FSDP2
        run with sharded checkpoints, and back); a changed config is warned about (a changed ``val.minimize``
        refused), and the records are reconciled with the config through the pure bookkeeping.

        :param cfg: The run's config.
        :param path: A checkpoint file to load instead of what ``ckpt.resume`` names (a rollback's).
        :param quiet: Do not say "resuming" on stderr (a rollback's candidates: the rollback says which it took).
        :returns: The checkpoint to resume, or None for a fresh run.
        :raises CheckpointError: When it cannot be resumed (see ``PtStorage`` and ``DcpStorage``).
        """
        self._refuse_other_format()
        starting = path is None  # not a rollback's candidate
        resume = self._ckpt.resume if path is None else str(path)
        named = resume not in ("auto", "never")
        in_shards = Path(resume).is_dir() if named else self._ckpt.format == "sharded"
        ckpt, path = self._read_resumable(resume, in_shards=in_shards)
        fetched = None
        if resume == "auto" and self._ckpt.remote is not None:
            fetched = self._fetched(ckpt, cfg)  # checked in its download folder, published only then
            if fetched is not None:
                ckpt, path = fetched
        if ckpt is None or path is None:
            if starting:
                self._lineage = bookkeeping.fresh_lineage(secrets.token_hex(8))
                self._record_lineage(self._lineage, 0)
            return None
        if fetched is None:  # a fetched one was checked before it was published
            self._check_config(ckpt, path, cfg)
        lineage = bookkeeping.branch_lineage(
            bookkeeping.lineage_from(ckpt.get("lineage", [])), secrets.token_hex(8), ckpt["step"]
        )
        if starting:
            self._record_lineage(lineage, int(ckpt["step"]))
        self._resumed = path
        records = self._reconcile(ckpt, cfg)
        if records.more and finished_run(ckpt):  # a finished run's file was let through: it continues here
            self._refuse_world_change(ckpt, path, continues=True)
        if records.notes:
            warn_user(f"resuming {path}: " + "; ".join(records.notes))
        if not quiet:
            self._say_resuming(path, records, ckpt.get("trainkit"))
            self._keep_resumed(path, ckpt, records, fetched=fetched is not None)
            if path.parent.name == KEPT_DIR and same_directory(path.parent.parent, self._files.out_dir):
                # ckpt.resume names a kept checkpoint of this folder: rerunning the command must find it again
                self._kept.resumed_from = kept_step(path.name)
        results = None if records.more else ckpt.get("results")  # a finished run that continues has none yet
        return Resume(
            ckpt=ckpt,
            path=path,
            records=records,
            results=dict(results) if results is not None else None,
            lineage=lineage,
        )

    def _fetched(self, local: Mapping[str, Any] | None, cfg: Config) -> tuple[dict[str, Any], Path] | None:
        """A remote checkpoint in the local one's history (:meth:`RemoteTier.candidates`), loaded and checked on
        every rank from its download folder as a named checkpoint is (schema, world size, config), then published
        into ``out_dir`` by rank 0: a refused one leaves ``out_dir`` as it was. A damaged one is warned about and
        the next one tried; any other refusal (a changed ``val.minimize``, another world size) raises.

        :returns: The payload and its published path, or None when the remote has nothing to take.
        """
        anchor = self._anchor(local) if self._rank == 0 else None
        for _ in range(FETCH_TRIES):
            fetched = self._remote.fetch(anchor) if self._rank == 0 and self._remote is not None else None
            shown = broadcast_object(None if fetched is None else (str(fetched.folder), fetched.manifest))
            if shown is None:
                return None
            folder, manifest = Path(shown[0]), shown[1]
            refused_elsewhere = CheckpointMismatchError(f"another rank refused the remote checkpoint in {folder}")
            loaded, damaged, error = None, None, None
            try:
                loaded = self._load_fetched(folder, manifest, cfg)
            except (CheckpointCorruptError, CheckpointUnsafeError) as exc:
                damaged = str(exc)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                error = exc
            try:
                raise_if_any_rank_failed(
                    error,
                    lambda: refused_elsewhere,  # noqa: B023 - called at once, in this iteration
                    world_size=self._world_size,
                )
            except BaseException:
                if fetched is not None:
                    RemoteTier.discard(fetched)
                raise
            problems = [problem for problem in all_gather_objects(damaged) if problem is not None]
            if problems or loaded is None:
                if fetched is not None and self._remote is not None:
                    self._remote.refuse(fetched, problems[0] if problems else "it could not be read")
                continue
            if fetched is not None and self._remote is not None:
                self._remote.publish(fetched)
            broadcast_object(None)  # rank 0 published before any rank reads out_dir
            ckpt, read = loaded
            return ckpt, self._files.out_dir / read.name
        return None

    def _load_fetched(self, folder: Path, manifest: Any, cfg: Config) -> tuple[dict[str, Any], Path]:
        """Load and check a downloaded remote checkpoint where it lies, as a named one (no fallback): its format,
        the schema, this run's world size, the config, and that its lineage is its commit record's."""
        in_shards = (folder / dcp_directory.LAST_DIR).is_dir()
        ckpt, path = self._read_resumable(
            str(folder / (dcp_directory.LAST_DIR if in_shards else self._files.last_path.name)), in_shards=in_shards
        )
        if ckpt is None or path is None:
            raise CheckpointCorruptError(f"{folder} holds no checkpoint")
        claimed = manifest.lineage  # a record from before lineages says nothing to compare
        if int(ckpt["step"]) != manifest.step or (
            claimed is not None and bookkeeping.lineage_from(ckpt.get("lineage", [])) != claimed
        ):
            raise CheckpointCorruptError(
                f"{path} does not match its remote commit record (step {ckpt['step']} and its lineage against step "
                f"{manifest.step})"
            )
        self._check_config(ckpt, path, cfg)
        if finished_run(ckpt) and self._reconcile(ckpt, cfg).more:  # as load() refuses it, before the publish
            self._refuse_world_change(ckpt, path, continues=True)
        return ckpt, path

    @staticmethod
    def _reconcile(ckpt: Mapping[str, Any], cfg: Config) -> bookkeeping.Resumed:
        """A checkpoint's records reconciled with the config (:func:`~trainkit.bookkeeping.reconcile`)."""
        val = cfg.val
        return bookkeeping.reconcile(
            bookkeeping.LoopState.from_dict(ckpt["loop"]),
            bookkeeping.BestState.from_dict(ckpt["best"]) if ckpt.get("best") is not None else None,
            bookkeeping.PatienceState.from_dict(ckpt["patience"]) if ckpt.get("patience") is not None else None,
            epochs=cfg.epochs,
            max_steps=cfg.max_steps,
            val_patience=val.patience,
            start_patience=val.start_patience,
            min_delta=val.min_delta,
        )

    def _anchor(self, local: Mapping[str, Any] | None) -> Anchor | None:
        """What a remote checkpoint must descend from: the local checkpoint, else the run folder's lineage record
        (a life that started here and was killed before its first save), else nothing (an empty folder)."""
        if local is not None:
            return Anchor(
                lineage=bookkeeping.lineage_from(local.get("lineage", [])),
                step=int(local["step"]),
                checkpoint=True,
                what=f"the local checkpoint (step {local['step']})",
            )
        record = self._files.out_dir / LINEAGE_RECORD
        if not os.path.lexists(record):
            return None
        what = f"the run that started in {self._files.out_dir} ({record.name})"
        try:
            raw = load_json(read_regular(record, MAX_LINEAGE_RECORD_BYTES))
            lineage, step = bookkeeping.lineage_from(raw["lineage"]), raw["step"]
            if type(step) is not int or not 0 <= step < 2**63:
                raise TypeError(f"step must be an int in [0, 2**63), got {step!r:.40}")
        except (OSError, ValueError, TypeError, KeyError, BookkeepingError) as exc:
            warn_user(f"{record} cannot be read ({exc}); no remote checkpoint is taken: delete it to take the newest")
            return Anchor(lineage=(), step=0, checkpoint=False, what=what)
        return Anchor(lineage=lineage, step=step, checkpoint=False, what=what)

    def _record_lineage(self, lineage: bookkeeping.Lineage, step: int) -> None:
        """Rank 0 of a run with ``ckpt.remote`` records the life starting in ``out_dir`` (see :data:`LINEAGE_RECORD`;
        only the remote tier reads it)."""
        if self._rank != 0 or not self._ckpt.enable or self._ckpt.remote is None:
            return
        record = {"lineage": [list(segment) for segment in lineage], "step": step}
        path = self._files.out_dir / LINEAGE_RECORD
        try:
            atomic_write_bytes(json.dumps(record).encode(), path)
        except OSError as exc:  # a directory planted there, say: a clear error, nothing else changed
            raise OutDirError(f"{path} cannot be written ({exc}); move it away") from None

    def _read_resumable(self, resume: str, *, in_shards: bool) -> tuple[dict[str, Any] | None, Path | None]:
        """Read what ``resume`` names in its format; an unfinished run's checkpoint that cannot resume on this number
        of processes is refused here, for both formats (a finished run's only once it is known to continue)."""
        ckpt, path = self._readers["sharded" if in_shards else "file"].load_resume(resume)
        if ckpt is not None and path is not None and not finished_run(ckpt):
            self._refuse_world_change(ckpt, path, continues=False)
        return ckpt, path

    def _refuse_world_change(self, ckpt: dict[str, Any], path: Path, *, continues: bool) -> None:
        """Refuse a checkpoint that cannot resume on this number of processes: the one place that asks
        (:func:`~trainkit.checkpoint.payload.resume_refusal`); ``continues``: a finished run that trains on."""
        refusal = resume_refusal(ckpt, self._world_size)
        if refusal is not None:
            raise CheckpointMismatchError(
                f"{path} was written by a run with world_size={ckpt['world_size']}, this run has "
                f"world_size={self._world_size}{' and continues it' if continues else ''}: {refusal} (or start fresh "
                "with ckpt.resume=never)"
            )

    def catch_up_remote(self, resume: Resume | None) -> None:
        """Queue for upload, in the background, what this run's local checkpoints hold and the remote lacks: a kill
        may have cut the upload of the checkpoint it resumes from (a finished run's final one included) or of an
        older one that ``ckpt.keep`` keeps; then run the remote's retention once (a step committed twice keeps the
        copy that is the local one). Every rank calls it after :meth:`load` (a collective for sharded checkpoints
        on several ranks); never raises (a store that fails is warned about, and training goes on).

        Only this folder's own history goes up: the resumed checkpoint when it is in ``out_dir`` (``last``, its
        previous copy, or a kept one) and the kept ``checkpoints/step-<step>`` of earlier steps; a remote copy
        counts as the local checkpoint when step, epoch and epoch end agree. What uploads: every local checkpoint
        that retention over the remote's committed ones and the local ones keeps (``newest`` the resumed step) and
        the remote lacks, oldest first. Sharded checkpoints on several ranks: the resumed one only (its shards from
        every rank, committed at the next save or at the end, :meth:`wait_remote`).

        :param resume: What :meth:`load` returned (None: a fresh run, nothing to catch up).
        """
        if self._remote is None or resume is None or not self._ckpt.enable:
            return
        several = self._ckpt.format == "sharded" and self._world_size > 1
        plan: tuple[list[tuple[bookkeeping.Checkpoint, Path]], Any] | None = None
        if self._rank == 0:
            try:
                plan = self._catch_up_plan(resume, last_only=several)
            except Exception as exc:  # noqa: BLE001 - the run goes on; its next commit's retention still runs
                warn_user(f"ckpt.remote={self._remote.url}: could not compare the remote with {resume.path} ({exc})")
        if several:
            wanted = broadcast_object([description.step for description, _ in plan[0]] if plan else [])
            if wanted:  # every rank uploads its own shards of the resumed directory into one folder
                self._remote_saves += 1
                description = plan[0][0][0] if plan else None  # rank 0's goes into the commit record
                upload = self._catch_up_upload(resume, resume.path, description, last=True, plan=plan)
                self._remote.catch_up([upload] if upload is not None else [], None)
            elif plan is not None:
                self._remote.catch_up([], plan[1])
            return
        if plan is None:
            return
        candidates, retention = plan
        uploads = []
        for description, path in candidates:
            upload = self._catch_up_upload(resume, path, description, last=path == resume.path, plan=plan)
            if upload is not None:
                uploads.append(upload)
        self._remote.catch_up(uploads, retention)

    def _catch_up_plan(
        self, resume: Resume, *, last_only: bool
    ) -> tuple[list[tuple[bookkeeping.Checkpoint, Path]], Any] | None:
        """Rank 0: the local checkpoints to upload (oldest first) and the retention to run after them."""
        assert self._remote is not None
        path, ckpt = resume.path, resume.ckpt
        if not same_directory(run_folder_of(path), self._files.out_dir):
            return None  # resumed from another folder: its history is that folder's
        described = self._describe_resumed(path, ckpt, resume.records)
        if described is None:
            return None
        last, minimize = described
        resumed_step = last.step
        local: dict[int, tuple[bookkeeping.Checkpoint, Path]] = {}
        if not last_only:
            for description, kept in self._kept.history():  # a larger step is an abandoned history's
                if description.step < resumed_step:
                    local[description.step] = (description, kept)
                elif description.step == resumed_step and _same_checkpoint(description, last):
                    last = description  # as its save recorded it (scores included)
        local[resumed_step] = (last, path)
        committed = self._remote.committed()
        present: dict[int, str] = {}  # the remote copy that is the local checkpoint, by step
        union = {step: description for step, (description, _) in local.items()}
        for name, manifest in committed:
            d = manifest.description
            remote = bookkeeping.Checkpoint(
                step=manifest.step, epoch=manifest.epoch, epoch_end=d["epoch_end"], time=d["time"], scores=d["scores"]
            )
            union.setdefault(manifest.step, remote)
            if manifest.step in local and _same_checkpoint(local[manifest.step][0], remote):
                present.setdefault(manifest.step, name)
        policy = self._kept.policy(minimize)
        reasons = bookkeeping.keep_reasons(policy, union.values(), newest=resumed_step)
        missing = [local[step] for step in sorted(local) if reasons.get(step) and step not in present]
        lineage = bookkeeping.lineage_from(ckpt.get("lineage", []))
        history = (lineage, resumed_step) if lineage else None  # retention judges the resumed checkpoint's history
        return missing, (policy, resumed_step, tuple(present.values()), history)

    def _catch_up_upload(
        self,
        resume: Resume,
        path: Path,
        description: bookkeeping.Checkpoint | None,
        *,
        last: bool,
        plan: tuple[list[tuple[bookkeeping.Checkpoint, Path]], Any] | None,
    ) -> tuple[list[tuple[Path, str, int | None]], Callable[..., Upload]] | None:
        """One catch-up upload: a committed folder as the save's own upload makes it (``best`` when it is the one
        that save had, ``metrics.jsonl`` up to the size the checkpoint records, ``last`` last); None (warned) when
        an older checkpoint's record cannot be read."""
        assert self._remote is not None
        record: Mapping[str, Any] = resume.ckpt
        if not last:
            try:  # an older kept checkpoint: its own record says its metrics' size and its best
                record = load_checkpoint(path / dcp_directory.ENGINE_FILE if path.is_dir() else path)
            except (CheckpointCorruptError, CheckpointUnsafeError, OSError) as exc:
                warn_user(f"ckpt.remote={self._remote.url}: {path} is not uploaded ({exc})")
                return None
        # the best file now is the one that save uploaded if the best record is the same (it has not changed since)
        best = [self.best_path] if record.get("best") == resume.ckpt.get("best") else []
        offset = record.get("metrics_offset")
        metrics = offset if self._rank == 0 and type(offset) is int and offset >= 0 else None
        files = published_files([*best, path], self._files.metrics_path, metrics, rank=self._rank)
        name = self.last_path.name  # last.prev.pt or checkpoints/step-<n>.pt goes up as last.pt
        files = [
            (local, name + remote[len(path.name) :] if remote.split("/")[0] == path.name else remote, size)
            for local, remote, size in files
        ]
        step = int(record["step"])
        minimize = resume.records.best.minimize if resume.records.best is not None else self._minimize
        several = self._ckpt.format == "sharded" and self._world_size > 1
        folder = self._remote_folder(step) if several else None
        retention = plan[1] if plan is not None else (None, int(resume.ckpt["step"]), (), None)
        lineage = bookkeeping.lineage_from(
            record.get("lineage", [])
        )  # its commit record names the checkpoint's own history
        return files, functools.partial(
            Upload,
            step=step,
            epoch=int(record["epoch"]) if description is None else description.epoch,
            run_id=record.get("wandb_run_id"),
            description=description if description is not None else bookkeeping.Checkpoint(step=step),
            policy=self._kept.policy(minimize),
            minimize=minimize,
            folder=folder,
            commits=folder is None,
            newest=int(resume.ckpt["step"]),
            prefer=tuple(retention[2]),
            lineage=lineage or None,
        )

    def rollback_resume(self, cfg: Config, first_bad_step: int) -> Resume | None:
        """The newest checkpoint written before optimizer step ``first_bad_step``, loaded (the divergence guard's
        rollback): ``last``, then its previous copy, then the kept ``checkpoints/step-<step>.pt`` files
        (:func:`~trainkit.bookkeeping.rollback_candidate`); a damaged one is warned about and passed over for the
        next older one, as an automatic resume falls back. None when none qualifies (every rank decides alike).

        :param cfg: The run's config.
        :param first_bad_step: The 0-based index of the first non-finite step of the guard's window.
        :returns: The checkpoint to roll back to, or None.
        """
        self.wait()  # a background save is published before anything is read
        for path in self._storage.published():  # newest first: last, then last.prev
            resume = self._load_for_rollback(cfg, path)
            if resume is not None and resume.ckpt["step"] <= first_bad_step:
                return resume
        candidates = [(c.step, c.step) for c in read_kept(self._kept.directory).described]
        while (
            chosen := bookkeeping.rollback_candidate(candidates, first_bad_step)
        ) is not None:  # one try per kept one
            resume = self._load_for_rollback(cfg, kept_path(self._kept.directory, chosen))
            if resume is not None:
                return resume
            candidates.remove((chosen, chosen))
        return None

    def _load_for_rollback(self, cfg: Config, path: Path) -> Resume | None:
        """A rollback candidate loaded, or None when it is damaged (warned: the next older one is tried, as an
        automatic resume falls back; a damaged ``last`` is set aside at the next save, as ``last.corrupt``, so that
        save cannot rotate it into ``last.prev``, the intact copy)."""
        try:
            return self.load(cfg, path, quiet=True)
        except (CheckpointCorruptError, CheckpointUnsafeError) as exc:
            warn_user(f"guard.nonfinite=rollback: {path} cannot be rolled back to ({exc}); trying an older checkpoint")
            if path == self.last_path:
                self._damaged_last = True
            return None

    def _set_damaged_aside(self) -> None:
        """Rank 0: move a ``last`` a rollback found damaged to ``last.corrupt`` (kept for inspection), once."""
        if not self._damaged_last:
            return
        self._damaged_last = False
        if self._rank == 0 and os.path.lexists(self.last_path):
            kept = self.last_path.with_name(f"{self.last_path.stem}.corrupt{self.last_path.suffix}")
            if os.path.isdir(kept) and not os.path.islink(kept):  # a sharded one set aside before: the newer wins
                shutil.rmtree(kept)
            os.replace(self.last_path, kept)
            warn_user(f"the damaged {self.last_path} is kept as {kept}; the next save writes {self.last_path} anew")

    def _keep_resumed(
        self, path: Path, ckpt: Mapping[str, Any], records: bookkeeping.Resumed, *, fetched: bool
    ) -> None:
        """Rank 0 under ``ckpt.keep``: the resumed ``last`` of this folder is kept if its step is not (a kill
        between its publish and its link, or one just taken from the remote), described as its save described it,
        with the time it was written."""
        in_shards = self._ckpt.format == "sharded"
        if not self._kept.active or not same_directory(path.parent, self._files.out_dir) or path.is_dir() != in_shards:
            return
        described = self._describe_resumed(path, ckpt, records)
        if described is None:
            return
        description, minimize = described
        if self._kept.keep_resumed(path, description, minimize=minimize):
            why = (
                "it was taken from ckpt.remote"
                if fetched
                else "the run before stopped after publishing it and before keeping it"
            )
            say(f"kept {path} as {self._kept.directory.name}/step-{description.step}: {why} (ckpt.keep)")

    def _describe_resumed(
        self, path: Path, ckpt: Mapping[str, Any], records: bookkeeping.Resumed
    ) -> tuple[bookkeeping.Checkpoint, bool] | None:
        """The resumed checkpoint as retention sees it (the time it was written), and the run's direction; None when
        its file cannot be examined."""
        loop, best = bookkeeping.LoopState.from_dict(ckpt["loop"]), records.best
        score = None  # the score of an epoch that did not improve is not in the checkpoint (its val/* metrics are)
        epoch_end = ckpt.get("trainkit") is None
        if best is not None and best.score is not None and best.epoch == loop.epoch - 1 and epoch_end:
            score = (int(ckpt["step"]), best.score)
        try:
            saved_at = os.lstat(path).st_mtime
        except OSError:
            return None
        description = describe_save(
            step=int(ckpt["step"]),
            epoch=loop.epoch,
            epoch_end=epoch_end,
            validated=loop.last_validated and epoch_end,
            score=score,
            latest_metrics=ckpt.get("latest_metrics") or {},
            saved_at=saved_at if math.isfinite(saved_at) else None,
        )
        return description, best.minimize if best is not None else self._minimize

    def _say_resuming(self, path: Path, records: bookkeeping.Resumed, mid_epoch: Mapping[str, Any] | None) -> None:
        line = records.line
        if records.more and mid_epoch is not None:
            position = bookkeeping.EpochPosition.from_dict(mid_epoch["position"])
            line += f", inside it: {position.done} done"
            if position.world_size != self._world_size:
                line += f" on {position.world_size} ranks, dealt anew over {self._world_size}"
        if self._rank == 0:
            say(f"resuming {path}: {line}")

    def _refuse_other_format(self) -> None:
        """Refuse to start fresh over a run folder whose checkpoints are in the other ``ckpt.format``."""
        if self._ckpt.resume != "auto" or not self._ckpt.enable:
            return
        other_format = "file" if self._ckpt.format == "sharded" else "sharded"
        other = self._readers[other_format].published()
        if other and not self._storage.published():
            raise CheckpointMismatchError(
                f"{other[0]} was written with ckpt.format={other_format!r}, and this run has "
                f"ckpt.format={self._ckpt.format!r}, which would start over beside it; resume it with "
                f"ckpt.format={other_format!r}, convert it by naming it in another out_dir (ckpt.resume={other[0]}), "
                "or start fresh (ckpt.resume=never)"
            )

    def _check_config(self, ckpt: Mapping[str, Any], path: Path, cfg: Config) -> None:
        """Warn about a config that changed since the checkpoint; refuse a changed ``val.minimize``."""
        changes = changed_on_resume(strip_secrets(ckpt.get("config") or {}, cfg), self._config)
        for key, old, new in changes:
            if key == "val.minimize" and ckpt.get("best") is not None:
                raise CheckpointMismatchError(
                    f"{path} tracked its best with val.minimize={old}, this config says {new}; the best score "
                    "cannot be compared across directions"
                )
        if changes:
            details = ", ".join(
                f"{key}: {render_value(key, old, cfg)} -> {render_value(key, new, cfg)}" for key, old, new in changes
            )
            warn_user(
                f"resuming {path} with a changed config ({details}); the result may differ from an uninterrupted run"
            )

    def check_format(self, registry: bookkeeping.CkptRegistry) -> None:
        """Refuse what ``ckpt.format`` cannot save: a model sharded by ``make_fsdp()`` in a single file.

        :param registry: The registry after ``setup()``.
        :raises UsageError: Naming the item and the fix.
        """
        if not self._ckpt.enable or self._ckpt.format != "file":
            return
        for name, obj in registry.items.items():
            if isinstance(obj, nn.Module) and fsdp.is_sharded(obj):
                raise UsageError(
                    f"checkpoint item {name!r} is sharded by make_fsdp(), and ckpt.format='file' would write only "
                    "rank 0's shards; set ckpt.format='sharded' (or ckpt.enable=false)"
                )

    def restore(self, resume: Resume, registry: bookkeeping.CkptRegistry) -> bookkeeping.CkptRegistry:
        """Put a checkpoint's items, train/eval modes and this rank's RNG states back (after ``setup()``).

        A running mean whose state differed between the saving ranks comes back as this rank's own (the same world
        size) or as the pooled share (another one); any other item as the checkpoint holds it (rank 0's).

        A sharded directory's modules and optimizers are read from its DCP files, resharded to this run; a file
        checkpoint (DDP or one process) loads into FSDP2 modules as whole states, sharded on load.

        :param resume: What :meth:`load` returned.
        :param registry: The registry after ``setup()``.
        :returns: The registry with plain values restored.
        """
        ckpt, items = resume.ckpt, registry.items
        self._lineage = resume.lineage  # the saves from here on belong to the resuming life
        if resume.path.is_dir():
            in_dcp = [name for name in items if isinstance(ckpt.get(name), str) and ckpt[name] == dcp_directory.SHARDED]
            dcp_directory.apply_items(items, dcp_directory.load_items(items, resume.path, in_dcp))
        elif any(fsdp.is_sharded(obj) for obj in items.values() if isinstance(obj, nn.Module)):
            converted = dcp_directory.apply_whole_items(items, ckpt)
            ckpt = {**ckpt, **dict.fromkeys(converted, dcp_directory.SHARDED)}
        # a running mean that differed between the saved ranks: this rank's own, or the pooled share on another world
        ckpt = {**ckpt, **item_states_for_rank(ckpt, rank=self._rank, world_size=self._world_size)}
        registry, _ = bookkeeping.apply_payload(registry, ckpt, load_into=load_item)
        modes = ckpt.get("training_modes") or {}
        for name, obj in registry.items.items():
            if isinstance(obj, nn.Module) and isinstance(modes.get(name), Mapping):
                restore_training_modes(obj, modes[name])
        rng = ckpt.get("rng")
        if ckpt.get("world_size") != self._world_size:  # saved states do not map onto another number of ranks
            seed_everything(reshard_seed(self._config.get("seed", 0), self._rank, int(ckpt["step"])))
        elif rng is not None:
            restore_rng(rng[self._rank])
        return registry

    def read_best(self, directory: Path, best: bookkeeping.BestState, model: nn.Module | None) -> BestWeights | None:
        """The best weights beside a resumed checkpoint, whose recorded best is ``best`` (a collective).

        Read in their own format, into ``model``'s layout. When they came from another folder or format, the
        next save writes them into this run's folder, so that it is complete on its own.

        :param directory: The resumed checkpoint's folder.
        :param best: The best record it holds.
        :param model: The run's model (unwrapped).
        :returns: The weights, or None (warned) when none match.
        """
        if self._resumed is not None and directory == self._resumed.parent:
            directory = run_folder_of(self._resumed)  # a kept checkpoint's best.pt is in its run folder
        in_shards = bool(published_directories(directory / dcp_directory.BEST_DIR))
        loaded = self._readers["sharded" if in_shards else "file"].best_weights(directory, best, model)
        if loaded is not None and loaded.rewrite:
            self._best_changed = True
        return loaded

    def scored(self, score: Any, *, step: int, improved: bool, minimize: bool) -> None:
        """Record a ``save_if_best`` result: the score at this step (for ``ckpt.keep``'s ``best`` rules) and, when it
        improved, that the best weights changed.

        :param score: The score given to ``save_if_best``.
        :param step: The optimizer step it was measured at.
        :param improved: Whether it improved (the weights were snapshotted).
        :param minimize: The direction of the best record.
        """
        if improved:
            self._best_changed = True
        self._minimize = minimize
        if self._kept.active:
            self._score = (step, float(score))  # save_if_best checked that it converts

    def open_journal(self, resume: Resume | None) -> JsonlSink | None:
        """Open ``metrics.jsonl`` (rank 0 of a run with checkpoints; None elsewhere), cut back to the checkpoint.

        Temp files of killed saves are removed first. A run resumed from another folder starts its file with that
        folder's rows, up to the size its checkpoint recorded.

        :param resume: What :meth:`load` returned, or None for a fresh run (which starts a fresh file).
        :returns: The journal, or None.
        """
        if not (self._ckpt.enable and self._rank == 0):
            return None
        self._files.remove_stale_temp_files()
        offset = resume.ckpt.get("metrics_offset") if resume is not None else 0
        history = None
        if (
            resume is not None
            and isinstance(offset, int)
            and not same_directory(run_folder_of(resume.path), self._files.out_dir)
        ):
            history = self._files.read_metrics_prefix(run_folder_of(resume.path), offset)
        return JsonlSink(self._files.metrics_path, truncate_to=offset, history=history)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        record: SaveRecord,
        registry: bookkeeping.CkptRegistry,
        *,
        best_weights: dict[str, Any] | None,
        before: Callable[[], None] | None,
    ) -> float | None:
        """Write the best checkpoint (when it changed since the last save), then ``last`` (a collective).

        Every rank's RNG states (and, inside an epoch, its share of the position) are gathered into the payload;
        the format's storage writes it, synchronously or in the background (``ckpt.async_save``).

        :param record: The engine's state.
        :param registry: The registered items.
        :param best_weights: The best-model snapshot (None before any improvement).
        :param before: Makes ``metrics.jsonl`` durable before ``last`` records its size; None when it is already.
        :returns: The seconds rank 0's save took (None elsewhere, with checkpoints off, or in the background).
        :raises CheckpointError: On every rank, when a rank's write failed.
        """
        changed, self._best_changed = self._best_changed, False
        if not self._ckpt.enable:
            return None
        states, refused = _checked_item_states(registry)
        if refused is not None and self._world_size == 1:
            raise refused
        self._remote_saves += 1
        uploaded = self._remote.report() if self._remote is not None and self._remote_token is not None else None
        shares = self._item_shares(states) if refused is None else None
        state = {"rng": capture_rng(), "position": record.rank_position, "remote": uploaded, "items": shares}
        state["loader"] = record.loader_state
        state["refused"] = refused
        gathered = all_gather_objects(state)  # also carries each rank's sharded upload, for the commit
        _raise_refused([rank_state["refused"] for rank_state in gathered])
        self._remote_reports([rank_state["remote"] for rank_state in gathered])
        self._set_damaged_aside()  # every rank is here, past any read of it
        rng = [state["rng"] for state in gathered]
        mid_epoch = None
        if record.position is not None:
            mid_epoch = mid_epoch_state(record.position, [state["position"] for state in gathered])
        loader_states = [rank_state["loader"] for rank_state in gathered]
        loader_states = loader_states if any(each is not None for each in loader_states) else None
        rank_items = None
        if shares is not None:
            differ = bookkeeping.differing_items([state["items"]["digests"] for state in gathered])
            rank_items = rank_items_state([state["items"]["means"] for state in gathered], differ)
        best = best_weights if changed and record.best is not None else None
        engine = functools.partial(
            self._payload, record=record, rng=rng, mid_epoch=mid_epoch, registry=registry, rank_items=rank_items,
            loader_states=loader_states,
        )  # fmt: skip
        request = SaveRequest(
            registry=registry,
            engine=engine,
            best_weights=best,
            best=record.best,
            config=self._config,
            epoch=record.loop.epoch,
            step=record.loop.step,
            **self._keeping(record, before),
        )
        return self._storage.save_checkpoint(request)

    def _item_shares(self, states: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
        """This rank's digest of every registered item's state but the modules and optimizers (replicated by DDP,
        sharded by FSDP: never hashed), and the state of each running mean among them; None on one process.

        Sent with the RNG states the save gathers anyway, so comparing the ranks costs no collective of its own."""
        if self._world_size == 1:
            return None
        digests, means = {}, {}
        for name, state in states.items():
            digests[name] = state_digest(state)
            if is_running_mean(state):
                means[name] = state
        return {"digests": digests, "means": means}

    def _keeping(self, record: SaveRecord, before: Callable[[], None] | None) -> dict[str, Callable[[], None] | None]:
        """The save's ``before`` and ``after`` (rank 0): under ``ckpt.keep`` describe the checkpoint in
        ``checkpoints/index.json`` before it is written and keep it under ``checkpoints/`` once it is published;
        with ``ckpt.remote`` hand the published files to the uploader."""
        if not self._kept.active and self._remote is None:
            return {"before": before, "after": None}
        epoch_end, score = record.position is None, self._score
        validated_here = score is not None and score[0] == record.loop.step  # saved at a validation's step
        description = describe_save(
            step=record.loop.step,
            epoch=record.loop.epoch,
            epoch_end=epoch_end,
            validated=(epoch_end and record.loop.last_validated) or validated_here,
            score=self._score,
            latest_metrics=record.latest_metrics,
        )
        minimize = record.best.minimize if record.best is not None else self._minimize
        if not self._kept.active:
            return {"before": before, "after": functools.partial(self._hand_over, record, description, minimize)}

        def announce_then_before() -> None:
            if before is not None:
                before()
            self._kept.announce(description, minimize=minimize)

        def keep_then_hand_over() -> None:
            self._kept.publish(self.last_path, description, minimize=minimize)
            if self._remote is not None:
                self._hand_over(record, description, minimize)

        return {"before": announce_then_before, "after": keep_then_hand_over}

    def _hand_over(self, record: SaveRecord, description: bookkeeping.Checkpoint, minimize: bool) -> None:
        """Hand the just-published ``best``, ``metrics.jsonl`` (up to this checkpoint's line) and ``last`` to the
        remote uploader (where the save's writes run, right after the publish)."""
        assert self._remote is not None
        metrics = record.metrics_offset if self._rank == 0 else None
        shared = self._remote_folder(record.loop.step)  # sharded: every rank's shards in one folder
        self._remote.hand_over(
            published_files([self.best_path, self.last_path], self._files.metrics_path, metrics, rank=self._rank),
            functools.partial(
                Upload,
                step=record.loop.step,
                epoch=record.loop.epoch,
                run_id=record.run_id,
                description=description,
                policy=self._kept.policy(minimize),
                minimize=minimize,
                folder=shared,
                commits=shared is None,
                lineage=self._lineage,
            ),
        )

    def _remote_folder(self, step: int) -> str | None:
        """A sharded save's remote folder, named alike on every rank (the run's token, the save's number)."""
        if self._ckpt.format != "sharded" or self._remote_token is None:
            return None
        return folder_name(step, f"{self._remote_token}{self._remote_saves:08x}")

    def _remote_reports(self, report: Any) -> None:
        """Rank 0 commits the newest sharded upload every rank reported done (``report`` is each rank's)."""
        if self._rank == 0 and self._remote is not None and self._remote_token is not None:
            self._remote.commit_reports(report)

    def _payload(
        self,
        items: dict[str, Any],
        *,
        record: SaveRecord,
        rng: list[dict[str, Any]],
        mid_epoch: dict[str, Any] | None,
        registry: bookkeeping.CkptRegistry,
        rank_items: dict[str, Any] | None,
        loader_states: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        return last_payload(
            items=items,
            epoch=record.loop.epoch,
            step=record.loop.step,
            world_size=self._world_size,
            config=self._config,
            loop=record.loop,
            best=record.best,
            patience=record.patience,
            rng=rng,
            wandb_run_id=record.run_id,
            latest_metrics=dict(record.latest_metrics),
            results=dict(record.results) if record.results is not None else None,
            metrics_offset=record.metrics_offset,
            training_modes={
                name: training_modes(obj) for name, obj in registry.items.items() if isinstance(obj, nn.Module)
            },
            mid_epoch=mid_epoch,
            guard_skips=[[epoch, batch] for epoch, batch in record.left_out],
            rank_items=rank_items,
            lineage=self._lineage,
            loader_states=loader_states,
        )

    def keep_best_on_disk(self, tracked: bool, epoch: int | None) -> None:
        """At the end of a run: when the best checkpoint went missing during it, say so and write it again.

        Decided alike on every rank for sharded checkpoints (rank 0 looks, every rank learns), since every rank
        writes its shards of ``best.ckpt``.

        :param tracked: Whether this rank holds a best (weights and record).
        :param epoch: The best's epoch, for the message.
        """
        if not self._ckpt.enable:
            return
        if self._storage.lost_best(tracked and not self._best_changed):
            if self._rank == 0:
                warn_user(
                    f"{self.best_path} was removed during the run; the best weights (epoch {epoch}) were still in "
                    "memory and are written to it again"
                )
            self._best_changed = True

    # ------------------------------------------------------------------ waiting and letting go

    def wait(self) -> None:
        """Finish a background save in flight (a collective for sharded saves); its failure raises here."""
        self._storage.wait()

    def wait_local(self) -> None:
        """Finish what this rank alone writes in the background (a file save on rank 0); no collective."""
        self._storage.wait_local()

    def abandon(self) -> None:
        """Let a background save end without raising or publishing a sharded one (this run is failing), then give
        this rank's upload of the checkpoint it published last up to ``ckpt.remote_wait_s``, as at a normal end (it
        needs no other rank; a sharded one is committed only with every rank's report, so it stays uncommitted).
        Never raises: the run's own failure is what propagates."""
        self._readers["file"].abandon()
        self._readers["sharded"].abandon()
        if self._remote is not None:
            try:
                self._remote.finish()
            except Exception as exc:  # noqa: BLE001 - never in the way of the failure that ends the run
                warn_user(f"ckpt.remote={self._remote.url}: could not wait for the last upload ({exc})")

    def finish(self) -> None:
        """At the end of a run: publish a background save (every rank) and free what saves kept between them."""
        self._storage.wait()
        self._storage.release()
        self._kept.join()
        self.wait_remote()

    def wait_remote(self) -> None:
        """Wait up to ``ckpt.remote_wait_s`` for the uploads in flight and queued (every rank; a sharded upload is
        committed once every rank's shards are up): at a run's end, and before a finished run's rerun returns."""
        if self._remote is not None:
            self._remote.finish()
        if self._remote_token is not None:  # every rank: the last sharded upload is committed once all are up
            self._remote_reports(all_gather_objects(self._remote.report() if self._remote else None))
            if self._rank == 0 and self._remote is not None:
                self._remote.finish()

    def finish_rerun(self) -> None:
        """A finished run's rerun returns: the catch-up of a run killed during its final upload or retention lands
        first (:meth:`wait_remote`), then the folder is let go (:meth:`release_folder`)."""
        try:
            self.wait_remote()
        finally:
            self.release_folder()

    def release_folder(self) -> None:
        """Let the folder go, and the remote prefix with it (idempotent): the next run on them may start."""
        if self._remote is not None:
            self._remote.close()
        self._lock.release()

    def close(self, failed: bool, before_release: Callable[[], None]) -> None:
        """Let go of everything: a background save lands (unless the run failed), then the folder is released.

        :param failed: The run failed: nothing is waited for that another rank may never finish.
        :param before_release: Called just before the folder is released (the trainer closes its sinks).
        """
        if not failed:
            self._readers["file"].wait()
        self._kept.join()  # a deletion in flight only removes whole files: waiting for it is always safe
        self._readers["sharded"].abandon()  # train() finished or abandoned it; only a trainer never trained has one
        self._readers["sharded"].release()
        if self._remote is not None:
            self._remote.close()
        before_release()
        self._lock.release()
