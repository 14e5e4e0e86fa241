"""The command line's one error kind, in a file of its own so every subcommand's module can raise it without
importing the command line that dispatches to them."""


class UsageError(Exception):
    """A bad command-line argument; reported as one line, exit code 2."""
