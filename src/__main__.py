"""`python -m rolldiff`: the same as the `rolldiff` command."""

import sys

from .cli import main

if __name__ == "__main__":  # a spawned `rolldiff serve --workers` process imports it
    sys.exit(main())
