"""`rolldiff demo`: the Gradio demo (docs/demo.md); Gradio is an extra, imported only by this command."""

from __future__ import annotations

import argparse
import importlib.util

from .arguments import (
    add_address_arguments,
    add_lora_arguments,
    add_memory_arguments,
    add_model_arguments,
    check_address_flags,
    check_lora_flags,
    check_memory_flags,
    positive,
)
from .errors import UsageError


def add_demo_command(commands) -> None:
    """The `demo` subcommand and its flags."""
    demo = commands.add_parser("demo", help="serve the Gradio demo", description="Serve the Gradio demo.")
    add_model_arguments(demo)
    add_lora_arguments(demo)
    add_memory_arguments(demo)
    add_address_arguments(demo, port=7860)
    demo.add_argument("--max-concurrency", type=positive(int), default=2, help="generations at once (default 2)")
    demo.set_defaults(run=run_demo, check_flags=_check_flags_alone)


def run_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("gradio") is None:
        raise UsageError("the demo needs Gradio, which is not installed: pip install 'rolldiff[demo]'")
    from ..defaults import default_device, default_dtype  # torch: only when the command runs
    from ..demo import build_demo  # imports gradio: only for this command
    from .loading import load_weights

    check_address_flags(args)
    device = args.device or default_device()
    dtype = args.dtype or default_dtype(device)
    if args.lora or args.offload or args.fp8_storage:  # one model, loaded as the flags say (now: the page needs it)
        label = f"{args.model or 'tiny-bouncing-shapes'}{' + LoRA' if args.lora else ''}"
        demo = build_demo(models={label: lambda: load_weights(args, device)}, max_concurrency=args.max_concurrency)
    else:
        demo = build_demo(args.model, max_concurrency=args.max_concurrency, device=device, dtype=dtype)
    demo.launch(server_name=args.host, server_port=args.port)
    return 0


def _check_flags_alone(args: argparse.Namespace) -> None:
    """The rules the flags decide on their own (no library, no model, no file read). Raises `UsageError`."""
    check_lora_flags(args)
    check_memory_flags(args)
