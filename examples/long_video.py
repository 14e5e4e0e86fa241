"""Generate a long video on a GPU from a real checkpoint, with a prompt schedule, streamed into an mp4.

The pipeline makes the video chunk by chunk and `generate_to_file` writes each chunk as it is decoded, so a
ten-minute video needs the memory of a few seconds. Each `--prompt` gets an equal share of the video; the
switches re-cache the rolling window under the new prompt (LongLive), so the scene carries on instead of cutting.

    python examples/long_video.py --model /path/to/self-forcing-diffusers --minutes 2 \\
        --prompt "a red fox trotting through fresh snow, cinematic" \\
        --prompt "the fox stops and looks up at falling snowflakes" --out fox.mp4

`--model` is a diffusers-format folder of `KreaRealtimeVideoPipeline` (Self-Forcing / LongLive 1.3B or Krea
Realtime 14B, made by `rolldiff convert`: docs/real_checkpoints.md). `--offload text-encoder` keeps the 11 GB text
encoder in CPU memory (docs/memory.md). With no arguments this prints its help.
"""

import argparse
import sys
import time

import torch

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.choices import OFFLOAD_MODES


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="diffusers-format KreaRealtimeVideoPipeline folder or Hub id")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a schedule; equal shares")
    parser.add_argument("--out", default="long_video.mp4", help="the .mp4 to write")
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the video (default 1)")
    parser.add_argument("--fps", type=int, default=16, help="frames per second (Wan 2.1 models: 16)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, help="weights kept in CPU memory until used")
    # Absolute RoPE positions run out after the model's table; relative ones never do.
    parser.add_argument("--position-mode", default="relative", choices=["absolute", "relative"])
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        parse_args(["--help"])  # prints the help and exits 0
    args = parse_args(argv)

    pipe = KreaRealtimeVideoPipeline.from_pretrained(args.model, dtype=torch.bfloat16)  # in CPU memory
    if args.offload:
        pipe.enable_offload(args.offload, device=args.device)
    else:
        pipe.to(args.device)

    # Round the length up to whole chunks, then give each prompt an equal share of the frames.
    num_frames = pipe.num_frames_for(args.minutes * 60, args.fps)
    share = num_frames // len(args.prompt)
    schedule = [(i * share, prompt) for i, prompt in enumerate(args.prompt)]
    print(
        f"{num_frames} frames ({num_frames / args.fps / 60:.1f} min), switching at frames {[f for f, _ in schedule]}"
    )

    start = time.perf_counter()
    frames = pipe.generate_to_file(
        args.out,
        fps=args.fps,
        num_frames=num_frames,
        height=args.height,
        width=args.width,
        prompt_schedule=schedule,
        position_mode=args.position_mode,
        generator=torch.Generator("cpu").manual_seed(args.seed),
    )
    seconds = time.perf_counter() - start
    print(f"Wrote {frames} frames to {args.out} in {seconds:.0f} s ({frames / seconds:.1f} frames per second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
