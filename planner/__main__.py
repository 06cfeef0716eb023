"""``python -m planner CONFIG [key=value ...] [--out DIR]``."""

import sys

from planner.cli import main

sys.exit(main())
