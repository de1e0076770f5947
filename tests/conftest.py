"""Suite-wide settings: one torch thread per test process, and Ctrl-C as a terminal delivers it.

The suite runs one pytest worker per core (``-n auto``), and the training processes the tests start run
with ``OMP_NUM_THREADS=1``; a worker that also used every core for its own tensors would only contend
with them, and with one thread it computes what those processes compute.

trainkit leaves a SIGINT the process inherited as ignored alone (a run started in the background by a shell).
The tests that press Ctrl-C stand for a run started from a terminal, so a suite started in the background
puts Python's own handler back: the processes it starts then get SIGINT as a terminal's would (the one test
of an ignored SIGINT ignores it on purpose).
"""

import signal

import torch

torch.set_num_threads(1)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
