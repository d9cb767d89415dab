"""`python -m kiln.cli ...`: the same as the `kiln` command."""

import sys

from . import main

sys.exit(main())
