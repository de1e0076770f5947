"""``python -m trainkit export CHECKPOINT OUT`` in the default torch format: a marked state dict a fresh module loads
with ``torch.load(weights_only=True)``, written atomically, and never over a checkpoint or anything but an earlier
export that ``--overwrite`` names.

Real runs (a tiny regressor), real files in tmp_path, every export through the CLI's own entry point.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.checkpoint_files import export_header
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit.checkpoint import load_checkpoint
from trainkit.checkpoint.export.target import EXPORT_MARKER
from trainkit.cli import main as cli_main


def export(capsys, *args) -> tuple[int, str, str]:
    """Run ``python -m trainkit export ARGS`` in this process; return its exit status, stdout and stderr."""
    capsys.readouterr()
    code = cli_main(["export", *(str(arg) for arg in args)])
    return code, *capsys.readouterr()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every entry under a folder (links not followed): a file's digest, a link's target, or 'folder'."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[name] = "folder"
        elif path.is_file():
            found[name] = digest(path)
        else:
            found[name] = "special"
    return found


def refused(capsys, out: Path, *args) -> str:
    """Export into ``out`` and check that it is refused: exit status 2 and one ``error:`` line naming ``out``."""
    code, printed, errors = export(capsys, *args)
    assert (code, printed) == (2, ""), errors
    assert errors.startswith("error: ") and errors.count("\n") == 1, errors
    assert str(out) in errors, errors
    return errors


def fresh_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two finished 2-epoch runs, ``a`` and ``b`` (``b`` keeps a step checkpoint per epoch)."""
    root = tmp_path_factory.mktemp("runs")
    for name, ckpt in (("a", {}), ("b", {"keep": "every_epochs:1"})):
        trainer = TinyTrainer(make_cfg(root / name, epochs=2, ckpt=ckpt))
        try:
            trainer.train()
        finally:
            trainer.close()
    return root


def test_the_torch_format_loads_with_weights_only_and_carries_its_header(runs, tmp_path, capsys):
    """last.pt exported in the default format: torch.load(weights_only=True) gives the weights bit for bit, a fresh
    module loads them strictly, and the state dict's _metadata marks the file as an export with the safetensors
    format's header."""
    out = tmp_path / "model.pt"
    code, printed, errors = export(capsys, runs / "a" / "last.pt", out)
    assert code == 0, errors
    assert f"wrote {out}: 4 tensors" in printed
    loaded = torch.load(out, weights_only=True)
    payload = torch.load(runs / "a" / "last.pt", weights_only=True)
    assert list(loaded) == list(payload["model"])
    assert all(torch.equal(loaded[name], payload["model"][name]) for name in loaded)
    fresh_net().load_state_dict(loaded)
    assert loaded._metadata == {EXPORT_MARKER: export_header(payload, epoch=2)}


def test_out_is_never_the_checkpoint_by_any_spelling(runs, tmp_path, capsys):
    """``export X X``, another spelling of X, a hard link and a link to it, with or without --overwrite and in both
    formats: refused in one line naming OUT; the checkpoint is byte for byte as it was and still resumes."""
    last = runs / "a" / "last.pt"
    before = digest(last)
    linked, hard = tmp_path / "linked.pt", tmp_path / "hard.pt"
    linked.symlink_to(last)
    os.link(last, hard)
    spellings = [last, runs / "a" / ".." / "a" / "last.pt", linked, hard]
    for out in spellings:
        for extra in ([], ["--overwrite"], ["--format", "safetensors", "--overwrite"]):
            refused(capsys, out, last, out, *extra)
    os.chdir(runs / "a")  # a relative spelling of the same file
    try:
        refused(capsys, Path("last.pt"), "last.pt", "last.pt", "--overwrite")
    finally:
        os.chdir(tmp_path)
    assert digest(last) == before and "loop" in load_checkpoint(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.pt", "linked.pt"]


def test_a_checkpoints_name_is_refused_wherever_it_is(runs, tmp_path, capsys):
    """``export a/last.pt b/best.pt`` (another run's best), its .prev copies, a kept step checkpoint, a path inside
    a sharded checkpoint's folder, and b/best.pt reached through a linked folder: refused with or without
    --overwrite, even where nothing is there yet; run b is as it was."""
    last = runs / "a" / "last.pt"
    before = tree(runs / "b")
    assert "best.pt" in before and "checkpoints/step-12.pt" in before, before
    alias = tmp_path / "alias"
    alias.symlink_to(runs / "b")
    targets = [
        runs / "b" / "best.pt",
        runs / "b" / "last.prev.pt",
        runs / "b" / "best.prev.pt",
        runs / "b" / "checkpoints" / "step-12.pt",
        runs / "b" / "checkpoints" / "step-99.pt",
        runs / "b" / "last.ckpt" / "model.pt",
        runs / "b" / "checkpoints" / "step-3.ckpt" / "model.pt",
        tmp_path / "elsewhere" / "best.pt",
        alias / "best.pt",
    ]
    for out in targets:
        for extra in ([], ["--overwrite"]):
            errors = refused(capsys, out, last, out, *extra)
            assert "as trainkit names a checkpoint" in errors and "a resume would take it for one" in errors
    assert tree(runs / "b") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias"]


def test_a_name_a_run_writes_or_deletes_in_its_folder_is_refused(runs, tmp_path, capsys):
    """An export at run b's lineage record, its staging or download folder of the remote tier (a run with ckpt.remote
    deletes them at its start, the export with them), its metrics, lock or kept index: refused in one line, in both
    formats, even where nothing is there yet; and a folder on OUT's way that is a file is one line, not a traceback."""
    last = runs / "a" / "last.pt"
    before = tree(runs / "b")
    targets = [
        runs / "b" / ".trainkit-lineage.json",
        runs / "b" / ".trainkit-folder-id",
        runs / "b" / ".remote-staging",
        runs / "b" / ".remote-staging" / "rank-0" / "model.pt",
        runs / "b" / ".remote-fetch-0123abcd",
        runs / "b" / "metrics.jsonl",
        runs / "b" / ".trainkit.lock",
        runs / "b" / "checkpoints" / "index.json",
    ]
    for out in targets:
        for extra in ([], ["--overwrite"], ["--format", "safetensors"]):
            errors = refused(capsys, out, last, out, *extra)
            assert "a run folder trainkit keeps for itself" in errors, errors
    assert tree(runs / "b") == before
    (tmp_path / "a-file").write_text("x")
    errors = refused(capsys, tmp_path / "a-file" / "model.pt", last, tmp_path / "a-file" / "model.pt")
    assert "a folder on its way is a file" in errors


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_out_dash_is_refused_instead_of_writing_a_file_named_dash(runs, tmp_path, capsys, monkeypatch, fmt):
    """``export CKPT -``: a shell's stdout is not a place an export goes; one line, and no file named ``-``."""
    monkeypatch.chdir(tmp_path)
    errors = refused(capsys, Path("-"), runs / "a" / "last.pt", "-", "--format", fmt)
    assert "OUT must name a file or folder to write" in errors
    assert not (tmp_path / "-").exists()


def test_an_existing_out_is_replaced_only_when_it_is_an_earlier_export_and_overwrite_says_so(runs, tmp_path, capsys):
    """A file of the user's (a plain state dict too), a folder, a link and a FIFO are refused with or without
    --overwrite, in one line, untouched; an earlier export is refused without --overwrite and replaced with it;
    no temp file is left behind."""
    last, best = runs / "a" / "last.pt", runs / "a" / "best.pt"
    mine = tmp_path / "mine.pt"
    torch.save(fresh_net().state_dict(), mine)  # weights of the user's own, no export marker
    notes = tmp_path / "notes.pt"
    notes.write_bytes(b"keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inside.txt").write_text("mine")
    link = tmp_path / "link.pt"
    link.symlink_to(notes)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    before = tree(tmp_path)
    for out in (mine, notes, folder, link, fifo):
        errors = refused(capsys, out, last, out)
        if out is not folder:
            assert "--overwrite" in errors
        refused(capsys, out, last, out, "--overwrite")
    assert tree(tmp_path) == before

    out = tmp_path / "model.pt"
    assert export(capsys, last, out)[0] == 0
    errors = refused(capsys, out, best, out)
    assert "exists; pass --overwrite" in errors
    assert export(capsys, best, out, "--overwrite")[0] == 0
    best_weights = torch.load(best, weights_only=True)["model"]
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[name], best_weights[name]) for name in best_weights)
    assert loaded._metadata[EXPORT_MARKER]["checkpoint"] == "best"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failed_write_leaves_the_earlier_export_as_it_was(runs, tmp_path, capsys, monkeypatch):
    """The write dies half way through (a full disk, a kill): OUT holds the earlier export, byte for byte, and no
    temp file is left; a file that appears at OUT while the checkpoint is read is never replaced."""
    last, best = runs / "a" / "last.pt", runs / "a" / "best.pt"
    out = tmp_path / "model.pt"
    assert export(capsys, last, out)[0] == 0
    before = digest(out)

    def torn_save(payload, handle, *args, **kwargs):
        handle.write(b"half a file")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr("trainkit.files.durable.torch.save", torn_save)
        code, _, errors = export(capsys, best, out, "--overwrite")
    assert code == 2 and "no space left" in errors
    assert digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]

    import trainkit.checkpoint

    late = tmp_path / "late.pt"
    read = trainkit.checkpoint.load_checkpoint

    def read_while_another_writes(source, *args, **kwargs):
        late.write_bytes(b"written meanwhile")
        return read(source, *args, **kwargs)

    monkeypatch.setattr(trainkit.checkpoint, "load_checkpoint", read_while_another_writes)
    refused(capsys, late, best, late)
    assert late.read_bytes() == b"written meanwhile"
