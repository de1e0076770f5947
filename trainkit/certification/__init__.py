"""certify's engine: proving a trainer's resume exact, between the trainer and the command line.

``python -m trainkit certify`` and ``trainkit.certify`` (:mod:`trainkit.cli.certify`, which parses the words) call
:func:`~trainkit.certification.engine.certify_trainer`. It plans where to interrupt
(:mod:`~trainkit.certification.plan`), runs each attempt as real processes (:mod:`~trainkit.certification.attempts`,
each rank in :mod:`~trainkit.certification.child`), compares the straight and the interrupted run bit for bit
(:mod:`~trainkit.certification.comparison`), looks for the likely cause of a divergence
(:mod:`~trainkit.certification.diagnosis`, :mod:`~trainkit.certification.causes`) and gives the verdict
(:mod:`~trainkit.certification.report`). Importing this loads no torch.
"""

from trainkit.certification.attempts import EXIT_SIGTERM, CertifyError
from trainkit.certification.causes import CAUSES, Cause, likely_causes
from trainkit.certification.comparison import compare_runs
from trainkit.certification.engine import DEFAULT_EPOCHS, DEFAULT_MAX_STEPS, certify_trainer, resolve_classes
from trainkit.certification.plan import Interruption, covering_steps, minimum_steps, plan_interruptions
from trainkit.certification.report import CertifyReport

__all__ = [
    "CAUSES",
    "DEFAULT_EPOCHS",
    "DEFAULT_MAX_STEPS",
    "EXIT_SIGTERM",
    "Cause",
    "CertifyError",
    "CertifyReport",
    "Interruption",
    "certify_trainer",
    "compare_runs",
    "covering_steps",
    "likely_causes",
    "minimum_steps",
    "plan_interruptions",
    "resolve_classes",
]
