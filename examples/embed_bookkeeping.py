"""Use trainkit's pure bookkeeping inside a hand-written loop, with no BaseTrainer.

The records are immutable and the functions pure, so they drop into any loop (here a plain PyTorch
one) and survive a restart as plain dicts: ``to_dict()`` into the checkpoint, ``from_dict()`` back.

    python examples/embed_bookkeeping.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from trainkit.bookkeeping import BestState, PatienceState, save_if_best, should_validate, step_patience


def make_data() -> tuple[torch.Tensor, ...]:
    """A fixed regression problem with a train and a val split."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3 * torch.randn(400, 1, generator=gen)
    return x[:300], y[:300], x[300:], y[300:]


def run(out_dir: Path, epochs: int = 40, stop_after: int | None = None) -> dict:
    """Train, validating every 2 epochs; resume from ``out_dir/state.json`` when it exists.

    :param out_dir: Where the bookkeeping state and the best weights are kept.
    :param epochs: The number of epochs.
    :param stop_after: Simulate a crash after this many epochs (to show the resume).
    :returns: The final bookkeeping as plain dicts.
    """
    torch.manual_seed(0)
    x_train, y_train, x_val, y_val = make_data()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    best, patience, start = BestState(minimize=True, min_delta=1e-4), PatienceState(patience=3), 0

    out_dir.mkdir(parents=True, exist_ok=True)
    state_file, weights_file = out_dir / "state.json", out_dir / "weights.pt"
    if state_file.exists():  # resume: records come back from plain dicts, weights from their own file
        saved = json.loads(state_file.read_text())
        best, patience = BestState.from_dict(saved["best"]), PatienceState.from_dict(saved["patience"])
        start = saved["next_epoch"]
        weights = torch.load(weights_file, weights_only=True)
        model.load_state_dict(weights["model"])
        optimizer.load_state_dict(weights["optimizer"])
        print(f"resumed at epoch {start}: best {best.score} at epoch {best.epoch}, {patience.remaining} misses left")

    stopped = False
    for epoch in range(start, epochs):
        loss = nn.functional.mse_loss(model(x_train), y_train)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if should_validate(epoch, epochs, every_n_epochs=2):
            with torch.no_grad():
                val_loss = nn.functional.mse_loss(model(x_val), y_val).item()
            best, improved = save_if_best(best, val_loss, epoch=epoch, metrics={"val/loss": val_loss})
            patience, stopped = step_patience(patience, improved, epoch=epoch)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, weights_file)
        record = {"best": best.to_dict(), "patience": patience.to_dict(), "next_epoch": epoch + 1}
        state_file.write_text(json.dumps(record))
        if stopped or (stop_after is not None and epoch + 1 >= stop_after):
            break
    status = "stopped early" if stopped else "done" if epoch + 1 >= epochs else f"paused after epoch {epoch}"
    print(f"{status}: best val loss {best.score:.4f} at epoch {best.epoch}")
    return {"best": best.to_dict(), "patience": patience.to_dict(), "stopped_early": stopped}


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/embed")
    run(out, stop_after=10)  # a "crash" after 10 epochs...
    run(out)  # ...and the resume, which continues from the saved records
