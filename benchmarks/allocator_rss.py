"""Is growing process RSS a leak or the allocator? Our chunk loop at a real frame size, RSS and live tensors.

    python benchmarks/allocator_rss.py --height 240 --width 416 --chunks 26
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/allocator_rss.py --height 240 --width 416 --chunks 26

A leak keeps more tensors alive as chunks go by; glibc's allocator instead grows RSS with the same tensors
alive (its mmap threshold adapts upwards, so large temporaries move onto a heap that fragments). A fixed
threshold (the environment variable above) keeps RSS flat at the cost of fresh pages for large temporaries.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from _common import WAN_1_3B, latent_hw, rss_mib
from research_loops import Setup, make_loop


def live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--chunks", type=int, default=26)
    parser.add_argument("--every", type=int, default=4, help="print every this many chunks")
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = Setup(model_config={**WAN_1_3B, "num_layers": args.layers}, latent_hw=latent_hw(args.height, args.width),
                  text_tokens=64)  # fmt: skip
    loop = make_loop("ours", setup)
    print("| chunk | RSS MiB | live tensors |\n| ---: | ---: | ---: |")
    for index in range(args.chunks):
        loop.chunk()
        if index % args.every == 0 or index == args.chunks - 1:
            print(f"| {index} | {rss_mib():.0f} | {live_tensors()} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
