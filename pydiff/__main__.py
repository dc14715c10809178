"""``python -m pydiff``: the pydiff command line (see pydiff.cli)."""

import sys

from .cli import main

sys.exit(main())
