"""Running on several processes: collectives with timeouts, FSDP2 sharding, and starting the ranks.

Owns: the process group and trainkit's collectives, every one bounded by ``dist.timeout_s``
(:mod:`~trainkit.distributed.collectives`), FSDP2's ``fully_shard`` and DTensor helpers
(:mod:`~trainkit.distributed.fsdp`), and ``launch``/``spawn``/``fork_server``
(:mod:`~trainkit.distributed.launch`).
"""
