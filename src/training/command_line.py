"""The command line both tiny-model training runs share (`python -m rolldiff.training`, `train_sana`).

`training_arguments` adds the flags of every run (output, time and step budget, VAE, optimiser, data, seed,
start-image batches) with the defaults and help texts that differ per model passed in; each entry point adds
its own flags after them and parses with `parse_training_arguments`, which refuses a share outside [0, 1]
before any work starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def training_arguments(
    description: str,
    *,
    clip_frames: int,
    vae_from: Path | None,
    vae_from_help: str,
    init_from_help: str,
    start_image_help: str,
) -> argparse.ArgumentParser:
    """A parser with the shared training flags; the keywords are the per-model defaults and help texts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall time of transformer training")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many transformer steps")
    parser.add_argument("--vae-from", type=Path, default=vae_from, help=vae_from_help)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clip-frames", type=int, default=clip_frames, help="latent frames per teacher-forcing clip")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids thrashing on shared CPUs)")
    parser.add_argument("--videos-per-prompt", type=int, default=12, help="training videos of 97 frames per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", type=Path, default=None, help=init_from_help)
    parser.add_argument("--start-image-batches", type=float, default=0.0, help=start_image_help)
    return parser


def parse_training_arguments(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    shares: Sequence[str] = ("start_image_batches",),
) -> argparse.Namespace:
    """`parser.parse_args(argv)`, exiting with a usage error when one of `shares` (dests) is outside [0, 1]."""
    args = parser.parse_args(argv)
    for name in shares:
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
    return args
