"""Files trainkit reads as hostile input, and files it writes durably.

Owns: bounded reads of regular files that never block or follow a link (:mod:`~trainkit.files.bounded_read`),
the opcode pre-scan of a pickle (:mod:`~trainkit.files.pickle_scan`), the zip structure of a ``.pt`` file
(:mod:`~trainkit.files.zip_check`), what a checkpoint may hold (:mod:`~trainkit.files.allowlist`), loading it with
``weights_only=True`` and checked builders (:mod:`~trainkit.files.weights_only_load`), atomic, fsynced writes and
links (:mod:`~trainkit.files.durable`), and a file's CRC-32 (:mod:`~trainkit.files.checksum`). Knows nothing of
runs, ranks or the trainer; imports only the standard library, torch and trainkit's errors and messages.
"""
