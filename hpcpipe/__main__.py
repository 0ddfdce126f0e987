"""`python -m hpcpipe` is the same as the `hpcpipe` console script."""

import sys

from hpcpipe.cli import main

sys.exit(main())
