"""The training loop's parts: batches and position, signals, progress bars, metrics, throughput, guard, rollback.

Owns: the epoch's batches counted and skipped into (:mod:`~trainkit.loop.batches`) and where the epoch stands
(:mod:`~trainkit.loop.position`), stop signals (:mod:`~trainkit.loop.signals`), progress bars
(:mod:`~trainkit.loop.progress`, the only module that imports tqdm), the metrics between pushes
(:mod:`~trainkit.loop.metrics`), ``perf/*`` (:mod:`~trainkit.loop.throughput`), the divergence guard and its
rollback (:mod:`~trainkit.loop.guard`, :mod:`~trainkit.loop.rollback`), the best-weights snapshot
(:mod:`~trainkit.loop.snapshot`) and optimizer helpers (:mod:`~trainkit.loop.optim`). Each part is given what it
acts on (other parts, callables, plain values), never the trainer.
"""
