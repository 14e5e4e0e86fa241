"""Generate long videos with the tiny toy-world pipeline and score them against the renderer.

    python -m rolldiff.training.evaluate_tiny --pipeline src/assets/tiny-bouncing-shapes --num-frames 1000

Prompts are generated as one batch per seed (the chunk loop costs about the same for 1 or 12 videos on a
CPU), then `evaluate_generator` scores the windows; the ground truth of the same prompts and seeds is
printed beside it. `--conditioning` also scores image-to-video and video-to-video on the same pipeline and
prompts (`rolldiff.training.evaluate_conditioning`, its default sizes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..pipelines.io.video_writer import frames_to_uint8
from ..toyworld.evaluate import evaluate_generator, format_table, ground_truth_fn, parse_windows
from .prompts import evaluation_prompts  # also importable from here, as before


def load_pipeline(path: Path):
    from ..defaults import pipeline_class  # the class named by the folder's model_index.json (either family)

    pipeline = pipeline_class(path).from_pretrained(path)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def generate_videos(pipeline, prompts: Sequence[str], num_frames: int, seed: int, height=32, width=32) -> np.ndarray:
    """uint8 `(len(prompts), num_frames, height, width, 3)`; generates whole chunks and cuts to `num_frames`."""
    output = pipeline(
        list(prompts),
        num_frames=pipeline.num_frames_for(num_frames, 1),  # whole chunks holding `num_frames`
        height=height,
        width=width,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    frames = np.asarray(output.frames)[:, :num_frames]  # (batch, frames, H, W, 3) in [0, 1]
    return frames_to_uint8(frames)


def evaluate_pipeline(pipeline, prompts, num_frames, windows, seeds, log=print) -> dict[str, dict[str, float]]:
    videos: dict[tuple[str, int], np.ndarray] = {}
    for seed in seeds:
        began = time.perf_counter()
        for prompt, video in zip(prompts, generate_videos(pipeline, prompts, num_frames, seed)):
            videos[prompt, seed] = video
        log(f"seed {seed}: {len(prompts)} videos of {num_frames} frames in {time.perf_counter() - began:.0f} s")
    return evaluate_generator(lambda p, n, s: videos[p, s], prompts, num_frames, windows, seeds)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", type=Path, default=Path("src/assets/tiny-bouncing-shapes"))
    parser.add_argument("--num-frames", type=int, default=1000)
    parser.add_argument("--windows", type=parse_windows, default=[(0, 100), (900, 1000)])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--prompts", type=int, default=12, help="how many of the 12 evaluation prompts to use")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save-video", type=Path, default=None, help="save the first video here as .npy")
    parser.add_argument(
        "--conditioning",
        action="store_true",
        help="also score image-to-video and video-to-video (evaluate_conditioning) on this pipeline",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = evaluation_prompts()[: args.prompts]
    pipeline = load_pipeline(args.pipeline)
    model = evaluate_pipeline(pipeline, prompts, args.num_frames, args.windows, args.seeds)
    truth = evaluate_generator(ground_truth_fn(), prompts, args.num_frames, args.windows, args.seeds)
    table = {f"model {name}": row for name, row in model.items()}
    table.update({f"truth {name}": row for name, row in truth.items()})
    print(f"{len(prompts)} prompts x {len(args.seeds)} seeds x {args.num_frames} frames")
    print(format_table(table))
    if args.save_video is not None:
        np.save(args.save_video, generate_videos(pipeline, prompts[:1], min(args.num_frames, 150), args.seeds[0])[0])
    if args.conditioning:
        from . import evaluate_conditioning

        evaluate_conditioning.main(
            ["--models", str(args.pipeline), "--prompts", str(args.prompts), "--threads", str(args.threads)]
        )


if __name__ == "__main__":
    main()
