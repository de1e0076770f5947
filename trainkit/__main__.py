"""``python -m trainkit``: command-line tools (``report``, ``inspect``, ``replay``)."""

import sys

from trainkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
