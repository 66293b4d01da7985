"""`python -m saga` runs the command line."""

import sys

from saga._entry import main

sys.exit(main())
