"""What each recipe costs per latent frame, next to the rolling policy: transformer forwards, query tokens, cache
memory, ms per frame (frame-wise and chunk-wise recipes compare per frame).

Each Krea-like recipe runs on the Krea-like pipeline at Wan-1.3B block shapes (1 block by default, random
weights, fp32, 80x128: 10x16 latents, 40 tokens per frame, as the 80x128 race), with `output_type="latent"` so
only the chunk loop is timed (the re-encoding row also decodes, which its first frame needs). Rows: forwards and query
tokens per latent frame (steps + the context pass, or + the context rebuild), the cache's `memory_bytes()`, and the
median ms per chunk over the steady-state chunks divided by the chunk's frames, all measured in one run. The
"pipelined" rows run `denoising="pipelined"` (one forward of every in-flight chunk per chunk made, then its context
pass), beside the same settings denoised sequentially.

    python benchmarks/recipes_cost.py              # about a minute on 2 CPU cores
    python benchmarks/recipes_cost.py --dry-run    # tiny shapes (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import WAN_1_3B, markdown_table
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

from rolldiff import KreaRealtimeTransformer3DModel, KreaRealtimeVideoPipeline
from rolldiff.recipes import get_recipe

WAN_BLOCK = {key: value for key, value in WAN_1_3B.items() if key != "num_layers"}
TINY_BLOCK = {**WAN_BLOCK, "num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32, "ffn_dim": 64}
ROWS = (
    ("rolling (rolldiff default: sink 3 + window 9)", None, {}),
    ("self-forcing", "self-forcing", {}),
    ("longlive", "longlive", {}),
    ("krea-realtime (keep first frame)", "krea-realtime", {"recompute_first_frame": "keep"}),
    ("krea-realtime (re-encoded first frame)", "krea-realtime", {}),
    ("causal-forcing (chunk-wise)", "causal-forcing", {}),
    ("causal-forcing-framewise", "causal-forcing-framewise", {}),
    ("causal-forcing-2step", "causal-forcing-2step", {}),
    ("causal-forcing-1step", "causal-forcing-1step", {}),
    ("rolling-sink", "rolling-sink", {}),
    ("infinity-rope (sink 1 + window 5)", "infinity-rope", {}),
    ("reward-forcing (EMA sink 3 + window 6)", "reward-forcing", {}),
    ("streamdiffusionv2 (from noise)", "streamdiffusionv2", {}),
    ("streamdiffusionv2, stream batch", "streamdiffusionv2", {"denoising": "stream_batch"}),
    ("streamdiffusionv2, pipelined (in-flight region)", "streamdiffusionv2", {"denoising": "pipelined"}),
    ("rolling-forcing (pipelined, its two views)", "rolling-forcing", {}),
    # denoising="pipelined": every step's chunk in flight, one forward for all (the in-flight chunks count in the window)
    ("rolling, pipelined (sink 3 + window 15)", None, {"denoising": "pipelined", "window_frames": 15}),
    ("self-forcing, pipelined", "self-forcing", {"denoising": "pipelined"}),
    ("causal-forcing, pipelined", "causal-forcing", {"denoising": "pipelined"}),
    ("causal-forcing-framewise, pipelined", "causal-forcing-framewise", {"denoising": "pipelined"}),
    ("longlive, pipelined (window 21)", "longlive", {"denoising": "pipelined", "window_frames": 21}),
    ("krea-realtime, pipelined (window 18)", "krea-realtime", {"denoising": "pipelined", "window_frames": 18}),
    ("rolling-forcing, sequential (its views)", "rolling-forcing", {"denoising": "sequential"}),
    (
        "self-forcing, pipelined, last_step (no context pass)",
        "self-forcing",
        {"denoising": "pipelined", "context_policy": "last_step"},
    ),
    (
        "rolling-sink, pipelined (window 30: its 18-frame source)",
        "rolling-sink",
        {"denoising": "pipelined", "window_frames": 30},
    ),
    (
        "Rolling Forcing's window (sink 3 + 18, relative, pipelined)",
        None,
        {"denoising": "pipelined", "sink_frames": 3, "window_frames": 18, "position_mode": "relative"},
    ),
)


def _pipeline(dry_run: bool, blocks: int, height: int, width: int) -> KreaRealtimeVideoPipeline:
    torch.manual_seed(0)
    block = TINY_BLOCK if dry_run else WAN_BLOCK
    transformer = KreaRealtimeTransformer3DModel(**block, num_layers=blocks).eval()
    vae = AutoencoderKLWan(base_dim=8 if dry_run else 32, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        height=32 if dry_run else height,
        width=48 if dry_run else width,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _measure(pipe, recipe, overrides, latent_frames: int, text: torch.Tensor) -> dict:
    """One row: transformer forwards and query tokens per latent frame, the cache, ms per latent frame (the median of
    the steady half of the chunks, per frame: frame-wise and chunk-wise recipes compare per frame)."""
    forwards, tokens = [], []
    patch = pipe.transformer.config.patch_size

    def count(module, args):
        rows, _, frames, height, width = args[0].shape  # a stream batch's rows are chunks of one video
        forwards.append(1)
        tokens.append(rows * frames * (height // patch[1]) * (width // patch[2]))

    hook = pipe.transformer.register_forward_pre_hook(count)
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(latent_frames), prompt_embeds=text, recipe=recipe, output_type="latent",
        generator=torch.Generator().manual_seed(0), **overrides,
    )  # fmt: skip
    times = []
    while True:
        start = time.perf_counter()
        if next(stream, None) is None:
            break
        times.append(time.perf_counter() - start)
    hook.remove()
    chunk_frames = stream.request.geometry.chunk_frames
    steady = times[len(times) // 2 :]
    return {
        "latent frames per chunk": str(chunk_frames),
        "forwards per frame": f"{len(forwards) / latent_frames:.2f}",
        "query tokens per frame": f"{sum(tokens) / latent_frames:.0f}",
        "cache KiB": f"{stream.memory_bytes() / 1024:.0f}",
        "ms per frame (median, steady)": f"{1000 * statistics.median(steady) / chunk_frames:.1f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, for CI")
    parser.add_argument("--chunks", type=int, default=None, help="chunks per row (default 8; 4 with --dry-run)")
    parser.add_argument("--blocks", type=int, default=1, help="transformer blocks (default 1)")
    parser.add_argument("--height", type=int, default=80, help="pixel height (default 80)")
    parser.add_argument("--width", type=int, default=128, help="pixel width (default 128)")
    parser.add_argument("--only", nargs="*", default=None, help="run only the rows whose label holds one of these")
    args = parser.parse_args(argv)
    chunks = args.chunks or (4 if args.dry_run else 8)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pipe = _pipeline(args.dry_run, args.blocks, args.height, args.width)
    text = torch.randn(1, 16 if args.dry_run else 512, pipe.transformer.config.text_dim)
    rows = []
    with torch.no_grad():
        _measure(pipe, None, {}, 6, text)  # warm-up: first-call allocations and kernel choices
        for label, recipe, overrides in ROWS:
            if args.only is not None and not any(part in label for part in args.only):
                continue
            if recipe is not None:
                get_recipe(recipe)  # a clear error if the registry changed
            rows.append({"recipe": label, **_measure(pipe, recipe, overrides, 3 * chunks, text)})
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
