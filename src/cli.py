"""The `rolldiff` command: `rolldiff generate` writes a long video to an mp4, `rolldiff demo` serves the Gradio demo.

Frames are streamed into the file chunk by chunk as they are generated, so memory stays that of one chunk
however long the video. Bad arguments end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .defaults import (
    DTYPES,
    ModelNotFoundError,
    default_device,
    default_dtype,
    frames_for_seconds,
    load_pipeline,
    native_size,
)
from .pipelines import StreamingVideoWriter

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad command-line argument; reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage block and exit itself
        raise UsageError(message)


# ---------------------------------------------------------------------------------------- argument types
def _prompt_at(text: str) -> tuple[int, str]:
    frame, sep, prompt = text.partition(":")
    if not sep or not frame.strip().isdigit() or not prompt.strip():
        raise argparse.ArgumentTypeError(f"expected FRAME:TEXT with FRAME a frame number >= 0, got {text!r}")
    return int(frame), prompt.strip()


def _steps(text: str) -> list[int]:
    try:
        return [int(step) for step in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1000,750,500,250, got {text!r}"
        ) from None


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a torch device like cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but CUDA is not available on this machine")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rolldiff", description="Generate long videos chunk by chunk with a rolling KV cache.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser(
        "generate",
        help="write a video to an mp4 file",
        description="Write a video to an mp4, streaming frames into the file as they are generated.",
    )
    generate.add_argument("--prompt", help="the text (optional when a --prompt-at starts at frame 0)")
    generate.add_argument(
        "--prompt-at",
        action="append",
        type=_prompt_at,
        default=[],
        metavar="FRAME:TEXT",
        help="switch to TEXT at video frame FRAME (repeatable), e.g. --prompt-at '48:a blue square moving up'",
    )
    generate.add_argument("--seconds", type=_positive(float), default=5.0, help="length (default 5); rounded up")
    generate.add_argument("--out", type=Path, default=Path("video.mp4"), help="the .mp4 to write (default video.mp4)")
    _add_model_arguments(generate)
    generate.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    generate.add_argument("--fps", type=_positive(int), default=16, help="frames per second of the file (default 16)")
    generate.add_argument("--height", type=_positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--width", type=_positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--steps", type=_steps, help="denoising steps, e.g. 1000,750,500,250 (default: the model's)")
    generate.add_argument("--chunk-frames", type=_positive(int), help="latent frames per chunk (default: the model's)")
    generate.add_argument("--sink-frames", type=int, help="latent frames kept forever at the start of the cache")
    generate.add_argument("--window-frames", type=_positive(int), help="latent frames of the rolling window")
    generate.add_argument("--position-mode", help="RoPE positions: absolute or relative (default: the model's)")
    generate.set_defaults(run=run_generate)

    demo = commands.add_parser("demo", help="serve the Gradio demo", description="Serve the Gradio demo.")
    _add_model_arguments(demo)
    demo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    demo.add_argument("--port", type=_positive(int), default=7860, help="port (default 7860)")
    demo.add_argument("--max-concurrency", type=_positive(int), default=2, help="generations at once (default 2)")
    demo.set_defaults(run=run_demo)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="pipeline folder or Hugging Face Hub id (default: the embedded tiny model)")
    parser.add_argument("--device", type=_device, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="weights dtype (default: bfloat16 on cuda, else float32)"
    )


# ---------------------------------------------------------------------------------------- commands
def run_generate(args: argparse.Namespace) -> int:
    if args.out.suffix.lower() != ".mp4":
        raise UsageError(f"--out must be an .mp4 file, got {str(args.out)!r}")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out's folder {str(args.out.parent)!r} does not exist")
    if args.prompt is None and not any(frame == 0 for frame, _ in args.prompt_at):
        raise UsageError("give --prompt, or a --prompt-at 0:TEXT for the first frames")

    device = args.device or default_device()
    pipe = load_pipeline(args.model, device=device, dtype=args.dtype or default_dtype(device))
    pipe.set_progress_bar_config(disable=True)  # ours counts chunks of the whole video instead
    native_height, native_width = native_size(pipe)
    height, width = args.height or native_height, args.width or native_width
    chunk_frames = args.chunk_frames or pipe.config.chunk_frames
    num_frames = frames_for_seconds(pipe, args.seconds, args.fps, chunk_frames)
    try:
        chunks = pipe.stream(  # checks every argument before any model work; names the bad one
            args.prompt,
            num_frames,
            height,
            width,
            prompt_schedule=sorted(args.prompt_at) or None,
            denoising_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(args.seed),
            chunk_frames=args.chunk_frames,
            sink_frames=args.sink_frames,
            window_frames=args.window_frames,
            position_mode=args.position_mode,
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    num_chunks = pipe._frames_to_latent(num_frames) // chunk_frames
    rounded = " (rounded up to whole chunks)" if num_frames != round(args.seconds * args.fps) else ""
    duration = num_frames / args.fps
    print(f"Generating {num_frames} frames{rounded}: {duration:.2f} s at {args.fps} fps, {height}x{width}, {device}")

    start = time.perf_counter()
    with StreamingVideoWriter(args.out, fps=args.fps) as writer, tqdm(total=num_chunks, unit="chunk") as progress:
        for frames in chunks:  # (1, frames, height, width, 3) in [0, 1]
            writer.write((frames[0] * 255.0).round().clip(0, 255).astype("uint8"))
            progress.update()
    elapsed = time.perf_counter() - start
    print(f"Wrote {writer.frames_written} frames to {args.out.resolve()}")
    print(f"{writer.frames_written / elapsed:.1f} frames per second ({elapsed:.1f} s for the whole video)")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from .demo import build_demo  # imports gradio: only for this command

    device = args.device or default_device()
    demo = build_demo(
        args.model, max_concurrency=args.max_concurrency, device=device, dtype=args.dtype or default_dtype(device)
    )
    demo.launch(server_name=args.host, server_port=args.port)
    return 0


@contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Keep stderr for our progress bar and errors: no per-component loading bars or library chatter."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [
        (lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)
    ]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:  # `main` may run inside a bigger program (or a test session): leave it as it was
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rolldiff` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        with _quiet_libraries():
            return args.run(args)
    except (UsageError, ModelNotFoundError) as exc:
        print(f"rolldiff: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever the message
        return EXIT_USAGE
