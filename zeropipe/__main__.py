"""``python -m zeropipe``: the same as the ``zeropipe`` command."""

import sys

from zeropipe.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
