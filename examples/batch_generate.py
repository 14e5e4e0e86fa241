"""One video per prompt, spread over processes with accelerate: many streams on one machine or many GPUs.

    accelerate launch examples/batch_generate.py --prompts prompts.txt --out-dir videos/
    accelerate launch --multi_gpu --num_processes 4 examples/batch_generate.py --prompts prompts.txt \\
        --out-dir videos/ --model /path/to/pipeline --seconds 60          # one process per GPU
    accelerate launch --multi_gpu --num_processes 2 examples/batch_generate.py --prompts prompts.txt \\
        --out-dir videos/                          # on a machine without GPUs: 2 CPU processes (gloo)

(`accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.x unless an MPI hostfile is
given; `--multi_gpu` starts one process per slot through torchrun, and without CUDA this script then asks
accelerate for CPU processes.)

`prompts.txt` holds one prompt per line (blank lines and lines starting with `#` are skipped). Prompt `i` is
written to `videos/{i:04d}.mp4` with seed `--seed + i`, so a video does not depend on how many processes run.
`PartialState().split_between_processes` gives each process its share of the prompts; each process loads the
pipeline once onto its own device and makes its videos one after the other, each with its own cache.

Resumable per prompt: a video is written to a temporary file and renamed when finished, so a finished
`NNNN.mp4` is complete and a rerun skips it; a video cut short is resumed from its last saved chunk
(`resume=True`), so a rerun after a crash or a pre-empted job only makes what is missing. The arguments are
checked before the model loads, every prompt before any video is made.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState

from rolldiff.defaults import DTYPES, default_dtype, load_pipeline, native_size


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, required=True, help="text file, one prompt per line")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for NNNN.mp4 (created if missing)")
    parser.add_argument("--model", help="pipeline folder or Hub id (default: the embedded tiny model)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each video (default 5)")
    parser.add_argument("--fps", type=int, default=16, help="frames per second (default 16)")
    parser.add_argument("--height", type=int, help="pixels (default: the model's native size)")
    parser.add_argument("--width", type=int, help="pixels (default: the model's native size)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (default 0)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on GPUs, float32 on CPUs")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= 24 * 3600):
        parser.error(f"--seconds must be a finite number in (0, 86400], got {args.seconds}")
    if not 0 < args.fps <= 240:
        parser.error(f"--fps must be in [1, 240], got {args.fps}")
    if not args.prompts.is_file():
        parser.error(f"--prompts {str(args.prompts)!r} is not a file")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {str(args.out_dir)!r} is a file, not a folder")
    return args


def read_prompts(path: Path) -> list[str]:
    """The prompts of `path`, one per line, without blank lines and `#` comments."""
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv or ["--help"])
    prompts = read_prompts(args.prompts)
    if not prompts:
        raise SystemExit(f"--prompts {str(args.prompts)!r} holds no prompt")

    # One process per device (or CPU process) that `accelerate launch` started; without CUDA, CPU processes.
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.is_main_process:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()

    device = "cpu" if state.device.type == "cpu" else str(state.device)
    if device == "cpu":  # CPU processes share the cores instead of each starting one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.num_processes))
    pipe = load_pipeline(args.model, device=device, dtype=args.dtype or default_dtype(device))
    pipe.set_progress_bar_config(disable=True)
    height, width = args.height or native_size(pipe)[0], args.width or native_size(pipe)[1]
    num_frames = pipe.num_frames_for(args.seconds, args.fps)
    for prompt in prompts:  # every prompt is checked before any video is made; a stream runs only when iterated
        pipe.stream(prompt, num_frames, height, width)

    with state.split_between_processes(list(enumerate(prompts))) as mine:
        for index, prompt in mine:
            out = args.out_dir / f"{index:04d}.mp4"
            if out.exists():  # renamed into place only when finished: complete
                print(f"[process {state.process_index}] {out} exists, skipped", flush=True)
                continue
            start = time.perf_counter()
            frames = pipe.generate_to_file(
                out,
                prompt,
                fps=args.fps,
                num_frames=num_frames,
                height=height,
                width=width,
                generator=torch.Generator("cpu").manual_seed(args.seed + index),
                resume=True,
            )
            elapsed = time.perf_counter() - start
            print(
                f"[process {state.process_index}] {out}: {frames} frames in {elapsed:.1f} s ({prompt!r})", flush=True
            )
    state.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
