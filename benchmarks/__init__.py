"""trainkit's benchmarks: what trainkit costs next to hand-written PyTorch loops (and Lightning), and its gates.

Run each from the repository root as a module, so that the ``trainkit`` it measures is this checkout's::

    python -m benchmarks.overhead --quick
    python -m benchmarks.step_resume --quick
    python -m benchmarks.sharded_save --quick
    python -m benchmarks.async_save --mb 16
    python -m benchmarks.gpu_check --cpu-smoke

What several of them share is in :mod:`benchmarks.common`, the verdict rule in :mod:`benchmarks.confidence`;
``benchmarks/README.md`` says what each measures and what its gates mean.
"""
