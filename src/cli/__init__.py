"""The `rolldiff` command: `rolldiff generate` writes a long video to an mp4, `rolldiff demo` serves the Gradio demo,
`rolldiff serve` serves live sessions, `rolldiff convert` turns a published checkpoint into a pipeline folder,
`rolldiff install-comfyui` makes ComfyUI load rolldiff's nodes.

One module per subcommand's flags; this one builds the parser and dispatches. A command's run lives in its own module
(`run_generate.py`, `run_serve.py`), imported when it runs: the parser imports nothing heavy, so `--help`, `--version`
and a mistyped flag answer without loading torch. Bad arguments end with one line on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__ as rolldiff_version
from ..checks import ModelNotFoundError
from .arguments import Parser
from .comfyui import add_comfyui_command
from .convert import add_convert_command
from .demo import add_demo_command
from .errors import EXIT_USAGE, UsageError
from .generate import add_generate_command
from .quiet import quiet_libraries
from .serve import add_serve_command

__all__ = ["UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rolldiff", description="Generate long videos chunk by chunk with a rolling KV cache.")
    parser.add_argument("--version", action="version", version=f"rolldiff {rolldiff_version}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_generate_command(commands)
    add_demo_command(commands)
    add_serve_command(commands)
    add_convert_command(commands)
    add_comfyui_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rolldiff` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:  # `rolldiff` alone: say what it does and how to start, not "the following arguments are required"
        parser.print_help()
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
        args.check_flags(args)  # the rules the flags decide alone: answered before any library loads
        with quiet_libraries():
            return args.run(args)
    except (UsageError, ModelNotFoundError) as exc:  # a missing model's message names --model
        print(f"rolldiff: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever the message
        return EXIT_USAGE
