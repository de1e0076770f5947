"""The training loop's parts: batches and position, signals, progress bars, metrics, throughput, guard, rollback.

Owns: the epoch's batches counted and skipped into (:mod:`~trainkit.loop.tracked_batches`) and where the epoch stands
(:mod:`~trainkit.loop.epoch_tracker`), stop signals (:mod:`~trainkit.loop.stop_signals`), progress bars
(:mod:`~trainkit.loop.progress`, the only module that imports tqdm), the metrics between pushes
(:mod:`~trainkit.loop.trainer_metrics`), ``perf/*`` (:mod:`~trainkit.loop.throughput`), the divergence guard and its
rollback (:mod:`~trainkit.loop.divergence_guard`, :mod:`~trainkit.loop.rollback`), the best-weights snapshot
(:mod:`~trainkit.loop.weight_snapshot`) and optimizer helpers (:mod:`~trainkit.loop.optim`). Each part is given what it
acts on (other parts, callables, plain values), never the trainer.
"""
