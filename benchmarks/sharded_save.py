"""Sharded checkpoints (``ckpt.format=sharded``) against today's rank-0 file, on 2 gloo ranks.

    python -m benchmarks.sharded_save [--sizes 10,100,1000] [--rounds 5] [--quick] [--out benchmarks/results]

For each checkpoint size (MB of weights plus AdamW's two moments, float32) five trainers of 2 processes
each save the same state, ``rounds`` times after one warm-up save, the first three through trainkit's own
save path (the trainer's checkpointer, ``trainer.checkpointer.save``, what the loop calls at an epoch's end):

- ``file``: a DDP model, ``ckpt.format=file``: rank 0 gathers nothing (DDP replicas are whole) and writes
  ``last.pt`` with ``torch.save``, temp file + fsync + rename;
- ``sharded``: an FSDP2 model (``make_fsdp``), ``ckpt.format=sharded``: every rank writes its half through DCP,
  then checksums, manifest, publish; the ``.prev`` directory a publish replaces is deleted in a background
  thread, which a loop overlaps with training: here it is waited for after each save, untimed (``discard``),
  so that it neither slows the next save nor the disk's measurement;
- ``sharded async``: the same with ``ckpt.async_save``: the loop is blocked while the shards are staged in
  host memory; the write runs in the background and is published at the next save (timed apart: ``drain``);
- ``bare dcp.save`` and ``bare dcp.async_save``: the same FSDP2 state saved by a plain ``dcp.save`` /
  ``dcp.async_save`` (its own gloo group, host buffers reused as trainkit's are) into a new directory,
  nothing of trainkit's around it (no checksums, no ``trainkit.pt``, no publish): DCP's own cost on this
  machine, the floor of any save built on it.

Reported per variant: the seconds the loop is blocked per save (the slowest rank, median over rounds), the
peak resident memory of each rank above its level just before a save (``VmHWM``; a fresh pair of
processes per variant, the peak reset before each save through ``/proc/self/clear_refs``), and what each rank
holds between background saves (``held``: the host copy they reuse, the bytes of the rank's own shards).

The synchronous sharded save's throughput (checkpoint bytes / blocked seconds) is compared with the disk's
own: ``dd if=/dev/zero bs=4M conv=fsync`` of the same number of bytes into the same folder, run by rank 0
right after each timed save (a pair side by side in time). This host's page cache runs at two speeds that
alternate from one write to the next (the same 1 GB dd took 0.43 s and 2.2 s in consecutive runs), so one
pair says more about which speed each side drew than about the save: the gated ratio is best against best
(the disk's fastest dd over the save's fastest round, what each can do), and the median of the per-pair
ratios is reported beside it. Goals: async blocked <= 0.1x sync sharded (medians); sync sharded throughput
>= 0.8x the disk's. Exit 1 when one is missed (``--quick`` only reports).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._pytree import tree_leaves

from benchmarks.common import RESULTS, save_inputs, write_json
from trainkit import BaseTrainer, Config, fork_server
from trainkit.distributed.collectives import all_gather_objects, free_port

GATE_ASYNC = 0.1
GATE_THROUGHPUT = 0.8
VARIANTS = {
    "file": {"wrap": "ddp", "ckpt": {"format": "file"}},
    "sharded": {"wrap": "fsdp", "ckpt": {"format": "sharded"}, "pair_disk": True},
    "sharded async": {"wrap": "fsdp", "ckpt": {"format": "sharded", "async_save": True}},
    "bare dcp.save": {"wrap": "fsdp", "ckpt": {"format": "sharded"}, "bare": "sync"},
    "bare dcp.async_save": {"wrap": "fsdp", "ckpt": {"format": "sharded"}, "bare": "async"},
}


@attrs.frozen(kw_only=True)
class SaveConfig(Config):
    """The engine's keys plus the size of the state and how to wrap it."""

    mb: int = 10
    wrap: str = "ddp"
    rounds: int = 3
    report: str = ""
    pair_disk: bool = False
    bare: str = ""  # "sync" / "async": a plain dcp.save / dcp.async_save instead of trainkit's save


class SaveTrainer(BaseTrainer):
    """A stack of square Linear layers of ``mb`` MB with weights + AdamW moments; no training, only saves."""

    config_class = SaveConfig
    cfg: SaveConfig

    def setup(self, ckpt: Any) -> None:
        cfg = self.cfg
        floats = cfg.mb * 2**20 // 4 // 3  # weights, exp_avg, exp_avg_sq
        layers = 16
        width = max(8, int((floats / layers) ** 0.5))
        torch.manual_seed(cfg.seed)
        net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        if cfg.wrap == "fsdp":
            self.model = self.make_fsdp(net, shard=nn.Linear)
        else:
            self.model = self.make_ddp(net)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(2, width)).sum().backward()
        self.optimizer.step()  # the moments exist: the checkpoint has its full size
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.payload_bytes = 3 * layers * width * width * 4

    def train_epoch(self) -> None:  # pragma: no cover - never trained
        raise NotImplementedError

    def val_epoch(self) -> bool:  # pragma: no cover - never validated
        raise NotImplementedError

    def measure(self) -> dict[str, Any]:
        """Save once to warm up, then ``rounds`` times: the blocked seconds of each, and the highest resident
        memory any save (with its background write) reached above the process's memory just before it.
        With ``pair_disk``, rank 0 measures the disk (:func:`disk_seconds`, the same bytes, the same folder) right
        after each timed save, while the other ranks wait: a pair side by side in time. With ``bare``, each save
        is a plain ``dcp.save`` (``sync``) or ``dcp.async_save`` (``async``: on a gloo group of its own, staged
        into reused host buffers as trainkit's are) of the same state into a new directory, nothing of
        trainkit's around it."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from trainkit.checkpoint.formats import dcp_directory

        bare = self.cfg.bare
        group = dist.new_group(backend="gloo") if bare == "async" else None
        stager = _stager() if bare == "async" else None
        items = dict(self.checkpoint_items)
        record, registry = save_inputs(items)
        samples: dict[str, list[float]] = {name: [] for name in ("blocked", "drain", "discard", "peak_mib", "disk")}
        for index in range(self.cfg.rounds + 1):
            self.barrier()
            before = _reset_peak_rss()
            target = str(self.out_dir / f"bare{index}")
            writing = None
            begun = time.perf_counter()
            if bare == "sync":
                dcp.save(dcp_directory.state_for_save(items), checkpoint_id=target)
            elif bare == "async":
                writing = dcp.async_save(
                    dcp_directory.state_for_save(items),
                    checkpoint_id=target,
                    process_group=group,
                    async_stager=stager,
                )
            else:
                self.checkpointer.save(record, registry, best_weights=None, before=lambda: None)
            took = time.perf_counter() - begun
            drain = self.wait_for_write(writing, target)
            discard_begun = time.perf_counter()
            dcp_directory.wait_discarded()  # the replaced .prev deleted in the background: a loop trains meanwhile
            discard = time.perf_counter() - discard_begun
            if index:
                self.record_round(samples, took, drain, discard, before)
        # what background saves keep between saves: a host copy of this rank's shards of the state
        held = (
            sum(
                _local(t).nbytes
                for t in tree_leaves(dcp_directory.state_for_save(items))
                if isinstance(t, torch.Tensor)
            )
            / 2**20
        )
        return {
            "blocked": samples["blocked"],
            "drain": samples["drain"],
            "discard": samples["discard"],
            "peak_mib": max(samples["peak_mib"]),
            "held_mib": held,
            "disk": samples["disk"],
        }

    def wait_for_write(self, writing: Any, target: str) -> float:
        """Wait for a save's background write (the checkpointer's, or a bare ``dcp.async_save``'s) after every
        rank's save returned; a bare save's directory removed after it.

        :param writing: A bare ``dcp.async_save``'s future, or None.
        :param target: A bare save's directory.
        :returns: The seconds the wait took (what the next save would wait for; 0 for synchronous saves).
        """
        self.barrier()
        drain_begun = time.perf_counter()
        self.checkpointer.wait()
        if writing is not None:
            getattr(writing, "upload_completion", writing).result()
        drain = time.perf_counter() - drain_begun
        if self.cfg.bare:
            self.barrier()
            if self.is_main:
                shutil.rmtree(target)
        return drain

    def record_round(
        self, samples: dict[str, list[float]], took: float, drain: float, discard: float, before: int
    ) -> None:
        """Record a timed round, and with ``pair_disk`` time the disk on rank 0 right after it (the others wait).

        :param samples: The rounds' samples, appended to.
        :param took: The save's blocked seconds.
        :param drain: Its background write's seconds after it.
        :param discard: The wait for the replaced ``.prev`` to be deleted.
        :param before: The resident memory (KiB) just before the save.
        """
        samples["blocked"].append(took)
        samples["drain"].append(drain)
        samples["discard"].append(discard)
        samples["peak_mib"].append((_status_kib("VmHWM") - before) / 1024)
        if self.cfg.pair_disk:
            if self.is_main:
                samples["disk"].append(disk_seconds(self.out_dir, self.payload_bytes))
            self.barrier()


def _stager() -> Any:
    """DCP's stager configured as trainkit's background saves configure theirs: host buffers kept from save to save,
    pinned (with non-blocking copies) when CUDA is there, staging finished before ``async_save`` returns."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )
    return DefaultStager(options)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field, in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> int:
    """Reset this process's peak resident memory to its current one (Linux >= 4.0); return the current, KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _worker(rank: int, world_size: int, cfg: dict[str, Any], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    trainer = SaveTrainer(cfg, rank, world_size)
    try:
        mine = trainer.measure()
        every = all_gather_objects(mine)
        if rank == 0:
            rounds = len(every[0]["blocked"])
            blocked = [max(r["blocked"][i] for r in every) for i in range(rounds)]  # the slowest rank's
            result = {
                "payload_bytes": trainer.payload_bytes,
                "blocked_s": statistics.median(blocked),
                "blocked_each_s": blocked,
                "drain_s": statistics.median(max(r["drain"][i] for r in every) for i in range(rounds)),
                "discard_s": statistics.median(every[0]["discard"]),
                "peak_mib_per_rank": [round(r["peak_mib"], 1) for r in every],
                "held_mib_per_rank": [round(r["held_mib"], 1) for r in every],
                "disk_each_s": mine["disk"],
            }
            Path(cfg["report"]).write_text(json.dumps(result))
    finally:
        trainer.close()


def run_variant(name: str, mb: int, rounds: int, folder: Path) -> dict[str, Any]:
    """One variant at one size, in a fresh pair of processes (forked by the fork server); returns rank 0's report."""
    out = folder / name.replace(" ", "_")
    report = folder / f"{name.replace(' ', '_')}.json"
    cfg = {
        "epochs": 1,
        "out_dir": str(out),
        "wandb": {"mode": "disabled"},
        "progress": {"enable": False},
        "dist": {"backend": "gloo", "timeout_s": 600},
        "mb": mb,
        "rounds": rounds,
        "report": str(report),
        **VARIANTS[name],
    }
    mp.start_processes(_worker, args=(2, cfg, free_port()), nprocs=2, join=True, start_method="forkserver")
    result = json.loads(report.read_text())
    shutil.rmtree(out, ignore_errors=True)
    return result


def disk_seconds(folder: Path, nbytes: int) -> float:
    """Seconds ``dd`` takes to write and fsync ``nbytes`` of zeros into ``folder`` (the disk's own speed)."""
    target = folder / "dd.bin"
    count = max(1, nbytes // (4 << 20))
    begun = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", "conv=fsync"], check=True, capture_output=True
    )
    took = time.perf_counter() - begun
    target.unlink()
    return took * nbytes / (count * (4 << 20))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="checkpoint sizes in MB, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timed saves per variant (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="10 MB, 1 round; goals only reported")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go")
    parser.add_argument("--dir", default=None, help="the folder to write checkpoints into (a temp dir by default)")
    args = parser.parse_args(argv)
    sizes = [10] if args.quick else [int(size) for size in args.sizes.split(",")]
    rounds = 1 if args.quick else args.rounds
    rows = []
    missed = []
    # every variant's pair of ranks forks from one server that imported torch once (fork_server)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, fork_server(["torch.distributed.checkpoint"]):
        folder = Path(tmp)
        for mb in sizes:
            results = {name: run_variant(name, mb, rounds, folder) for name in VARIANTS}
            nbytes = results["sharded"]["payload_bytes"]
            syncs, disks = results["sharded"]["blocked_each_s"], results["sharded"]["disk_each_s"]
            sync, background = results["sharded"]["blocked_s"], results["sharded async"]["blocked_s"]
            row = {
                "mb": mb,
                "bytes": nbytes,
                "disk_dd_s": [round(d, 4) for d in disks],
                "sharded each_s": [round(t, 4) for t in syncs],
                **{f"{name} blocked_s": round(r["blocked_s"], 4) for name, r in results.items()},
                "sharded async drain_s": round(results["sharded async"]["drain_s"], 4),
                "sharded discard_s": round(results["sharded"]["discard_s"], 4),
                **{f"{name} peak_mib": r["peak_mib_per_rank"] for name, r in results.items()},
                "sharded async held_mib": results["sharded async"]["held_mib_per_rank"],
                "async / sync": round(background / sync, 3),
                "sync / bare dcp.save": round(sync / results["bare dcp.save"]["blocked_s"], 3),
                "bare async / bare sync": round(
                    results["bare dcp.async_save"]["blocked_s"] / results["bare dcp.save"]["blocked_s"], 3
                ),
                "sync throughput / disk": round(min(disks) / min(syncs), 3),
                "sync throughput / disk, median of pairs": round(
                    statistics.median(d / t for d, t in zip(disks, syncs, strict=True)), 3
                ),
            }
            rows.append(row)
            if row["async / sync"] > GATE_ASYNC:
                missed.append(f"{mb} MB: async/sync {row['async / sync']} > {GATE_ASYNC}")
            if row["sync throughput / disk"] < GATE_THROUGHPUT:
                missed.append(f"{mb} MB: sync throughput/disk {row['sync throughput / disk']} < {GATE_THROUGHPUT}")
            print(json.dumps(row), flush=True)
    name = "sharded_save_quick.json" if args.quick else "sharded_save.json"
    meta = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "goals": {"async / sync": f"<= {GATE_ASYNC}", "sync throughput / disk": f">= {GATE_THROUGHPUT}"},
    }
    write_json(args.out, name, {"meta": meta, "rows": rows, "missed": missed}, indent=1)
    for line in missed:
        print(f"goal missed: {line}")
    return 1 if missed and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
