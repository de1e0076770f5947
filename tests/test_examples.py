"""The examples run for real, on short settings, so none of them can rot; and the report command draws a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import ROOT

QUIET = ["wandb.mode=disabled", "progress.enable=false"]


def run(args, env=None, **kwargs):
    """Run a command from the repository root and return the completed process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env, **kwargs)


# bitwise resume is a CPU promise: on a GPU, cuDNN's convolution backward is not deterministic by default
# (docs/checkpoints.rst), so these runs hide any GPU
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}


def test_digits_trains_tests_and_leaves_its_files(tmp_path):
    """A short digits run prints its test accuracy and leaves last.pt, best.pt and metrics.jsonl."""
    out = tmp_path / "digits"
    proc = run([sys.executable, "examples/digits.py", "epochs=4", f"out_dir={out}", *QUIET])
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy:" in proc.stdout
    accuracy = float(proc.stdout.split("test accuracy:")[1].split("%")[0])
    assert accuracy > 80.0
    assert {"last.pt", "best.pt", "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    last = torch.load(out / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler"} <= set(last)


def test_digits_reads_a_yaml_file_and_overrides(tmp_path):
    """A YAML file sets keys, and later dotted overrides win over it."""
    config = tmp_path / "conf.yaml"
    config.write_text(f"epochs: 9\nout_dir: {tmp_path / 'yaml'}\nval:\n  patience: 2\nchannels: 8\n")
    proc = run([sys.executable, "examples/digits.py", str(config), "epochs=2", *QUIET])
    assert proc.returncode == 0, proc.stderr
    last = torch.load(tmp_path / "yaml" / "last.pt", weights_only=True)
    assert last["config"]["epochs"] == 2 and last["config"]["channels"] == 8 and last["config"]["val"]["patience"] == 2


def test_digits_typo_is_a_clear_error(tmp_path):
    """A misspelled override stops the script with the closest key named."""
    proc = run([sys.executable, "examples/digits.py", "val.paitence=3", f"out_dir={tmp_path}", *QUIET])
    assert proc.returncode != 0
    assert "did you mean 'val.patience'?" in proc.stderr


def test_ctrl_c_then_rerun_resumes_to_the_same_result(tmp_path):
    """Ctrl-C mid-run exits 130 after saving; the same command resumes and ends exactly like an uninterrupted run."""
    args = [sys.executable, "examples/digits.py", "epochs=4", "val.patience=null", *QUIET]  # 3 after the first save
    reference = run([*args, f"out_dir={tmp_path / 'ref'}"], env=ON_CPU)
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "interrupted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ON_CPU}
    proc = subprocess.Popen(
        [*args, f"out_dir={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (out / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130, stderr
    assert "SIGINT received" in stderr
    resumed = run([*args, f"out_dir={out}"], env=ON_CPU)
    assert resumed.returncode == 0, resumed.stderr
    assert "trainkit: resuming" in resumed.stderr
    accuracy = [line for line in resumed.stdout.splitlines() if line.startswith("test accuracy")]
    expected = [line for line in reference.stdout.splitlines() if line.startswith("test accuracy")]
    assert accuracy[0].split("(")[0] == expected[0].split("(")[0]
    ref_last = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)
    got_last = torch.load(out / "last.pt", weights_only=True)
    for key, value in ref_last["model"].items():
        assert torch.equal(got_last["model"][key], value), key
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["trainer/step"] for row in rows]
    assert steps == sorted(steps)
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "ref" / "metrics.jsonl").read_text()


def test_extending_a_finished_digits_run_ends_as_the_longer_run(tmp_path):
    """A finished 2-epoch digits run rerun with epochs=3 ends bit-identical to a 3-epoch run (its schedule is sized
    by lr_decay_epochs, not epochs), in the weights, the scheduler and every metric."""
    args = [sys.executable, "examples/digits.py", "val.patience=null", *QUIET]
    for out, epochs in (("ref", [3]), ("extended", [2, 3])):
        for n in epochs:
            proc = run([*args, f"epochs={n}", f"out_dir={tmp_path / out}"], env=ON_CPU)
            assert proc.returncode == 0, proc.stderr
    ref = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)
    got = torch.load(tmp_path / "extended" / "last.pt", weights_only=True)
    for key, value in ref["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert got["scheduler"]["_last_lr"] == ref["scheduler"]["_last_lr"]
    ref_rows = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    got_rows = [json.loads(line) for line in (tmp_path / "extended" / "metrics.jsonl").read_text().splitlines()]
    assert [row for row in got_rows if not row.keys() & {"test/accuracy", "test/loss"}] == [
        row for row in ref_rows if not row.keys() & {"test/accuracy", "test/loss"}
    ]


# the GPT example's YAML with a model and batches small enough for a test: a few steps take a second or two
TINY_GPT = ["n_layer=1", "n_embd=32", "n_head=2", "block_size=16", "batch_size=4", "val_windows=8"]


def test_gpt_ends_at_max_steps_with_the_final_validation_and_a_checkpoint(tmp_path):
    """A 6-step GPT run (2 micro-batches a step) validates every 3 steps and at its last step, pushes a row every 2
    steps with tokens/s, and leaves last.pt at step 6 with its schedule and the kept step checkpoints."""
    out = tmp_path / "gpt"
    args = ["max_steps=6", "val.every_n_steps=3", "ckpt.every_n_steps=2", "log_every_n_steps=2", "accum_steps=2"]
    proc = run([sys.executable, "examples/gpt.py", "examples/gpt.yaml", *args, *TINY_GPT, f"out_dir={out}", *QUIET])
    assert proc.returncode == 0, proc.stderr
    assert "best val loss:" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["trainer/step"] for row in rows if "val/loss" in row] == [3, 6]
    assert {2, 4} <= {row["trainer/step"] for row in rows if "train/loss" in row}
    assert rows[-1]["trainer/step"] == 6 and all(
        row["perf/tokens_per_s"] > 0 for row in rows if "perf/steps_per_s" in row
    )
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["step"] == 6 and {"model", "optimizer", "scheduler"} <= set(last)
    assert last["scheduler"]["last_epoch"] == 6  # stepped once per optimizer step, not per micro-batch
    assert "step-6.pt" in {p.name for p in (out / "checkpoints").iterdir()}
    assert (out / "best.pt").is_file()


@pytest.mark.ddp
def test_digits_runs_under_torchrun_with_two_processes(tmp_path):
    """The unchanged script runs as 2 gloo processes under torchrun and reports a test accuracy."""
    out = tmp_path / "ddp"
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "examples/digits.py",
            "epochs=3",
            f"out_dir={out}",
            "dist.timeout_s=60",
            *QUIET,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("test accuracy:") == 1
    assert torch.load(out / "last.pt", weights_only=True)["world_size"] == 2


def test_embed_bookkeeping_example_resumes_from_plain_dicts(tmp_path):
    """The no-trainer example pauses, resumes from its JSON records, and finishes."""
    proc = run([sys.executable, "examples/embed_bookkeeping.py", str(tmp_path / "embed")])
    assert proc.returncode == 0, proc.stderr
    assert "paused after epoch 9" in proc.stdout and "resumed at epoch 10" in proc.stdout
    state = json.loads((tmp_path / "embed" / "state.json").read_text())
    assert state["best"]["kind"] == "BestState"


def test_report_prints_the_summary_and_draws_curves(tmp_path):
    """python -m trainkit report summarizes a real run and writes curves.png."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "digits"
    proc = run([sys.executable, "examples/digits.py", "epochs=3", f"out_dir={out}", *QUIET])
    assert proc.returncode == 0, proc.stderr
    report = run([sys.executable, "-m", "trainkit", "report", str(out)])
    assert report.returncode == 0, report.stderr
    for needle in ("epochs run:   3", "stop reason:  max_epochs", "best epoch:", "test/acc:", "curves:"):
        assert needle in report.stdout
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_report_on_a_folder_without_a_run_fails_clearly(tmp_path):
    """The report command names the missing metrics file and exits 2."""
    report = run([sys.executable, "-m", "trainkit", "report", str(tmp_path)])
    assert report.returncode == 2
    assert "metrics.jsonl does not exist" in report.stderr


def test_a_config_error_on_the_command_line_is_one_line_and_exit_status_2(tmp_path):
    """A misspelled override prints one line naming the closest key and exits 2, as argparse does."""
    proc = run([sys.executable, "examples/digits.py", "val.paitence=3", f"out_dir={tmp_path}", *QUIET])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["digits.py: error: unknown config key 'val.paitence'; did you mean 'val.patience'?"], lines


def test_a_python_caller_of_config_from_argv_still_gets_the_config_error():
    """config_from_argv with explicit words raises ConfigError instead of exiting."""
    from trainkit import Config, ConfigError
    from trainkit.cli import config_from_argv

    with pytest.raises(ConfigError, match="did you mean 'val.patience'"):
        config_from_argv(Config, ["epochs=1", "val.paitence=3"])


def test_a_misspelled_resume_mode_names_the_choices(tmp_path):
    """ckpt.resume=sometimes is reported as not auto, never or an existing checkpoint path."""
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer
    from trainkit import CheckpointError

    with pytest.raises(CheckpointError, match=r"ckpt.resume must be 'auto', 'never' or the path of an existing"):
        TinyTrainer(make_cfg(tmp_path, ckpt={"resume": "sometimes"}))


def test_inspect_shows_what_a_checkpoint_holds(tmp_path):
    """python -m trainkit inspect prints epoch, step, config, items with tensor shapes/dtypes/bytes, best and
    patience records and RNG owners, for last.pt and best.pt."""
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer

    TinyTrainer(make_cfg(tmp_path, epochs=3, scripted_scores=(3.0, 1.0, 2.0), val={"patience": 4})).train()
    last = run([sys.executable, "-m", "trainkit", "inspect", str(tmp_path / "last.pt")])
    assert last.returncode == 0, last.stderr
    for needle in (
        "a trainkit last.pt, schema 1",
        "epoch:        3 done, step",
        "best:         score 1 at epoch 1, step 12 (minimize",
        "patience:     3 of 4 left",
        "rng:          rank 0: ",
        "  epochs = 3",
        "  model: 4 tensor(s)",
        "    0.weight: float32 32x8 (1.0 KiB)",
        "  optimizer: ",
    ):
        assert needle in last.stdout, (needle, last.stdout)
    best = run([sys.executable, "-m", "trainkit", "inspect", str(tmp_path / "best.pt")])
    assert best.returncode == 0 and "a trainkit best.pt" in best.stdout and "best epoch:   1" in best.stdout


@pytest.mark.parametrize("content", [b"not a checkpoint", b"PK\x05\x06" + b"\x00" * 18])
def test_inspect_of_a_damaged_file_is_one_line(tmp_path, content):
    """inspect gives a damaged or foreign file the same one-line refusal as a resume, and exit status 2."""
    path = tmp_path / "last.pt"
    path.write_bytes(content)
    proc = run([sys.executable, "-m", "trainkit", "inspect", str(path)])
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: checkpoint ")


def test_inspect_of_a_bare_state_dict_says_it_is_not_a_trainkit_checkpoint(tmp_path):
    """A user's own torch.save(model.state_dict()) is refused as not a trainkit checkpoint, in one line."""
    import torch

    torch.save({"weight": torch.zeros(2)}, tmp_path / "weights.pt")
    proc = run([sys.executable, "-m", "trainkit", "inspect", str(tmp_path / "weights.pt")])
    assert proc.returncode == 2 and "is not a trainkit checkpoint" in proc.stderr


def test_curve_panels_put_test_points_and_the_lr_on_the_plot_and_a_wide_loss_on_a_log_axis():
    """The report's panels: a loss spanning more than a decade gets a log axis, a narrow one does not; test
    metrics join their metric's panel; grad norms get a panel of their own, the learning rate one too."""
    from trainkit.cli.report import curve_panels

    rows = [
        {"trainer/epoch": 0, "train/loss": 2.0, "val/loss": 2.1, "train/grad_norm": 3.0, "lr/opt/decay": 1e-3},
        {"trainer/epoch": 1, "train/loss": 0.05, "val/loss": 0.08, "val/acc": 0.9, "lr/opt/decay": 1e-5},
        {"trainer/epoch": 1, "test/loss": 0.09, "test/acc": 0.88},
    ]
    panels = curve_panels(rows)
    assert list(panels) == ["loss", "acc", "grad_norm", "lr"]
    assert panels["grad_norm"]["keys"] == ["train/grad_norm"]
    assert panels["loss"] == {"keys": ["test/loss", "train/loss", "val/loss"], "log": True}
    assert panels["acc"] == {"keys": ["test/acc", "val/acc"], "log": False}
    assert panels["lr"]["log"] is True
    narrow = curve_panels([{"train/loss": 0.5}, {"train/loss": 0.3}])
    assert narrow["loss"]["log"] is False
