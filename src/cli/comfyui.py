"""`rolldiff install-comfyui FOLDER`: make ComfyUI (in FOLDER, run with the Python rolldiff is installed in) load
rolldiff's nodes. The library's `install_nodes` does the work; its refusals are shown with the argument's name."""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import relabel


def add_comfyui_command(commands) -> None:
    """The `install-comfyui` subcommand."""
    install = commands.add_parser(
        "install-comfyui",
        help="make a ComfyUI installation load rolldiff's nodes (docs/comfyui.md)",
        description="Write custom_nodes/comfyui-rolldiff into a ComfyUI folder; the nodes come from this rolldiff "
        "package, so install rolldiff in the Python environment ComfyUI runs in.",
    )
    install.add_argument(
        "comfyui_folder", type=Path, metavar="COMFYUI_FOLDER", help="the folder with ComfyUI's main.py"
    )
    install.set_defaults(run=run_install, check_flags=lambda args: None)


def run_install(args: argparse.Namespace) -> int:
    from ..comfyui.install import install_nodes

    try:
        module = install_nodes(args.comfyui_folder)
    except ValueError as exc:
        raise relabel(exc, {"comfyui_folder": "COMFYUI_FOLDER"}) from None
    print(f"rolldiff install-comfyui: wrote {module}; restart ComfyUI, then find the nodes under 'rolldiff'.")
    return 0
