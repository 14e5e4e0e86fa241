"""`rolldiff generate`: a video written to an mp4 as it is made, chunk by chunk, so memory stays that of one chunk
however long the video. Every flag is checked before the model loads (the library's own checks, their messages
shown with the flags' names); Ctrl-C or SIGTERM keeps the frames made, and `--resume` continues from them."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..defaults import default_device, native_size
from ..pipelines.io.resume import ResumeError, load_state, state_path_for, write_video
from ..pipelines.io.video_writer import check_output_path, count_frames, partial_path_for
from ..pipelines.request.builder import check_image_mode
from ..pipelines.request.prompt_schedule import PromptSchedule
from ..pipelines.request.text_encoding import PromptWarning
from ..recipes import list_recipes
from .arguments import (
    MAX_FPS,
    MAX_SECONDS,
    add_model_arguments,
    non_negative_seconds,
    positive,
    prompt_at,
    quality,
    seed,
    step_list,
    window_frames,
)
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, UsageError, relabel
from .loading import add_compile_and_decoder_arguments, load_from_flags

# The library's argument names and the flags that set them: a library error is relabelled with the flag (the
# rule itself is checked once, by the library).
FLAGS = {
    "prompt": "--prompt",
    "prompt_schedule": "--prompt-at",
    "denoising_steps": "--steps",
    "first_chunk_steps": "--first-chunk-steps",
    "denoising": "--denoising",
    "height": "--height",
    "width": "--width",
    "num_frames": "--seconds",
    "seconds": "--seconds",
    "fps": "--fps",
    "chunk_frames": "--chunk-frames",
    "sink_frames": "--sink-frames",
    "window_frames": "--window-frames",
    "position_mode": "--position-mode",
    "sink_mode": "--sink-mode",
    "context_policy": "--context-policy",
    "elastic_window": "--elastic-window",
    "context_window_frames": "--context-window-frames",
    "kv_quantization": "--kv-quantization",
    "kv_offload": "--kv-offload",
    "image": "--image",
    "image_mode": "--image-mode",
    "video": "--video",
    "strength": "--strength",
    "video_noise_mix": "--video-noise-mix",
    "recipe": "--recipe",
    "overlap_decode": "--overlap-decode",
    "devices": "--pipeline-parallel",
    "path": "--out",
    "quality": "--quality",
    "state_every_s": "--state-every",
}


def add_generate_command(commands) -> None:
    """The `generate` subcommand, its flags in groups as `--help` shows them."""
    generate = commands.add_parser(
        "generate",
        help="write a video to an mp4 file",
        description="Write a video to an mp4, streaming frames into the file as they are generated.",
    )
    generate.add_argument("--prompt", help="the text (optional when a --prompt-at starts at frame 0)")
    generate.add_argument(
        "--prompt-at",
        action="append",
        type=prompt_at,
        default=[],
        metavar="FRAME:TEXT",
        help="switch to TEXT at video frame FRAME (repeatable), e.g. --prompt-at '48:a blue square moving up'",
    )
    generate.add_argument(
        "--seconds",
        type=positive(float, MAX_SECONDS),
        default=5.0,
        help="length (default 5, at most a day); rounded up",
    )
    generate.add_argument("--out", type=Path, default=Path("video.mp4"), help="the .mp4 to write (default video.mp4)")
    add_model_arguments(generate)
    generate.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    generate.add_argument(
        "--fps", type=positive(int, MAX_FPS), default=16, help="frames per second of the file (default 16)"
    )
    generate.add_argument("--height", type=positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--width", type=positive(int), help="pixels (default: the model's native size)")
    generate.add_argument(
        "--recipe",
        choices=list_recipes(),
        help="the checkpoint authors' inference settings (rolldiff.recipes); explicit flags override them",
    )
    _add_denoising_arguments(
        generate.add_argument_group("denoising and context (default: the recipe's, else the model's)")
    )
    _add_input_arguments(generate.add_argument_group("start image and input video"))
    _add_speed_arguments(generate.add_argument_group("speed"))
    _add_file_arguments(generate.add_argument_group("the file"))
    generate.set_defaults(run=run_generate)


def _add_denoising_arguments(group) -> None:
    """Steps, chunking, the cache's sink and window, how a chunk becomes context."""
    group.add_argument("--steps", type=step_list, help="denoising steps, e.g. 1000,750,500,250 (default: the model's)")
    group.add_argument(
        "--first-chunk-steps",
        type=step_list,
        help="the first chunk's own steps, e.g. 1000,750,500,250 (Causal Forcing++)",
    )
    group.add_argument(
        "--denoising",
        help="'sequential' (default), 'pipelined': every step's chunk in flight, one forward for all (Rolling Forcing), "
        "or 'stream_batch': StreamDiffusionV2's batch of one row per step, each with its own cache",
    )
    group.add_argument("--chunk-frames", type=positive(int), help="latent frames per chunk (default: the model's)")
    group.add_argument("--sink-frames", type=int, help="latent frames kept forever at the start of the cache")
    group.add_argument(
        "--window-frames",
        type=window_frames,
        help="latent frames of the rolling window, or 'all' (every earlier frame stays visible)",
    )
    group.add_argument("--position-mode", help="RoPE positions: absolute or relative (default: the model's)")
    group.add_argument("--sink-mode", help="fixed, or rolling (Rolling Sink's sliding sink; needs relative positions)")
    group.add_argument(
        "--context-policy",
        help="how a chunk becomes context: rolling (a clean pass, the default), recompute (Krea: rebuilt each chunk) "
        "or last_step (StreamDiffusionV2: the last step's K/V, no clean pass)",
    )
    group.add_argument(
        "--elastic-window",
        action="store_true",
        default=None,
        help="the window counts the frames being denoised: fewer in flight see more committed frames (Rolling Forcing)",
    )
    group.add_argument(
        "--context-window-frames",
        type=int,
        help="latent frames the context pass attends to, counting its chunk (Rolling Forcing's clean pass: 21)",
    )
    group.add_argument(
        "--kv-quantization", choices=["int8", "fp8"], help="store the K/V window quantized (about half of bf16)"
    )
    group.add_argument(
        "--kv-offload", action="store_true", default=None, help="keep the K/V window in CPU memory between blocks"
    )


def _add_input_arguments(group) -> None:
    """Image-to-video and video-to-video."""
    group.add_argument("--image", type=Path, help="start frame (image-to-video): a PNG/JPEG the video starts on")
    group.add_argument(
        "--image-mode",
        choices=["chunk", "frame"],
        help="with --image: 'chunk' repeats it over the first chunk (Krea; the default), 'frame' commits its one "
        "latent frame first (Self-Forcing/CausVid; the self-forcing recipe's)",
    )
    group.add_argument(
        "--video", type=Path, help="input video (video-to-video), read chunk by chunk; the output ends with it"
    )
    group.add_argument(
        "--strength",
        type=float,
        help="with --video: how much of each input chunk is regenerated, in (0, 1] (default 0.8)",
    )
    group.add_argument(
        "--video-noise-mix",
        help="with --video: sigma (noised to the step --strength cuts at; the default), strength (noise*s + "
        "input*(1-s), every step runs) or motion (StreamDiffusionV2's: s and the first step follow the input's "
        "motion; its recipe's)",
    )


def _add_speed_arguments(group) -> None:
    """The GPU speed switches, the tiny decoder and pipeline parallelism."""
    add_compile_and_decoder_arguments(group)
    group.add_argument(
        "--cuda-graphs", action="store_true", help="replay the compiled cached step as CUDA graphs (implies --compile)"
    )
    group.add_argument(
        "--fp8",
        action="store_true",
        help="float8 weights and activations for the linear layers (torchao; CUDA, sm 8.9+)",
    )
    group.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="diffusers attention backend (flash, _flash_3, _native_cudnn, native, ...) or 'fastest' for the device",
    )
    group.add_argument(
        "--overlap-decode", action="store_true", help="decode chunk k on a side stream while chunk k+1 denoises (CUDA)"
    )
    group.add_argument(
        "--pipeline-parallel",
        type=positive(int),
        metavar="N",
        help="split the transformer's blocks into N stages, one process each (CPU: gloo; CUDA: NCCL on --device's "
        "GPU and the next N - 1); the same video as one process",
    )


def _add_file_arguments(group) -> None:
    """Encoding quality, and resuming an interrupted run."""
    group.add_argument(
        "--quality",
        type=quality,
        default=5.0,
        help="mp4 encoding, 1 (smallest file) to 10 (lossless); default 5",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same command from its last saved chunk (the video equals an "
        "uninterrupted one)",
    )
    group.add_argument(
        "--state-every",
        type=non_negative_seconds,
        default=60.0,
        metavar="SECONDS",
        help="save the resume state after a chunk at most this often (0: every chunk; default 60)",
    )


def _start_image(path: Path | None):
    """`--image` read as an RGB picture, or a usage error naming the file."""
    if path is None:
        return None
    from ..pipelines.io.video_input import read_image

    try:
        return read_image(path)
    except ValueError as exc:
        raise UsageError(f"--image: cannot read {str(path)!r} as an image ({exc})") from None


# ---------------------------------------------------------------------------------------- the run
def _check_before_loading(args: argparse.Namespace) -> None:
    """The rules that need no model, run by the library's own checks before it loads (so a typo costs no load)."""
    try:
        check_output_path(args.out)
        PromptSchedule.build(args.prompt, sorted(args.prompt_at) or None, num_frames=math.inf)
        check_image_mode(args.image_mode, args.image)
    except ValueError as exc:
        raise relabel(exc, FLAGS) from None
    if args.video is not None and not args.video.is_file():
        raise UsageError(f"--video: no such file {str(args.video)!r}")
    if args.pipeline_parallel is not None:
        # each stage loads the model again and runs it as loaded, and a split run cannot load a saved state
        given = [flag for flag, on in (("--compile", args.compile), ("--cuda-graphs", args.cuda_graphs),
                                       ("--fp8", args.fp8), ("--attention-backend", args.attention_backend),
                                       ("--resume", args.resume)) if on]  # fmt: skip
        if given:
            raise UsageError(f"--pipeline-parallel runs the model as loaded, without {', '.join(given)}; drop them.")


def _call_arguments(args: argparse.Namespace, image) -> dict:
    """The `pipe.stream` arguments the flags set (None: the recipe's or the model's)."""
    return dict(
        prompt=args.prompt,
        prompt_schedule=sorted(args.prompt_at) or None,
        denoising_steps=args.steps,
        first_chunk_steps=args.first_chunk_steps,
        denoising=args.denoising,
        chunk_frames=args.chunk_frames,
        sink_frames=args.sink_frames,
        window_frames=args.window_frames,
        position_mode=args.position_mode,
        sink_mode=args.sink_mode,
        context_policy=args.context_policy,
        elastic_window=args.elastic_window,
        context_window_frames=args.context_window_frames,
        kv_quantization=args.kv_quantization,
        kv_offload=args.kv_offload,
        image=image,
        image_mode=args.image_mode,
        video=None if args.video is None else str(args.video),
        strength=args.strength,
        video_noise_mix=args.video_noise_mix,
        recipe=args.recipe,
        overlap_decode=args.overlap_decode,
        devices=_stage_devices(args.pipeline_parallel, args.device or default_device()),
    )


def _stage_devices(stages: int | None, device: str) -> list[str] | None:
    """`--pipeline-parallel N`: the device of each stage (N CPUs, or --device's GPU and the next N - 1)."""
    if stages is None:
        return None
    if not device.startswith("cuda"):
        return [device] * stages
    first = int(device.partition(":")[2] or 0)
    return [f"cuda:{first + stage}" for stage in range(stages)]


def run_generate(args: argparse.Namespace) -> int:
    _check_before_loading(args)
    image = _start_image(args.image)  # read (and refused) before the model loads
    device = args.device or default_device()
    pipe = load_from_flags(args, device)
    native_height, native_width = native_size(pipe)
    height, width = args.height or native_height, args.width or native_width
    call = _call_arguments(args, image)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PromptWarning)
            # The length as the stream resolves it (the flags, else --recipe's or the folder's), then every
            # argument checked and the bad one named; nothing runs until the stream is iterated.
            num_frames = pipe.num_frames_for(args.seconds, args.fps, **call)
            generator = torch.Generator("cpu").manual_seed(args.seed)
            stream = pipe.stream(num_frames=num_frames, height=height, width=width, generator=generator, **call)
    except (ValueError, TypeError, OSError) as exc:
        raise relabel(exc, FLAGS) from exc
    _report_warnings(caught)
    rounded = " (rounded up to whole chunks)" if num_frames != round(args.seconds * args.fps) else ""
    duration = num_frames / args.fps
    print(f"Generating {num_frames} frames{rounded}: {duration:.2f} s at {args.fps} fps, {height}x{width}, {device}")

    pipe.set_progress_bar_config(disable=False, unit="chunk")  # the stream makes its bar at the first chunk
    start = time.perf_counter()
    try:
        with _sigterm_as_interrupt():
            # a temporary file beside --out until the end; resume states beside it
            frames = write_video(
                stream,
                args.out,
                args.fps,
                resume=args.resume,
                state_every_s=args.state_every,
                quality=args.quality,
            )
    except KeyboardInterrupt:
        print(f"rolldiff: interrupted; {_kept(args.out)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ResumeError as exc:
        raise UsageError(f"--resume: {relabel(exc, FLAGS)}") from exc
    except (FloatingPointError, MemoryError) as exc:  # NaN latents, or a cache that does not fit: stopped there
        print(f"rolldiff: error: {exc} {_kept(args.out)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stream.close()  # its input video and offload hooks, however the run ended
    elapsed = time.perf_counter() - start
    print(f"Wrote {frames} frames to {args.out.resolve()}")
    print(f"{frames / elapsed:.1f} frames per second ({elapsed:.1f} s for the whole video)")
    return 0


def _kept(out: Path) -> str:
    """What a failed run left: the partial file (if any frame was made), the untouched target, how to resume."""
    partial, state = partial_path_for(out), state_path_for(out)
    if not partial.exists():
        return f"no frame was finished; {out} was not touched."
    message = f"the {count_frames(partial)} frames made are kept in {partial}; {out} was not touched."
    if state.exists():
        message += f" Run the same command with --resume to continue from frame {load_state(state).frames_written}."
    return message


def _report_warnings(caught: list[warnings.WarningMessage]) -> None:
    """One `rolldiff: warning:` line per prompt warning (unknown words, truncation); others as Python shows them."""
    for warning in caught:
        if issubclass(warning.category, PromptWarning):
            print(f"rolldiff: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill PID` stops a run like Ctrl-C does: the frames done are kept, not lost with an unfinished file."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
