"""Kept checkpoints (``ckpt.keep``) in real runs: the files on disk, resuming from one, planted links and foreign
files, a SIGKILL during the background deletion, and the ``inspect``/``retain`` commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer
from trainkit import ConfigError
from trainkit.checkpoint import load_checkpoint
from trainkit.checkpoint.formats.dcp_directory import read_engine
from trainkit.checkpoint.kept import read_kept
from trainkit.checkpoint.payload import validate_last
from trainkit.cli import main
from trainkit.run.lock import RunLock

STEPS_PER_EPOCH = 6
"""TinyTrainer's 192 training samples in batches of 32."""


def run(out: Path, **overrides) -> TinyTrainer:
    """Train a TinyTrainer in ``out`` to the end and close it."""
    trainer = TinyTrainer(make_cfg(out, **overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def kept_steps(out: Path) -> list[int]:
    """The steps of the kept checkpoint files in ``out/checkpoints`` (regular files named step-<int>.pt)."""
    return [c.step for c in read_kept(out / "checkpoints").described]


def assert_loads(path: Path, step: int) -> dict:
    """Assert ``path`` passes the resume's checks and holds ``step``; return its payload."""
    payload = load_checkpoint(path)
    validate_last(payload, path=path, world_size=1)
    assert payload["step"] == step
    return payload


def test_default_writes_no_checkpoints_folder(tmp_path):
    """Without ckpt.keep a run writes last.pt and best.pt as before, and no checkpoints/ folder."""
    run(tmp_path, epochs=2)
    assert (tmp_path / "last.pt").is_file()
    assert not (tmp_path / "checkpoints").exists()


SCORES = (0.9, 0.5, 0.7, 0.3, 0.6, 0.8)
"""Scripted validation scores (minimized): the best two are epochs 3 and 1, the best is epoch 3."""


def test_kept_checkpoints_follow_the_policy_and_each_loads(tmp_path):
    """latest:2 and best:2 keep the two newest epoch ends and the two best-scored ones, each a whole checkpoint of
    its step, the best one holding the best record; the index explains each."""
    run(tmp_path, epochs=6, scripted_scores=SCORES, ckpt={"keep": "latest:2,best:2"})
    epoch_steps = [STEPS_PER_EPOCH * (e + 1) for e in range(6)]
    best_two = [epoch_steps[3], epoch_steps[1]]
    assert kept_steps(tmp_path) == sorted({*epoch_steps[-2:], *best_two})
    for step in kept_steps(tmp_path):
        assert_loads(tmp_path / "checkpoints" / f"step-{step}.pt", step)
    best = assert_loads(tmp_path / "checkpoints" / f"step-{epoch_steps[3]}.pt", epoch_steps[3])
    assert best["best"]["epoch"] == 3 and best["best"]["score"] == 0.3
    described = {c.step: c for c in read_kept(tmp_path / "checkpoints").described}
    assert described[epoch_steps[1]].scores["score"] == 0.5
    assert described[epoch_steps[1]].epoch == 2 and described[epoch_steps[1]].epoch_end


def test_step_checkpoints_are_kept_with_async_saves(tmp_path):
    """With ckpt.every_n_steps and async saves, step checkpoints inside an epoch are kept too (no scores), and
    every_steps:4 keeps the multiples of 4 (plus the newest)."""
    run(tmp_path, epochs=2, ckpt={"keep": "every_steps:4", "every_n_steps": 2, "async_save": True})
    assert kept_steps(tmp_path) == [4, 8, 12]
    inside = {c.step: c for c in read_kept(tmp_path / "checkpoints").described}[4]
    assert not inside.epoch_end and not inside.scores
    assert_loads(tmp_path / "checkpoints" / "step-4.pt", 4)


def test_resume_from_a_kept_checkpoint(tmp_path):
    """ckpt.resume names a kept checkpoint: the run continues from its epoch with the best.pt of its run folder."""
    first = tmp_path / "first"
    run(first, epochs=5, scripted_scores=SCORES, ckpt={"keep": "every_epochs:1"})
    kept = first / "checkpoints" / f"step-{STEPS_PER_EPOCH * 4}.pt"  # after epoch 3, the best so far
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no best checkpoint matches" warning: best.pt is found beside it
        trainer = TinyTrainer(
            make_cfg(tmp_path / "second", epochs=6, scripted_scores=SCORES, ckpt={"resume": str(kept)})
        )
    try:
        assert trainer.best_model is not None
        trainer.train()
        assert trainer.epochs_trained == [4, 5]
    finally:
        trainer.close()
    offset = load_checkpoint(kept)["metrics_offset"]  # the run folder's history up to it came along
    history = (first / "metrics.jsonl").read_bytes()[:offset]
    assert offset > 0 and (tmp_path / "second" / "metrics.jsonl").read_bytes().startswith(history)


def test_planted_links_and_foreign_files_are_left_alone(tmp_path):
    """A symlink under a kept name (one older than every checkpoint, one at a step the run writes) is neither
    followed, replaced nor deleted, its target unchanged; names trainkit does not write are untouched."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "checkpoints").mkdir(parents=True)
    target = elsewhere / "precious.pt"
    target.write_bytes(b"not yours")
    (out / "checkpoints" / "step-5.pt").symlink_to(target)
    (out / "checkpoints" / "step-12.pt").symlink_to(target)
    foreign = ["step-007.pt", "step-1.pt.bak", "notes.txt", "step-3.ckpt"]
    for name in foreign:
        (out / "checkpoints" / name).write_text(name)
    with pytest.warns(RuntimeWarning, match="step-12.pt is a symbolic link"):
        run(out, epochs=3, ckpt={"keep": "latest:1"})
    for name in ("step-5.pt", "step-12.pt"):
        assert (out / "checkpoints" / name).is_symlink()
        assert os.readlink(out / "checkpoints" / name) == str(target)
    assert target.read_bytes() == b"not yours"
    assert all((out / "checkpoints" / name).read_text() == name for name in foreign)
    assert kept_steps(out) == [18]


KILLED_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import trainkit.checkpoint.kept as files
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer

    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    real = files.remove_kept
    def remove_then_hang(path):
        real(path)
        marker.write_text(path.name)
        time.sleep(60)  # killed here, between two deletions
    files.remove_kept = remove_then_hang
    trainer = TinyTrainer(make_cfg(out, epochs=8, ckpt={"keep": "latest:1"}))
    trainer.train()
    """
)


def test_a_kill_during_background_deletion_leaves_a_resumable_folder(tmp_path):
    """SIGKILL between two deletions: every kept checkpoint left is whole, and the run resumes and finishes,
    its next save deleting what the policy lets go."""
    out = tmp_path / "run"
    run(out, epochs=5, ckpt={"keep": "every_epochs:1"})
    assert len(kept_steps(out)) == 5
    marker = tmp_path / "deleted-one"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(out), str(marker)], cwd=ROOT, env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), child.stderr.read().decode() if child.poll() is not None else "timed out"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stderr.close()
    left = kept_steps(out)
    assert 1 < len(left) < 6  # one deleted, the rest (and the new step 36) still there
    for step in left:
        assert_loads(out / "checkpoints" / f"step-{step}.pt", step)
    trainer = run(out, epochs=8, ckpt={"keep": "latest:1"})
    assert trainer.epochs_trained[-1] == 7  # resumed where the killed run's last.pt stood, and finished
    assert kept_steps(out) == [48]


KILLED_BEFORE_KEEPING = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import trainkit.checkpoint.kept as files
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer

    out, step = Path(sys.argv[1]), int(sys.argv[2])
    real = files.KeptCheckpoints.publish
    def killed_at(self, source, description, **kwargs):
        if description.step == step:  # last.pt of that step is published, its kept copy not made yet
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, source, description, **kwargs)
    files.KeptCheckpoints.publish = killed_at
    scores = (0.9, 0.5, 0.7, 0.3, 0.6, 0.8)
    TinyTrainer(make_cfg(out, epochs=5, scripted_scores=scores, ckpt={"keep": "every_epochs:1"})).train()
    """
)


def test_a_kill_between_publishing_last_and_keeping_it_is_kept_on_resume(tmp_path, capfd):
    """SIGKILL after last.pt of step 24 is published and before its kept copy is made: the resumed run keeps it
    (as its save would have: epoch 4's end, its validation scores), so the folder ends as an uninterrupted one."""
    out, reference = tmp_path / "killed", tmp_path / "reference"
    run(reference, epochs=5, scripted_scores=SCORES, ckpt={"keep": "every_epochs:1"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_KEEPING, str(out), "24"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert load_checkpoint(out / "last.pt")["step"] == 24 and kept_steps(out) == [6, 12, 18]
    capfd.readouterr()
    run(out, epochs=5, scripted_scores=SCORES, ckpt={"keep": "every_epochs:1"})
    assert "kept " in capfd.readouterr().err
    assert kept_steps(out) == kept_steps(reference) == [6, 12, 18, 24, 30]
    assert_loads(out / "checkpoints" / "step-24.pt", 24)
    got, expected = (
        {c.step: c for c in read_kept(folder / "checkpoints").described}[24] for folder in (out, reference)
    )
    assert (got.epoch, got.epoch_end, dict(got.scores)) == (expected.epoch, expected.epoch_end, dict(expected.scores))
    assert got.scores["score"] == 0.3


def test_cli_inspect_and_retain_dry_run_then_apply(tmp_path, capsys):
    """inspect lists each kept checkpoint with the rule keeping it; retain --dry-run deletes nothing, retain
    deletes what its rules do not keep, refuses a folder a live run holds, and names --keep in a bad rule."""
    run(tmp_path, epochs=4, scripted_scores=SCORES, ckpt={"keep": "every_epochs:1"})
    assert main(["inspect", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "4 kept checkpoints" in listing and "newest, every_epochs:1" in listing
    assert main(["retain", str(tmp_path), "--keep", "best:1", "--dry-run"]) == 0
    assert "would delete step-6.pt" in capsys.readouterr().out
    assert kept_steps(tmp_path) == [6, 12, 18, 24]
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert main(["retain", str(tmp_path), "--keep", "best:1"]) == 2
        assert "is in use by another trainer in this process" in capsys.readouterr().err
    finally:
        lock.release()
    assert kept_steps(tmp_path) == [6, 12, 18, 24]
    assert main(["retain", str(tmp_path), "--keep", "best:2"]) == 0  # minimize comes from the index
    assert kept_steps(tmp_path) == [12, 24]  # the best two: epoch 3 (0.3, the newest too) and epoch 1 (0.5)
    assert main(["retain", str(tmp_path), "--keep", "latest:0"]) == 2
    assert "--keep must be comma-separated retention rules" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("latest:0", "'latest:0': the count must be an int >= 1"),
        ("every_seconds:soon", "must be a number of seconds > 0"),
        ("keep_everything", "'keep_everything' is not a retention rule"),
    ],
)
def test_bad_keep_values_name_the_key_the_rule_and_the_value(tmp_path, value, rule):
    """A bad ckpt.keep, on the dotted CLI or in a mapping, is refused naming ckpt.keep, the rule and the value."""
    with pytest.raises(ConfigError, match=f"ckpt.keep must be comma-separated retention rules, got '{value}'") as exc:
        TinyTrainer.config_class(epochs=1).with_overrides([f"ckpt.keep={value}"])
    assert rule in str(exc.value)
    with pytest.raises(ConfigError, match="ckpt.keep"):
        TinyTrainer.config_class.from_mapping({"epochs": 1, "ckpt": {"keep": [value]}})


def test_a_hostile_index_is_read_entry_by_entry(tmp_path):
    """index.json is untrusted: an entry that does not check out (a bool epoch, a NaN time, a name with leading
    zeros) is dropped with a warning and its file judged by its step alone; a symlinked index is not followed."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for step in (6, 12, 18):
        (directory / f"step-{step}.pt").write_bytes(b"x")
    (directory / "index.json").write_text(
        '{"format": 1, "minimize": true, "keep": ["latest:1"], "kept": {'
        '"6": {"epoch": true}, "012": {"epoch": 2}, "18": {"epoch": 3, "epoch_end": true, "time": NaN},'
        '"12": {"epoch": 2, "epoch_end": true, "time": 5.0, "scores": {"score": 0.5}}}}'
    )
    with pytest.warns(RuntimeWarning, match="3 entries do not check out"):
        folder = read_kept(directory)
    described, refused, minimize, keep = folder.described, folder.refused, folder.minimize, folder.keep
    by_step = {c.step: c for c in described}
    assert sorted(by_step) == [6, 12, 18] and not refused
    assert by_step[12].scores["score"] == 0.5 and by_step[12].epoch_end
    assert not by_step[6].epoch_end and not by_step[18].scores  # judged by their steps alone
    assert (minimize, keep) == (True, ("latest:1",))
    (tmp_path / "elsewhere.json").write_text((directory / "index.json").read_text())
    (directory / "index.json").unlink()
    (directory / "index.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        folder = read_kept(directory)
    described, minimize = folder.described, folder.minimize
    assert minimize is None and all(not c.scores for c in described)


def weights(trainer: TinyTrainer) -> dict:
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def test_sharded_kept_directories_resume_leave_links_alone_and_retain_lists_them(tmp_path, capsys):
    """ckpt.format=sharded with latest:2 keeps exactly the two newest epoch ends as step-<step>.ckpt/ directories
    (hard links to last.ckpt's files, checked by their manifest); a resume from one trains on bit-identically; a
    planted symlink step-3.ckpt is neither followed nor deleted, a dead process's trash directory is cleaned,
    and retain --dry-run lists the directories, retain deletes them whole."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"not yours")
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step-3.ckpt").symlink_to(elsewhere, target_is_directory=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    trash = out / "checkpoints" / f".step-6.ckpt.{int(dead.stdout)}.0.trash"  # a kill during a removal
    trash.mkdir()
    (trash / "__0_0.distcp").write_bytes(b"x")
    sharded = {"format": "sharded", "keep": "latest:2"}
    trainer = run(out, epochs=4, ckpt=sharded)
    final = weights(trainer)
    steps = [STEPS_PER_EPOCH * 3, STEPS_PER_EPOCH * 4]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["index.json", "step-18.ckpt", "step-24.ckpt", "step-3.ckpt"]  # no temp or trash name left
    assert kept_steps(out) == steps
    assert (out / "checkpoints" / "step-3.ckpt").is_symlink() and (elsewhere / "precious").read_bytes() == b"not yours"
    kept = out / "checkpoints" / "step-24.ckpt"
    for name in os.listdir(out / "last.ckpt"):  # the same files as last.ckpt, linked
        assert os.stat(kept / name).st_ino == os.stat(out / "last.ckpt" / name).st_ino
    for step in steps:
        payload, problem = read_engine(
            out / "checkpoints" / f"step-{step}.ckpt", rank=0, world_size=1, validate=validate_last
        )
        assert problem is None and payload["step"] == step
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # best.ckpt is found in the kept directory's run folder
        resumed = TinyTrainer(
            make_cfg(
                tmp_path / "second",
                epochs=4,
                ckpt={"format": "sharded", "resume": str(out / "checkpoints" / "step-18.ckpt")},
            )
        )
    try:
        assert resumed.best_model is not None
        resumed.train()
        assert resumed.epochs_trained == [3]
        for name, value in weights(resumed).items():
            assert torch.equal(value, final[name]), name
    finally:
        resumed.close()
    assert main(["inspect", str(out)]) == 0
    listing = capsys.readouterr().out
    assert "2 kept checkpoints" in listing and "step-3.ckpt (a symbolic link): not a file trainkit wrote" in listing
    assert main(["retain", str(out), "--keep", "latest:1", "--dry-run"]) == 0
    shown = capsys.readouterr().out
    assert "would delete step-18.ckpt" in shown and "keep    step-24.ckpt  (newest, latest:1)" in shown
    assert kept_steps(out) == steps
    assert main(["retain", str(out), "--keep", "latest:1"]) == 0
    assert "ignore  step-3.ckpt (a symbolic link)" in capsys.readouterr().out
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["index.json", "step-24.ckpt", "step-3.ckpt"]
    assert (elsewhere / "precious").exists()


# ---------------------------------------------------------------------------------------------- issue 43


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file name in ``folder`` with its bytes (what an attack must leave as it was)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_retain_refuses_a_checkpoints_folder_that_is_a_symbolic_link(tmp_path, capsys):
    """retain on a run folder whose checkpoints/ is a symlink to another folder deletes nothing and writes nothing
    there (exit 2, naming the link), dry run included; inspect says it is not followed."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    for step in (6, 12, 18):
        (elsewhere / f"step-{step}.pt").write_bytes(b"precious %d" % step)
    (elsewhere / "index.json").write_text('{"format": 1, "minimize": true, "keep": null, "kept": {}}')
    before = snapshot(elsewhere)
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    for dry in ([], ["--dry-run"]):
        assert main(["retain", str(out), "--keep", "latest:1", *dry]) == 2
        assert "checkpoints is a symbolic link" in capsys.readouterr().err
        assert snapshot(elsewhere) == before
    assert main(["inspect", str(out)]) == 0
    assert "checkpoints is a symbolic link, not a directory trainkit made: not followed" in capsys.readouterr().out
    assert (out / "checkpoints").is_symlink() and snapshot(elsewhere) == before


HUGE = "1" + "0" * 400
"""An int too large for a float, as JSON spells it (10**400)."""


def test_ints_too_large_for_a_float_in_the_index_are_bad_entries_not_a_crash(tmp_path, capsys):
    """10**400 as a score or a time in index.json is a bad entry, warned about and judged by its step: the run
    keeps checkpoints and finishes, inspect and retain list and apply rules without a traceback."""
    out = tmp_path / "run"
    directory = out / "checkpoints"
    directory.mkdir(parents=True)
    for step in (1, 2):
        (directory / f"step-{step}.pt").write_bytes(b"x")
    (directory / "index.json").write_text(
        '{"format": 1, "minimize": true, "keep": ["latest:1"], "kept": {'
        f'"1": {{"epoch": 1, "time": {HUGE}}}, "2": {{"epoch": 1, "scores": {{"score": {HUGE}}}}}}}}}'
    )
    with pytest.warns(RuntimeWarning, match="2 entries do not check out"):
        described = read_kept(directory).described
    assert [(c.step, c.epoch_end, dict(c.scores)) for c in described] == [(1, False, {}), (2, False, {})]
    with pytest.warns(RuntimeWarning, match="2 entries do not check out"):
        run(out, epochs=2, ckpt={"keep": "every_epochs:1"})
    assert kept_steps(out) == [6, 12]  # the first save's read of the index did not kill the run
    (directory / "index.json").write_text(
        '{"format": 1, "minimize": true, "keep": ["latest:1"], "kept": {'
        f'"6": {{"epoch": 1, "scores": {{"score": {HUGE}}}}}, "12": {{"epoch": 2, "time": -{HUGE}}}}}}}'
    )
    with pytest.warns(RuntimeWarning, match="2 entries do not check out"):
        assert main(["inspect", str(out)]) == 0
    assert "2 kept checkpoints" in capsys.readouterr().out
    with pytest.warns(RuntimeWarning, match="2 entries do not check out"):
        assert main(["retain", str(out), "--keep", "latest:1"]) == 0
    assert "1 deleted, 1 kept" in capsys.readouterr().out and kept_steps(out) == [12]


KILLED_AT_THE_LINK = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer

    out, step, where, fmt = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    def killing(real):  # the rename that publishes the kept copy of step N (a file, or a directory of links)
        def rename(src, dst, *args, **kwargs):
            target = Path(os.fspath(dst))
            if target.parent.name == "checkpoints" and target.name.startswith(f"step-{step}."):
                if where == "before":  # last is published, its kept copy not made visible yet
                    os.kill(os.getpid(), signal.SIGKILL)
                real(src, dst, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)  # the kept copy is visible, nothing after it ran
            return real(src, dst, *args, **kwargs)
        return rename
    os.replace, os.rename = killing(os.replace), killing(os.rename)
    scores = (0.9, 0.5, 0.7, 0.6, 0.8)
    TinyTrainer(make_cfg(out, epochs=5, scripted_scores=scores, ckpt={"keep": "best:2", "format": fmt})).train()
    """
)
SECOND_BEST_DOES_NOT_IMPROVE = (0.9, 0.5, 0.7, 0.6, 0.8)
"""Minimized: the best two are epoch 1 (0.5, the best) and epoch 3 (0.6, which did not improve the best)."""


@pytest.mark.parametrize("fmt", ["file", "sharded"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_kill_around_the_link_of_a_kept_checkpoint_keeps_its_description(tmp_path, where, fmt):
    """SIGKILL just before or just after the link that keeps step 24 (the second best, an epoch that did not
    improve the best, so its score is in no checkpoint): the resumed run still ranks it by its score and ends
    with the kept set of an uninterrupted run, {12, 24, 30}."""
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", KILLED_AT_THE_LINK, str(out), "24", where, fmt],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert kept_steps(out) == ([12, 18, 24] if where == "after" else [12, 18])
    run(out, epochs=5, scripted_scores=SECOND_BEST_DOES_NOT_IMPROVE, ckpt={"keep": "best:2", "format": fmt})
    assert kept_steps(out) == [12, 24, 30]
    described = {c.step: c for c in read_kept(out / "checkpoints").described}
    assert described[24].scores["score"] == 0.6 and described[24].epoch == 4 and described[24].epoch_end


def test_planted_higher_steps_and_newline_names_never_displace_the_real_newest(tmp_path, capsys):
    """A planted step-999.pt and a step-998.pt name with a trailing newline: the run keeps its own newest under
    latest:1 (the planted 999 is left alone, ranked by no rule), the newline name is foreign and untouched, and
    retain, which takes the newest from the index, does the same; guard.skip_batches refuses "0:1\\n"."""
    out = tmp_path / "run"
    directory = out / "checkpoints"
    directory.mkdir(parents=True)
    planted = {"step-999.pt": b"planted", "step-998.pt\n": b"newline"}
    for name, data in planted.items():
        (directory / name).write_bytes(data)
    run(out, epochs=2, ckpt={"keep": "latest:1"})
    assert kept_steps(out) == [12, 999]
    assert_loads(directory / "step-12.pt", 12)
    assert all((directory / name).read_bytes() == data for name, data in planted.items())
    assert main(["inspect", str(out)]) == 0
    listing = capsys.readouterr().out
    assert "newest, latest:1" in listing and "after the newest" in listing
    assert main(["retain", str(out), "--keep", "latest:1"]) == 0
    assert "keep    step-999.pt  (after the newest)" in capsys.readouterr().out
    assert kept_steps(out) == [12, 999]
    assert all((directory / name).read_bytes() == data for name, data in planted.items())
    with pytest.raises(ConfigError, match="guard.skip_batches must be a list of 'EPOCH:BATCH' strings"):
        TinyTrainer.config_class.from_mapping({"epochs": 1, "guard": {"skip_batches": ["0:1\n"]}})


def test_retain_refuses_empty_rules_and_a_best_rule_that_ranks_nothing(tmp_path, capsys):
    """retain --keep '' or ' , ' is refused (it would delete all but the newest), and so is a best rule on a metric no
    checkpoint has (a typo), naming the rule and the scores there are; --dry-run says so; nothing is deleted. A run
    whose ckpt.keep has such a rule warns once."""
    with pytest.warns(RuntimeWarning, match="ckpt.keep rule best:1:val/acc:min ranks no kept checkpoint") as seen:
        run(tmp_path, epochs=3, scripted_scores=SCORES, ckpt={"keep": "every_epochs:1,best:1:val/acc"})
    assert len([w for w in seen if "ranks no kept" in str(w.message)]) == 1
    assert kept_steps(tmp_path) == [6, 12, 18]
    for keep in ("", " , "):
        assert main(["retain", str(tmp_path), "--keep", keep]) == 2
        assert "--keep must name at least one retention rule" in capsys.readouterr().err
    assert main(["retain", str(tmp_path), "--keep", "best:1:val/los"]) == 2
    err = capsys.readouterr().err
    assert "best:1:val/los:min ranks no checkpoint: none has a finite 'val/los'" in err
    assert "the scores recorded are score, val/loss" in err
    assert main(["retain", str(tmp_path), "--keep", "best:1:val/los", "--dry-run"]) == 0
    assert "warning: best:1:val/los:min ranks no checkpoint" in capsys.readouterr().out
    assert kept_steps(tmp_path) == [6, 12, 18]
    assert main(["retain", str(tmp_path), "--keep", "best:1:val/loss"]) == 0
    assert kept_steps(tmp_path) == [12, 18]


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_directory_planted_as_the_index_stops_keeping_not_the_run(tmp_path, capsys, fmt):
    """A directory at checkpoints/index.json: the run warns once, keeps nothing there and trains to the end, resume
    included; retain refuses the folder before deleting anything; inspect says why; the directory is untouched."""
    out = tmp_path / "run"
    planted = out / "checkpoints" / "index.json"
    planted.mkdir(parents=True)
    (planted / "mine").write_text("mine")
    for epochs in (2, 3):  # a fresh run, then a resume
        with pytest.warns(RuntimeWarning, match="index.json is a directory, not the index trainkit writes") as seen:
            trainer = run(out, epochs=epochs, ckpt={"keep": "latest:1", "format": fmt})
        assert trainer.epochs_trained == ([0, 1] if epochs == 2 else [2])
        assert len([w for w in seen if "index.json is a directory" in str(w.message)]) == 1
    assert kept_steps(out) == [] and (planted / "mine").read_text() == "mine"
    for step in (6, 12):
        (out / "checkpoints" / f"step-{step}.pt").write_bytes(b"x")
    assert main(["retain", str(out), "--keep", "latest:1"]) == 2
    assert "index.json is a directory, not the index trainkit writes" in capsys.readouterr().err
    assert kept_steps(out) == [6, 12] and (planted / "mine").read_text() == "mine"
    assert main(["inspect", str(out)]) == 0
    assert "a run keeps nothing there while it is so" in capsys.readouterr().out


@pytest.fixture
def read_only_checkpoints(tmp_path):
    """A run folder whose checkpoints/ cannot be written: a read-only tmpfs mounted there (root ignores modes), or a
    folder of mode 0555 for anyone else; skipped where neither is possible."""
    out = tmp_path / "run"
    directory = out / "checkpoints"
    directory.mkdir(parents=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield out
        directory.chmod(0o755)
        return
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"mounting a read-only tmpfs is not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield out
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_read_only_checkpoints_folder_is_warned_about_and_the_run_trains_on(read_only_checkpoints, fmt):
    """A checkpoints/ that cannot be written: both formats warn at each save that the step is not kept, and train to
    the end with last and best written as ever."""
    out = read_only_checkpoints
    with pytest.warns(RuntimeWarning, match=r"step 6 is not kept"):
        trainer = run(out, epochs=2, ckpt={"keep": "latest:1", "format": fmt})
    assert trainer.epochs_trained == [0, 1] and kept_steps(out) == []
    last = out / ("last.ckpt" if fmt == "sharded" else "last.pt")
    assert last.exists() and (out / ("best.ckpt" if fmt == "sharded" else "best.pt")).exists()
    if fmt == "file":
        assert_loads(last, 12)


KILLED_IN_THE_LAST_DELETION = textwrap.dedent(
    """
    import os, shutil, signal, sys
    from pathlib import Path
    import trainkit.checkpoint.kept as files
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer

    out, fmt = Path(sys.argv[1]), sys.argv[2]
    last = out / "checkpoints" / ("step-24.ckpt" if fmt == "sharded" else "step-24.pt")
    real_remove, real_rmtree = files.remove_kept, shutil.rmtree
    def remove_then_die(path):  # a file deleted, the others not yet
        real_remove(path)
        if last.exists():
            os.kill(os.getpid(), signal.SIGKILL)
    def die_in_rmtree(path, *args, **kwargs):  # a directory renamed to its trash name, not removed yet
        if last.exists() and str(path).endswith(".trash"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rmtree(path, *args, **kwargs)
    files.remove_kept = remove_then_die if fmt == "file" else files.remove_kept
    files.shutil.rmtree = die_in_rmtree
    scores = (0.9, 0.5, 0.7, 0.3)  # best:1 keeps 12 and 18 (the newest) until 24 improves: both go at once
    TinyTrainer(make_cfg(out, epochs=4, scripted_scores=scores, ckpt={"keep": "best:1", "format": fmt})).train()
    """
)


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_kill_in_the_deletion_after_the_last_save_is_finished_by_resuming_the_finished_run(tmp_path, fmt):
    """SIGKILL during the background deletion that follows a run's last save: resuming the finished run trains
    nothing and finishes the deletion (the kept set of an uninterrupted run), a sharded trash directory included."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", KILLED_IN_THE_LAST_DELETION, str(out), fmt],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    trash = [name for name in left if name.endswith(".trash")]
    assert kept_steps(out) == [18, 24] and len(trash) == (fmt == "sharded"), left  # 12 deleted (or in the trash)
    trainer = run(out, epochs=4, scripted_scores=(0.9, 0.5, 0.7, 0.3), ckpt={"keep": "best:1", "format": fmt})
    assert trainer.epochs_trained == []
    name = "step-24.ckpt" if fmt == "sharded" else "step-24.pt"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["index.json", name]


def test_the_kept_checkpoint_a_run_resumed_from_is_kept_so_the_command_reruns(tmp_path, capsys):
    """ckpt.resume=<out_dir>/checkpoints/step-12.pt into the same folder under latest:1: step 12 is never deleted
    by that run (the kept set is {12, 24}), so running the same command again
    resumes from it again."""
    out = tmp_path / "run"
    run(out, epochs=4, ckpt={"keep": "every_epochs:1"})
    again = {"keep": "latest:1", "resume": str(out / "checkpoints" / "step-12.pt")}
    for _ in range(2):  # the command, then the same command again
        trainer = run(out, epochs=4, ckpt=again)
        assert trainer.epochs_trained == [2, 3]
        assert kept_steps(out) == [12, 24]
    assert_loads(out / "checkpoints" / "step-24.pt", 24)
