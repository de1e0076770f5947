"""The command line: ``python -m trainkit COMMAND``, one module per command, and configs from an argv.

:func:`config_from_argv` builds a config from YAML files and dotted overrides (:mod:`~trainkit.cli.argv`);
:func:`main` parses the words and dispatches the commands (:mod:`~trainkit.cli.commands`), each answered by its own
module, a local path or a remote URL alike: ``report`` (:mod:`~trainkit.cli.report`), ``inspect``
(:mod:`~trainkit.cli.inspect`), ``export`` (:mod:`~trainkit.cli.export`), ``retain`` (:mod:`~trainkit.cli.retain`),
``replay`` (:mod:`~trainkit.cli.replay`) and ``certify`` (:mod:`~trainkit.cli.certify`, over certify's engine in
:mod:`trainkit.certification`). Importing this loads no torch.
"""

from trainkit.cli.argv import config_from_argv, load_yaml
from trainkit.cli.commands import main

__all__ = ["config_from_argv", "load_yaml", "main"]
