"""``python -m hetpipe``: the command line (:mod:`hetpipe.cli`)."""

import sys

from hetpipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
