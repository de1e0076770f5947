"""The rule for metric keys that are wall-clock by nature, which certify leaves out when it compares two runs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainkit.run.read_metrics import WALL_CLOCK_NAMES, is_wall_clock, without_wall_clock

segments = st.sampled_from(["train", "val", "perf", "loss", "time", "timestamp", "lr", "_runtime", "acc"])
keys = st.lists(segments, min_size=1, max_size=3).map("/".join)


@given(st.dictionaries(keys, st.floats(allow_nan=False)))
def test_only_perf_and_time_keys_are_dropped_and_the_rest_keep_their_order(row):
    """A key goes when it is under perf/ or its last segment names a time; every other key stays, in order."""
    kept = without_wall_clock(row)
    expected = [k for k in row if not (k.startswith("perf/") or k.split("/")[-1] in WALL_CLOCK_NAMES)]
    assert list(kept) == expected
    assert all(kept[k] == row[k] for k in kept)


def test_the_engines_own_rows_lose_only_their_perf_figures():
    """A row as the engine writes it (throughput on) keeps the step, epoch, losses and rates of the optimizer."""
    row = {"trainer/step": 6, "train/loss": 3.1, "lr/optimizer/decay": 0.05, "perf/samples_per_s": 6749.8}
    assert without_wall_clock(row) == {"trainer/step": 6, "train/loss": 3.1, "lr/optimizer/decay": 0.05}
    assert is_wall_clock("perf/mfu") and not is_wall_clock("val/time_to_target_steps")
