"""``python -m trainkit``: command-line tools (``report``)."""

import sys

from trainkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
