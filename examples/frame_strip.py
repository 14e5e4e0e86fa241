"""Render a strip of frames from a pipeline (the README's picture): one row per prompt.

python examples/frame_strip.py --out docs/default_model_strip.png
"""

from __future__ import annotations

import argparse

import numpy as np
import PIL.Image
import torch

from rolldiff.defaults import load_pipeline, native_size

PROMPTS = [
    "a red circle moving left",
    "a blue square moving up",
    "a green triangle moving right",
    "a yellow circle moving down",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--frames", type=int, default=48, help="frames generated per prompt")
    parser.add_argument("--every", type=int, default=3, help="keep every n-th frame")
    parser.add_argument("--scale", type=int, default=3, help="nearest-neighbour upscaling of the strip")
    args = parser.parse_args()

    pipe = load_pipeline(args.model, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    height, width = native_size(pipe)
    rows = []
    for prompt in PROMPTS:
        generator = torch.Generator().manual_seed(0)
        frames = pipe(prompt, num_frames=args.frames, height=height, width=width, generator=generator).frames[0]
        rows.append(np.concatenate(list(frames[:: args.every]), axis=1))  # (H, W * kept, 3)
    strip = (np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)
    image = PIL.Image.fromarray(strip)
    image.resize((image.width * args.scale, image.height * args.scale), PIL.Image.NEAREST).save(args.out)
    print(f"wrote {args.out}: {len(PROMPTS)} prompts x {len(frames[:: args.every])} frames")


if __name__ == "__main__":
    main()
