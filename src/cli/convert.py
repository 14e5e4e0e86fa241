"""`rolldiff convert`: a published checkpoint file and its diffusers base -> a pipeline folder that runs the authors'
recipe, so `rolldiff generate --model FOLDER` (or `from_pretrained(FOLDER)`) needs no other flag.

Every check runs before anything is written (the library's `plan_conversion`); its errors are shown with the flags
that set the arguments they name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..choices import DTYPE_NAMES
from .arguments import add_recipe_argument, positive
from .errors import relabel

# The library's argument names and the flags of this command that set them.
CONVERT_FLAGS = {
    "checkpoint": "CHECKPOINT",
    "base": "--base",
    "output": "--out",
    "recipe": "--recipe",
    "lora": "--lora",
    "use_ema": "--ema/--no-ema",
    "fuse_lora": "--keep-lora-adapter",
    "overwrite": "--overwrite",
    "height": "--height",
    "width": "--width",
}


EXAMPLES = """examples:
  rolldiff convert checkpoints/self_forcing_dmd.pt --base Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out self-forcing
  rolldiff convert models/longlive_base.pt --lora models/lora.pt --base Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out longlive
  rolldiff generate --model self-forcing --prompt "..." --seconds 60   # the authors' settings, no other flag
one command per published checkpoint: docs/real_checkpoints.md
"""


def add_convert_command(commands) -> None:
    """The `convert` subcommand and its flags."""
    convert = commands.add_parser(
        "convert",
        help="turn a published checkpoint (Self-Forcing, LongLive, Krea, LongSANA, ...) into a pipeline folder",
        description="Write a pipeline folder from an original checkpoint and its diffusers base; the folder's "
        "model_index.json names the recipe, so `rolldiff generate --model FOLDER` runs the authors' settings.",
        epilog=EXAMPLES,
    )
    convert.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="the authors' .pt/.pth/.safetensors")
    convert.add_argument(
        "--base",
        required=True,
        help="diffusers base folder or Hub id (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan-AI/Wan2.1-T2V-14B-Diffusers, "
        "Efficient-Large-Model/SANA-Video_2B_480p_diffusers)",
    )
    convert.add_argument("--out", type=Path, required=True, help="the pipeline folder to write (must not exist)")
    add_recipe_argument(convert, "the checkpoint's recipe (default: detected from the file)")
    convert.add_argument("--lora", type=Path, help="LongLive's lora.pt, fused into the weights (recipe longlive)")
    convert.add_argument(
        "--keep-lora-adapter",
        action="store_true",
        help="keep the LoRA as an adapter beside the transformer (scalable per call) instead of fusing it",
    )
    ema = convert.add_mutually_exclusive_group()
    ema.add_argument("--ema", dest="use_ema", action="store_true", default=None, help="take generator_ema")
    ema.add_argument("--no-ema", dest="use_ema", action="store_false", help="take generator")
    convert.add_argument(
        "--dtype", choices=DTYPE_NAMES, help="cast the transformer and text encoder (default: as stored)"
    )
    convert.add_argument("--height", type=positive(int), help="native frame height calls default to (480)")
    convert.add_argument("--width", type=positive(int), help="native frame width calls default to (832)")
    convert.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    convert.set_defaults(run=run_convert, check_flags=lambda args: None)  # its checks need the checkpoint's keys


def run_convert(args: argparse.Namespace) -> int:
    from ..defaults import DTYPES
    from ..pipelines.conversion import convert_checkpoint

    try:
        plan = convert_checkpoint(
            args.checkpoint,
            args.base,
            args.out,
            recipe=args.recipe,
            lora=args.lora,
            fuse_lora=not args.keep_lora_adapter,
            use_ema=args.use_ema,
            dtype=None if args.dtype is None else DTYPES[args.dtype],
            height=args.height,
            width=args.width,
            overwrite=args.overwrite,
        )
    except ValueError as exc:
        raise relabel(exc, CONVERT_FLAGS) from None
    print(
        f"rolldiff convert: {args.out} ({plan.pipeline_class_name}, recipe {plan.recipe}, {plan.decided})\n"
        f"  run it: rolldiff generate --model {args.out} --prompt '...' --out video.mp4",
        flush=True,
    )
    return 0
