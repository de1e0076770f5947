"""Files planted in a run folder, as an attacker with write access to it would plant them: nothing runs, nothing
crashes, nothing hangs, and nothing on disk is lost.

Each attack is a real file in ``tmp_path``; where the failure would be a crash or a hang, the reader runs in a child
process with a timeout, so a segmentation fault or a blocked read fails the test instead of the test run. Every
code-running file is first shown to run its code when read the way torch or DCP reads it by itself, so that its
refusal here means something.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import trainkit
from tests.faults.harness import ROOT, child_env
from tests.faults.hostile import Reduces
from tests.helpers.checkpoint_files import rewrite, small_checkpoint
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShardTrainer, TinyTrainer
from trainkit import CheckpointCorruptError, CheckpointUnsafeError
from trainkit.checkpoint.formats.dcp_read import read_metadata
from trainkit.cli import main as cli_main

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
needs_dev_zero = pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")

SHARDED = {"format": "sharded"}
DEEP_KEY = b"\x80\x02}" + b"K\x01" + b"\x85" * 10**6 + b"K\x02s."
"""A pickle of a dict whose key is a million nested one-tuples: hashing it recurses past the C stack."""


def sharded_run(out: Path, epochs: int = 2) -> Path:
    TinyTrainer(make_cfg(out, epochs=epochs, ckpt=SHARDED)).train()
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A finished 1-process sharded run (last.ckpt, last.prev.ckpt, best.ckpt) and a file-format run."""
    root = tmp_path_factory.mktemp("pristine")
    sharded_run(root / "sharded")
    TinyTrainer(make_cfg(root / "file", epochs=2)).train()
    return root


@pytest.fixture
def run_dir(pristine, tmp_path):
    """A fresh copy of the sharded run folder."""
    return Path(shutil.copytree(pristine / "sharded", tmp_path / "run", symlinks=True))


@pytest.fixture
def marker(tmp_path):
    """The file that any planted code creates: it must never appear."""
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "planted code ran"


def recompute_manifest(directory: Path) -> None:
    """Rewrite manifest.json for the files as they are now, as a planter who knows the format would."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name != "manifest.json" and path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            files[path.name] = [len(data), zlib.crc32(data)]
    (directory / "manifest.json").write_text(json.dumps({"version": 1, "files": files}, sort_keys=True))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the run lock (each run writes its pid and start time into it)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".trainkit.lock"
    }


def code_metadata(genuine: bytes, marker: Path) -> bytes:
    """``.metadata`` that runs ``touch marker`` and then returns the genuine metadata, as plain pickle reads it."""
    assert genuine[:2] == b"\x80\x04"
    return b"\x80\x04cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR0" + genuine[2:]


def entry_span(directory: Path, fqn: str) -> tuple[str, int, int]:
    metadata = read_metadata(directory)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            return info.relative_path, info.offset, info.length
    raise KeyError(fqn)


def replace_entry(directory: Path, fqn: str, blob: bytes) -> Path:
    """Overwrite one entry of a .distcp file with ``blob`` (padded to the entry's length); recompute the manifest."""
    name, offset, length = entry_span(directory, fqn)
    assert len(blob) <= length, (len(blob), length)
    shard = bytearray((directory / name).read_bytes())
    shard[offset : offset + length] = blob + b"\0" * (length - len(blob))
    (directory / name).write_bytes(bytes(shard))
    recompute_manifest(directory)
    return directory / name


def legacy_save(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def popped_string(pad: int) -> bytes:
    """A string of ``pad`` bytes that the pickle pops at once (BINUNICODE, POP): room-filling for the pre-scan."""
    return b"X" + struct.pack("<I", pad) + b"p" * pad + b"0"


def fitted_archive(tmp_path: Path, body, length: int) -> bytes:
    """A torch zip archive of exactly ``length`` bytes whose data.pkl is ``body(pad)`` (a protocol-2 pickle without
    its PROTO, ``pad`` bytes longer for each byte of ``pad``): it fills an entry of a .distcp file whole, with its end
    record at the end."""
    archive = tmp_path / "fitted.pt"

    def build(pad: int) -> bytes:
        rewrite(small_checkpoint(tmp_path, {"config": 0}), archive, data_pkl=b"\x80\x02" + body(pad))
        return archive.read_bytes()

    blob = build(length - len(build(0)))
    assert len(blob) == length
    return blob


def child(code: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainkit", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


RESUME = (
    "import sys, warnings; warnings.simplefilter('ignore')\n"
    "from tests.helpers.trainers import TinyTrainer\nfrom tests.helpers.configs import make_cfg\n"
    "try:\n    TinyTrainer(make_cfg({out!r}, epochs=3, ckpt={ckpt!r})).train()\n"
    "except Exception as exc:\n    print(type(exc).__name__, exc)\n    sys.exit(2)\n"
    "print('resumed')\n"
)


# ---------------------------------------------------------------------------------- 1. code in .metadata


def test_a_planted_metadata_that_runs_code_is_refused_by_resume_export_and_inspect(run_dir, marker, capsys):
    """A .metadata whose pickle runs code and then returns the genuine metadata (manifest recomputed) runs it when
    DCP's own reader reads it; trainkit's resume, export and inspect refuse it as unsafe, naming the file and the
    global, and leave every file as it was (no fallback to last.prev.ckpt, nothing renamed)."""
    last = run_dir / "last.ckpt"
    (last / ".metadata").write_bytes(code_metadata((last / ".metadata").read_bytes(), marker))
    recompute_manifest(last)

    proof = Path(shutil.copytree(last, run_dir.parent / "proof"))
    import torch.distributed.checkpoint as dcp

    dcp.FileSystemReader(str(proof)).read_metadata()
    assert marker.exists(), "the planted .metadata does not run code when DCP reads it: the test proves nothing"
    marker.unlink()

    before = snapshot(run_dir)
    refusal = r"last\.ckpt/\.metadata was refused: its pickle names posix\.system"
    with pytest.raises(CheckpointUnsafeError, match=refusal):
        TinyTrainer(make_cfg(run_dir, epochs=3, ckpt=SHARDED))
    assert snapshot(run_dir) == before
    for command in (["export", str(last), str(run_dir.parent / "out.pt")], ["inspect", str(last)]):
        assert cli_main(command) == 2
        assert "posix.system" in capsys.readouterr().err
    assert not (run_dir.parent / "out.pt").exists()


def test_a_planted_best_ckpt_alone_is_refused_at_resume(run_dir, marker):
    """The last checkpoint is intact and only best.ckpt/.metadata is planted: the resume (which reads the best
    weights for test()) refuses it as unsafe instead of running it."""
    best = run_dir / "best.ckpt"
    (best / ".metadata").write_bytes(code_metadata((best / ".metadata").read_bytes(), marker))
    recompute_manifest(best)
    with pytest.raises(CheckpointUnsafeError, match=r"best\.ckpt/\.metadata was refused.*posix\.system"):
        TinyTrainer(make_cfg(run_dir, epochs=3, ckpt=SHARDED))


@pytest.mark.parametrize(
    "mutate, error, fragment",
    [
        (
            lambda m: m.replace(b"torch.distributed.checkpoint.metadata", b"torch.distributed.checkpoint.metadatb"),
            CheckpointUnsafeError,
            "torch.distributed.checkpoint.metadatb.Metadata",
        ),
        (lambda m: m.replace(b"__0_0.distcp", b"../../etc/pw"), CheckpointUnsafeError, "not a shard file"),
        (lambda m: m[: len(m) // 2], CheckpointCorruptError, "cannot be read as DCP metadata"),
        (lambda m: b"\x80\x04K\x01.", CheckpointCorruptError, "holds a int, not DCP's Metadata"),
    ],
    ids=["other-class", "path-outside", "truncated", "not-metadata"],
)
def test_metadata_that_is_not_dcps_is_refused_and_says_why(run_dir, mutate, error, fragment):
    """A .metadata naming a class that is not DCP's, entries stored outside the directory's files, a cut pickle or
    another value (manifest recomputed each time): unsafe or corrupt, never loaded."""
    last = run_dir / "last.ckpt"
    (last / ".metadata").write_bytes(mutate((last / ".metadata").read_bytes()))
    recompute_manifest(last)
    with pytest.raises(error, match=fragment):
        read_metadata(last)


# ---------------------------------------------------------------------------------- 2. code in a .distcp entry


def test_a_non_tensor_entry_that_runs_code_is_refused(run_dir, marker, tmp_path):
    """The optimizer's lr entry in __0_0.distcp overwritten with a legacy torch.save of an object whose reduce runs
    code (padded, manifest recomputed) runs it under DCP's own planner; trainkit's resume from that directory into
    a fresh out_dir refuses it as unsafe, naming the file and the entry."""
    last = run_dir / "last.ckpt"
    fqn = "optimizer.param_groups.0.lr"
    shard = replace_entry(last, fqn, legacy_save(Reduces(os.system, f"touch {marker}")))

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    proof = Path(shutil.copytree(last, tmp_path / "proof"))
    with contextlib.suppress(Exception, CheckpointException):  # whatever DCP makes of it, the code has run by then
        reader = dcp.FileSystemReader(str(proof))
        dcp.load({fqn: 0.0}, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
    assert marker.exists(), "the planted entry does not run code under DCP: the test proves nothing"
    marker.unlink()

    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointUnsafeError) as info:
        TinyTrainer(make_cfg(fresh, epochs=3, ckpt={"resume": str(last), **SHARDED}))
    assert str(shard) in str(info.value) and fqn in str(info.value)
    assert "legacy torch.save pickle" in str(info.value)


def test_a_zip_entry_naming_a_code_global_is_refused_naming_it(run_dir, marker, tmp_path):
    """An entry that is a zip archive as torch.save writes one, whose pickle calls os.system: weights_only refuses
    the global, and the refusal names it."""
    last = run_dir / "last.ckpt"
    fqn = "model.0.weight"  # the entry with the most room: a tensor's

    def body(pad: int) -> bytes:  # os.system("touch MARKER   ..."): the shell ignores the trailing spaces
        command = f"touch {marker}".encode() + b" " * pad
        return b"cposix\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."

    pickle.loads(b"\x80\x02" + body(0))
    assert marker.exists(), "the planted pickle does not run code when unpickled: the test proves nothing"
    marker.unlink()
    replace_entry(last, fqn, fitted_archive(tmp_path, body, entry_span(last, fqn)[2]))
    with pytest.raises(CheckpointUnsafeError, match="posix.system"):
        TinyTrainer(make_cfg(tmp_path / "fresh", epochs=3, ckpt={"resume": str(last), **SHARDED}))


# ---------------------------------------------------------------------------------- 3. pickles that segfault


def test_a_pickle_built_to_segfault_is_refused_by_inspect_report_and_resume(pristine, tmp_path):
    """A CRC-valid last.pt whose data.pkl holds a million nested one-tuples as a dict key kills a plain torch.load
    (weights_only) with a segmentation fault; inspect, report and a resume refuse it as unsafe, in bounded time."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    rewrite(small_checkpoint(tmp_path, {"config": 0}), run / "last.pt", data_pkl=DEEP_KEY)
    proof = child(f"import torch; torch.load({str(run / 'last.pt')!r}, weights_only=True)")
    assert proof.returncode == -11, "the planted pickle does not crash torch.load: the test proves nothing"

    inspect = cli("inspect", str(run / "last.pt"))
    assert inspect.returncode == 2, inspect.stderr[-2000:]
    assert "before it was unpickled: its pickle nests values more than 1000 deep" in inspect.stderr
    report = cli("report", str(run), "--no-plot")
    assert report.returncode == 2 and "nests values more than 1000 deep" in report.stderr, report.stderr[-2000:]
    resume = child(RESUME.format(out=str(run), ckpt={}))
    assert resume.returncode == 2 and resume.stdout.startswith("CheckpointUnsafeError"), resume.stdout + resume.stderr


def test_pickles_built_to_segfault_inside_a_sharded_directory_are_refused(run_dir, tmp_path):
    """The same pickle as .metadata, or inside a .distcp entry: refused as unsafe before any unpickler sees it."""
    last = run_dir / "last.ckpt"
    (last / ".metadata").write_bytes(b"\x80\x04" + DEEP_KEY[2:])
    recompute_manifest(last)
    inspect = cli("inspect", str(last))
    assert inspect.returncode == 2 and "nests values more than 1000 deep" in inspect.stderr, inspect.stderr[-2000:]

    entry = Path(shutil.copytree(run_dir / "last.prev.ckpt", tmp_path / "entry"))
    _, _, length = entry_span(entry, "model.0.weight")  # a tensor entry: the largest one there is
    deep = fitted_archive(tmp_path, lambda pad: popped_string(pad) + b"K\x01" + b"\x85" * 1200 + b".", length)
    replace_entry(entry, "model.0.weight", deep)
    resume = child(RESUME.format(out=str(tmp_path / "fresh"), ckpt={"resume": str(entry), **SHARDED}))
    assert resume.returncode == 2, resume.stdout + resume.stderr[-2000:]
    assert resume.stdout.startswith("CheckpointUnsafeError") and "nests values more than 1000 deep" in resume.stdout


# ---------------------------------------------------------------------------------- 4. FIFOs and devices


def fifo_at(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def dev_zero_at(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


@needs_fifo
@needs_dev_zero
@pytest.mark.parametrize("plant", [fifo_at, dev_zero_at], ids=["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_fifo_or_dev_zero_in_a_sharded_directory_never_hangs(run_dir, plant, name):
    """A FIFO, or a link to /dev/zero, in place of a shard file or .metadata of last.ckpt and last.prev.ckpt: inspect
    says so at once, and the resume stops at once with the problem of each directory (killed at 60 s otherwise)."""
    for directory in ("last.ckpt", "last.prev.ckpt"):
        plant(run_dir / directory / name)
    inspect = cli("inspect", str(run_dir / "last.ckpt"), timeout=60)
    assert inspect.returncode == 2, inspect.stderr[-2000:]
    kind = "a FIFO (named pipe), not a regular file" if plant is fifo_at else "a symbolic link (to /dev/zero)"
    assert kind in inspect.stderr, inspect.stderr[-2000:]
    resume = child(RESUME.format(out=str(run_dir), ckpt=SHARDED), timeout=60)
    assert resume.returncode == 2 and resume.stdout.startswith("CheckpointCorruptError"), resume.stdout
    assert resume.stdout.count(kind) == 2, resume.stdout


# ---------------------------------------------------------------------------------- 6. deep JSON


def test_a_deep_manifest_falls_back_to_the_previous_checkpoint(run_dir):
    """A 100000-deep manifest.json in last.ckpt is a damaged directory: the resume warns and falls back to
    last.prev.ckpt instead of dying of a RecursionError."""
    (run_dir / "last.ckpt" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.warns(RuntimeWarning, match=r"manifest\.json is not a trainkit manifest \(JSON nested more than"):
        trainer = TinyTrainer(make_cfg(run_dir, epochs=3, ckpt=SHARDED))
    assert trainer.epoch == 1  # last.prev.ckpt: written after epoch 0, so epoch 1 runs next
    trainer.train()


def test_report_and_replay_skip_a_deep_line_of_the_journal(pristine, tmp_path):
    """A 100000-deep line in metrics.jsonl is one damaged line to report and replay, not a crash."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    with open(run / "metrics.jsonl", "a") as journal:
        journal.write("[" * 100_000 + "]" * 100_000 + "\n")
    for command in (["report", str(run), "--no-plot"], ["replay", str(run), "val.patience=1"]):
        done = cli(*command)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "skipped 1 damaged line(s) (3)" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------------------------- 7, 8. temporary directories


def test_links_planted_under_temporary_names_never_stop_a_save(run_dir, tmp_path):
    """Symbolic links planted under the names a save's temporary directories had (the old predictable ones, their
    -old siblings) are removed, never followed; every save still publishes; the links' target is untouched."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("mine")
    for name in (".last.ckpt.tmp-2-8-1", ".last.ckpt.tmp-2-8-1-old", ".best.ckpt.tmp-2-8-1", ".last.ckpt.tmp-x"):
        (run_dir / name).symlink_to(target)
    TinyTrainer(make_cfg(run_dir, epochs=4, ckpt=SHARDED)).train()
    assert snapshot(target) == {"keep": b"mine"}
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]
    assert torch.load(run_dir / "last.ckpt" / "trainkit.pt", weights_only=True)["loop"]["epoch"] == 4


def test_a_save_writes_into_a_private_random_directory_and_refuses_a_link_planted_in_it(tmp_path, monkeypatch):
    """Each save's temporary directory has a fresh random name and mode 0700; a link that appears in it while the
    shards are written (which only its owner could plant) fails the save, publishing nothing."""
    from torch.distributed.checkpoint import FileSystemWriter

    out = tmp_path / "run"
    seen = []
    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        directory = Path(self.path)
        seen.append((directory.name, os.stat(directory).st_mode & 0o777))
        if len(seen) == 4:  # the second epoch's save of last.ckpt (best.ckpt is written first)
            (directory / "__0_7.distcp").symlink_to(tmp_path / "victim")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    with pytest.raises(trainkit.CheckpointError, match=r"__0_7\.distcp is a symbolic link"):
        TinyTrainer(make_cfg(out, epochs=3, scripted_scores=(2.0, 1.0, 0.5), ckpt=SHARDED)).train()
    names = [name for name, _ in seen]
    assert len(set(names)) == len(names) and all(len(name.rsplit("-", 1)[1]) >= 8 for name in names)
    assert {mode for _, mode in seen} == {0o700}
    assert torch.load(out / "last.ckpt" / "trainkit.pt", weights_only=True)["loop"]["epoch"] == 1  # the first save
    assert oct(os.stat(out / "last.ckpt").st_mode & 0o777) == oct(0o777 & ~trainkit.checkpoint.current_umask())


# ---------------------------------------------------------------------------------- every load, without pickle


def test_no_byte_of_a_sharded_resume_export_or_inspect_reaches_an_unrestricted_unpickler(run_dir, monkeypatch, capsys):
    """With pickle.load/loads and torch.load(weights_only=False) made to fail, a sharded resume that reads the best
    weights, an export and an inspect all work: nothing they read from disk reaches an unpickler that could run it."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("an unrestricted unpickler was reached")

    real_load = torch.load

    def checked_load(*args, weights_only=None, **kwargs):
        if weights_only is not True:
            refuse(*args)
        return real_load(*args, weights_only=True, **kwargs)

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", checked_load)
    monkeypatch.setattr(dcp_filesystem.pickle, "load", refuse)
    trainer = TinyTrainer(make_cfg(run_dir, epochs=3, ckpt=SHARDED, test={"enable": True}))
    assert trainer.best_model is not None
    trainer.train()
    assert cli_main(["export", str(run_dir / "best.ckpt"), str(run_dir / "best_weights.pt")]) == 0
    assert cli_main(["inspect", str(run_dir / "last.ckpt")]) == 0
    capsys.readouterr()
    assert calls == []


def unpickler_calls(source: str) -> list[str]:
    """The calls in ``source`` that could hand bytes to an unpickler able to run code, as source text."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base) for base in node.bases]
            if any(base.endswith("Unpickler") for base in bases):
                found.append(f"class {node.name}({', '.join(bases)})")
        if not isinstance(node, ast.Call):
            continue
        module, _, function = ast.unparse(node.func).rpartition(".")
        keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
        unpickles = module in ("pickle", "_pickle") and function in ("load", "loads", "Unpickler")
        trusting_torch_load = module == "torch" and function == "load" and keywords.get("weights_only") != "True"
        dcp_reader = function == "FileSystemReader"
        trusting_dcp_load = (module, function) == ("dcp", "load") and not (
            keywords.get("storage_reader", "").startswith("SafeReader(")
            and keywords.get("planner") == "SafeLoadPlanner()"
        )
        unsafe_flag = "allow_pickle" in keywords or keywords.get("weights_only", "True") != "True"
        if unpickles or trusting_torch_load or dcp_reader or trusting_dcp_load or unsafe_flag:
            found.append(ast.unparse(node)[:120])
    return found


def test_trainkit_reaches_no_unrestricted_unpickler_in_its_source():
    """No trainkit module calls pickle.load/loads, torch.load without weights_only=True, allow_pickle, DCP's own
    reader, or dcp.load without trainkit's reader and planner; the unpicklers trainkit has are named here with why
    they are safe. The search itself finds each kind of call it looks for."""
    package = Path(trainkit.__file__).parent
    allowed = {
        # peers of one job, in memory, never bytes from disk (torch's own object collectives do the same)
        ("collectives.py", "pickle.loads(payload.cpu().numpy().tobytes())"),
        # admits DCP's metadata records only (find_class), after check_pickle bounded the bytes
        ("dcp_read.py", "class _MetadataUnpickler(pickle.Unpickler)"),
    }
    found = [
        (path.name, call)
        for path in sorted(package.rglob("*.py"))
        for call in unpickler_calls(path.read_text())
        if (path.name, call) not in allowed
    ]
    assert found == [], found
    planted = (
        "import pickle, torch\npickle.load(f)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
        "dcp.load(state, checkpoint_id=d)\nnp.load(f, allow_pickle=True)\ndcp.FileSystemReader(d)\n"
        "class U(pickle.Unpickler): pass\n"
    )
    assert len(unpickler_calls(planted)) == 7


# ---------------------------------------------------------------------------------- on two gloo ranks


@pytest.mark.ddp
@needs_fifo
def test_two_ranks_refuse_a_planted_directory_together_and_fall_back_past_a_fifo(tmp_path, marker):
    """On 2 gloo ranks: a FIFO in last.ckpt (rank 1's share) is found at once and both ranks fall back to
    last.prev.ckpt together; a planted .metadata is refused on every rank as unsafe; no rank waits for another."""

    def cfg(out, **overrides):
        return make_cfg(out, **{"epochs": 2, "dist": {"timeout_s": 60}, "ckpt": SHARDED, "report": False, **overrides})

    out = tmp_path / "run"
    # torch imported once for the 3 spawns
    with trainkit.fork_server(preload=["torch.distributed.checkpoint", "tests.helpers.trainers"]):
        trainkit.spawn(ShardTrainer, cfg(out), 2)
        fifo_at(out / "last.ckpt" / "__1_0.distcp")
        result = trainkit.spawn(ShardTrainer, cfg(out, epochs=3), 2)  # a rank blocked on the FIFO would time out
        assert result is not None
        assert torch.load(out / "last.ckpt" / "trainkit.pt", weights_only=True)["loop"]["epoch"] == 3

        last = out / "last.ckpt"
        (last / ".metadata").write_bytes(code_metadata((last / ".metadata").read_bytes(), marker))
        recompute_manifest(last)
        with pytest.raises(Exception, match=r"CheckpointUnsafeError|\.metadata was refused"):
            trainkit.spawn(ShardTrainer, cfg(out, epochs=4), 2)


# ---------------------------------------------------------------------------------- the second attack round


def long1(n: int) -> bytes:
    """Pickle's LONG1 opcode for ``n``."""
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


STALLING_PICKLES = {
    # torch's allowlist has _codecs.encode: punycode is quadratic in distinct characters (~10 s a call on 8000)
    "punycode": b"\x80\x02}q\x00X\x01\x00\x00\x00w](c_codecs\nencode\nq\x01"
    + unicode("".join(chr(0x100 + i) for i in range(8000)))
    + b"q\x02"
    + unicode("punycode")
    + b"q\x03\x86R"
    + b"h\x01h\x02h\x03\x86R" * 99
    + b"es.",
    # and builtins.bytearray: bytearray(10**15) from a few bytes
    "bytearray": b"\x80\x02}X\x01\x00\x00\x00wc__builtin__\nbytearray\n" + long1(10**15) + b"\x85Rs.",
    # ints that differ by multiples of 2**61 - 1 hash alike: building the dict is quadratic
    "colliding keys": b"\x80\x02}(" + b"".join(long1(k * (2**61 - 1)) + b"N" for k in range(1, 30_001)) + b"u.",
}


@pytest.mark.parametrize("name", sorted(STALLING_PICKLES))
def test_pickles_that_make_allowlisted_functions_stall_are_refused_at_once(tmp_path, name):
    """Pickles that call functions on torch's own allowlist with arguments no pickler writes (a quadratic codec, a
    huge bytearray), or whose dict keys' hashes collide, are refused by the pre-scan as unsafe, in seconds."""
    path = tmp_path / "last.pt"
    rewrite(small_checkpoint(tmp_path, {"config": 0}), path, data_pkl=STALLING_PICKLES[name])
    done = cli("inspect", str(path), timeout=60)
    assert done.returncode == 2 and "before it was unpickled" in done.stderr, done.stderr[-2000:]


def test_a_pickle_that_raises_inside_torchs_unpickler_is_corrupt_and_the_resume_falls_back(pristine, tmp_path):
    """A last.pt whose pickle makes torch's unpickler raise TypeError ({[]: None}) is corrupt: load_checkpoint says
    so, and an automatic resume falls back to last.prev.pt instead of dying."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    rewrite(small_checkpoint(tmp_path, {"config": 0}), run / "last.pt", data_pkl=b"\x80\x02}]Ns.")
    with pytest.raises(CheckpointCorruptError, match="could not be read: TypeError"):
        trainkit.checkpoint.load_checkpoint(run / "last.pt")
    with pytest.warns(RuntimeWarning, match="resuming from the previous checkpoint"):
        TinyTrainer(make_cfg(run, epochs=3))


def test_a_sparse_tensor_with_an_index_out_of_bounds_is_refused(pristine, tmp_path):
    """A sparse tensor whose indices lie outside its size (torch does not check by default; using it segfaults)
    is refused when the checkpoint loads."""
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 10**9]]), torch.tensor([1.0, 2.0]), (2,), check_invariants=False)
    path = tmp_path / "sparse.pt"
    torch.save({"item": {"s": bad}}, path)
    with pytest.raises(CheckpointCorruptError, match="size is inconsistent with indices"):
        trainkit.checkpoint.load_checkpoint(path)


def rewrite_metadata(directory: Path, change) -> None:
    """Change the unpickled .metadata with ``change`` and write it back (manifest recomputed)."""
    metadata = read_metadata(directory)
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    recompute_manifest(directory)


def add_entries(metadata, count, make):
    for i in range(count):
        metadata.state_dict_metadata[f"model.x{i}"] = make(metadata)


def huge_uncovered(metadata):
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([64 << 20]), [])


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda m: m.__dict__.__setitem__(5, {1}), "unexpected attribute '5'"),
        (lambda m: setattr(m, "storage_meta", 5), "storage_meta is a int"),
        (lambda m: add_entries(m, 300, lambda m: m.state_dict_metadata["model.0.weight"]), "shares its record"),
        (lambda m: add_entries(m, 8, huge_uncovered), "its chunks hold 0 of the 67108864 elements"),
    ],
    ids=["int-attribute", "storage-meta-int", "shared-entries", "uncovered-tensors"],
)
def test_metadata_built_to_stall_or_amplify_is_refused(run_dir, change, fragment):
    """A .metadata whose fields are of a kind DCP never writes (an int attribute, a storage_meta that is not one),
    that shares one entry between many keys (checking them cost M x N), or that declares tensors no chunk stores
    (an export wrote 512 MB of uninitialised memory from them) is refused by read_metadata, at once."""
    rewrite_metadata(run_dir / "last.ckpt", change)
    with pytest.raises((CheckpointCorruptError, CheckpointUnsafeError), match=re.escape(fragment)):
        read_metadata(run_dir / "last.ckpt")


def test_report_and_replay_skip_a_row_with_an_int_no_float_holds(pristine, tmp_path):
    """A metrics.jsonl row with a 400-digit int (float() overflows on it) is a damaged line to report and replay."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    with open(run / "metrics.jsonl", "a") as journal:
        journal.write('{"trainer/epoch": 5, "val/loss": 1' + "0" * 400 + "}\n")
    for command in (["report", str(run), "--no-plot"], ["replay", str(run), "val.patience=1"]):
        done = cli(*command)
        assert done.returncode == 0 and "skipped 1 damaged line(s)" in done.stderr, done.stderr[-2000:]


def test_report_of_a_last_pt_that_is_not_trainkits_is_one_line(pristine, tmp_path, capsys):
    """report validates last.pt as a resume does: a torch.save of {"loop": [1]} is one error line, status 2."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    torch.save({"loop": [1]}, run / "last.pt")
    assert cli_main(["report", str(run), "--no-plot"]) == 2
    assert "is not a valid trainkit last.pt" in capsys.readouterr().err


@pytest.mark.parametrize("name", [".trainkit.lock", "metrics.jsonl"])
def test_a_hard_link_planted_as_the_lock_or_the_journal_is_refused_and_its_target_kept(pristine, tmp_path, name):
    """.trainkit.lock or metrics.jsonl planted as a hard link to another file (last.pt, or a file outside the run)
    is refused before anything is written into it: the linked file keeps every byte."""
    run = Path(shutil.copytree(pristine / "file", tmp_path / "run"))
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"mine" * 1000)
    (run / name).unlink()
    os.link(victim, run / name)
    with pytest.raises(trainkit.OutDirError, match=rf"{re.escape(name)} has 2 hard links"):
        TinyTrainer(make_cfg(run, epochs=3))
    assert victim.read_bytes() == b"mine" * 1000


def test_a_wandb_file_with_history_but_no_run_record_is_not_taken_as_sent(tmp_path):
    """A planted .wandb file holding history at steps 0..999 but no run record (W&B writes that first) is warned
    about and not counted: the history still ends where the real files end, so later rows are sent."""
    from tests.helpers.wandb_files import history_record, leveldb_log
    from trainkit.run.wandb_run import read_wandb_history

    folder = tmp_path / "wandb" / "offline-run-20200101_000000-abcd1234"
    folder.mkdir(parents=True)
    planted = folder / "run-abcd1234.wandb"
    planted.write_bytes(leveldb_log([history_record(step, 1) for step in range(1000)]))
    with pytest.warns(RuntimeWarning, match="holds W&B history but no run record"):
        history = read_wandb_history([tmp_path / "wandb"], "abcd1234")
    assert history.next_step == 0 and history.empty == (planted,)


def test_item_states_nested_through_shared_containers_are_measured_whole(tmp_path):
    """Three 200-deep chains that end in one another (each container reached first at a shallow depth) nest 600
    deep: validation counts the whole depth and refuses it, naming the way in."""
    from trainkit.checkpoint.payload import validate_last

    def chain(depth, bottom):
        root = current = []
        for _ in range(depth - 1):
            current.append([])
            current = current[0]
        current.append(bottom)
        return root

    c = chain(200, 0)
    b = chain(200, c)
    a = chain(200, b)
    real = torch.load(sharded_run(tmp_path / "r", epochs=1) / "last.ckpt" / "trainkit.pt", weights_only=True)
    payload = {**real, "items": [*real["items"], "extra"], "extra": {"a": a, "b": b, "c": c}}
    with pytest.raises(
        CheckpointCorruptError, match=r"extra\['[ab]'\]\[0\]\[0\]\[0\]\[0\]\[0\]\.\.\. must be nested at most 256"
    ):
        validate_last(payload, path="last.pt")
