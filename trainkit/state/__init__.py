"""Module and RNG state in and out of checkpoints.

Owns: a module's state dict with names free of ``torch.compile``'s wrapper and its training flags
(:mod:`~trainkit.state.modules`), and every random generator of a process: seeding, capture, restore, and the
sample-keyed generators (:mod:`~trainkit.state.rng`), and the digest that tells whether the ranks hold the same
state of a registered item (:mod:`~trainkit.state.digest`).
"""
