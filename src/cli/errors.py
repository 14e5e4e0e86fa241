"""The command line's one error kind and its exit codes, in a file of their own so every subcommand's module can
raise it without importing the command line that dispatches to them."""

from __future__ import annotations

from collections.abc import Mapping

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # what a shell reports for a program stopped by Ctrl-C (128 + SIGINT)


class UsageError(Exception):
    """A bad command-line argument; reported as one line, exit code 2."""


def relabel(error: Exception, flags: Mapping[str, str]) -> UsageError:
    """The library's message with each argument it names shown as the flag that sets it (`--steps
    (`denoising_steps`)`), as one usage error: the rule itself is checked once, by the library; `flags` maps the
    library's argument names to the command's flags."""
    message = str(error)
    for name, flag in flags.items():
        message = message.replace(f"`{name}`", f"{flag} (`{name}`)")
    return UsageError(message)
