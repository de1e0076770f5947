"""The likely causes certify names when two runs diverge (:data:`CAUSES`), and how it picks them
(:func:`likely_causes`).

Pure: the evidence (what the attempts found, whether two straight runs agree, a value seen to differ after a resume)
is gathered by :mod:`trainkit.certification.diagnosis`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["CAUSES", "Cause", "likely_causes"]


CAUSES: dict[str, tuple[str, str]] = {
    "unregistered": (
        "an optimizer, LR scheduler, torch.Generator or module the trainer holds but never registered: a resume "
        "starts it afresh",
        "register it in setup(): self.add_checkpoint_items(NAME=self.NAME)",
    ),
    "uncaptured_rng": (
        "randomness from a generator trainkit does not capture (a random.Random or numpy Generator of the trainer's "
        "or its dataset's own): a resume draws from its start again",
        "draw from the global generators trainkit captures (random, np.random, torch), from "
        "trainkit.sample_generator(seed, index) per sample, or from a torch.Generator registered with "
        "add_checkpoint_items()",
    ),
    "loader_outside_progress": (
        "a DataLoader iterated in train_epoch() without self.progress(): a resume inside the epoch restarts it "
        "from its first batch",
        "iterate the epoch's loader through self.progress(loader); draw from a second loader by index, or give it "
        "state_dict()/load_state_dict() and register it",
    ),
    "nondeterministic": (
        "a non-deterministic op: two straight runs differ from each other, so no resume can match",
        "call torch.use_deterministic_algorithms(True) (and on CUDA set CUBLAS_WORKSPACE_CONFIG=:4096:8) to find "
        "the op; avoid atomics-based kernels (index_add_, scatter_add_ on CUDA) or randomness from time or os.urandom",
    ),
    "local_state": (
        "state held across batches in a local variable of train_epoch(): a resume inside the epoch starts it afresh "
        "(a resume at an epoch's end does not)",
        "keep it in a registered item (trainkit.RunningMean, or an object with state_dict()/load_state_dict()), "
        "or on an attribute registered with add_checkpoint_items()",
    ),
    "unregistered_value": (
        "a value the trainer or its data keeps (a counter, a generator's state) that no checkpoint restores: right "
        "after a resume it differs from the straight run's",
        "keep it in a registered item (an object with state_dict()/load_state_dict() passed to "
        "add_checkpoint_items(), trainkit.RunningMean); a dataset's: save it in the dataset's state_dict() and put it "
        "back in load_state_dict() (a StatefulDataLoader saves and loads a dataset's state with its own)",
    ),
    "loader_state_incomplete": (
        "the state of a loader that carries its own position (state_dict()/load_state_dict(), e.g. a "
        "StatefulDataLoader) does not restore a value its dataset or sampler holds: right after a resume it differs "
        "from the straight run's",
        "save the value in the dataset's state_dict() and put it back in load_state_dict() (a torch.Generator: "
        "get_state() and set_state(), not a new generator); a StatefulDataLoader saves a dataset's state only when the "
        "dataset has both methods, and otherwise replays the epoch from the dataset as a resume made it",
    ),
    "unknown": (
        "none of the documented causes was detected",
        "compare the two kept run folders (python -m trainkit inspect FOLDER/checkpoints/step-N.pt) at the step "
        "named above",
    ),
}
"""The likely causes certify names, by key: what goes wrong, and the fix."""


@attrs.frozen(kw_only=True)
class Cause:
    """A likely cause of a divergence (:data:`~trainkit.certification.causes.CAUSES`).

    :ivar key: Its key in :data:`~trainkit.certification.causes.CAUSES`.
    :ivar found: What was found: attribute names with their kinds, or a loader's name; empty for a hint.
    """

    key: str = attrs.field(validator=attrs.validators.in_(tuple(CAUSES)))
    found: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def what(self) -> str:
        """What goes wrong."""
        return CAUSES[self.key][0]

    @property
    def fix(self) -> str:
        """How to fix it."""
        return CAUSES[self.key][1]


_RNG_KINDS = ("random.Random", "numpy.random.Generator", "numpy.random.RandomState")


def likely_causes(
    unregistered: Sequence[tuple[str, str]],
    loaders_outside: Sequence[str],
    *,
    straight_runs_agree: bool | None,
    resumed_mid_epoch: bool,
    batches_after_resume: str | None = None,
    lost: tuple[str, str] | None = None,
) -> tuple[Cause, ...]:
    """Name the likely causes of a divergence, most certain first.

    Pure. A value seen to differ right after a resume comes first (``lost``: a counter or a generator's state no
    checkpoint restored, under a loader that carries its own position or not); then what the attempts found
    (unregistered objects, generators of their own, loaders outside ``progress()``); then two straight runs that differ
    name a non-deterministic op; then training batches that differ right after a resume name randomness from a generator
    trainkit does not capture (one no attribute scan reaches: a module's global ``random.Random``, say); then a
    divergence right after a resume inside an epoch names state held in a local variable; else ``unknown``.

    :param unregistered: ``(attribute, kind)`` pairs from :func:`trainkit.certification.child.unregistered_objects`.
    :param loaders_outside: Names of loaders iterated in ``train_epoch()`` without ``progress()``.
    :param straight_runs_agree: Whether a second straight run matched the first (None: not run).
    :param resumed_mid_epoch: Whether the resume before the first diverging checkpoint was inside an epoch.
    :param batches_after_resume: How the batches a resumed attempt trained on first differ from the straight
        run's (None: they do not).
    :param lost: ``(key, what)``: the first value that differed right after a resume, its cause key
        (``unregistered_value`` or ``loader_state_incomplete``) and what was seen; None when none did.
    :returns: The causes.

    >>> found = likely_causes([("sched", "LR scheduler")], [], straight_runs_agree=None, resumed_mid_epoch=True)
    >>> [(cause.key, cause.found) for cause in found]
    [('unregistered', ('sched (LR scheduler)',))]
    >>> likely_causes([], [], straight_runs_agree=True, resumed_mid_epoch=True)[0].key
    'local_state'
    >>> seen = "data.seen: 8 in the straight run, 2 after the resume from step 5 (at step 6)"
    >>> [c.key for c in likely_causes([], [], straight_runs_agree=None, resumed_mid_epoch=True,
    ...                               lost=("unregistered_value", seen))]
    ['unregistered_value']
    """
    causes = [] if lost is None else [Cause(key=lost[0], found=[lost[1]])]
    objects = [f"{name} ({kind})" for name, kind in unregistered if kind not in _RNG_KINDS]
    generators = [f"{name} ({kind})" for name, kind in unregistered if kind in _RNG_KINDS]
    if objects:
        causes.append(Cause(key="unregistered", found=objects))
    if generators:
        causes.append(Cause(key="uncaptured_rng", found=generators))
    if loaders_outside:
        causes.append(Cause(key="loader_outside_progress", found=loaders_outside))
    if straight_runs_agree is False and lost is None:
        causes.append(Cause(key="nondeterministic"))
    elif not causes and batches_after_resume is not None:  # data drawn from a generator no scan could reach
        causes.append(Cause(key="uncaptured_rng", found=[batches_after_resume]))
    if not causes and resumed_mid_epoch:
        causes.append(Cause(key="local_state"))
    return tuple(causes) or (Cause(key="unknown"),)
