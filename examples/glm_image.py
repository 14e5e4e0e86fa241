"""Generate or edit an image with GLM-Image from a local checkpoint folder, through rolldiff's condition cache.

The folder is a diffusers GLM-Image pipeline (e.g. a download of `zai-org/GLM-Image`, or one saved by
`GlmImageCachedPipeline.save_pretrained`); nothing is fetched from the network. Text-to-image without
`--image`; editing with one or more `--image` references (their K/V are written once into the
condition cache and read in place at every conditional step).

    python examples/glm_image.py --model /path/to/GLM-Image --prompt "a red fox" --out fox.png
    python examples/glm_image.py --model /path/to/GLM-Image --prompt "make it night" \
        --image day.png [--image style.png] --height 1024 --width 1024 --out night.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import PIL.Image
import torch

from rolldiff import GlmImageCachedPipeline

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="local GLM-Image pipeline folder (model_index.json)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--image", type=Path, action="append", default=[], help="reference image (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("glm_image.png"))
    parser.add_argument("--height", type=int, default=None, help="default: the first reference's, else 1024")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-offload", action="store_true", help="keep models on the CPU until each is used")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if not (args.model / "model_index.json").is_file():
        sys.exit(f"--model {args.model}: no model_index.json there; pass a diffusers GLM-Image pipeline folder.")
    missing = [str(path) for path in args.image if not path.is_file()]
    if missing:
        sys.exit(f"--image: no such file(s): {', '.join(missing)}")
    references = [PIL.Image.open(path).convert("RGB") for path in args.image] or None

    pipe = GlmImageCachedPipeline.from_pretrained(args.model, dtype=DTYPES[args.dtype], local_files_only=True)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)
    start = time.perf_counter()
    image = pipe(
        prompt=args.prompt,
        image=references,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
    ).images[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    print(
        f"{args.out}: {image.width}x{image.height}, {len(args.image)} reference(s), {time.perf_counter() - start:.1f} s"
    )
    return args.out


if __name__ == "__main__":
    main()
