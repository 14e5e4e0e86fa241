"""Score image-to-video and video-to-video of the tiny toy-world pipelines against the renderer.

    python -m rolldiff.training.evaluate_conditioning --models tiny-bouncing-shapes tiny-bouncing-shapes-sana

- **Image-to-video.** Frame 0 of a held-out toy video becomes the start image (`image=`) under the video's own
  prompt. Scored per window (frames 1-10 and 90-100) against the renderer's trajectory from that start: the
  shape's colour (pixel accuracy as `evaluate_tiny`, and frames whose shape keeps the image's colour and shape),
  the distance of its centre to the true centre, the frames within `ON_TRACK_PX` of it, the direction
  accuracy and speed, and how far it has moved the prompted way by frame 8 (the truth: 8 px, before any bounce). Two reference rows come from the renderer: the truth held for the first chunk (what a perfect
  model reaches, since the image fills the whole first chunk and motion starts at the next) and the truth from
  another start (chance level for the distance).
- **Video-to-video.** A held-out toy video is re-prompted to each other colour (same shape and direction) and
  each other shape (same colour and direction) at each strength; the output is scored against the input's
  track: the distance of the centres, the frames on track, and how often the shape takes the prompt's colour and
  shape or keeps the input's. Strength 1.0 (text-to-video with the same noise) is the reference that ignores
  the input.

Held-out means render seeds that no training video used, and whose starts leave the shape on a line (its
coordinate across the prompted axis) that no training video of the same prompt ran along, so no frame of a
held-out video is a training frame of its prompt. Generators are plain functions, so the renderer plugs in for
reference rows and tests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..pipelines.codecs.streaming_decode import denormalize_wan_latents
from ..pipelines.codecs.streaming_encode import StreamingWanEncoder
from ..pipelines.io.video_writer import frames_to_uint8
from ..toyworld.metrics import evaluate_video
from ..toyworld.world import (
    COLOURS,
    DIRECTIONS,
    SHAPES,
    SceneSpec,
    all_prompts,
    parse_prompt,
    random_start,
    render_video,
)
from .conditioning_metrics import ShapeTrack, attribute_rate, follow_metrics, track_shape, window
from .prompts import evaluation_prompts
from .train_transformer import render_seed
from .train_vae import tensor_to_videos, videos_to_tensor

# prompts, start images uint8 (H, W, 3) one per prompt, num_frames -> uint8 (len(prompts), num_frames, H, W, 3)
ImageToVideoFn = Callable[[list[str], list[np.ndarray], int], np.ndarray]
# prompts, input video uint8 (num_frames, H, W, 3), strength, num_frames -> uint8 (len(prompts), num_frames, H, W, 3)
VideoToVideoFn = Callable[[list[str], np.ndarray, float, int], np.ndarray]

IMAGE_TO_VIDEO_WINDOWS = ((1, 11), (90, 101))  # [start, stop): frames 1-10 and 90-100
STRENGTHS = (0.3, 0.5, 0.7, 0.9, 1.0)
HEAD_START_FRAME = 8  # == MIN_FRAMES_BEFORE_BOUNCE: every true start moves 8 px the prompted way by then
FIRST_HELD_OUT_SEED = 500_000  # above every training render seed (1000 * video + prompt) up to 500 videos a prompt
HEIGHT = WIDTH = 32
SHIPPED_VIDEOS_PER_PROMPT = 12  # --videos-per-prompt (its default) of both embedded models' training runs


def window_label(window_bounds: tuple[int, int]) -> str:
    """(1, 11) -> 'frames 1-10' (both ends included)."""
    return f"frames {window_bounds[0]}-{window_bounds[1] - 1}"


# ------------------------------------------------------------------------------------------------ held-out data
def _off_axis(prompt: str, seed: int) -> float:
    """The start's coordinate across the prompted axis: the line the shape moves along for the whole video."""
    spec = parse_prompt(prompt)
    axis = int(DIRECTIONS[spec.direction][0] == 0)  # 0 = moves along x
    return random_start(spec.direction, np.random.default_rng(seed), HEIGHT, WIDTH)[1 - axis]


def held_out_seeds(prompt: str, count: int, videos_per_prompt: int = SHIPPED_VIDEOS_PER_PROMPT) -> list[int]:
    """`count` render seeds for `prompt` whose videos share no line, and no frame, with its training videos."""
    index = all_prompts().index(parse_prompt(prompt).prompt)  # the training set's prompt index
    used = {_off_axis(prompt, render_seed(index, video)) for video in range(videos_per_prompt)}
    seeds, seed = [], FIRST_HELD_OUT_SEED + index
    while len(seeds) < count:
        line = _off_axis(prompt, seed)
        if line not in used:
            seeds.append(seed)
            used.add(line)  # held-out videos differ from each other too
        seed += 1000
        if seed > FIRST_HELD_OUT_SEED + 1000 * 10_000:
            raise ValueError(f"count={count} held-out lines do not exist for {prompt!r} at {HEIGHT}x{WIDTH}")
    return seeds


# ------------------------------------------------------------------------------------------------ image-to-video
def image_to_video_scores(
    video: np.ndarray, truth: np.ndarray, prompt: str, windows: Sequence[tuple[int, int]]
) -> dict[str, dict[str, float]]:
    """Scores of one image-to-video output uint8 `(F, H, W, 3)` against the true continuation, per window."""
    spec = parse_prompt(prompt)
    track, reference = track_shape(video), track_shape(truth)
    scores = {}
    for start, stop in windows:
        clip, true_clip = window(track, start, stop), window(reference, start, stop)
        prompted = evaluate_video(video, prompt, (start, stop))
        scores[window_label((start, stop))] = {
            "colour_accuracy": prompted["colour_accuracy"],
            "keeps_colour": attribute_rate(clip, colour=spec.colour),
            "keeps_shape": attribute_rate(clip, shape=spec.shape),
            **follow_metrics(clip, true_clip),
            "direction_accuracy": prompted["direction_accuracy"],
            "mean_speed": prompted["mean_speed"],
        }
        if start <= HEAD_START_FRAME < stop:
            scores[window_label((start, stop))].update(head_start(track, spec.direction))
    return scores


def head_start(track: ShapeTrack, direction: str) -> dict[str, float]:
    """How far the shape has moved the prompted way by `HEAD_START_FRAME`, before any true bounce (px, signed)."""
    velocity = DIRECTIONS[direction]
    axis = int(velocity[0] == 0)
    moved = float((track.centres[HEAD_START_FRAME, axis] - track.centres[0, axis]) * velocity[axis])
    if not (track.found[0] and track.found[HEAD_START_FRAME]):
        return {"displacement_px_frame_8": math.nan, "prompted_way_by_frame_8": 0.0}
    return {"displacement_px_frame_8": moved, "prompted_way_by_frame_8": float(moved >= 1.0)}


def evaluate_image_to_video(
    generate: ImageToVideoFn,
    prompts: Sequence[str],
    seeds_per_prompt: int,
    windows: Sequence[tuple[int, int]] = IMAGE_TO_VIDEO_WINDOWS,
) -> dict[str, dict[str, float]]:
    """Mean scores per window over `prompts` x `seeds_per_prompt` held-out starts, one batch of prompts per seed."""
    num_frames = max(stop for _, stop in windows)
    per_window: dict[str, list[dict[str, float]]] = {window_label(w): [] for w in windows}
    seeds = {prompt: held_out_seeds(prompt, seeds_per_prompt) for prompt in prompts}
    for k in range(seeds_per_prompt):
        truths = [render_video(prompt, num_frames, HEIGHT, WIDTH, seeds[prompt][k]) for prompt in prompts]
        videos = _checked(
            generate(list(prompts), [truth[0] for truth in truths], num_frames), len(prompts), num_frames
        )
        for prompt, video, truth in zip(prompts, videos, truths):
            for name, scores in image_to_video_scores(video, truth, prompt, windows).items():
                per_window[name].append(scores)
    return {name: _mean(rows) for name, rows in per_window.items()}


def rendered_image_to_video(held_frames: int = 1, other_start: bool = False, vae=None) -> ImageToVideoFn:
    """The renderer as an image-to-video model: the true motion from the image's shape, held for `held_frames`.

    `held_frames=chunk_frames` through the pipeline's `vae` is the best a model whose first chunk is the image
    can score (the VAE blurs a circle at the frame's edge into a square-ish blob); `other_start=True` renders
    from a random start instead (the distance a model that ignores the image reaches).
    """

    def generate(prompts: list[str], images: list[np.ndarray], num_frames: int) -> np.ndarray:
        rng = np.random.default_rng(0)
        videos = []
        for prompt, image in zip(prompts, images):
            direction = parse_prompt(prompt).direction
            start = random_start(direction, rng, HEIGHT, WIDTH) if other_start else _image_centre(image)
            video = render_video(prompt, num_frames, HEIGHT, WIDTH, start=start)
            videos.append(video[np.maximum(np.arange(num_frames) - (held_frames - 1), 0)])
        return np.stack(videos) if vae is None else through_vae(vae, np.stack(videos))

    return generate


def _image_centre(image: np.ndarray) -> tuple[float, float]:
    track = track_shape(image[None])
    if not track.found[0]:
        raise ValueError("the start image shows no toy-world shape; the renderer cannot continue it")
    return float(track.centres[0, 0]), float(track.centres[0, 1])


@torch.no_grad()
def through_vae(vae, videos: np.ndarray) -> np.ndarray:
    """The VAE round trip (posterior mean, one encode and decode) of uint8 videos `(batch, F, H, W, 3)`.

    Encoded by `StreamingWanEncoder`, which keeps every frame (`vae.encode` drops those past the last group of 4).
    """
    latents = StreamingWanEncoder(vae).encode(videos_to_tensor(videos).to(vae.dtype))
    return tensor_to_videos(vae.decode(denormalize_wan_latents(latents, vae)).sample)


# ------------------------------------------------------------------------------------------------ video-to-video
def reprompts(prompt: str) -> list[tuple[str, str]]:
    """(kind, prompt) pairs: every other colour ('colour'), then every other shape ('shape'), same direction."""
    spec = parse_prompt(prompt)
    colours = [("colour", SceneSpec(c, spec.shape, spec.direction).prompt) for c in COLOURS if c != spec.colour]
    shapes = [("shape", SceneSpec(spec.colour, s, spec.direction).prompt) for s in SHAPES if s != spec.shape]
    return colours + shapes


def video_to_video_scores(output: np.ndarray, reference: ShapeTrack, source: str, target: str) -> dict[str, float]:
    """Scores of one re-prompted output uint8 `(F, H, W, 3)` against the input's track (last third separately)."""
    track, source_spec, target_spec = track_shape(output), parse_prompt(source), parse_prompt(target)
    late = len(output) - len(output) // 3
    return {
        **follow_metrics(track, reference),
        "distance_px_last_third": follow_metrics(
            window(track, late, len(output)), window(reference, late, len(output))
        )["distance_px"],
        "takes_colour": attribute_rate(track, colour=target_spec.colour),
        "keeps_colour": attribute_rate(track, colour=source_spec.colour),
        "takes_shape": attribute_rate(track, shape=target_spec.shape),
        "keeps_shape": attribute_rate(track, shape=source_spec.shape),
    }


def evaluate_video_to_video(
    generate: VideoToVideoFn,
    prompts: Sequence[str],
    num_frames: int,
    strengths: Sequence[float] = STRENGTHS,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, dict[str, float]]:
    """Mean scores per `"{strength} {kind}"` ('colour' or 'shape' re-prompts) over one held-out video per prompt."""
    rows: dict[str, list[dict[str, float]]] = {f"{s:g} {kind}": [] for s in strengths for kind in ("colour", "shape")}
    for prompt in prompts:
        video = render_video(prompt, num_frames, HEIGHT, WIDTH, held_out_seeds(prompt, 1)[0])
        reference, targets = track_shape(video), reprompts(prompt)
        for strength in strengths:
            outputs = _checked(
                generate([t for _, t in targets], video, strength, num_frames), len(targets), num_frames
            )
            for (kind, target), output in zip(targets, outputs):
                rows[f"{strength:g} {kind}"].append(video_to_video_scores(output, reference, prompt, target))
        log(f"  {prompt}: {len(targets)} re-prompts x {len(strengths)} strengths")
    return {name: _mean(scores) for name, scores in rows.items()}


def input_through_vae(vae) -> VideoToVideoFn:
    """The input's VAE round trip for every prompt: what an edit that changes nothing scores."""

    def generate(prompts: list[str], video: np.ndarray, strength: float, num_frames: int) -> np.ndarray:
        return np.repeat(through_vae(vae, video[None]), len(prompts), axis=0)

    return generate


# ------------------------------------------------------------------------------------------------ pipelines
def pipeline_image_to_video(pipeline, seed: int = 0, image_mode: str = "chunk") -> ImageToVideoFn:
    """A pipeline's `image=` mode, whole chunks cut to `num_frames`, one noise seed for every batch."""

    def generate(prompts: list[str], images: list[np.ndarray], num_frames: int) -> np.ndarray:
        output = pipeline(
            prompts,
            num_frames=pipeline.num_frames_for(num_frames, 1, image=list(images), image_mode=image_mode),
            height=HEIGHT,
            width=WIDTH,
            image=list(images),
            image_mode=image_mode,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        )
        return frames_to_uint8(output.frames[:, :num_frames])

    return generate


def pipeline_video_to_video(pipeline, seed: int = 0) -> VideoToVideoFn:
    """A pipeline's `video=` mode; `num_frames` must be whole chunks (the output ends with the input)."""

    def generate(prompts: list[str], video: np.ndarray, strength: float, num_frames: int) -> np.ndarray:
        if pipeline.num_frames_for(num_frames, 1) != num_frames:
            raise ValueError(
                f"num_frames must be whole chunks for video-to-video; got {num_frames}, "
                f"nearest: {pipeline.valid_num_frames(num_frames)}"
            )
        output = pipeline(
            prompts,
            num_frames=num_frames,
            height=HEIGHT,
            width=WIDTH,
            video=video,
            strength=strength,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        )
        return frames_to_uint8(output.frames)

    return generate


def _checked(videos: np.ndarray, batch: int, num_frames: int) -> np.ndarray:
    videos = np.asarray(videos)
    if videos.dtype != np.uint8 or videos.shape[:2] != (batch, num_frames):
        raise ValueError(
            f"a generator must return uint8 ({batch}, {num_frames}, H, W, 3); got {videos.dtype} {videos.shape}"
        )
    return videos


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each score over rows, ignoring NaN (a distance where no frame found the shape)."""
    means = {}
    for name in rows[0]:
        values = np.array([row[name] for row in rows], dtype=np.float64)
        means[name] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
    return means


# ------------------------------------------------------------------------------------------------ tables, CLI
def format_rows(table: dict[str, dict[str, float]], first_column: str) -> str:
    """Markdown table: one row per entry of `table`, one column per score."""
    columns = list(next(iter(table.values())))
    lines = [f"| {first_column} | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, row in table.items():
        cells = ["-" if math.isnan(row[c]) else f"{row[c]:.3f}" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def image_to_video_tables(
    models: dict[str, object], prompts: Sequence[str], seeds_per_prompt: int, log=print, image_mode: str = "chunk"
):
    """`{window: {source: scores}}` for each model and the two renderer references (`image_mode="frame"`: the image
    is one latent frame, so the best reference holds only frame 0)."""
    sources: dict[str, ImageToVideoFn] = {
        name: pipeline_image_to_video(pipe, image_mode=image_mode) for name, pipe in models.items()
    }
    for pipe in models.values():  # the embedded models share one VAE: one reference row for it
        chunk = pipe.latent_to_frames(pipe.config.chunk_frames if image_mode == "chunk" else 1)
        reference = f"truth, first {chunk} frames held, through the VAE" if chunk > 1 else "truth, through the VAE"
        sources.setdefault(reference, rendered_image_to_video(held_frames=chunk, vae=pipe.vae))
    sources["truth from another start"] = rendered_image_to_video(other_start=True)
    tables: dict[str, dict[str, dict[str, float]]] = {}
    for source, generate in sources.items():
        began = time.perf_counter()
        for window_name, scores in evaluate_image_to_video(generate, prompts, seeds_per_prompt).items():
            tables.setdefault(window_name, {})[source] = scores
        log(f"image-to-video, {source}: {time.perf_counter() - began:.0f} s")
    return tables


def video_to_video_table(pipe, prompts: Sequence[str], num_frames: int, strengths: Sequence[float]):
    """`{"{strength} {kind}": scores}` of a pipeline, and the same re-prompts scored on the input's VAE round trip."""
    table = evaluate_video_to_video(pipeline_video_to_video(pipe), prompts, num_frames, strengths)
    unchanged = evaluate_video_to_video(input_through_vae(pipe.vae), prompts, num_frames, strengths=(1.0,))
    table.update({f"input through the VAE, {name.split()[1]}": scores for name, scores in unchanged.items()})
    return table


def _without_nan(value):
    """Strict JSON has no NaN: an undefined score is saved as null."""
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-bouncing-shapes", "tiny-bouncing-shapes-sana"])
    parser.add_argument("--prompts", type=int, default=12, help="how many of the 12 evaluation prompts to use")
    parser.add_argument("--i2v-seeds", type=int, default=4, help="held-out starts per prompt for image-to-video")
    parser.add_argument("--v2v-frames", type=int, default=72, help="frames of each video-to-video input")
    parser.add_argument("--strengths", type=float, nargs="+", default=list(STRENGTHS))
    parser.add_argument("--modes", nargs="+", choices=["i2v", "v2v"], default=["i2v", "v2v"])
    parser.add_argument(
        "--image-mode", choices=["chunk", "frame"], default="chunk", help="the image-to-video convention scored"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also save every table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..defaults import load_pipeline

    models = {name: load_pipeline(name, device="cpu", dtype="float32") for name in args.models}
    for pipe in models.values():
        pipe.set_progress_bar_config(disable=True)
    prompts = evaluation_prompts()[: args.prompts]
    results: dict = {}
    if "i2v" in args.modes:
        results["image_to_video"] = image_to_video_tables(models, prompts, args.i2v_seeds, image_mode=args.image_mode)
        print(f"\nimage-to-video: {len(prompts)} prompts x {args.i2v_seeds} held-out starts")
        for window_name, table in results["image_to_video"].items():
            print(f"\n{window_name}\n{format_rows(table, 'source')}")
    if "v2v" in args.modes:
        results["video_to_video"] = {}
        for name, pipe in models.items():
            began = time.perf_counter()
            table = video_to_video_table(pipe, prompts, args.v2v_frames, args.strengths)
            results["video_to_video"][name] = table
            print(
                f"\nvideo-to-video, {name}: {len(prompts)} held-out videos of {args.v2v_frames} frames x 5 re-prompts "
                f"({time.perf_counter() - began:.0f} s)\n{format_rows(table, 'strength, re-prompt')}"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_without_nan(results), indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
