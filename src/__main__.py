"""`python -m rolldiff`: the same as the `rolldiff` command."""

import sys

from .cli import main

sys.exit(main())
