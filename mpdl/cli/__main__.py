"""`python -m mpdl.cli VERB ...`: the `mpdl` command (what `mpdl launch` starts on every rank)."""

import sys

from mpdl.cli import main

sys.exit(main())
