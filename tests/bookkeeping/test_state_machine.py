"""Stateful property test of the bookkeeping core against a plain-list model.

A hypothesis state machine runs one training loop's bookkeeping on two tracks fed the same score stream:
the *reference* track is never interrupted, the *resumed* track is saved to a JSON checkpoint and rebuilt
with ``from_dict`` / ``apply_payload`` at random points. After every step both tracks must equal each other
and a model computed from the plain list of scores seen so far.
"""

from __future__ import annotations

import json
import math

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trainkit.bookkeeping import (
    STOP_EARLY,
    STOP_MAX_EPOCHS,
    BestState,
    CkptRegistry,
    LoopState,
    PatienceState,
    apply_payload,
    collect_payload,
    end_epoch,
    register_items,
    save_if_best,
    step_patience,
)

NAN = float("nan")
INF = float("inf")

# Quarters are exact in binary, so a stream over them is full of ties and exact min_delta steps.
QUARTERS = st.integers(min_value=-8, max_value=8).map(lambda k: k / 4)
SPECIALS = st.sampled_from([NAN, INF, -INF, 0.0, -0.0])
SCORES = st.one_of(QUARTERS, SPECIALS, st.floats(min_value=-1e6, max_value=1e6))
AUX_METRICS = st.sampled_from([0.5, -0.0, NAN, INF, -INF])
MIN_DELTAS = st.one_of(st.just(0.0), st.sampled_from([0.25, 0.5]), st.floats(min_value=0.0, max_value=1.0))


def same_float(a: float | None, b: float | None) -> bool:
    """Equality that counts NaN as equal to NaN (JSON round trips make new NaN objects)."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def same_metrics(a, b) -> bool:
    return set(a) == set(b) and all(same_float(a[key], b[key]) for key in a)


def same_best(a: BestState, b: BestState) -> bool:
    plain = ("minimize", "min_delta", "score", "epoch")
    return all(getattr(a, name) == getattr(b, name) for name in plain) and same_metrics(a.metrics, b.metrics)


class Counter:
    """A stateful checkpoint item, like a model or an optimizer: it round-trips through state_dicts."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


@attrs.define
class Track:
    """One run's bookkeeping: the records, the registry, and the epoch at which the loop stopped."""

    best: BestState
    patience: PatienceState
    loop: LoopState
    registry: CkptRegistry
    stop_epoch: int | None = None

    @property
    def counter(self) -> Counter:
        return self.registry.items["validations"]


@settings(stateful_step_count=50, deadline=None)
class BookkeepingMachine(RuleBasedStateMachine):
    """Drives BestState, PatienceState, LoopState and CkptRegistry with random score streams."""

    @initialize(
        minimize=st.booleans(),
        min_delta=MIN_DELTAS,
        patience=st.sampled_from([None, 1, 2, 3, 4, 5]),
        start_patience=st.integers(min_value=0, max_value=4),
        epochs=st.integers(min_value=1, max_value=30),
        tag=st.sampled_from(["run-a", "", "ü"]),
    )
    def start(self, minimize, min_delta, patience, start_patience, epochs, tag):
        self.minimize = minimize
        self.min_delta = min_delta
        self.patience = patience
        self.start_patience = start_patience
        self.epochs = epochs
        self.tag = tag
        self.reference = self._new_track()
        self.resumed = self._new_track()
        self.epoch = 0  # epochs run so far, including those after the loop stopped
        self.steps = 0  # optimizer steps taken while the loop ran
        self.history: list[tuple[int, float, dict[str, float]]] = []  # (epoch, score, expected best metrics)

    def _new_track(self) -> Track:
        registry, _ = register_items(CkptRegistry(), {"validations": Counter(), "tag": self.tag})
        return Track(
            best=BestState(minimize=self.minimize, min_delta=self.min_delta),
            patience=PatienceState(patience=self.patience, start_patience=self.start_patience),
            loop=LoopState(),
            registry=registry,
        )

    # ----- the plain-list model -------------------------------------------------------------------

    def model_improvements(self) -> list[bool]:
        """Replay the stream with the strict rule: finite, and no best yet or beyond best by more than min_delta."""
        best = None
        flags = []
        for _, score, _ in self.history:
            if self.minimize:
                improved = math.isfinite(score) and (best is None or score < best - self.min_delta)
            else:
                improved = math.isfinite(score) and (best is None or score > best + self.min_delta)
            if improved:
                best = score
            flags.append(improved)
        return flags

    def model_best(self) -> tuple[float, int, dict[str, float]] | None:
        flags = self.model_improvements()
        improving = [entry for entry, improved in zip(self.history, flags) if improved]
        if not improving:
            return None
        epoch, score, metrics = improving[-1]
        return score, epoch, metrics

    def model_remaining_after_each(self) -> list[int | None]:
        """Patience minus the counted misses (at epochs >= start_patience) since the last improvement, >= 0."""
        remaining = []
        trailing: list[int] = []  # epochs of the misses since the last improvement
        for (epoch, _, _), improved in zip(self.history, self.model_improvements()):
            trailing = [] if improved else trailing + [epoch]
            counted = [e for e in trailing if e >= self.start_patience]
            remaining.append(None if self.patience is None else max(0, self.patience - len(counted)))
        return remaining

    def model_remaining(self) -> int | None:
        return self.model_remaining_after_each()[-1] if self.history else self.patience

    def model_stop(self) -> tuple[int, str] | None:
        """The epoch at which the loop stops and why: the first exhausted patience, else the last epoch."""
        for (epoch, _, _), remaining in zip(self.history, self.model_remaining_after_each()):
            if epoch < self.epochs and remaining == 0:
                return epoch, STOP_EARLY
        if self.epoch >= self.epochs:
            return self.epochs - 1, STOP_MAX_EPOCHS
        return None

    # ----- rules ----------------------------------------------------------------------------------

    def _run_epoch(self, score: float | None, aux: float, with_metrics: bool, steps: int) -> None:
        epoch = self.epoch
        loop_running = not self.reference.loop.finished
        if score is not None:
            metrics = {"val/score": score, "aux": aux} if with_metrics else None
            expected = {"best/val/score": score, "best/val/aux": aux} if with_metrics else {}
            self.history.append((epoch, score, expected))
        for track in (self.reference, self.resumed):
            stop = False
            if score is not None:
                track.best, improved = save_if_best(track.best, score, epoch=epoch, metrics=metrics)
                track.patience, stop = step_patience(track.patience, improved, epoch=epoch)
                track.counter.n += 1
                assert stop == (self.model_remaining() == 0)
            if not track.loop.finished:
                track.loop, more = end_epoch(track.loop, epochs=self.epochs, early_stop=stop, step=self.steps + steps)
                if not more:
                    track.stop_epoch = epoch
        if loop_running:
            self.steps += steps
        self.epoch += 1

    @rule(score=SCORES, aux=AUX_METRICS, with_metrics=st.booleans(), steps=st.integers(min_value=0, max_value=3))
    def validate(self, score, aux, with_metrics, steps):
        """An epoch that ends with a validation scoring ``score``."""
        self._run_epoch(score, aux, with_metrics, steps)

    @rule(offset=st.sampled_from([-2, -1, 0, 1, 2]), aux=AUX_METRICS, steps=st.integers(min_value=0, max_value=3))
    def validate_near_best(self, offset, aux, steps):
        """A validation scoring exactly the best, or the best moved by one or two min_deltas either way."""
        best = self.reference.best.score
        score = (0.0 if best is None else best) + offset * self.min_delta
        self._run_epoch(score, aux, True, steps)

    @rule(steps=st.integers(min_value=0, max_value=3))
    def train_only(self, steps):
        """An epoch without validation: patience and the best are untouched, the loop moves on."""
        self._run_epoch(None, 0.0, False, steps)

    @rule()
    def save_and_resume(self):
        """Write the resumed track to a JSON checkpoint and rebuild it from there, as a restarted run does."""
        track = self.resumed
        checkpoint = {
            "best": track.best.to_dict(),
            "patience": track.patience.to_dict(),
            "loop": track.loop.to_dict(),
            **collect_payload(track.registry),
        }
        loaded = json.loads(json.dumps(checkpoint))
        fresh, _ = register_items(CkptRegistry(), {"validations": Counter(), "tag": "stale"})
        registry, restored = apply_payload(fresh, loaded, strict=True)
        assert restored == ("validations", "tag")
        rebuilt = Track(
            best=BestState.from_dict(loaded["best"]),
            patience=PatienceState.from_dict(loaded["patience"]),
            loop=LoopState.from_dict(loaded["loop"]),
            registry=registry,
            stop_epoch=track.stop_epoch,
        )
        assert same_best(rebuilt.best, track.best)
        assert rebuilt.patience == track.patience
        assert rebuilt.loop == track.loop
        assert rebuilt.counter.n == track.counter.n
        assert rebuilt.registry.items["tag"] == self.tag
        self.resumed = rebuilt

    # ----- invariants -----------------------------------------------------------------------------

    @invariant()
    def best_matches_model(self):
        """The best score, its epoch and its best/val/ metrics are those of the model's last improvement."""
        expected = self.model_best()
        for track in (self.reference, self.resumed):
            if expected is None:
                assert track.best.score is None and track.best.epoch is None
                assert dict(track.best.metrics) == {}
            else:
                score, epoch, metrics = expected
                assert track.best.score == score
                assert track.best.epoch == epoch
                assert same_metrics(track.best.metrics, metrics)

    @invariant()
    def best_is_the_extremum_without_min_delta(self):
        """With min_delta 0 the best is the extremum of the finite scores, first reached."""
        finite = [(score, epoch) for epoch, score, _ in self.history if math.isfinite(score)]
        if self.min_delta != 0 or not finite:
            return
        extremum = min(score for score, _ in finite) if self.minimize else max(score for score, _ in finite)
        first_epoch = next(epoch for score, epoch in finite if score == extremum)
        assert self.reference.best.score == extremum
        assert self.reference.best.epoch == first_epoch

    @invariant()
    def patience_matches_model(self):
        """remaining is patience minus the trailing counted misses, floored at 0; exhausted iff it is 0."""
        remaining = self.model_remaining()
        for track in (self.reference, self.resumed):
            assert track.patience.remaining == remaining
            assert track.patience.exhausted == (remaining == 0)
            if remaining is not None:
                assert 0 <= remaining <= self.patience

    @invariant()
    def loop_matches_model(self):
        """The loop stops at the first exhausted patience, else after the last epoch, with the steps taken."""
        stop = self.model_stop()
        for track in (self.reference, self.resumed):
            if stop is None:
                assert track.loop == LoopState(epoch=self.epoch, step=self.steps)
                assert track.stop_epoch is None
            else:
                epoch, reason = stop
                assert track.loop == LoopState(epoch=epoch + 1, step=self.steps, stop_reason=reason)
                assert track.stop_epoch == epoch

    @invariant()
    def resumed_equals_uninterrupted(self):
        """Resuming from JSON checkpoints at any points leaves every record as in the uninterrupted run."""
        ref, res = self.reference, self.resumed
        assert same_best(ref.best, res.best)
        assert ref.patience == res.patience
        assert ref.loop == res.loop
        assert ref.stop_epoch == res.stop_epoch
        assert ref.counter.n == res.counter.n == len(self.history)


TestBookkeeping = BookkeepingMachine.TestCase
