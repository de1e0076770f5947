"""``python -m trainkit export CHECKPOINT OUT --format safetensors``: the weights a checkpoint holds, bit for bit, in
files that the Hugging Face hub's readers load and that run no code.

The runs are real (a tiny regressor, one with a tied embedding and head and a transposed parameter, a 2-rank FSDP2
run with sharded checkpoints); every export goes through the CLI's own entry point, and every file is read back with
plain ``safetensors``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainkit
from tests.faults.hostile import Reduces
from tests.helpers.checkpoint_files import export_header
from tests.helpers.configs import make_cfg
from tests.helpers.trainers import ShardTrainer, TinyTrainer, make_data, whole_best
from trainkit.checkpoint.export.safetensors_files import export_names, parse_size, plan_shards
from trainkit.cli import main as cli_main
from trainkit.cli.export import config_sha256
from trainkit.errors import ConfigError

safetensors_torch = pytest.importorskip("safetensors.torch")


def export(capsys, *args) -> tuple[int, str, str]:
    """Run ``python -m trainkit export ARGS`` in this process; return its exit status, stdout and stderr."""
    capsys.readouterr()
    code = cli_main(["export", *(str(arg) for arg in args)])
    return code, *capsys.readouterr()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same names, dtypes, shapes and bytes (a -0.0 is not a 0.0, a NaN equals its own bits)."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), name


@pytest.fixture(scope="module")
def file_run(tmp_path_factory) -> Path:
    """A finished 2-epoch run with file checkpoints: last.pt and best.pt."""
    out = tmp_path_factory.mktemp("file_run")
    TinyTrainer(make_cfg(out, epochs=2)).train()
    return out


def test_last_pt_round_trips_bit_for_bit_with_its_run_in_the_header(file_run, tmp_path, capsys):
    """last.pt exported as one .safetensors file: the tensors are the checkpoint's, bit for bit, a fresh module
    loads them, and the header names the format, the trainkit version, the item, the epoch, the step and the
    sha256 of the config the checkpoint records."""
    out = tmp_path / "model.safetensors"
    code, printed, errors = export(capsys, file_run / "last.pt", out, "--format", "safetensors")
    assert code == 0, errors
    assert f"wrote {out}: 4 tensors" in printed
    payload = torch.load(file_run / "last.pt", weights_only=True)
    assert_bitwise(safetensors_torch.load_file(out), payload["model"])
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    net.load_state_dict(safetensors_torch.load_file(out))
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as handle:
        header = handle.metadata()
    assert header == export_header(payload, epoch=2)


def test_best_pt_exports_to_a_folder_of_one_file_and_a_best_records_its_step(file_run, tmp_path, capsys):
    """best.pt into a folder: the weights fit in one shard, so the folder holds model.safetensors alone (no index,
    as the hub writes it), equal to the best weights; the header says best, its epoch, and the best's step."""
    out = tmp_path / "best"
    assert export(capsys, file_run / "best.pt", out, "--format", "safetensors")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    best = torch.load(file_run / "best.pt", weights_only=True)
    assert_bitwise(safetensors_torch.load_file(out / "model.safetensors"), best["model"])
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        header = handle.metadata()
    assert header["checkpoint"] == "best" and header["epoch"] == str(best["epoch"])
    assert best["best"]["step"] is not None and header["step"] == str(best["best"]["step"])


def test_small_shards_carry_the_hubs_index(file_run, tmp_path, capsys):
    """--max-shard-size 600B splits the 4 tensors (1024, 128, 128 and 4 bytes, in the checkpoint's order) as the hub
    does: the index maps every name to its file, total_size is the tensors' bytes, every shard loads,
    holds what the index says, and stays under the limit unless one tensor alone is larger."""
    out = tmp_path / "shards"
    code, printed, errors = export(
        capsys, file_run / "last.pt", out, "--format", "safetensors", "--max-shard-size", "600B"
    )
    assert code == 0, errors
    weights = torch.load(file_run / "last.pt", weights_only=True)["model"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != "model.safetensors.index.json")
    count = len(files)
    assert count > 1 and f"wrote {count + 1} files in {out}" in printed
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert index["weight_map"].keys() == weights.keys() and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert index["metadata"]["format"] == "pt"
    loaded = {}
    for name in files:
        shard = safetensors_torch.load_file(out / name)
        assert {key for key, file in index["weight_map"].items() if file == name} == shard.keys()
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= 600 or len(shard) == 1
        loaded.update(shard)
    assert_bitwise(loaded, weights)


def test_a_one_process_sharded_checkpoint_round_trips_last_and_best(tmp_path, capsys):
    """last.ckpt and best.ckpt (DCP directories) of a 1-process run export to the run's final and best weights,
    bit for bit, with the config's hash in the header as a .pt's has it."""
    run = tmp_path / "run"
    trainer = TinyTrainer(make_cfg(run, epochs=2, ckpt={"format": "sharded"}))
    trainer.train()
    expected = {"last": trainer.model.state_dict(), "best": whole_best(trainer)}
    engine = torch.load(run / "last.ckpt" / "trainkit.pt", weights_only=True)
    for kind in ("last", "best"):
        out = tmp_path / f"{kind}.safetensors"
        code, _, errors = export(capsys, run / f"{kind}.ckpt", out, "--format", "safetensors")
        assert code == 0, errors
        assert_bitwise(safetensors_torch.load_file(out), expected[kind])
        from safetensors import safe_open

        with safe_open(str(out), framework="pt") as handle:
            assert handle.metadata()["config_sha256"] == config_sha256(engine["config"])


class TiedNet(nn.Module):
    """An embedding whose weight is also the output head's (as examples/gpt.py ties them), and a parameter that is
    a transposed view (non-contiguous)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4, bias=False)
        self.head.weight = self.emb.weight
        self.mix = nn.Parameter(torch.randn(3, 4).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head(torch.tanh(self.body(x))) @ self.mix).mean(-1, keepdim=True)


class TiedTrainer(TinyTrainer):
    """TinyTrainer's task and loop with :class:`TiedNet` as its model."""

    def setup(self, ckpt):
        x, y = make_data(self.cfg.n_samples)
        self.train_set = TensorDataset(x[:192], y[:192])
        self.val_x, self.val_y, self.test_x, self.test_y = x[192:256], y[192:256], x[256:], y[256:]
        torch.manual_seed(self.cfg.seed)
        self.model = self.make_ddp(TiedNet())
        self.optimizer = self.make_optimizer()
        self.sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=self.cfg.seed)
        self.loader = DataLoader(self.train_set, batch_size=self.cfg.batch_size, sampler=self.sampler)
        self.add_samplers(self.sampler)
        self.add_checkpoint_items(model=self.model, optimizer=self.optimizer)
        self.epochs_trained, self.epochs_validated = [], []


def test_a_tied_head_is_written_once_and_a_transposed_parameter_as_it_reads(tmp_path, capsys):
    """The checkpoint holds emb.weight and head.weight in one storage and mix as a transposed view: the file holds
    emb.weight once (head.weight recorded in the header as its alias, as safetensors' save_model records one) and
    mix with its values in row order; safetensors' load_model puts every weight back into a fresh tied model, bit
    for bit."""
    run = tmp_path / "run"
    TiedTrainer(make_cfg(run, epochs=2)).train()
    weights = torch.load(run / "last.pt", weights_only=True)["model"]
    assert weights["head.weight"].untyped_storage().data_ptr() == weights["emb.weight"].untyped_storage().data_ptr()
    assert not weights["mix"].is_contiguous()  # else the test proves nothing
    out = tmp_path / "tied.safetensors"
    code, printed, errors = export(capsys, run / "last.pt", out, "--format", "safetensors")
    assert code == 0 and "(tied, written once: head.weight = emb.weight)" in printed, errors
    written = safetensors_torch.load_file(out)
    assert "head.weight" not in written and torch.equal(written["mix"], weights["mix"])
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["head.weight"] == "emb.weight"
    fresh = TiedNet()
    safetensors_torch.load_model(fresh, out)
    assert fresh.head.weight is fresh.emb.weight
    assert_bitwise(fresh.state_dict(), weights)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_a_two_rank_fsdp2_sharded_checkpoint_exports_in_shards(tmp_path, capsys):
    """last.ckpt written by 2 FSDP2 gloo ranks, exported in one process as shards of at most 2KB: together they
    hold the weights the ranks held at the end, bit for bit, and a bare module loads them."""
    run = tmp_path / "run"
    cfg = make_cfg(run, epochs=2, dist={"timeout_s": 60}, wrap="fsdp", ckpt={"format": "sharded"})
    trainkit.spawn(ShardTrainer, cfg, 2)
    final = torch.load(run / "report2.pt")["weights"]
    out = tmp_path / "export"
    code, _, errors = export(capsys, run / "last.ckpt", out, "--format", "safetensors", "--max-shard-size", "2KB")
    assert code == 0, errors
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(safetensors_torch.load_file(out / name))
    assert len(set(index["weight_map"].values())) >= 2
    assert_bitwise(loaded, final)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    net.load_state_dict(loaded)


def test_without_safetensors_one_line_names_the_package_and_writes_nothing(file_run, tmp_path, monkeypatch, capsys):
    """safetensors not importable: exit status 2 and one line saying how to install it; nothing written."""
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "model.safetensors"
    code, printed, errors = export(capsys, file_run / "last.pt", out, "--format", "safetensors")
    assert (code, printed) == (2, "")
    assert errors == "error: safetensors is not installed: pip install 'trainkit[safetensors]'\n"
    assert not out.exists()
    assert export(capsys, file_run / "last.pt", tmp_path / "plain.pt")[0] == 0  # the torch format needs none


def test_a_planted_checkpoint_that_runs_code_is_refused_before_anything_is_written(tmp_path, capsys):
    """A last.pt whose pickle runs a shell command when torch.load reads it unrestricted: the export refuses it,
    the command never runs, and OUT (a file or a folder) does not exist after."""
    marker = tmp_path / "MARKER"
    planted = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.ones(2)}, "loop": Reduces(os.system, f"touch {marker}")}, planted)
    proof = subprocess.run(
        [sys.executable, "-c", f"import torch; torch.load({str(planted)!r}, weights_only=False)"], check=False
    )
    assert proof.returncode == 0 and marker.exists(), "the planted file does not run code: the test proves nothing"
    marker.unlink()
    for out in (tmp_path / "out.safetensors", tmp_path / "out"):
        code, _, errors = export(capsys, planted, out, "--format", "safetensors")
        assert code == 2 and "posix.system" in errors
        assert not out.exists() and not marker.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_the_file_loads_where_transformers_is_absent(file_run, tmp_path, capsys):
    """transformers is not installed; a fresh interpreter with plain safetensors (and no trainkit) loads the file
    and its header."""
    assert importlib.util.find_spec("transformers") is None
    out = tmp_path / "model.safetensors"
    assert export(capsys, file_run / "last.pt", out, "--format", "safetensors")[0] == 0
    script = (
        "import sys\nfrom safetensors.torch import load_file\nfrom safetensors import safe_open\n"
        f"w = load_file({str(out)!r})\n"
        f"h = safe_open({str(out)!r}, framework='pt').metadata()\n"
        "assert 'transformers' not in sys.modules and 'trainkit' not in sys.modules\n"
        "print(sorted(w), h['format'])\n"
    )
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert shown.stdout.strip() == "['0.bias', '0.weight', '3.bias', '3.weight'] pt"


def test_out_is_never_lost_unless_it_is_an_earlier_export_and_overwrite_says_so(file_run, tmp_path, capsys):
    """An existing file or non-empty folder is refused (named, with the fix); --overwrite replaces a file (a link
    itself, not what it points to), or a folder of an earlier export's files, but never a folder holding anything
    else; an empty folder is filled."""
    last = file_run / "last.pt"
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"keep me")
    code, _, errors = export(capsys, last, target, "--format", "safetensors")
    assert code == 2 and "exists; pass --overwrite" in errors and target.read_bytes() == b"keep me"
    assert export(capsys, last, target, "--format", "safetensors", "--overwrite")[0] == 0
    assert safetensors_torch.load_file(target).keys() == {"0.weight", "0.bias", "3.weight", "3.bias"}
    outside, link = tmp_path / "outside.txt", tmp_path / "link.safetensors"
    outside.write_text("not yours")
    link.symlink_to(outside)
    assert export(capsys, last, link, "--format", "safetensors", "--overwrite")[0] == 0
    assert outside.read_text() == "not yours" and not link.is_symlink()  # the link replaced, never written through

    folder = tmp_path / "folder"
    folder.mkdir()
    assert export(capsys, last, folder, "--format", "safetensors", "--max-shard-size", "600B")[0] == 0
    code, _, errors = export(capsys, last, folder, "--format", "safetensors")
    assert code == 2 and "is not an empty folder" in errors
    assert export(capsys, last, folder, "--format", "safetensors", "--overwrite")[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]  # the shards of before are gone
    (folder / "notes.txt").write_text("mine")
    code, _, errors = export(capsys, last, folder, "--format", "safetensors", "--overwrite")
    assert code == 2 and "notes.txt" in errors and (folder / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_bad_options_are_refused_naming_the_option_the_rule_and_the_value(file_run, tmp_path, capsys):
    """A size that is none, a single file over its limit, and safetensors options with --format torch."""
    last = file_run / "last.pt"
    code, _, errors = export(capsys, last, tmp_path / "o", "--format", "safetensors", "--max-shard-size", "5 parsecs")
    assert code == 2 and "--max-shard-size must be a size of at least 1 byte" in errors and "'5 parsecs'" in errors
    one_file = tmp_path / "o.safetensors"
    code, _, errors = export(capsys, last, one_file, "--format", "safetensors", "--max-shard-size", "1KB")
    assert code == 2 and "when OUT" in errors and "is one file, got 1000; name a folder" in errors
    code, _, errors = export(capsys, last, tmp_path / "o.pt", "--max-shard-size", "1KB")
    assert code == 2 and "--max-shard-size goes with --format safetensors" in errors
    assert list(tmp_path.iterdir()) == []


@given(st.integers(1, 10**6), st.sampled_from(["", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "gb"]))
def test_parse_size_reads_every_unit(number, unit):
    """A whole number and a unit (any case) is that many bytes: decimal units as the hub's, binary ones as 2**10n."""
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    assert parse_size(f"{number}{unit}") == number * scale[unit.upper()]


@pytest.mark.parametrize("text", ["", "0", "0.1B", "-5GB", "5XB", "GB", "1e9"])
def test_parse_size_refuses_what_is_no_size(text):
    with pytest.raises(ConfigError, match=r"--max-shard-size must be a size of at least 1 byte"):
        parse_size(text)


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 120))
def test_plan_shards_follows_the_hub(sizes, limit):
    """Every tensor in exactly one file, each file's in the tensors' order; a shard over the limit holds one tensor;
    one shard is model.safetensors, more are model-NNNNN-of-NNNNN.safetensors."""
    named = {f"t{i}": size for i, size in enumerate(sizes)}
    plan = plan_shards(named, limit)
    assert sorted(name for names in plan.values() for name in names) == sorted(named)
    for names in plan.values():
        assert names == sorted(names, key=lambda name: int(name[1:]))
    if len(plan) == 1:
        assert list(plan) == ["model.safetensors"]
        return
    count = len(plan)
    assert list(plan) == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for names in plan.values():
        assert sum(named[n] for n in names) <= limit or len(names) == 1


def test_export_names_drop_wrappers_and_keep_a_submodule_named_module():
    """DDP's module. (at the top or deeper) and compile's _orig_mod. go; a 'module' beside siblings stays; two
    names that would become one are an error."""
    assert export_names(["_orig_mod.module.w", "_orig_mod.module.b"]) == {
        "_orig_mod.module.w": "w",
        "_orig_mod.module.b": "b",
    }
    assert export_names(["a.module.w", "module.x"]) == {"a.module.w": "a.w", "module.x": "module.x"}
    from trainkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="would both be exported as 'w'"):
        export_names(["w", "_orig_mod.w"])


@st.composite
def tangled_tensors(draw) -> dict[str, torch.Tensor]:
    """Tensors as checkpoints hold them: whole ones, second names for them (tied), transposes, slices and reshapes
    of them (views sharing their memory), in any order."""
    bases = [torch.arange(draw(st.integers(1, 4)) * 6, dtype=torch.float32) * (i + 1) for i in range(3)]
    kinds = st.sampled_from(["whole", "tied", "transposed", "slice", "reshaped"])
    tensors = {}
    for index, kind in enumerate(draw(st.lists(kinds, min_size=1, max_size=8))):
        base = bases[draw(st.integers(0, 2))]
        tensors[f"t{index}"] = {
            "whole": base,
            "tied": base,
            "transposed": base.view(-1, 2).t(),
            "slice": base[2:5],
            "reshaped": base.view(-1, 3),
        }[kind]
    return tensors


@given(tangled_tensors())
def test_unique_storages_gives_safetensors_what_it_takes_with_every_value_kept(tensors):
    """Whatever shares memory how: safetensors saves the result, every kept name loads its own values back, and
    every dropped name is a second name of the very tensor a kept name holds."""
    from trainkit.checkpoint.export.safetensors_files import unique_storages

    kept, aliases = unique_storages(tensors)
    assert kept.keys() | aliases.keys() == tensors.keys() and not kept.keys() & aliases.keys()
    loaded = safetensors_torch.load(safetensors_torch.save(kept))
    assert_bitwise(loaded, {name: tensors[name] for name in kept})
    for alias, name in aliases.items():
        assert name in kept and tensors[alias].data_ptr() == tensors[name].data_ptr()
        assert tensors[alias].shape == tensors[name].shape and tensors[alias].stride() == tensors[name].stride()
