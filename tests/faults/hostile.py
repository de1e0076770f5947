"""A corpus of hostile checkpoint files, and a script that tries to resume from each of them.

Every file would run code, or build an object that is not a tensor or a plain value, if it were
unpickled without ``weights_only=True``. The code it runs only creates a sentinel file, so a test can
tell whether it ran.

Usage: ``python -m tests.faults.hostile CORPUS_DIR OUT_DIR`` tries ``trainkit.checkpoint.load_checkpoint``
and a TinyTrainer resume (``ckpt.resume=<file>``) on every ``*.pt`` in CORPUS_DIR and prints one JSON
line per file: ``{"name", "load", "resume"}``, each the type of the error raised, or ``"loaded"``.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

SENTINEL_NAME = "SENTINEL"


class Reduces:
    """An object whose unpickling calls ``func(*args)``."""

    def __init__(self, func, *args) -> None:
        self.func = func
        self.args = args

    def __reduce__(self):
        return self.func, self.args


class Unlisted:
    """A harmless class that is not on torch's allowlist."""

    def __init__(self) -> None:
        self.value = 1


def _handcrafted(path: Path, pickle_bytes: bytes) -> None:
    """Write a torch zip checkpoint whose ``data.pkl`` is ``pickle_bytes`` (valid CRCs, as torch lays it out)."""
    torch.save({"placeholder": 0}, path)
    members = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            members[info.filename] = archive.read(info)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, pickle_bytes if name.endswith("/data.pkl") else data)


def build_corpus(folder: Path, sentinel: Path, valid_payload: dict | None = None) -> dict[str, Path]:
    """Write the hostile files into ``folder``; each would create ``sentinel`` (or an unallowed object) if unpickled.

    :param folder: Where the files go.
    :param sentinel: The file that running any of their code creates.
    :param valid_payload: A real trainkit checkpoint payload to hide a hostile entry in.
    :returns: Name to path.
    """
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    touch = f"touch {sentinel}"
    objects = {
        "os_system": Reduces(os.system, touch),
        "eval": Reduces(builtins.eval, f"open({str(sentinel)!r}, 'w').close()"),
        "exec": Reduces(builtins.exec, f"import os; os.system({touch!r})"),
        "subprocess": Reduces(subprocess.call, ["touch", str(sentinel)]),
        "unlisted_class": {"model": {}, "extra": Unlisted()},
        "whole_module": torch.nn.Linear(2, 2),
        "numpy_datetime_array": {"weights": np.array(["2020-01-01"], dtype="datetime64[D]")},
        "numpy_object_array": {"weights": np.array([Reduces(os.system, touch)], dtype=object)},
    }
    if valid_payload is not None:
        hidden = dict(valid_payload)
        hidden["config"] = {**hidden["config"], "hook": Reduces(os.system, touch)}
        objects["hidden_in_real_checkpoint"] = hidden
    paths = {}
    for name, obj in objects.items():
        paths[name] = folder / f"{name}.pt"
        torch.save(obj, paths[name])
    paths["legacy_format"] = folder / "legacy_format.pt"
    torch.save(Reduces(os.system, touch), paths["legacy_format"], _use_new_zipfile_serialization=False)
    raw_pickles = {  # protocol 0 by hand: GLOBAL, MARK, STRING, TUPLE, REDUCE
        "raw_global_posix_system": f"cposix\nsystem\n(S'{touch}'\ntR.".encode(),
        "raw_builtins_import": (
            f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'{touch}'\ntR.".encode()
        ),
    }
    for name, data in raw_pickles.items():
        paths[name] = folder / f"{name}.pt"
        _handcrafted(paths[name], data)
    return paths


CODE_RUNNING = (
    "os_system",
    "eval",
    "exec",
    "subprocess",
    "numpy_object_array",
    "hidden_in_real_checkpoint",
    "legacy_format",
    "raw_global_posix_system",
    "raw_builtins_import",
)
"""The files whose unpickling runs code (the others only build objects that are not allowed)."""


def try_all(corpus: Path, out: Path) -> list[dict[str, str]]:
    """Try to load and to resume from every file in ``corpus``; report what each attempt raised."""
    from tests.helpers.configs import make_cfg
    from tests.helpers.trainers import TinyTrainer
    from trainkit.checkpoint import load_checkpoint

    results = []
    for path in sorted(corpus.glob("*.pt")):
        outcome = {"name": path.stem}
        try:
            load_checkpoint(path)
            outcome["load"] = "loaded"
        except Exception as exc:  # noqa: BLE001 - the type is what is reported
            outcome["load"] = type(exc).__name__
        try:
            TinyTrainer(make_cfg(out / path.stem, ckpt={"resume": str(path)}))
            outcome["resume"] = "loaded"
        except Exception as exc:  # noqa: BLE001
            outcome["resume"] = type(exc).__name__
        results.append(outcome)
    return results


def main() -> None:
    """Print one JSON line per corpus file with what loading and resuming it raised."""
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    for outcome in try_all(args.corpus, args.out):
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    sys.exit(main())
