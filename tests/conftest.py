"""Suite-wide settings: one torch thread per test process.

The suite runs one pytest worker per core (``-n auto``), and the training processes the tests start run
with ``OMP_NUM_THREADS=1``; a worker that also used every core for its own tensors would only contend
with them, and with one thread it computes what those processes compute.
"""

import torch

torch.set_num_threads(1)
