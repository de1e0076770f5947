"""The run folder's own records: its lock, the ``metrics.jsonl`` journal, the W&B run, and the run log over both.

Owns: the folder lock (:mod:`~trainkit.run.lock`), the shared names of the folder (:mod:`~trainkit.run.folder`),
``metrics.jsonl`` written (:mod:`~trainkit.run.journal`) and read back (:mod:`~trainkit.run.read_metrics`), the W&B
run and its offline history (:mod:`~trainkit.run.wandb_run`, the only module that imports wandb), and the
:class:`~trainkit.run.log.RunLog` that feeds both.
"""
