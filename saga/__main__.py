"""`python -m saga` runs the command line."""

import sys

from saga.cli import main

sys.exit(main())
