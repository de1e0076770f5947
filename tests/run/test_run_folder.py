"""The run folder in careless and hostile environments: one run per out_dir, no writes through symlinks.

Real processes on a real folder for the lock; real files and links for the rest.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.faults.harness import train, write_run
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import TinyTrainer, param_digest
from trainkit import OutDirError
from trainkit.checkpoint import atomic_save, load_checkpoint, previous_path
from trainkit.run.journal import JsonlSink
from trainkit.run.lock import LOCK_FILE, RunLock


def slow_cfg(out_dir, **overrides):
    return make_cfg(out_dir, epochs=3, **overrides)


def rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------------------------- one run per out_dir


def test_a_second_run_on_the_same_out_dir_is_refused_at_once(tmp_path):
    """The same command launched twice: the second is refused at once naming the holder; the first is unharmed
    (stopped with SIGTERM afterwards, it saves its epoch and exits 143 with a consistent folder)."""
    out = tmp_path / "run"
    # about 3 s per epoch for up to 10 epochs: the first run outlives the second's start on any machine
    first = train(write_run(tmp_path / "a.json", make_cfg(out, epochs=10), {"batch_sleep": 0.5}), tmp_path / "a.log")
    try:
        assert first.wait_for("epoch 1 ")
        started = time.monotonic()
        second = train(write_run(tmp_path / "b.json", make_cfg(out, epochs=10)), tmp_path / "b.log")
        assert second.wait(timeout=60) == 2  # a refusal: one line, exit status 2
        assert time.monotonic() - started < 30  # refused, not queued behind the first
        message = second.stderr
        assert len(message.strip().splitlines()) == 1 and "Traceback" not in message
        assert "error: out_dir" in message and f"pid {first.proc.pid} on host {socket.gethostname()}" in message
        assert "since 20" in message
        assert "epoch 0 " not in second.stdout  # it never trained
        assert "epoch 9 " not in first.stdout, "the first run must still be running when the second is refused"
        first.signal(signal.SIGTERM)
        assert first.wait() == 143, first.stderr[-3000:]
    finally:
        first.kill_session()
    saved = torch.load(out / "last.pt", weights_only=True)
    steps = [row["trainer/step"] for row in rows(out)]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert steps[-1] == saved["step"] and saved["loop"]["stop_reason"] is None


def test_a_lock_left_by_a_killed_run_never_blocks(tmp_path):
    """A run killed with SIGKILL leaves its lock file behind; the next run takes the folder and resumes."""
    out = tmp_path / "run"
    first = train(write_run(tmp_path / "a.json", slow_cfg(out), {"batch_sleep": 0.4}), tmp_path / "a.log")
    try:
        assert first.wait_for("epoch 2 ")
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.wait()
    finally:
        first.kill_session()
    assert (out / LOCK_FILE).exists()
    second = train(write_run(tmp_path / "b.json", slow_cfg(out)), tmp_path / "b.log")
    assert second.wait() == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr


def test_another_trainer_in_this_process_is_refused_until_the_first_is_done(tmp_path):
    """Two trainers on one folder in one process: the second is refused until the first finishes or closes."""
    first = TinyTrainer(make_cfg(tmp_path, epochs=1))
    with pytest.raises(OutDirError, match="in use by another trainer in this process"):
        TinyTrainer(make_cfg(tmp_path, epochs=1))
    first.train()  # the end of train() lets go of the folder
    second = TinyTrainer(make_cfg(tmp_path, epochs=2))
    second.close()
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()


def test_a_run_without_checkpoints_takes_no_lock(tmp_path):
    """ckpt.enable=false writes nothing into out_dir, not even a lock file, and two such runs may share it."""
    first = TinyTrainer(make_cfg(tmp_path / "run", epochs=1, ckpt={"enable": False}))
    TinyTrainer(make_cfg(tmp_path / "run", epochs=1, ckpt={"enable": False})).train()
    first.train()
    assert not (tmp_path / "run").exists()


def test_startup_cleanup_removes_only_trainkits_temp_files_of_dead_writers(tmp_path):
    """A dead writer's temp file goes; a live writer's, a link, and files trainkit does not name stay."""
    dead = subprocess.run([sys.executable, "-c", "print(__import__('os').getpid())"], capture_output=True, text=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        gone = tmp_path / f".last.pt.{int(dead.stdout)}.3.tmp"
        gone_prev = tmp_path / f".best.prev.pt.{int(dead.stdout)}.4.tmp"
        live = tmp_path / f".last.pt.{alive.pid}.0.tmp"
        mine = tmp_path / ".notes.tmp"
        victim = tmp_path / "victim.txt"
        victim.write_text("keep")
        link = tmp_path / f".last.prev.pt.{int(dead.stdout)}.9.tmp"
        link.symlink_to(victim)
        for path in (gone, gone_prev, live, mine):
            path.write_bytes(b"partial")
        TinyTrainer(make_cfg(tmp_path, epochs=1)).train()
        assert not gone.exists() and not gone_prev.exists()
        assert live.exists() and mine.exists() and link.is_symlink() and victim.read_text() == "keep"
    finally:
        alive.kill()
        alive.wait()


# ---------------------------------------------------------------------------------- no writes through symlinks


def test_planted_prev_links_never_redirect_the_rotation(tmp_path):
    """Planted .last.prev.pt.<pid>.<n>.tmp links are skipped: the .prev rotation never writes through them."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    path = tmp_path / "last.pt"
    atomic_save({"n": 0}, path, keep_previous=True)
    for n in range(2000):  # every name this process's next saves could pick
        (tmp_path / f".last.prev.pt.{os.getpid()}.{n}.tmp").symlink_to(victim)
    for n in (1, 2, 3):
        atomic_save({"n": n}, path, keep_previous=True)
    assert victim.read_bytes() == b"precious"
    previous = previous_path(path)
    assert not previous.is_symlink() and load_checkpoint(previous)["n"] == 2
    assert load_checkpoint(path)["n"] == 3


def test_a_symlinked_out_dir_still_works(tmp_path):
    """out_dir itself may be a symbolic link to a real folder: a run writes into that folder."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    TinyTrainer(make_cfg(tmp_path / "link", epochs=2)).train()
    assert (real / "last.pt").is_file() and (real / "metrics.jsonl").is_file()
    TinyTrainer(make_cfg(tmp_path / "link", epochs=3)).train()  # and resumes through it


def test_a_planted_lock_link_is_refused(tmp_path):
    """A symbolic link planted as the lock file is not written through: the run is refused, the target intact."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).symlink_to(victim)
    with pytest.raises(OutDirError, match="symbolic link"):
        TinyTrainer(make_cfg(tmp_path / "run", epochs=1))
    assert victim.read_text() == "keep"


# ---------------------------------------------------------------------------------- found before the first epoch


def test_an_out_dir_that_cannot_be_created_is_found_before_the_first_epoch(tmp_path):
    """An out_dir below a plain file cannot be written: the constructor says so, before any training."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutDirError, match="cannot be written"):
        TinyTrainer(make_cfg(tmp_path / "file" / "run", epochs=1))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_dir_is_found_before_the_first_epoch(tmp_path):
    """A read-only out_dir is refused by the constructor, not after the first epoch."""
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with pytest.raises(OutDirError, match="cannot be written"):
            TinyTrainer(make_cfg(out, epochs=1))
    finally:
        out.chmod(0o755)


@pytest.mark.parametrize("name", ["last.pt", "best.pt", "last.prev.pt"])
def test_a_directory_in_place_of_a_checkpoint_is_found_before_the_first_epoch(tmp_path, name):
    """A directory where a checkpoint goes is named by the constructor, and left as it is."""
    (tmp_path / name).mkdir(parents=True)
    (tmp_path / name / "keep.txt").write_text("keep")
    with pytest.raises(OutDirError, match=f"{name} is a directory"):
        TinyTrainer(make_cfg(tmp_path, epochs=1, ckpt={"resume": "never"}))
    assert (tmp_path / name / "keep.txt").read_text() == "keep"


def test_run_lock_is_released_by_garbage_collection(tmp_path):
    """A RunLock dropped without release() lets go of the folder (a trainer that is never closed)."""
    lock = RunLock(tmp_path)
    lock.acquire()
    with pytest.raises(OutDirError):
        RunLock(tmp_path).acquire()
    del lock
    again = RunLock(tmp_path)
    again.acquire()
    again.release()


def test_a_released_lock_is_free_while_a_forked_child_lives_on(tmp_path):
    """A child forked while the lock was held (a persistent DataLoader worker) keeps a copy of its descriptor;
    release() must free the folder anyway, not when the last child exits."""
    lock = RunLock(tmp_path)
    lock.acquire()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only sleeps holding the inherited descriptor
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        again = RunLock(tmp_path)
        again.acquire()  # before the fix: "in use by another trainer in this process"
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_best_pt_lost_mid_run_is_reported_and_written_again_at_the_end(tmp_path):
    """best.pt deleted from disk during the run: the end of the run says so and writes it again from memory."""

    class LosesBest(TinyTrainer):
        def train_epoch(self):
            super().train_epoch()
            if self.epoch == 2:
                (self.out_dir / "best.pt").unlink()

    trainer = LosesBest(make_cfg(tmp_path, epochs=4, scripted_scores=(3.0, 1.0, 2.0, 2.5)))
    with pytest.warns(RuntimeWarning, match=r"best.pt was removed during the run; the best weights \(epoch 1\)"):
        trainer.train()
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["best"]["epoch"] == 1
    assert all(torch.equal(best["model"][k], v) for k, v in trainer.best_model.items())


# ---------------------------------------------------------------------------------- metrics.jsonl


def test_a_metrics_jsonl_symlink_is_never_written_through(tmp_path):
    """A metrics.jsonl planted as a link is refused by the constructor; the link's target is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OutDirError, match="metrics.jsonl is a symbolic link"):
        TinyTrainer(make_cfg(tmp_path / "run", epochs=1))
    assert victim.read_text() == "precious"


def test_a_fifo_as_metrics_jsonl_does_not_hang(tmp_path):
    """A FIFO at metrics.jsonl is refused at once instead of blocking the run forever."""
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "metrics.jsonl")
    started = time.monotonic()
    with pytest.raises(OutDirError, match="not a regular file"):
        TinyTrainer(make_cfg(tmp_path / "run", epochs=1))
    assert time.monotonic() - started < 30


def test_the_journal_is_synced_before_the_checkpoint_that_records_its_size(tmp_path, monkeypatch):
    """Every save fsyncs metrics.jsonl before last.pt is published (the fsync may run while the file is written),
    and last.pt's metrics_offset is within what was synced."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        size = os.fstat(fd).st_size
        real_fsync(fd)
        if target.endswith("metrics.jsonl"):
            events.append(size)  # durable once the fsync returned

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        if os.fspath(dst).endswith("/last.pt"):
            events.append("published")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    offset = torch.load(tmp_path / "last.pt", weights_only=True)["metrics_offset"]
    published = [i for i, item in enumerate(events) if item == "published"]
    assert len(published) == 2
    for start, end in zip([-1, *published], published):
        assert any(isinstance(item, int) for item in events[start + 1 : end]), events  # a sync in every save
    assert max(item for item in events[: published[-1]] if isinstance(item, int)) >= offset


def test_the_journal_says_whether_a_checkpoint_needs_to_sync_it(tmp_path):
    """synced is False from a row's append to the next sync, and for a file found with rows (a resumed run's)."""
    path = tmp_path / "metrics.jsonl"
    journal = JsonlSink(path)
    assert journal.synced  # a new, empty file: nothing to make durable
    journal.log({"loss": 1.0})
    assert not journal.synced
    journal.sync()
    assert journal.synced
    journal.finish()
    reopened = JsonlSink(path, truncate_to=path.stat().st_size)
    assert not reopened.synced  # rows found at open go with the first sync
    reopened.sync()
    assert reopened.synced
    reopened.finish()


@pytest.mark.parametrize(("cut", "damaged", "blank"), [(1, 0, 0), (7, 1, 0), ("row", 0, 1)])
def test_a_journal_cut_below_the_recorded_offset_is_padded_with_a_warning(tmp_path, cut, damaged, blank):
    """A tail lost in a crash (metrics.jsonl shorter than last.pt records): the resume pads it to the recorded
    size and warns; new rows start on a line of their own, and report skips what the crash tore.

    Cut by its newline only, the last row is whole again; cut inside, it stays a damaged line; a whole row
    lost leaves a blank line."""
    import warnings as stdlib_warnings

    from trainkit.run.read_metrics import read_metrics

    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    path = tmp_path / "metrics.jsonl"
    data = path.read_bytes()
    keep = len(data) - (len(data.splitlines(keepends=True)[-1]) if cut == "row" else cut)
    path.write_bytes(data[:keep])
    with pytest.warns(RuntimeWarning, match="metrics.jsonl is .* bytes shorter than the checkpoint recorded"):
        trainer = TinyTrainer(make_cfg(tmp_path, epochs=3))
    trainer.train()
    after = path.read_bytes()
    assert after.startswith(data[:keep]) and after[len(data) - 1 : len(data)] == b"\n"
    with stdlib_warnings.catch_warnings(record=True) as caught:
        stdlib_warnings.simplefilter("always")
        rows = read_metrics(tmp_path)
    assert [str(w.message) for w in caught if "damaged" in str(w.message)] == (
        [f"{path}: skipped 1 damaged line(s) ({len(data.splitlines())}), e.g. a row cut short by a crash"]
        if damaged
        else []
    )
    assert len(rows) == len(after.splitlines()) - damaged - blank
    assert rows[-1]["trainer/epoch"] == 2 and all(isinstance(row, dict) for row in rows)


def test_report_skips_a_damaged_last_line_with_a_warning(tmp_path):
    """report reads a metrics.jsonl whose last line a crash cut short: the line is skipped with a warning."""
    from trainkit.run.read_metrics import read_metrics

    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    path = tmp_path / "metrics.jsonl"
    whole = read_metrics(tmp_path)
    path.write_bytes(path.read_bytes() + b'{"trainer/step": 9, "tra')
    with pytest.warns(RuntimeWarning, match=r"skipped 1 damaged line"):
        assert read_metrics(tmp_path) == whole


def test_report_replaces_a_curves_png_link_instead_of_writing_through_it(tmp_path):
    """report draws into a file of its own and renames it over curves.png: a planted link's target is untouched."""
    pytest.importorskip("matplotlib")
    from trainkit.cli.report import plot_curves, summarize_run

    TinyTrainer(make_cfg(tmp_path / "run", epochs=2)).train()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run" / "curves.png").symlink_to(victim)
    path = plot_curves(tmp_path / "run", summarize_run(tmp_path / "run"))
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and path.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------------------- hostile files at resume


def test_a_last_pt_of_the_wrong_shape_falls_back_to_the_previous_one(tmp_path):
    """A CRC-valid last.pt whose engine entries have the wrong shape is refused naming the key; auto-resume
    falls back to last.prev.pt and trains to the same end as an untouched run."""
    reference = TinyTrainer(make_cfg(tmp_path / "ref", epochs=3))
    reference.train()
    out = tmp_path / "run"

    class Stops(TinyTrainer):
        def train_epoch(self):
            if self.epoch == 2:
                raise RuntimeError("stop")
            super().train_epoch()

    with pytest.raises(RuntimeError, match="stop"):
        Stops(make_cfg(out, epochs=3)).train()
    payload = torch.load(out / "last.pt", weights_only=True)
    payload["loop"] = 5
    torch.save(payload, out / "last.pt")
    with pytest.warns(RuntimeWarning, match=r"loop must be a LoopState dict.*resuming from the previous checkpoint"):
        resumed = TinyTrainer(make_cfg(out, epochs=3))
    assert resumed.epoch == 1 and (out / "last.corrupt.pt").exists()
    resumed.train()
    assert param_digest(resumed.model) == param_digest(reference.model)


def test_a_fifo_at_last_pt_falls_back_instead_of_hanging(tmp_path):
    """A FIFO planted at last.pt is refused without blocking, and the run resumes from last.prev.pt."""
    TinyTrainer(make_cfg(tmp_path, epochs=2)).train()
    (tmp_path / "last.pt").unlink()
    os.mkfifo(tmp_path / "last.pt")
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        trainer = TinyTrainer(make_cfg(tmp_path, epochs=3))
    assert time.monotonic() - started < 30 and trainer.epoch == 1


def test_a_users_own_state_dict_as_best_pt_is_not_taken_for_the_best(tmp_path):
    """best.pt overwritten by a bare torch.save(model.state_dict()) is refused with a warning, never loaded."""
    scores = (2.0, 1.0, 0.5)
    trainer = TinyTrainer(make_cfg(tmp_path, epochs=2, scripted_scores=scores))
    trainer.train()
    torch.save(trainer.model.state_dict(), tmp_path / "best.pt")
    (tmp_path / "best.prev.pt").unlink()
    with pytest.warns(RuntimeWarning) as record:
        resumed = TinyTrainer(make_cfg(tmp_path, epochs=3, scripted_scores=scores))
    messages = [str(w.message) for w in record]
    assert any("best.pt is not a valid trainkit best.pt" in m for m in messages), messages
    assert any("no best checkpoint matches the best recorded" in m for m in messages), messages
    assert resumed.best_model is None
    resumed.train()
    assert resumed.best_state.epoch == 2 and resumed.best_model is not None


def test_a_failed_construction_leaves_nothing_open_and_the_folder_free(tmp_path):
    """setup() raising: the metrics file is closed, the lock released, and the next trainer starts normally."""

    class FailingSetup(TinyTrainer):
        def setup(self, ckpt):
            raise RuntimeError("setup failed")

    def open_files():
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the descriptor listdir itself used, closed since
                continue
        return found

    before = open_files()
    with pytest.raises(RuntimeError, match="setup failed"):
        FailingSetup(make_cfg(tmp_path, epochs=1))
    leaked = {path for path in open_files() - before if str(tmp_path) in path}
    assert not leaked
    TinyTrainer(make_cfg(tmp_path, epochs=1)).train()
