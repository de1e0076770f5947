"""``python -m trainkit certify``: a trainer run straight and interrupted (SIGTERM, SIGKILL), compared bit for bit.

Real trainers in real child processes on real files: the README's, the examples', a clean one on 2 gloo ranks, and
one per planted defect, each caught at the right checkpoint with the right item and the right cause.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler

import trainkit
from tests.helpers import ROOT
from trainkit.certification import CertifyError, plan_interruptions
from trainkit.certification.child import unregistered_objects
from trainkit.cli import main
from trainkit.cli.certify import certify
from trainkit.errors import ConfigError

HELPERS = "tests.helpers.certify_trainers"


@pytest.fixture(scope="module", autouse=True)
def server():
    """One fork server (torch, trainkit and the examples' imports loaded once) for every certify of this file."""
    with trainkit.fork_server(preload=["trainkit.certification.child", "numpy", "sklearn.datasets"]):
        yield


@pytest.fixture
def examples_path(monkeypatch):
    """The repository root and examples/ on sys.path, which certify's child processes inherit."""
    monkeypatch.syspath_prepend(str(ROOT))


def test_the_readme_trainer_passes_and_certify_writes_only_its_own_folders(tmp_path, monkeypatch, capsys):
    """The README's trainer PASSes from the command line (options among the config words; exit 0), the run time and
    both kept folders are printed, ``--json`` holds the verdict, and the config's out_dir is never created."""
    block = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    (tmp_path / "readme_trainer.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    user_out = tmp_path / "my-run"
    work, report = tmp_path / "certify", tmp_path / "report.json"
    argv = ["certify", "readme_trainer:MyTrainer", f"out_dir={user_out}", "--term-at", "5", "epochs=2"]
    status = main([*argv, "--kill-at", "11", "--work-dir", str(work), "--json", str(report)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "readme_trainer:MyTrainer: PASS" in out
    assert re.search(r"time: +\d+\.\d s \(bound: --timeout-s 600\)", out), out
    assert str(work / "straight") in out and str(work / "interrupted") in out
    data = json.loads(report.read_text())
    assert data["verdict"] == "PASS" and data["total_steps"] == 16 and data["divergence"] is None
    assert [i["how"] for i in data["interruptions"]] == ["term", "kill"]
    assert not user_out.exists()
    assert (work / "straight" / "last.pt").is_file() and (work / "interrupted" / "best.pt").is_file()


def test_the_digits_example_passes(tmp_path, examples_path):
    """examples/digits.py's trainer, on a tiny budget, resumes exactly from a SIGTERM and a SIGKILL mid-epoch."""
    words = [str(ROOT / "examples/digits.yaml"), "channels=4", "batch_size=256", "test.enable=false"]
    report = certify("examples.digits:DigitsTrainer", words, epochs=2, term_at=[2], kill_at=[7], work_dir=tmp_path)
    assert report.passed, report.lines()
    assert report.total_steps == 10 and report.checkpoints_compared == 10


def test_the_gpt_example_passes(tmp_path, examples_path):
    """examples/gpt.py's trainer, shrunk, resumes exactly inside its accumulation windows' step boundaries."""
    words = [str(ROOT / "examples/gpt.yaml"), "n_layer=1", "n_embd=16", "n_head=2", "block_size=16", "batch_size=2"]
    words += ["val_windows=4", "val.every_n_steps=2", "log_every_n_steps=1"]
    report = certify("examples.gpt:GPTTrainer", words, max_steps=4, term_at=[1], kill_at=[3], work_dir=tmp_path)
    assert report.passed, report.lines()
    assert report.rows_compared >= 4


@pytest.mark.ddp
def test_a_clean_trainer_passes_on_two_gloo_ranks(tmp_path):
    """On 2 processes (a gloo group) the interrupted run, stopped by SIGTERM and SIGKILL, matches the straight one;
    the loader its validations inside the epoch iterate is not taken for a training loader outside progress()."""
    words = ["epochs=1", "val.every_n_steps=5"]  # validations inside the epoch, over a loader iterated directly
    report = certify(f"{HELPERS}:CleanTrainer", words, world_size=2, term_at=[4], kill_at=[9], work_dir=tmp_path)
    assert report.passed, report.lines()
    assert report.notes == ()
    assert report.world_size == 2 and report.checkpoints_compared == report.total_steps == 12
    assert report.resumes[0][1] >= 4  # on several ranks the signal is agreed on at the next step boundary


DEFECTS = {
    "UnregisteredScheduler": ("unregistered", ["scheduler (LR scheduler)"], "optimizer", "param_groups[0].lr", 6),
    "OwnRandom": ("uncaptured_rng", ["noise (random.Random)"], "model", "0.weight", 4),
    "HiddenRandom": (
        "uncaptured_rng",
        ["the first batch after a resume (epoch 0, batch 3) differs from the straight run's"],
        "model",
        "0.weight",
        4,
    ),
    "LoaderOutsideProgress": ("loader_outside_progress", ["extra_loader"], "model", "0.weight", 4),
    "Nondeterministic": ("nondeterministic", [], "model", "0.weight", 1),
    "LocalState": ("local_state", [], "model", "0.weight", 4),
}


@pytest.mark.parametrize("name", DEFECTS)
def test_each_planted_defect_is_caught_with_its_item_and_cause(tmp_path, name):
    """A SIGTERM at step 3 or 4 (inside the first epoch): the first diverging checkpoint, the first item and tensor that
    differ, and the cause (with what it found) are the planted defect's."""
    key, found, section, tensor, step = DEFECTS[name]
    # the scheduler decays every 3 steps: a fresh one counting from step 4 decays after step 7, not after step 6
    term_at = [4] if name == "UnregisteredScheduler" else [3]
    report = certify(f"{HELPERS}:{name}", ["epochs=1"], term_at=term_at, work_dir=tmp_path)
    assert not report.passed
    divergence = report.divergence
    assert (divergence.where, divergence.step) == (f"checkpoints/step-{step}.pt", step), report.lines()
    assert (divergence.section, divergence.name) == (section, tensor), report.lines()
    assert divergence.max_abs_diff is not None and divergence.max_abs_diff > 0
    assert report.causes[0].key == key and list(report.causes[0].found) == found, report.lines()


def test_a_divergence_exits_1_and_bad_input_exits_2(tmp_path, capsys):
    """The command's exit status: 1 with the diverging step printed, 2 with one error line naming the bad input."""
    argv = ["certify", f"{HELPERS}:LocalState", "epochs=1", "--term-at", "3", "--work-dir", str(tmp_path / "w")]
    assert main(argv) == 1
    assert "first diverging checkpoint: checkpoints/step-4.pt (step 4)" in capsys.readouterr().out
    assert trainkit.certify is certify  # the same check from Python, on the package's face
    assert main(["certify", "no_such_module_here:Trainer"]) == 2
    assert "no_such_module_here" in capsys.readouterr().err
    assert (
        main(["certify", f"{HELPERS}:CleanTrainer", "epochs=1", "--kill-at", "12", "--work-dir", str(tmp_path / "x")])
        == 2
    )
    assert "--kill-at must name steps in [1, 11]" in capsys.readouterr().err


def test_the_run_time_is_bounded(tmp_path):
    """A check that cannot finish within --timeout-s is stopped there, its running attempt killed, with a clear
    error."""
    with pytest.raises(CertifyError, match=r"ran past --timeout-s 0\.5"):
        certify(f"{HELPERS}:SlowTrainer", ["epochs=3"], timeout_s=0.5, work_dir=tmp_path)


def test_the_work_folder_is_never_the_users_out_dir(tmp_path):
    """--work-dir inside the config's out_dir, or a folder certify did not make, is refused before anything runs."""
    with pytest.raises(ConfigError, match="--work-dir must not be the config's out_dir"):
        certify(f"{HELPERS}:CleanTrainer", [f"out_dir={tmp_path}", "epochs=1"], work_dir=tmp_path / "inside")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="--work-dir must be empty"):
        certify(f"{HELPERS}:CleanTrainer", ["epochs=1"], work_dir=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@given(total=st.integers(2, 500), seed=st.integers(0, 2**32))
def test_drawn_interruptions_are_distinct_steps_inside_the_run(total, seed):
    """Without chosen steps, one SIGTERM and one SIGKILL at distinct steps in [1, total - 1], in step order, the same
    for the same seed."""
    plan = plan_interruptions(total, seed=seed)
    steps = [i.step for i in plan]
    assert steps == sorted(set(steps)) and all(1 <= step < total for step in steps)
    assert {i.how for i in plan} == ({"term", "kill"} if total > 2 else {"term"})
    assert plan == plan_interruptions(total, seed=seed)


def test_the_scan_finds_what_a_trainer_holds_unregistered_and_skips_what_is_covered():
    """Optimizers in a list, a sampler's generator, a dataset's numpy generator and a random.Random are named; a
    module inside a registered one and a module with nothing to train are not."""

    class Dataset(torch.utils.data.Dataset):
        def __init__(self):
            self.rng = np.random.default_rng(0)

        def __len__(self):
            return 4

        def __getitem__(self, index):
            return index

    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(inner)
    attributes = {
        "model": model,
        "inner": inner,
        "frozen": torch.nn.Identity(),
        "sampler": RandomSampler(range(4), generator=torch.Generator()),
        "loader": DataLoader(Dataset(), batch_size=2),
        "optimizers": [torch.optim.SGD(inner.parameters(), lr=0.1)],
        "jitter": random.Random(1),
    }
    found = unregistered_objects(attributes, [model])
    assert sorted(found) == [
        ("jitter", "random.Random"),
        ("loader.dataset.rng", "numpy.random.Generator"),
        ("optimizers[0]", "optimizer"),
        ("sampler.generator", "torch.Generator"),
    ]


def _prefix_listing(url):
    """Every object under a remote prefix: its name, size and SHA-256, and the folders a file:// prefix holds."""
    import hashlib

    from trainkit.checkpoint.remote import open_store

    fs, root = open_store(url)
    fs.invalidate_cache()
    listing = {}
    for path, info in fs.find(root, withdirs=True, detail=True).items():
        name = path[len(root.rstrip("/")) + 1 :]
        if info["type"] == "directory":
            listing[name] = "folder"
        else:
            data = fs.cat_file(path)
            listing[name] = (info["size"], len(data), hashlib.sha256(data).hexdigest())
    return listing


@pytest.mark.parametrize("store", ["file", "s3"])
def test_certify_touches_nothing_under_the_configs_remote_prefix(tmp_path, request, store):
    """A config whose ckpt.remote holds a real, longer run of the same trainer: certify neither uploads there nor
    resumes from it (each of its runs starts at step 0 and PASSes), the prefix is byte for byte as it was (every
    object's size and digest), and the report says the remote tier was not certified."""
    import secrets

    from tests.helpers.certify_trainers import CleanTrainer
    from tests.helpers.configs import make_cfg

    if store == "s3":
        request.getfixturevalue("s3_endpoint")
        url = f"s3://trainkit-{secrets.token_hex(4)}/runs/real"
    else:
        url = f"file://{tmp_path}/remote/runs/real"
    real = CleanTrainer(make_cfg(tmp_path / "real", epochs=2, ckpt={"remote": url, "every_n_steps": 4}))
    try:
        real.train()
    finally:
        real.close()
    before = _prefix_listing(url)
    assert any(name.endswith("commit.json") for name in before), before  # the real run committed checkpoints
    words = ["epochs=1", "val.minimize=true", f"ckpt.remote={url}"]  # the real run's config, on certify's budget
    report = certify(f"{HELPERS}:CleanTrainer", words, term_at=[3], kill_at=[7], work_dir=tmp_path / "work")
    assert report.passed, report.lines()
    assert report.total_steps == 12 and report.resumes == ((3, 3), (7, 6)), report.lines()
    assert _prefix_listing(url) == before
    assert any("ckpt.remote" in note and "not certified" in note for note in report.notes), report.notes
    assert url not in "\n".join(report.lines())  # a URL may name more than a prefix: it is not repeated
